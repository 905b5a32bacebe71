"""Checkpoints of a whole RL run: every trainable role, the controller's state, every RNG.

Layout under `--ckpt.path`:

    global_step<N>/actor/, critic/   DeepSpeed checkpoints (weights, optimizer, scheduler)
    global_step<N>/rng_<role>_rank<r>.pt   each rank's RNG states
    global_step<N>/controller.pt     step, prompt position, KL controller, the driver's RNG states,
                                     the rollouts sampled ahead (`rl/ahead.py`) with their policy version
    latest                           the newest complete tag, written last
    best_global_step<N>/             the best held-out evaluation so far (`--ckpt.best_metric_key`):
                                     the same contents; never rotated, replaced by a better one,
                                     never named by `latest`

A tag is written as `.global_step<N>.partial` and renamed when whole, so `latest` never names a
half-written checkpoint and a failed save leaves the earlier ones as they were. A resumed run
pushes the restored actor weights to the engines before its first rollout, so it makes exactly
the updates of an uninterrupted run (`torch.equal` in fp32 on CPU; tests/unit/test_rl_resume.py).
Rotation (`--ckpt.max_num`) removes only this run's own tags (`trainers/checkpoints.py`).

With `--ckpt.path s3://...` the roles' ranks may sit on several nodes: each rank writes its part
into a staging folder on its own node and uploads it (`RankActor._role_save_to`), the controller
uploads `controller.pt`, and `latest` is written after all of them; a resume has every rank
download the tag onto its node (`_role_load_from`) and the controller read its state from S3.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from rlhf_core.infra.not_applied import say_once
from rlhf_core.rl.selection import spread_of
from rlhf_core.trainers import checkpoints
from rlhf_core.trainers.checkpoints import rng_state, set_rng_state

CONTROLLER = "controller.pt"


class BestMetric:
    """The best held-out evaluation so far, by `--ckpt.best_metric_key` ('': `auto`, the run's
    default held-out check, the sampled accuracy where a verifier scores the evaluation; 'none':
    off). Part of the checkpoint: a resumed run keeps it."""

    AUTO = "eval/sampled_accuracy"

    def __init__(self, key: str, auto: str = AUTO):
        self.key, self.auto = key, auto
        self.value, self.step, self.spread = float("-inf"), None, None

    @property
    def metric(self) -> str:
        """The evaluation metric it compares ('' resolved to `auto`)."""
        return self.auto if self.key == "" else self.key

    def improves(self, metrics: dict[str, float], step: int) -> bool:
        """Whether `metrics` (one evaluation's, at `step`) beat the best so far; if so, it becomes it."""
        key = self.metric
        if self.key == "none" or key not in metrics:
            if self.key not in ("", "none") and metrics:
                say_once(f"rlhf: --ckpt.best_metric_key {self.key}: the evaluation has no such metric (it has "
                         f"{', '.join(sorted(metrics))}); no best checkpoint is kept")
            return False
        if metrics[key] <= self.value:
            return False
        self.value, self.step, self.spread = metrics[key], step, spread_of(metrics, key)
        return True

    def state_dict(self) -> dict:
        return {"key": self.metric if self.key == "" else self.key, "value": self.value, "step": self.step,
                "spread": self.spread}

    def load_state_dict(self, state: dict | None) -> None:
        """A resume asking for another metric starts its own best."""
        if state and state.get("key") in (self.key, self.metric):
            self.value, self.step, self.spread = state["value"], state["step"], state.get("spread")


def _state(controller) -> dict:
    return {"step": controller.step, "prompt_position": controller.prompts.position,
            "kl": controller.kl.state_dict(), "rng": rng_state(), "best": controller.best.state_dict(),
            "evaluated_on": controller.evaluated_on,
            "guard": controller.guard.state_dict() if controller.guard is not None else None,
            "policy_version": controller.policy_version, "ahead": controller.ahead.state_dict()}


def save(controller, ckpt: str | os.PathLike, run_id: str | None, best: bool = False) -> str:
    """Write the checkpoint of `controller`'s current step, whole or not at all; returns this run's
    id (for rotation). A full disk removes the partial folder and raises DiskFullError (exit 2).
    `best`: the best evaluation so far, as `best_global_step<N>`, replacing the run's earlier best."""
    from rlhf_core.infra import storage
    tag = f"{'best_' if best else ''}global_step{controller.step}"
    resumable = not controller.cfg.ckpt.disable_ds and not best  # `latest` names regular tags only
    roles = [g for g in (controller.actor, controller.critic) if g is not None]
    if checkpoints.is_remote(ckpt):
        ckpt = str(ckpt).rstrip("/")
        checkpoints.begin_remote(ckpt, tag)
        for pending in [g.call_all_async("_role_save_to", "save_checkpoint", f"{ckpt}/{tag}") for g in roles]:
            pending.per_rank()  # every rank's part is uploaded
        local = checkpoints.staging_dir("controller")
        kept = f"nothing of checkpoint {tag} is named by `latest` at {ckpt}; earlier ones are as they were"
        with storage.saving("--ckpt.path", local, f"checkpoint {tag} (staged before its upload)", kept,
                            cleanup=lambda: shutil.rmtree(local, ignore_errors=True)):
            if not controller.cfg.ckpt.disable_ds:
                torch.save(_state(controller), local / CONTROLLER)
        checkpoints.upload_part(local, ckpt, tag)  # removes `local`
        if resumable:
            checkpoints.write_latest(ckpt, tag)  # last: every part is on S3
        print(f"checkpoint {tag} uploaded to {ckpt}/{tag}", file=sys.stderr, flush=True)
    else:
        ckpt = Path(ckpt)
        kept = f"the checkpoint in progress ({tag}) was removed; earlier ones and `latest` are as they were"
        with storage.saving("--ckpt.path", ckpt, f"checkpoint {tag}", kept,
                            cleanup=lambda: checkpoints.abandon(ckpt, tag)):
            directory = checkpoints.begin(ckpt, tag)
            for pending in [g.call_all_async("save_checkpoint", str(directory)) for g in roles]:
                pending.per_rank()
            if not controller.cfg.ckpt.disable_ds:
                torch.save(_state(controller), directory / CONTROLLER)
            checkpoints.commit(ckpt, tag, resumable=resumable)
    with storage.saving("--ckpt.path", ckpt, checkpoints.CHECKPOINTS, f"checkpoint {tag} is whole and `latest` "
                        "names it; only its entry for rotation is missing"):
        run_id = run_id or checkpoints.new_run_id()
        checkpoints.record_tag(ckpt, tag, run_id, "ppo", controller.step, best=best)
        checkpoints.rotate(ckpt, run_id, controller.cfg.ckpt.max_num, controller.cfg.ckpt.max_mem)
    if best:
        print(f"best checkpoint: {controller.best.metric}={controller.best.value:.4f} at step "
              f"{controller.step}: {checkpoints.location(ckpt, tag)}", file=sys.stderr, flush=True)
    return run_id


def load(controller, ckpt: str | os.PathLike) -> str | None:
    """Restore the newest checkpoint under `ckpt` into `controller` (and its roles); returns the run
    id that wrote it, or None (and a note) when there is none yet."""
    remote = checkpoints.is_remote(ckpt)
    ckpt = str(ckpt).rstrip("/") if remote else Path(ckpt)
    tag = checkpoints.latest_tag(ckpt)
    if tag is None:
        print(f"rlhf: --ckpt.load_enable: no checkpoint in {ckpt} yet; starting from step 0 "
              "(stage.json records resume.checkpoint null)", file=sys.stderr, flush=True)
        return None
    directory = checkpoints.location(ckpt, tag)
    roles = [g for g in (controller.actor, controller.critic) if g is not None]
    method = ("_role_load_from", "load_checkpoint") if remote else ("load_checkpoint",)
    for pending in [g.call_all_async(*method, directory) for g in roles]:
        pending.per_rank()
    if remote:
        import io

        from rlhf_core.infra import storage

        state = torch.load(io.BytesIO(storage._fs(directory).cat_file(f"{directory}/{CONTROLLER}")),
                           weights_only=False)
    else:
        state = torch.load(Path(directory) / CONTROLLER, weights_only=False)
    controller.step = int(state["step"])
    controller.prompts.position = int(state["prompt_position"])
    controller.kl.load_state_dict(state["kl"])
    if state.get("evaluated_on") == controller.evaluated_on:  # else other prompts: their numbers do not compare
        controller.best.load_state_dict(state.get("best"))
        if controller.guard is not None:
            controller.guard.load_state_dict(state.get("guard"))
    else:
        print("rlhf: the checkpoint's evaluations during training were on other held-out prompts (or none): the "
              "best evaluation and the reward-hacking guard's window start afresh", file=sys.stderr, flush=True)
    controller.policy_version = int(state.get("policy_version", controller.step))
    controller.ahead.load_state_dict(state.get("ahead"), controller.step)  # the batches sampled ahead, if any
    set_rng_state(state["rng"])
    run_id = checkpoints.run_of(ckpt, tag) or checkpoints.new_run_id()
    checkpoints.record_tag(ckpt, tag, run_id, "ppo", controller.step)
    print(f"resumed from {directory} at step {controller.step}", file=sys.stderr, flush=True)
    controller.resume["checkpoint"] = str(directory)
    return run_id
