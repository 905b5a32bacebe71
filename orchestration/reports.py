"""What a pipeline run shows people: the evaluation, the pipeline's report, a timing table.

The evaluation becomes a Prefect markdown artifact. The pipeline report answers "did RLHF help,
by how much, at what KL cost": a headline (best policy vs SFT on the promote metric, with its
KL), the evaluation, and every training stage's curves from MLflow. Images (`rlhf_core.stages.plots`)
are files beside the report in MLflow, and data URIs in the Prefect artifact (the embedded
Prefect serves no image URLs).
"""

from __future__ import annotations

import base64
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from orchestration.stages import StageOutcome
from rlhf_core.stages.pairs import PAIR_FRACTION

# What each stage's own held-out evaluation says, shown after a pipeline run ("before -> after").
KEY_METRICS = {
    "sft": [("eval loss", "eval_initial/loss", "eval/loss")],
    "rm": [("pairwise accuracy", "eval_initial/accuracy", "eval/accuracy")],
    "dpo": [("reward accuracy", None, "eval/reward_accuracy"),
            ("chosen-rejected log-prob margin", "eval_initial/logp_margin", "eval/logp_margin")],
    "pairs": [("prompts with a pair", None, PAIR_FRACTION)],
    "batch_inference": [("rows", None, "batch_inference/rows"), ("kept", None, "batch_inference/kept_rows"),
                        ("their mean reward", None, "batch_inference/kept_reward_mean")],
}


def stage_metrics_lines(stage: str, metrics: dict) -> list[str]:
    lines = [hacking_line(metrics)] if "guard/fired_step" in metrics else []
    for label, before, after in KEY_METRICS.get(stage, []):
        if after not in metrics:
            continue
        text = f"{metrics[after]:.4g}"
        if before and before in metrics:
            text = f"{metrics[before]:.4g} -> {text}"
        lines.append(f"{label}: {text}")
    return lines


def hacking_line(metrics: dict) -> str:
    """The RL stage's reward-hacking guard fired (`rlhf_core/rl/guard.py`): where, by how much (plain
    text: the report's markdown and the terminal summary both print it)."""
    line = (f"reward hacking flagged: from step {metrics['guard/since_step']:.0f} to step "
            f"{metrics['guard/fired_step']:.0f} the training reward rose by {metrics['guard/reward_rise']:.4g} while "
            f"the held-out check fell by {metrics['guard/metric_drop']:.4g}")
    if "guard/stopped_step" in metrics:
        return line + f"; training stopped at step {metrics['guard/stopped_step']:.0f}"
    return line + " (--eval.stop_on_hacking stops training there)"


def publish_eval_report(outcome: StageOutcome, promote_metric: str) -> dict:
    """Publish the eval stage's table, its comparison chart and sample generations; return its
    metrics, policies and markdown. The chart is also attached to the eval stage's MLflow run."""
    from rlhf_core.stages.evaluation import format_eval_markdown, read_eval_report
    from rlhf_core.stages.plots import eval_comparison_png

    report = read_eval_report(outcome.output_uri)
    markdown = format_eval_markdown(report)
    chart = eval_comparison_png(report)
    _log_artifacts(outcome.run_id, {EVAL_CHART: chart}, artifact_path=None)
    create_markdown_artifact(markdown=markdown + "\n" + _image_markdown("policies side by side", _data_uri(chart)),
                             key=f"rlhf-{_slug(outcome.name)}",
                             description=f"{outcome.name}: policies vs reference on held-out prompts")
    return {"metrics": outcome.metrics, "markdown": markdown, "promote_metric": promote_metric,
            "policies": report["policies"], "output_uri": outcome.output_uri}


# --- the pipeline report -------------------------------------------------------------------------

EVAL_CHART = "eval_comparison.png"
REPORT_FILE = "report.md"
REPORT_ARTIFACT_PATH = "report"  # where the report and its images go in the parent run's artifacts
# Stage kinds whose runs have no training curves (data, generation, evaluation).
NO_CURVES = {"prep", "eval", "pairs", "batch_inference"}


