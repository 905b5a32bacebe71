"""`rlhf pipeline run`: the `rlhf` flow from the command line (the CLI hands `pipeline` over to here).

With nothing configured the flow runs in-process against Prefect's ephemeral API, a local Ray
and the SQLite MLflow store; `PREFECT_API_URL`, `RAY_ADDRESS` and `MLFLOW_TRACKING_URI` point it
at servers instead. `--config FILE.yaml` has one section per flow parameter:

    settings: {stages: [sft, rm], from_run: <run id>, output_root: s3://bucket/rlhf}
    prep: {task: addition, n_train: 4000}
    sft: {max_epochs: 1, learning_rate: 5e-4}
    rm: {...}
    prm: {max_epochs: 3}                                              # with stage prm: `rlhf train prm`'s flags
    dpo: {beta: 0.2}
    ppo: {train.max_steps: 40, algo.advantage.estimator: group_norm}   # any `rlhf train ppo` spelling
    rejection_sampling: {rounds: 2, best_of_n: 4}                     # with stage rejection_sampling
    conditional_sft: {condition_percentile: 90}                       # with stage conditional_sft
    distill: {kd_coef: 0.5}                                           # `rlhf train kd`'s flags
    evaluation: {max_samples: 100, promote_metric: sampled_accuracy}
    iterative: {rounds: 2}
    online: {start_from: champion}
"""

from __future__ import annotations

import argparse
import os
import shlex

from rlhf_core.config import build_config, load_yaml
from rlhf_core.infra.network import free_port
from rlhf_core.infra.redaction import refuse_inline_secrets
from rlhf_core.infra.settings import ConfigError

HELP = "Run the whole lifecycle as the Prefect flow `rlhf`"  # `rlhf pipeline` (registered in pyproject.toml)
SECTIONS = ("settings", "prep", "sft", "rm", "prm", "dpo", "ppo", "rejection_sampling", "conditional_sft", "distill",
            "evaluation", "iterative", "online")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["run"])
    parser.add_argument("--config", default=None, help="YAML with sections " + ", ".join(SECTIONS))
    parser.add_argument("--stages", default=None, help="Comma-separated stages (default: prep,sft,rm,ppo,eval; "
                        "DPO: prep,sft,rm,dpo,eval; both side by side: prep,sft,rm,dpo,ppo,eval; a smaller student "
                        "distilled from the policy: prep,sft,rm,ppo,distill,eval; rejection sampling: "
                        "prep,sft,rm,rejection_sampling,eval; conditional SFT: prep,sft,rm,conditional_sft,eval; a process "
                        "reward model for a task of steps: prep,sft,prm)")
    parser.add_argument("--from_run", default=None, help="Earlier pipeline run to take upstream outputs from")
    parser.add_argument("--output_root", default=None, help="Local directory or s3:// URI for stage outputs")
    parser.add_argument("--force", action="store_true", help="Rerun every stage, ignoring cached outputs")


