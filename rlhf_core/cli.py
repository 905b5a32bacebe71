"""The `rlhf` command: `prep`, `train sft|rm|dpo|kto|ppo`, `serve-rm`, `eval`, `pairs`,
`pipeline run`, `prune`, `lineage`, `hardware`.

Flags are the stage config's field names (OpenRLHF's); `--config FILE.yaml` supplies any of them,
flags win. Exit status (tests/unit/test_bad_input.py holds every case of 2):

- 2, bad input, one message naming the flag, file, row or key: configuration and data problems
  (models and reward files are checked before any data or weights are read), `rlhf pairs` when
  every prompt's samples score the same (a retry would repeat it), a reward file or server
  answering something unusable.
- 1, a failed stage, which a retry may fix: a reward server that stayed unreachable, an MLflow
  server or S3 endpoint that did not answer in time (`rlhf_core/infra/reachability.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlhf_core.config import STAGE_CONFIGS, add_config_flags, build_config, load_yaml
from rlhf_core.infra.loggers import export_wandb_key
from rlhf_core.infra.settings import EXIT_CONFIG, ConfigError
from rlhf_core.models.families import FAMILIES
from rlhf_core.models.sizes import MODEL_SIZES

EXIT_USAGE = EXIT_CONFIG
EXIT_FAILED = 1
COMMAND_GROUP = "rlhf.commands"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="The RLHF lifecycle: prep, train, evaluate.")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prep", help="Build the built-in task data, tokenizer and tiny base model")
    prep.add_argument("--out", required=True, help="Output directory")
    prep.add_argument("--task", default="addition", help="Built-in task name")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--model_size", default="tiny", choices=list(MODEL_SIZES))
    prep.add_argument("--model_family", default=None, help="Build the base in the shape of a model family, with its "
                      "special tokens and chat template: " + ", ".join(FAMILIES) + " (default: the built-in "
                      "tiny Llama)")
    prep.add_argument("--student_size", default=None, choices=list(MODEL_SIZES), help="Also build a randomly "
                      "initialised student base of this (smaller) size with the same tokenizer, in student/: where "
                      "`rlhf train kd` (the pipeline's distill stage) starts a smaller model (default: none)")
    prep.add_argument("--n_train", type=int, default=None, help="Training examples per data kind")
    prep.add_argument("--n_test", type=int, default=None, help="Held-out examples per data kind")
    prep.add_argument("--demo_error_rate", type=float, default=None, help="Fraction of SFT training demonstrations "
                      "that are wrong (near misses): SFT then stays imperfect and RL has room (default 0)")

    train = sub.add_parser("train", help="Train one stage")
    stages = train.add_subparsers(dest="stage", required=True)
    for name, cls in STAGE_CONFIGS.items():
        add_config_flags(_dry_run(stages.add_parser(name, help=f"{name} trainer",
                                                    argument_default=argparse.SUPPRESS)), cls)
    from rlhf_core.rl_config import add_ppo_flags

    add_ppo_flags(_dry_run(stages.add_parser("ppo", argument_default=argparse.SUPPRESS, help="PPO-family RL (PPO, "
                                             "REINFORCE++, RLOO, GRPO, Dr.GRPO): OpenRLHF's dotted or flat flags")))

    from rlhf_core.config import ROLLOUT_STAGE_CONFIGS

    add_config_flags(_dry_run(sub.add_parser("eval", argument_default=argparse.SUPPRESS, help="Evaluate a policy "
                                             "against a reference: reward, exact match, win rate, KL")),
                     ROLLOUT_STAGE_CONFIGS["eval"])
    add_config_flags(_dry_run(sub.add_parser("pairs", argument_default=argparse.SUPPRESS, help="Sample the policy, "
                                             "score, keep (best, worst) per prompt: online DPO data")),
                     ROLLOUT_STAGE_CONFIGS["pairs"])
    from rlhf_core.config import BatchInferenceConfig

    add_config_flags(_dry_run(sub.add_parser("batch_inference", argument_default=argparse.SUPPRESS,
                                             help="OpenRLHF's batch inference: generate best-of-N responses, or score "
                                             "rows into rejection-sampling, conditional-SFT or DPO data")),
                     BatchInferenceConfig)

    _add_orchestration_commands(sub)

    from rlhf_core.rewards.cli import add_serve_rm_arguments

    add_serve_rm_arguments(sub.add_parser("serve-rm", help="Serve reward models or a reward file over HTTP "
                                          "(POST /get_reward, bearer token required)"))

    sub.add_parser("hardware", help="What a stage's ranks would train on here (device, native bf16, what each "
                   "--param_dtype resolves to), probed on the Ray cluster; one JSON line")

    lineage = sub.add_parser("lineage", help="Where did this model come from: stages, data and configs back to the "
                             "base model")
    lineage.add_argument("ref", help="MLflow run id, models:/NAME@ALIAS, models:/NAME/VERSION, or an output path/URI")
    lineage.add_argument("--json", action="store_true", help="Print the lineage tree as JSON")

    return parser


def _dry_run(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--dry_run", action="store_true", default=False,
                        help="Parse and validate the flags and --config, print the resolved config (one spelling: "
                        "nested sections) and exit 0; reads no data, model or tokenizer, touches no MLflow, S3 or "
                        "home directory, checks no placement against this machine's devices")
    return parser


def dry_run(cfg) -> int:
    """`--dry_run`: the resolved config as JSON on stdout, nothing else done."""
    print(json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True))
    return 0


def flag_values(args: argparse.Namespace) -> dict:
    """The config fields a stage command's flags set (the command's own arguments left out)."""
    return {k: v for k, v in vars(args).items() if k not in ("command", "stage", "config", "dry_run")}


def train_config(args: argparse.Namespace):
    """The stage config `rlhf train <stage>` builds from its flags and `--config` YAML (ConfigError
    naming the flag when it cannot)."""
    values = flag_values(args)
    yaml_values = load_yaml(args.config) if getattr(args, "config", None) else None
    if args.stage == "ppo":
        from rlhf_core.rl_config import build_ppo_config

        return build_ppo_config(yaml_values, values)
    return build_config(STAGE_CONFIGS[args.stage], yaml_values, values)


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"rlhf: error: {message}", file=sys.stderr)
    return code


def _check_models(cfg, flags: dict[str, str]) -> None:
    """Every model a stage starts from (config attribute -> its flag) must be loadable: checked before
    any data or weights are read (ConfigError naming the flag). The policy must hold a tokenizer."""
    from rlhf_core.models.loading import check_pretrained

    checked = set()
    for attr, flag in flags.items():
        for location in (getattr(cfg, attr, None) or "").split(","):
            location = location.strip()
            if location and location not in checked:
                check_pretrained(location, flag, tokenizer=attr == "pretrain")
                checked.add(location)


def _check_reward_files(remote_url: str | None) -> None:
    """Import each reward file now (ConfigError: missing, not importable, no reward_func), before any
    model loads; the RL stage then gets the same loaded function (`load_reward_file` caches it)."""
    from rlhf_core.rewards.reward_file import load_reward_file

    for url in (remote_url or "").split(","):
        if url.strip().endswith(".py"):
            load_reward_file(url.strip())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlhf_core.data.loading import DataError
    from rlhf_core.infra.reachability import StoreUnavailable, check_config_stores, check_stage_stores
    from rlhf_core.infra.tracking import AttemptAbandoned
    from rlhf_core.stages.launch import StageFailed, is_bad_input

    try:
        if args.command == "prep":
            from rlhf_core.stages.prep import check_prep_params, prep_config, run_prep

            sizes = {k: getattr(args, k) for k in ("n_train", "n_test", "demo_error_rate", "model_family",
                                                        "student_size")
                     if getattr(args, k) is not None}
            check_prep_params(prep_config(task=args.task, seed=args.seed, model_size=args.model_size, **sizes))
            check_stage_stores({"out": args.out}, use_mlflow=bool(os.environ.get("MLFLOW_RUN_ID")))
            manifest = run_prep(args.out, task=args.task, seed=args.seed, model_size=args.model_size, **sizes)
            print(json.dumps(manifest["outputs"], indent=2))
            return 0
        if args.command == "train" and args.stage == "ppo":
            from rlhf_core.stages.launch import run_rl_stage

            cfg = train_config(args)
            if args.dry_run:
                return dry_run(cfg)
            export_wandb_key(cfg)
            check_config_stores(cfg)
            _check_models(cfg, {"pretrain": "--actor.model_name_or_path", "ref_pretrain": "--ref.model_name_or_path",
                                "critic_pretrain": "--critic.model_name_or_path",
                                "reward_pretrain": "--reward.model_name_or_path"})
            _check_reward_files(cfg.reward.remote_url)
            if cfg.train.agent_func_path:  # import it now: a broken file is a config error, before any model loads
                from rlhf_core.rl.agents import check_agent

                check_agent(cfg.train.agent_func_path, cfg.train.agent_turn_rewards)
            print(json.dumps(run_rl_stage(cfg), indent=2, sort_keys=True))
            return 0
        if args.command == "train":
            cfg = train_config(args)
            if args.dry_run:
                return dry_run(cfg)
            export_wandb_key(cfg)
            from rlhf_core.stages.launch import run_stage

            check_config_stores(cfg)
            _check_models(cfg, {"pretrain": "--pretrain", "ref_pretrain": "--ref_pretrain",
                                "teacher_pretrain": "--teacher_model"})
            manifest = run_stage(cfg)
            print(json.dumps(manifest, indent=2, sort_keys=True))
            return 0
        if args.command in ("eval", "pairs"):
            from rlhf_core.config import ROLLOUT_STAGE_CONFIGS
            from rlhf_core.stages.evaluation import run_eval
            from rlhf_core.stages.pairs import NoPairsError, run_pairs

            cfg = build_config(ROLLOUT_STAGE_CONFIGS[args.command], load_yaml(args.config) if args.config
                               else None, flag_values(args))
            if args.dry_run:
                return dry_run(cfg)
            check_config_stores(cfg)
            _check_models(cfg, {"pretrain": "--pretrain", "ref_pretrain": "--ref_pretrain",
                                "reward_pretrain": "--reward_pretrain"})
            try:
                manifest = (run_eval if args.command == "eval" else run_pairs)(cfg)
            except NoPairsError as e:
                return _fail(str(e), EXIT_USAGE)
            print(json.dumps(manifest, indent=2, sort_keys=True))
            return 0
        if args.command == "batch_inference":
            from rlhf_core.config import BatchInferenceConfig
            from rlhf_core.stages.batch_inference import run_batch_inference

            cfg = build_config(BatchInferenceConfig, load_yaml(args.config) if args.config else None, flag_values(args))
            if args.dry_run:
                return dry_run(cfg)
            cfg.check_complete()
            _check_models(cfg, {"pretrain": "--pretrain"})
            print(json.dumps(run_batch_inference(cfg), indent=2, sort_keys=True))
            return 0
        if args.command == "serve-rm":
            from rlhf_core.rewards.cli import serve_rm_main

            return serve_rm_main(args)
        if args.command == "hardware":
            from rlhf_core.distributed.cluster import prepare_environment
            from rlhf_core.infra.precision import HARDWARE_PREFIX
            from rlhf_core.stages.launch import probe_hardware

            prepare_environment()
            print(HARDWARE_PREFIX + json.dumps(probe_hardware(), sort_keys=True), flush=True)
            return 0
        if args.command == "lineage":
            from rlhf_core.stages.provenance import LineageError, build, lineage_json, render

            try:
                tree = build(args.ref)
            except LineageError as e:
                return _fail(str(e), EXIT_FAILED)
            print(lineage_json(tree) if args.json else render(tree))
            return 0
        if getattr(args, "orchestration_run", None) is not None:
            return args.orchestration_run(args)
    except (ConfigError, DataError) as e:
        return _fail(str(e))
    except (StoreUnavailable, AttemptAbandoned) as e:  # infrastructure: the store away, or the attempt given up
        return _fail(str(e), EXIT_FAILED)
    except StageFailed as e:
        if is_bad_input(e.cause):
            return _fail(str(e.cause))
        if isinstance(e.cause, AttemptAbandoned):
            return _fail(str(e.cause), EXIT_FAILED)
        return _fail(f"stage failed: {type(e.cause).__name__}: {e.cause}", EXIT_FAILED)
    return _fail(f"unknown command {args.command}")


def _add_orchestration_commands(sub) -> None:
    """The commands the orchestration layer registers (`pipeline`, `prune`) under the entry-point
    group COMMAND_GROUP: a module with HELP, add_arguments(parser) and run(args). The library never
    imports that layer, so `rlhf train` runs where Prefect is not installed."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name):
        try:
            command = ep.load()
        except ImportError as e:  # registered but not importable here: say so when it is asked for
            parser = sub.add_parser(ep.name, help=f"(unavailable here: {e})")
            message = f"`rlhf {ep.name}` needs {ep.value}, which does not import here: {e}"
            parser.set_defaults(orchestration_run=lambda args, message=message: _fail(message))
            continue
        parser = sub.add_parser(ep.name, help=command.HELP)
        command.add_arguments(parser)
        parser.set_defaults(orchestration_run=command.run)


def _tracks_here(argv: list[str]) -> bool:
    """Whether this command may open an MLflow run in its own process: a training stage, on rank 0
    (or no launcher's rank), with MLflow not turned off on the command line and no dry run. A guess
    from the words alone: a wrong yes costs an idle process, a wrong no MLflow in this process."""
    words = [w.lower() for w in argv]
    if not words or words[0] != "train" or os.environ.get("RANK", "0") != "0":
        return False
    off = {"--dry_run", "-h", "--help", "--use_mlflow=false", "--no-use_mlflow", "--no_use_mlflow"}
    return not off.intersection(words) and not any(
        a == "--use_mlflow" and b in ("false", "0", "no") for a, b in zip(words, words[1:], strict=False))


def entry() -> None:
    """The `rlhf` command: `main` in a process of its own, whose heap is frozen when it has finished
    (no final collector pass over it on the way out: rlhf_core/infra/heap.py)."""
    import gc

    from rlhf_core.infra import heap, mlflow_side

    if _tracks_here(sys.argv[1:]):
        mlflow_side.start()  # MLflow imports on another core while the stage imports torch (mlflow_side.py)
    heap.own_process()
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