def publish_pipeline_report(parent_run_id: str, outcomes: dict[str, StageOutcome], eval_outcome: StageOutcome | None,
                            promote_metric: str) -> str:
    """The pipeline run's one report: did RLHF help, by how much, at what KL cost; the evaluation
    table and chart; each training stage's curves (from its MLflow metric history).

    The report (REPORT_FILE) and its PNGs go to the parent run's artifacts (under `report/`, images linked
    relatively), each stage's curves also to its own run; a Prefect markdown artifact carries the
    same report with the images embedded as data URIs (the embedded Prefect serves no image URLs).
    Returns the report file's markdown."""
    from orchestration import lineage

    client = lineage.client()
    report = None
    if eval_outcome is not None:
        from rlhf_core.stages.evaluation import read_eval_report

        report = read_eval_report(eval_outcome.output_uri)
    curves = {name: history_of(client, outcome) for name, outcome in outcomes.items() if outcome.stage not in NO_CURVES}
    built = build_pipeline_report(parent_run_id, outcomes, report, curves, promote_metric)
    for name, outcome in outcomes.items():
        image = built.images.get(curves_file(name))
        if image is not None:
            _log_artifacts(outcome.run_id, {"training_curves.png": image}, artifact_path=None, client=client)
    _log_artifacts(parent_run_id, {REPORT_FILE: built.markdown.encode("utf-8"), **built.images},
                   artifact_path=REPORT_ARTIFACT_PATH, client=client)
    create_markdown_artifact(markdown=built.render(lambda name: _data_uri(built.images[name])),
                             key="rlhf-pipeline-report",
                             description="Did RLHF help, by how much, at what KL cost: the pipeline run's report")
    return built.markdown


@dataclass
class BuiltReport:
    """The report's markdown around image slots, and the images (file name -> PNG bytes)."""

    parts: list  # str, or ("image", title, file name)
    images: dict[str, bytes]

    def render(self, image_url) -> str:
        """The markdown with each image at `image_url(file name)`."""
        return "".join(p if isinstance(p, str) else _image_markdown(p[1], image_url(p[2])) for p in self.parts)

    @property
    def markdown(self) -> str:
        """The report file's markdown: images as files next to it."""
        return self.render(lambda name: name)


def build_pipeline_report(parent_run_id: str, outcomes: dict[str, StageOutcome], report: dict | None,
                          curves: dict[str, dict[str, list[tuple[float, float]]]], promote_metric: str) -> BuiltReport:
    """The report from what the run left (pure: no MLflow, no Prefect). `report`: the eval stage's
    eval.json; `curves`: each training stage's metric history, `{key: [(step, value)]}`."""
    from rlhf_core.stages.evaluation import format_eval_markdown
    from rlhf_core.stages.plots import eval_comparison_png, training_curves_png

    parts: list = [f"# RLHF pipeline report\n\nMLflow pipeline run `{parent_run_id}`.\n\n"]
    images: dict[str, bytes] = {}
    parts.append("## Did RLHF help?\n\n")
    if report is None:
        parts.append("No evaluation ran in this pipeline run: add `eval` to `settings.stages` to compare the "
                     "policies with their reference.\n\n")
    else:
        students = {name: o.manifest.get("inputs", {}).get("teacher_model") for name, o in outcomes.items()
                    if o.stage == "kd"}
        parts.append(headline(report, promote_metric, students=frozenset(students))["text"] + "\n\n")
        parts += [line + "\n\n" for line in student_lines(report, students, promote_metric)]
        images[EVAL_CHART] = eval_comparison_png(report)
        parts.append(("image", "evaluation: policies side by side", EVAL_CHART))
        parts.append("\n\n" + _demote(format_eval_markdown(report)) + "\n")
    # Every stage that trained or made data, with its key numbers; curves where it trained.
    shown = [(name, o) for name, o in outcomes.items() if o.stage not in ("prep", "eval")]
    if shown:
        parts.append("## Training\n\n")
    for name, outcome in shown:
        parts.append(f"### {name}" + (f" (`{outcome.stage}`)" if outcome.stage != name else "") + "\n\n")
        facts = stage_metrics_lines(outcome.stage, outcome.metrics)
        facts.append(f"MLflow run `{outcome.run_id}`" + (" (cached: reused an earlier run's output)"
                                                         if outcome.cached else ""))
        parts.append("".join(f"- {line}\n" for line in facts) + "\n")
        if outcome.stage in NO_CURVES:
            continue
        image = training_curves_png(outcome.stage, f"{name}: training curves", curves.get(name, {}))
        if image is None:
            parts.append("No training curves were logged for this stage.\n\n")
            continue
        images[curves_file(name)] = image
        parts += [("image", f"{name}: training curves", curves_file(name)), "\n\n"]
    return BuiltReport(parts, images)


