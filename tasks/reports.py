"""What a pipeline run shows people: the evaluation as a Prefect markdown artifact, a timing table."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from rlhf_core.pairs import PAIR_FRACTION
from tasks.stages import StageOutcome

# What each stage's own held-out evaluation says, shown after a pipeline run ("before -> after").
KEY_METRICS = {
    "sft": [("eval loss", "eval_initial/loss", "eval/loss")],
    "rm": [("pairwise accuracy", "eval_initial/accuracy", "eval/accuracy")],
    "dpo": [("reward accuracy", None, "eval/reward_accuracy"),
            ("chosen-rejected log-prob margin", "eval_initial/logp_margin", "eval/logp_margin")],
    "pairs": [("prompts with a pair", None, PAIR_FRACTION)],
}


def stage_metrics_lines(stage: str, metrics: dict) -> list[str]:
    lines = []
    for label, before, after in KEY_METRICS.get(stage, []):
        if after not in metrics:
            continue
        text = f"{metrics[after]:.4g}"
        if before and before in metrics:
            text = f"{metrics[before]:.4g} -> {text}"
        lines.append(f"{label}: {text}")
    return lines


def publish_eval_report(outcome: StageOutcome, promote_metric: str) -> dict:
    """Publish the eval stage's table and sample generations; return its metrics and samples."""
    from rlhf_core.evaluation import format_eval_markdown, read_eval_report

    report = read_eval_report(outcome.output_uri)
    markdown = format_eval_markdown(report)
    create_markdown_artifact(markdown=markdown, key=f"rlhf-{outcome.name.replace('_', '-')}",
                             description=f"{outcome.name}: policy vs reference on held-out prompts")
    return {"metrics": outcome.metrics, "markdown": markdown, "promote_metric": promote_metric,
            "output_uri": outcome.output_uri}


def summary_table(summary: dict) -> str:
    """Per-stage task time, time inside the Ray job, and the difference (orchestration overhead)."""
    lines = [f"{'stage':<16}{'cached':>8}{'task s':>10}{'job s':>10}{'overhead s':>12}"]
    for name, t in summary["stages"].items():
        lines.append(f"{name:<16}{'yes' if t['cached'] else 'no':>8}{t['task_seconds']:>10.1f}"
                     f"{t['job_seconds']:>10.1f}{t['overhead_seconds']:>12.1f}")
    lines.append(f"{'pipeline':<16}{'':>8}{summary['wall_seconds']:>10.1f}{summary['job_seconds']:>10.1f}"
                 f"{summary['overhead_seconds']:>12.1f}")
    return "\n".join(lines)
