"""The `rlhf` command: `prep`, `train sft|rm|dpo|kto`, `demo`.

Flags are the stage config's field names (OpenRLHF's), `--config FILE.yaml` supplies any of
them, flags win. Configuration and data problems print one clear message naming the flag, file,
row or key, and exit with status 2 before anything trains; a failed stage exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf_core.config import STAGE_CONFIGS, ConfigError, add_config_flags, build_config, load_yaml

EXIT_USAGE = 2
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="The RLHF lifecycle: prep, train, evaluate.")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prep", help="Build the built-in task data, tokenizer and tiny base model")
    prep.add_argument("--out", required=True, help="Output directory")
    prep.add_argument("--task", default="addition", help="Built-in task name")
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--model_size", default="tiny", choices=["tiny", "small"])

    train = sub.add_parser("train", help="Train one stage")
    stages = train.add_subparsers(dest="stage", required=True)
    for name, cls in STAGE_CONFIGS.items():
        add_config_flags(stages.add_parser(name, help=f"{name} trainer", argument_default=argparse.SUPPRESS), cls)

    demo = sub.add_parser("demo", help="prep, then SFT -> reward model -> DPO on the built-in task")
    demo.add_argument("--out", default=None, help="Working directory (default: <state dir>/demo)")
    demo.add_argument("--task", default="reverse", help="Built-in task (reverse learns fastest on a CPU)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--config", default=None, help="YAML with per-stage overrides under sft:, rm:, dpo:")
    return parser


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"rlhf: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from rlhf_core.data.loading import DataError
    from rlhf_core.launch import StageFailed

    try:
        if args.command == "prep":
            from rlhf_core.prep import prepare

            paths = prepare(args.out, task=args.task, seed=args.seed, model_size=args.model_size)
            print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
            return 0
        if args.command == "train":
            values = {k: v for k, v in vars(args).items() if k not in ("command", "stage", "config")}
            cfg = build_config(STAGE_CONFIGS[args.stage], load_yaml(args.config) if getattr(args, "config", None)
                               else None, values)
            from rlhf_core.launch import run_stage

            manifest = run_stage(cfg)
            print(json.dumps(manifest, indent=2, sort_keys=True))
            return 0
        if args.command == "demo":
            from rlhf_core.demo import run_demo

            run_demo(args.out, task=args.task, seed=args.seed, overrides=load_yaml(args.config) if args.config else {})
            return 0
    except (ConfigError, DataError) as e:
        return _fail(str(e))
    except StageFailed as e:
        if isinstance(e.cause, (ConfigError, DataError)):
            return _fail(str(e.cause))
        return _fail(f"stage failed: {type(e.cause).__name__}: {e.cause}", EXIT_FAILED)
    return _fail(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