def headline(report: dict, promote_metric: str, students: frozenset[str] = frozenset()) -> dict:
    """Best policy against the reference on the promote metric: the sentence and its numbers.
    Distilled `students` are no candidates (they are never the champion) unless nothing else was
    evaluated; `student_lines` reports them.

    `promote_metric` names a per-model metric (`sampled_accuracy`) or a key of one model
    (`eval/<name>/sampled_accuracy`); higher wins. A fraction (accuracy, pass@k, win rate)
    differs in percentage points, anything else in its own units."""
    from rlhf_core.config import REFERENCE_NAME
    from rlhf_core.stages.evaluation import metric_key

    metrics = report["metrics"]
    metric = promote_metric.rsplit("/", 1)[-1]
    policies = [p["name"] for p in report["policies"]]
    policies = [p for p in policies if p not in students] or policies
    values = {name: metrics.get(metric_key(name, metric)) for name in policies}
    values = {name: v for name, v in values.items() if v is not None}
    if not values:
        raise ValueError(f"promote metric {promote_metric!r}: the evaluation has no {metric!r} for any policy "
                         f"(its metrics: {', '.join(sorted(metrics))})")
    best = max(values, key=lambda name: values[name])
    reference = metrics.get(metric_key(REFERENCE_NAME, metric))
    if reference is None and metric == "win_rate" and report.get("reference"):
        reference = 0.5  # the reference against itself
    fraction = metric in {"greedy_accuracy", "sampled_accuracy", "win_rate"} or metric.startswith("pass_at_")
    label = METRIC_LABELS.get(metric, metric.replace("_", " "))
    if metric.startswith("pass_at_"):
        label = f"pass@{metric.removeprefix('pass_at_')}"

    def show(v: float) -> str:
        return f"{v:.1%}" if fraction else f"{v:.4g}"

    def delta_text(d: float) -> str:
        return f"{d * 100:+.1f} points" if fraction else f"{d:+.4g}"

    def kl_text(name: str) -> str:
        kl = metrics.get(metric_key(name, "kl"))
        return "no KL (no reference)" if kl is None else f"KL {kl:.3f} nats to the reference"

    out = {"best": best, "metric": metric, "value": values[best], "reference_value": reference,
           "kl": metrics.get(metric_key(best, "kl"))}
    if reference is None:
        out["delta"] = None
        text = (f"Best policy: `{best}`, {label} **{show(values[best])}**; there is no reference value to compare "
                f"with ({kl_text(best)}).")
    else:
        delta = values[best] - reference
        out["delta"] = delta
        verdict = "**Yes.**" if delta > 0 else "**No.**" if delta < 0 else "**No change.**"
        kl = out["kl"]
        cost = f"at a KL of **{kl:.3f} nats** to the reference" if kl is not None else "(no KL estimate)"
        text = (f"{verdict} The best policy, `{best}`, reaches {label} **{show(values[best])}** against "
                f"{show(reference)} for the reference (SFT): **{delta_text(delta)}**, {cost}.")
        others = [f"`{n}` {show(v)} ({delta_text(v - reference)}, {kl_text(n)})" for n, v in values.items() if n != best]
        if others:
            text += " Other policies: " + "; ".join(others) + "."
    out["text"] = text + f" (Promote metric: `{promote_metric}`, higher wins.)"
    return out