def flow_parameters(config: dict, args: argparse.Namespace | None = None) -> dict:
    """Validated flow parameters from a YAML mapping plus command-line overrides (ConfigError if bad)."""
    from pydantic import ValidationError

    from flows.params import (
        STAGE_PARAMS,
        ConditionalSFTParams,
        EvalParams,
        IterativeDPOParams,
        OnlineRLParams,
        PipelineSettings,
        PrepParams,
        RejectionSamplingParams,
    )

    unknown = set(config) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"--config: unknown section(s) {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    settings = dict(config.get("settings") or {})
    if args is not None:
        if args.stages:
            settings["stages"] = [s.strip() for s in args.stages.split(",") if s.strip()]
        for key in ("from_run", "output_root"):
            if getattr(args, key):
                settings[key] = getattr(args, key)
        if args.force:
            settings["force"] = True
    params = {}
    for name, cls in (("settings", PipelineSettings), ("prep", PrepParams), ("evaluation", EvalParams),
                      ("iterative", IterativeDPOParams), ("online", OnlineRLParams),
                      ("rejection_sampling", RejectionSamplingParams), ("conditional_sft", ConditionalSFTParams)):
        values = settings if name == "settings" else (config.get(name) or {})
        try:
            params[name] = cls.model_validate(values)
        except ValidationError as e:
            problems = "; ".join(f"{name}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise ConfigError(f"--config: {problems}") from None
    for name, cls in STAGE_PARAMS.items():
        try:
            params[name] = build_config(cls, None, config.get(name) or {}, complete=False)
        except ConfigError as e:
            raise ConfigError(f"--config section {name}: {e}") from None
    refuse_inline_secrets({name: p.model_dump(mode="json") for name, p in params.items()}, "--config")
    return params


def run(args: argparse.Namespace) -> int:
    from flows.embedded import prepare_stores
    from flows.pipeline import rlhf
    from orchestration.lifeline import lifeline

    params = flow_parameters(load_yaml(args.config) if args.config else {}, args)
    prepare_stores()  # another run may be creating the same SQLite databases right now
    with lifeline():  # Prefect's ephemeral server, the local Ray: nothing outlives this process
        summary = rlhf(**params)
        print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    from orchestration.reports import stage_metrics_lines, summary_table
    from rlhf_core.infra.settings import tracking_uri

    print("\n=== pipeline run", summary["pipeline_run_id"], flush=True)
    for name, timing in summary["stages"].items():
        for line in stage_metrics_lines(timing["stage"], timing["metrics"]):
            print(f"  {name:<14}{line}")
    if "evaluation" in summary:
        print(summary["evaluation"]["markdown"])
    print("\n" + summary_table(summary))
    print("\noutputs:")
    for name, uri in summary["outputs"].items():
        print(f"  {name:<16}{uri}")
    registry = summary.get("registry", {})
    for name, entry in registry.get("policies", {}).items():
        value = f", {registry['policy']['metric']} = {entry['value']}" if "value" in entry else ""
        print(f"\n{name}: registered {entry['model']} v{entry['version']}{value}", end="")
    champion = registry.get("policy")
    if champion:
        state = "is the new champion" if champion.get("champion") else "did not beat the champion"
        print(f"\nbest policy: {champion['best']} ({champion['model']} v{champion['version']}) {state} "
              f"({champion.get('metric')} = {champion.get('value')}, previous {champion.get('previous_champion_value')})")
        print(f"champion: models:/{champion['model']}@champion -> {champion.get('champion_uri')}")
    elif registry.get("policies"):
        print()
    print(f"\nsummary:    {summary['summary_uri']}")
    if "report" in summary:
        print(f"report:     {report_uri(summary['pipeline_run_id'])} (also the Prefect artifact rlhf-pipeline-report)")
    print("lineage:    rlhf lineage models:/rlhf-policy@champion")
    print(f"MLflow UI:  mlflow ui --backend-store-uri {tracking_uri()}")
    print(f"Prefect UI: {prefect_ui_hint()}")


def report_uri(parent_run_id: str) -> str:
    """Where the pipeline report landed among the parent run's MLflow artifacts."""
    from orchestration.lineage import client
    from orchestration.reports import REPORT_ARTIFACT_PATH, REPORT_FILE

    return f"{client().get_run(parent_run_id).info.artifact_uri}/{REPORT_ARTIFACT_PATH}/{REPORT_FILE}"


def prefect_ui_hint() -> str:
    """Where this run's flow runs can be seen: the server in use, or a command that serves the
    embedded database's UI. The UI finds its API at the port Prefect's settings name, not at
    `--port`, so the command sets the port through the setting (4200 when free, else a free one):
    UI and API then agree on any port."""
    api = os.environ.get("PREFECT_API_URL")
    if api:
        return api.rstrip("/").removesuffix("/api")
    home = os.environ.get("PREFECT_HOME")
    prefix = f"PREFECT_HOME={shlex.quote(home)} " if home else ""
    port = free_port(4200)
    # the V2 UI, Prefect's default from 3.8 (3.7, the GPU profile's, serves the old one unless asked)
    return (f"{prefix}PREFECT_SERVER_API_PORT={port} PREFECT_SERVER_UI_V2_ENABLED=true prefect server start  "
            f"(then open http://127.0.0.1:{port})")

