"""Figures for people: training curves of a stage and the evaluation's policies side by side, as PNG bytes.

Pure functions, data in and PNG bytes out; the caller reads MLflow and decides where images go.
matplotlib is imported inside the functions, and only its object-oriented API (a `Figure` on an
Agg canvas): no pyplot, no global backend or figure state, no display, safe in worker threads.
Panels are small (3.4 x 2.5 inches at 100 dpi, at most three a row) so a report stays light and
reads on a laptop screen.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

Series = Sequence[tuple[float, float]]  # (step, value) points, in any order
PANEL_INCHES = (3.4, 2.5)
MAX_COLUMNS = 3
DPI = 100
LOG_SCALE_RATIO = 100  # a positive panel spanning more than this factor is drawn on a log axis


def _figure(n_panels: int, title: str):
    """A figure with one axes per panel (row-major), its title, and the Agg canvas it draws on."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 2 if n_panels == 4 else min(MAX_COLUMNS, max(1, n_panels))
    rows = max(1, math.ceil(n_panels / cols))
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows + 0.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10, fontweight="bold")
    return fig, axes[:n_panels]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    # No "Software" metadata: the bytes depend on the data and the drawing, not on the version string.
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _style(ax, title: str, xlabel: str | None = None) -> None:
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=8)


def line_panels_png(title: str, panels: Sequence[tuple[str, Mapping[str, Series]]], xlabel: str = "step") -> bytes:
    """Curves: one panel per `(panel title, {series label: [(step, value), ...]})`, as PNG bytes.

    A series of a few points (a held-out evaluation) is drawn with markers, a long one as a line;
    a panel with several series gets a legend; positive values spanning more than `LOG_SCALE_RATIO`
    get a log axis. Empty series are skipped; a panel left empty says so.
    """
    if not panels:
        raise ValueError("line_panels_png: no panels to draw")
    fig, axes = _figure(len(panels), title)
    for ax, (panel_title, series) in zip(axes, panels, strict=True):
        drawn, values = 0, []
        for label, points in series.items():
            points = sorted((float(s), float(v)) for s, v in points if v is not None and math.isfinite(v))
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            sparse = len(points) <= 12
            ax.plot(xs, ys, label=label, linewidth=1.4, marker="o" if sparse else None, markersize=3.5)
            drawn += 1
            values += ys
        if values and min(values) > 0 and max(values) / min(values) > LOG_SCALE_RATIO:
            ax.set_yscale("log")  # e.g. an SFT loss from 5.6 to 0.006: linear would flatten the end
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", fontsize=8, color="0.5",
                    transform=ax.transAxes)
        if drawn > 1:
            ax.legend(fontsize=7, frameon=False)
        _style(ax, panel_title, xlabel)
    return _png(fig)


def bar_panels_png(title: str, names: Sequence[str],
                   panels: Sequence[tuple[str, Mapping[str, Sequence[float | None]]]],
                   percent: Sequence[bool] | None = None,
                   reference_lines: Mapping[str, Mapping[str, tuple[float, str]]] | None = None) -> bytes:
    """Grouped bars: `names` on the x axis (the models), one panel per `(panel title, {series
    label: one value per name, None where the model has none})`, values written above the bars.

    `percent[i]`: panel i holds fractions, shown as percentages on a 0-100 axis. A model without a
    value in a panel has no place on its axis. `reference_lines[panel title]`: horizontal lines
    `{label: (value, linestyle)}` (e.g. where the reference stands).
    """
    if not panels:
        raise ValueError("bar_panels_png: no panels to draw")
    percent = list(percent) if percent is not None else [False] * len(panels)
    fig, axes = _figure(len(panels), title)
    for ax, (panel_title, series), pct in zip(axes, panels, percent, strict=True):
        for label, values in series.items():
            if len(values) != len(names):
                raise ValueError(f"bar_panels_png: {panel_title}/{label}: {len(values)} values for {len(names)} names")
        # Only the models that have a value in this panel get a place on its axis.
        shown = [i for i in range(len(names)) if any(v[i] is not None for v in series.values())]
        width = 0.8 / max(1, len(series))
        for j, (label, values) in enumerate(series.items()):
            xs = [x - 0.4 + width * (j + 0.5) for x, i in enumerate(shown) if values[i] is not None]
            ys = [100 * values[i] if pct else values[i] for i in shown if values[i] is not None]
            bars = ax.bar(xs, ys, width=width * 0.92, label=label)
            ax.bar_label(bars, labels=[f"{y:.1f}" if pct else f"{y:.3g}" for y in ys], fontsize=7, padding=1)
        ax.set_xticks(range(len(shown)), [names[i] for i in shown], fontsize=8, rotation=20 if len(shown) > 3 else 0)
        ax.set_xlim(-0.6, len(shown) - 0.4)
        ax.axhline(0, color="0.4", linewidth=0.6)
        if pct:
            ax.set_ylim(0, 109)
            ax.set_ylabel("%", fontsize=8)
        else:
            ax.margins(y=0.18)
        for label, (y, style) in (reference_lines or {}).get(panel_title, {}).items():
            ax.axhline(100 * y if pct else y, color="0.3", linestyle=style, linewidth=0.9, label=label)
        if len(series) > 1 or (reference_lines or {}).get(panel_title):
            ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.1),
                      ncol=min(3, len(series) + len((reference_lines or {}).get(panel_title, {}))))
        _style(ax, panel_title)
        ax.grid(False, axis="x")
    return _png(fig)


# --- what the pipeline's report draws ---------------------------------------------------------------