def student_lines(report: dict, students: dict[str, str | None], promote_metric: str) -> list[str]:
    """Per distilled student the evaluation compared (name -> its teacher's URI): its size against
    its teacher's and what it kept of the teacher's promote metric."""
    from rlhf_core.config import REFERENCE_NAME
    from rlhf_core.stages.evaluation import metric_key

    metric = promote_metric.rsplit("/", 1)[-1]
    label = METRIC_LABELS.get(metric, metric.replace("_", " "))
    fraction = metric in {"greedy_accuracy", "sampled_accuracy", "win_rate"} or metric.startswith("pass_at_")
    entries = {p["name"]: p for p in report["policies"]}
    if report.get("reference"):
        entries.setdefault(REFERENCE_NAME, {"name": REFERENCE_NAME, "uri": report["reference"],
                                            "parameters": report.get("reference_parameters")})

    def show(v: float) -> str:
        return f"{v:.1%}" if fraction else f"{v:.4g}"

    lines = []
    for name, teacher_uri in students.items():
        if name not in entries:
            continue
        teacher = next((e for e in entries.values() if e["uri"] == teacher_uri and e["name"] != name), None)
        size, text = entries[name].get("parameters"), f"Distilled student `{name}`"
        if size:
            text += f" ({_count(size)} parameters"
            if teacher is not None and teacher.get("parameters"):
                text += f", {size / teacher['parameters']:.0%} of its teacher `{teacher['name']}`'s"
            text += ")"
        value = report["metrics"].get(metric_key(name, metric))
        if value is None:
            lines.append(text + ".")
            continue
        text += f": {label} **{show(value)}**"
        teacher_value = report["metrics"].get(metric_key(teacher["name"], metric)) if teacher else None
        if teacher_value is not None:
            kept = f"{(value - teacher_value) * 100:+.1f} points" if fraction else f"{value - teacher_value:+.4g}"
            text += f" against {show(teacher_value)} for its teacher ({kept})"
        elif teacher_uri:
            text += f" (its teacher `{teacher_uri}` was not evaluated here)"
        lines.append(text + ".")
    return lines


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


METRIC_LABELS = {"greedy_accuracy": "held-out greedy accuracy", "sampled_accuracy": "held-out sampled accuracy",
                 "reward": "reward-model score", "win_rate": "win rate over the reference",
                 "response_len": "response length"}


def history_of(client, outcome: StageOutcome) -> dict[str, list[tuple[float, float]]]:
    """A stage's metric history `{key: [(step, value)]}` from the MLflow run that trained it
    (through `rlhf.cached_from` when this run reused an earlier one's output)."""
    from rlhf_core.stages.plots import curve_keys

    run = client.get_run(outcome.manifest.get("mlflow_run_id") or outcome.run_id)
    for _ in range(10):  # a chain of reuses; bounded so a tag loop cannot spin
        source = run.data.tags.get("rlhf.cached_from")
        if not source or source == run.info.run_id:
            break
        run = client.get_run(source)
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in sorted(curve_keys(outcome.stage) & set(run.data.metrics))}


def curves_file(stage_name: str) -> str:
    return f"curves_{_slug(stage_name)}.png"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower())


def _demote(markdown: str) -> str:
    """Headings one level down (the evaluation's own document becomes a section of the report)."""
    return "\n".join("#" + line if line.startswith("#") else line for line in markdown.split("\n"))


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _image_markdown(title: str, url: str) -> str:
    return f"![{title}]({url})"


def _log_artifacts(run_id: str, files: dict[str, bytes], artifact_path: str | None, client=None) -> None:
    """Write `files` (name -> bytes) to a temporary folder and log them to the MLflow run."""
    from orchestration import lineage

    client = client or lineage.client()
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        client.log_artifacts(run_id, tmp, artifact_path=artifact_path)


def summary_table(summary: dict) -> str:
    """Per-stage task time, time inside the Ray job, and the difference (orchestration overhead)."""
    lines = [f"{'stage':<16}{'cached':>8}{'task s':>10}{'job s':>10}{'overhead s':>12}"]
    for name, t in summary["stages"].items():
        lines.append(f"{name:<16}{'yes' if t['cached'] else 'no':>8}{t['task_seconds']:>10.1f}"
                     f"{t['job_seconds']:>10.1f}{t['overhead_seconds']:>12.1f}")
    lines.append(f"{'pipeline':<16}{'':>8}{summary['wall_seconds']:>10.1f}{summary['job_seconds']:>10.1f}"
                 f"{summary['overhead_seconds']:>12.1f}")
    return "\n".join(lines)
