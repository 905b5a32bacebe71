"""Weights & Biases and TensorBoard beside MLflow: the same metrics at the same steps.

MLflow stays the system of record (params, lineage, the model registry); these are the dashboards
OpenRLHF users already watch. `--logger.wandb.key` (flat `--use_wandb`, OpenRLHF's spelling, whose
value is the API key) turns W&B on; `--logger.tensorboard_dir` (`--use_tensorboard DIR`) writes
TensorBoard event files to `DIR/<run name>`. Rank 0 of a stage logs.

The W&B key is a secret: the config holds it as a `SecretStr` (every dump, MLflow param, stage.json
and the config the stage's job receives show `**********`); the command moves it into the process
environment (`WANDB_API_KEY`, `export_wandb_key`) before the stage's job starts, where W&B reads it
and where the redaction of every record finds it. W&B's run metadata (which records the command
line, and with it a key given as a flag) is off.

W&B runs online unless `WANDB_MODE` or `--logger.wandb.mode` says offline; a run that cannot reach
the server goes on offline, said in one line with the folder to `wandb sync` later. A sink that
fails while training says so once and stops; it never stops the training.
"""

from __future__ import annotations

import os
import sys
import time

# `--use_wandb True` (a flag's value read as an on switch, not a key): log in as W&B would without one.
SWITCH_WORDS = {"true", "1", "yes", "on"}
MASK = "**********"  # pydantic's SecretStr in a dump


def wandb_key(cfg) -> str | None:
    """The W&B key given in `cfg` (None: none given, an on switch, or a dump's mask)."""
    key = cfg.logger.wandb.key
    value = key.get_secret_value() if key is not None else None
    if not value or value.lower() in SWITCH_WORDS or value == MASK:
        return None
    return value


def export_wandb_key(cfg) -> None:
    """Put a key given as a flag into `WANDB_API_KEY` (before the stage's processes start: they inherit it)."""
    key = wandb_key(cfg)
    if key is not None:
        os.environ["WANDB_API_KEY"] = key


class _Sink:
    name = "sink"

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 (a sink with nothing to flush keeps the default)
        pass


class TensorBoardSink(_Sink):
    name = "TensorBoard"

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)

    def close(self):
        self.writer.flush()
        self.writer.close()


class WandbSink(_Sink):
    name = "W&B"

    def __init__(self, settings, run_name: str, config: dict):
        import wandb

        self.wandb, self.step = wandb, 0
        mode = settings.mode or os.environ.get("WANDB_MODE") or "online"
        # WANDB_DIR as it is now: W&B reads the environment once per process (its settings singleton),
        # so a process that runs several stages would put every later run in the first one's folder
        common = dict(entity=settings.org, project=settings.project, group=settings.group, name=run_name,
                      config=config, reinit="create_new", dir=os.environ.get("WANDB_DIR"))
        quiet = wandb.Settings(x_disable_meta=True, save_code=False, disable_git=True, silent=True,
                               init_timeout=float(os.environ.get("RLHF_WANDB_INIT_TIMEOUT_S", "60")))
        try:
            self.run = wandb.init(mode=mode, settings=quiet, **common)
        except Exception as e:  # noqa: BLE001 - no network, a refused key: go on offline, and say so
            if mode == "offline":
                raise
            self.run = wandb.init(mode="offline", settings=quiet, **common)
            print(f"W&B: could not start an online run ({type(e).__name__}); logging offline to {self.run.dir}: "
                  f"`wandb sync {os.path.dirname(self.run.dir)}` uploads it later", file=sys.stderr, flush=True)

    def log(self, metrics, step):
        values = {k: float(v) for k, v in metrics.items()}
        if step < self.step:  # W&B's history only moves forward: what comes for an earlier step (a stage's
            self.run.summary.update(values)  # final metrics, at step 0) goes to the run's summary
            return
        self.step = step
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


class MetricSinks:
    """The dashboards a stage's rank 0 logs to beside MLflow (none when none is asked for)."""

    def __init__(self, sinks: list[_Sink]):
        self.sinks = sinks
        self._last_step: dict[str, int] = {}

    @classmethod
    def for_stage(cls, cfg, run_name: str | None, config: dict) -> MetricSinks:
        logger, sinks = cfg.logger, []
        name = run_name or f"{cfg.stage}_{time.strftime('%m%dT%H:%M')}"
        if logger.wandb.key is not None:
            _require("wandb", "--logger.wandb.key (--use_wandb)")
            sinks.append(WandbSink(logger.wandb.with_defaults(cfg.stage), logger.wandb.run_name or name, config))
        if logger.tensorboard_dir:
            _require("tensorboard", "--logger.tensorboard_dir (--use_tensorboard)")
            sinks.append(TensorBoardSink(os.path.join(logger.tensorboard_dir, logger.wandb.run_name or name)))
        return cls(sinks)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(metrics, step)
            except Exception as e:  # noqa: BLE001 - a dashboard never stops training
                self.sinks.remove(sink)
                print(f"{sink.name}: logging failed ({type(e).__name__}: {e}); no more metrics go there this run",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001
                print(f"{sink.name}: closing failed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        self.sinks = []


def _require(package: str, flag: str) -> None:
    import importlib.util

    from rlhf_core.infra.settings import ConfigError

    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{flag} needs the {package} package: pip install 'rlhf-lifecycle[loggers]'")