# Per stage kind: (panel title, {series label: MLflow metric key}); a held-out series also takes the
# stage's `eval_initial/` value at step 0 (its model before training). Keys as the trainers log them
# (docs/flags.md, "What is logged").
STAGE_CURVES: dict[str, list[tuple[str, dict[str, str]]]] = {
    "sft": [("loss (response tokens)", {"train": "train/loss", "held-out": "eval/loss"})],
    "rm": [("loss", {"train": "train/loss", "held-out": "eval/loss"}),
           ("pairwise accuracy", {"train": "train/accuracy", "held-out": "eval/accuracy"})],
    "dpo": [("loss", {"train": "train/loss", "held-out": "eval/loss"}),
            ("implicit-reward accuracy", {"train": "train/reward_accuracy", "held-out": "eval/reward_accuracy"}),
            ("chosen - rejected log-prob margin", {"train": "train/logp_margin", "held-out": "eval/logp_margin"})],
    "kto": [("loss", {"train": "train/loss", "held-out": "eval/loss"})],
    "kd": [("loss (NLL and distillation mixed)", {"train": "train/loss", "held-out": "eval/loss"}),
           ("the terms", {"NLL": "train/nll", "distillation": "train/distill_loss", "held-out NLL": "eval/nll"})],
    "prm": [("loss (per step)", {"train": "train/loss", "held-out": "eval/loss"}),
            ("step accuracy", {"train": "train/acc", "held-out": "eval/acc"})],
    "ppo": [("reward (rollouts)", {"mean": "rollout/reward_mean"}),
            ("KL to reference (rollouts)", {"kl": "rollout/kl"}),
            ("entropy", {"entropy": "train/entropy"}),
            ("clip fraction", {"clip frac": "train/clip_frac"}),
            ("response length (tokens)", {"length": "rollout/response_length"}),
            ("held-out accuracy", {"sampled": "eval/sampled_accuracy", "greedy": "eval/greedy_accuracy"}),
            # the reward-hacking guard's two numbers (rl/guard.py): they part ways when the policy games its reward
            ("training reward against the held-out check", {"training reward": "rollout/reward_mean",
                                                            "held-out accuracy (selection)": "select/sampled_accuracy",
                                                            "held-out accuracy": "eval/sampled_accuracy",
                                                            "gold reward (selection)": "select/sampled_gold_reward",
                                                            "gold reward": "eval/sampled_gold_reward"})],
}
DEFAULT_CURVES = [("loss", {"train": "train/loss", "held-out": "eval/loss"})]
INITIAL_PREFIX = "eval_initial/"


def curve_keys(stage: str) -> set[str]:
    """The MLflow metric keys a stage kind's curves read (its held-out keys' `eval_initial/` twins too)."""
    keys = {key for _, series in STAGE_CURVES.get(stage) or DEFAULT_CURVES for key in series.values()}
    return keys | {INITIAL_PREFIX + k.removeprefix("eval/") for k in keys if k.startswith("eval/")}


def stage_panels(stage: str, history: Mapping[str, Series]) -> list[tuple[str, dict[str, Series]]]:
    """The panels of a stage's training curves from its metric history (`{key: [(step, value)]}`):
    the stage kind's panels that have any data; for a kind without a definition, its `train/loss`."""
    definition = STAGE_CURVES.get(stage) or DEFAULT_CURVES
    panels = []
    for title, keys in definition:
        series = {}
        for label, key in keys.items():
            points = list(history.get(key, []))
            if key.startswith("eval/"):
                points += list(history.get(INITIAL_PREFIX + key.removeprefix("eval/"), []))
            if points:
                series[label] = points
        if series:
            panels.append((title, series))
    return panels


def training_curves_png(stage: str, title: str, history: Mapping[str, Series]) -> bytes | None:
    """PNG of a stage's training curves, or None when its history holds none of them."""
    panels = stage_panels(stage, history)
    return line_panels_png(title, panels) if panels else None


def eval_comparison_png(report: dict) -> bytes:
    """PNG of an `rlhf eval` report: accuracy (greedy, sampled, pass@k), reward-model score, win rate
    and KL, one bar per model (the reference's bar where it has the metric)."""
    from rlhf_core.stages.evaluation import metric_key, model_names, pass_at_k_metric

    m = report["metrics"]
    names = model_names(report)
    k = report.get("n_samples_per_prompt", 1)
    temperature = report.get("temperature", 1.0)

    def values(metric: str) -> list[float | None]:
        return [m.get(metric_key(n, metric)) for n in names]

    candidates = [
        ("held-out accuracy (verifier)", {"greedy": values("greedy_accuracy"),
                                          f"sampled (T={temperature:g})": values("sampled_accuracy"),
                                          f"pass@{k}": values(pass_at_k_metric(k))}, True),
        ("reward-model score (greedy)", {"reward": values("reward")}, False),
        ("win rate vs reference (RM)", {"win rate": values("win_rate")}, True),
        ("KL(policy || reference), nats", {"kl": values("kl")}, False),
    ]
    panels, percent = [], []
    for title, series, pct in candidates:
        series = {label: v for label, v in series.items() if any(x is not None for x in v)}
        if series:
            panels.append((title, series))
            percent.append(pct)
    if not panels:
        panels, percent = [("response length (tokens, greedy)", {"length": values("response_len")})], [False]
    lines = {"win rate vs reference (RM)": {"reference (ties 1/2)": (0.5, "--")}}
    return bar_panels_png(f"Evaluation on {report['num_prompts']} held-out prompts", names, panels, percent, lines)
