"""The pipeline report against a real (temporary SQLite) MLflow store: headline numbers, training
curves read back from the stage runs, images as files in MLflow and as data URIs for Prefect."""

import base64
import json
import math
import re
import time

import pytest

from orchestration import lineage, reports
from orchestration.stages import StageOutcome

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def eval_report(ppo_sampled=0.82):
    return {"policies": [{"name": "dpo", "uri": "/m/dpo"}, {"name": "ppo", "uri": "/m/ppo"}], "reference": "/m/sft",
            "reward_model": "/m/rm", "task": "sort", "dataset": "json@/d", "num_prompts": 200,
            "n_samples_per_prompt": 4, "temperature": 1.0, "num_kl_samples": 800,
            "metrics": {"eval/dpo/greedy_accuracy": 0.98, "eval/dpo/sampled_accuracy": 0.70,
                        "eval/dpo/pass_at_4": 0.97, "eval/ppo/greedy_accuracy": 0.975,
                        "eval/ppo/sampled_accuracy": ppo_sampled, "eval/ppo/pass_at_4": 0.99,
                        "eval/reference/greedy_accuracy": 0.995, "eval/reference/sampled_accuracy": 0.69,
                        "eval/reference/pass_at_4": 0.96, "eval/dpo/reward": 1.2, "eval/ppo/reward": 1.5,
                        "eval/reference/reward": 1.1, "eval/dpo/win_rate": 0.498, "eval/ppo/win_rate": 0.61,
                        "eval/dpo/kl": 0.13, "eval/ppo/kl": 0.35},
            "samples": [{"prompt": "sort CBA", "answer": "ABC",
                         "responses": {"dpo": {"text": "ABC", "correct": True, "sampled_correct": 3},
                                       "ppo": {"text": "ABC", "correct": True, "sampled_correct": 4},
                                       "reference": {"text": "ACB", "correct": False, "sampled_correct": 2}}}]}


def test_headline_best_policy_against_the_reference():
    h = reports.headline(eval_report(), "eval/ppo/sampled_accuracy")
    assert h["best"] == "ppo" and h["delta"] == pytest.approx(0.13) and h["kl"] == 0.35
    assert "**Yes.**" in h["text"] and "**+13.0 points**" in h["text"] and "0.350 nats" in h["text"]
    assert "`dpo` 70.0% (+1.0 points, KL 0.130 nats" in h["text"]
    # A bare metric name works too; the best of the policies wins; worse than the reference is a "No".
    h = reports.headline(eval_report(ppo_sampled=0.60), "sampled_accuracy")
    assert h["best"] == "dpo" and "**Yes.**" in h["text"] and "**+1.0 points**" in h["text"]
    assert "`ppo` 60.0% (-9.0 points" in h["text"]
    h = reports.headline(eval_report(), "greedy_accuracy")
    assert h["best"] == "dpo" and "**No.**" in h["text"] and "**-1.5 points**" in h["text"]
    h = reports.headline(eval_report(), "reward")
    assert h["best"] == "ppo" and "**+0.4**" in h["text"]  # not a fraction: its own units
    h = reports.headline(eval_report(), "win_rate")
    assert h["reference_value"] == 0.5 and "**+11.0 points**" in h["text"]
    with pytest.raises(ValueError, match="exact_match"):
        reports.headline(eval_report(), "eval/policy_exact_match")


def test_a_distilled_student_is_reported_with_its_size_against_its_teacher():
    report = eval_report()
    report["policies"] = [{"name": "ppo", "uri": "/m/ppo", "parameters": 1_050_000},
                          {"name": "distill", "uri": "/m/distill", "parameters": 148_480}]
    report["reference_parameters"] = 1_050_000
    report["metrics"]["eval/distill/sampled_accuracy"] = 0.75
    (line,) = reports.student_lines(report, {"distill": "/m/ppo"}, "sampled_accuracy")
    assert line == ("Distilled student `distill` (148k parameters, 14% of its teacher `ppo`'s): held-out sampled "
                    "accuracy **75.0%** against 82.0% for its teacher (-7.0 points).")
    (line,) = reports.student_lines(report, {"distill": "/m/sft"}, "sampled_accuracy")  # SFT taught it
    assert "of its teacher `reference`'s" in line and "against 69.0% for its teacher (+6.0 points)" in line
    (line,) = reports.student_lines(report, {"distill": "/elsewhere"}, "sampled_accuracy")
    assert line.endswith("(its teacher `/elsewhere` was not evaluated here).")
    assert reports.student_lines(report, {"distill-round2": "/m/ppo"}, "sampled_accuracy") == []  # not evaluated
    outcome = StageOutcome("kd", "distill", "/m/distill", "run-d", "k", False, {}, {"inputs": {"teacher_model": "/m/ppo"}})
    kept = StageOutcome("batch_inference", "rejection_sampling-score-round1", "/m/rs", "run-s", "k", False,
                        {"batch_inference/rows": 64, "batch_inference/kept_rows": 16}, {})
    report["metrics"]["eval/distill/sampled_accuracy"] = 0.9  # better than its teacher: still no champion
    built = reports.build_pipeline_report("parent", {"distill": outcome, kept.name: kept}, report, {},
                                          "sampled_accuracy")
    assert "Distilled student `distill` (148k parameters" in built.markdown
    assert "The best policy, `ppo`," in built.markdown  # the headline ranks the policies, not the student
    assert "- rows: 64\n- kept: 16\n" in built.markdown  # a data stage's numbers, and no curves for it
    assert built.markdown.count("No training curves") == 1  # the student's (no history given here)


def test_a_flagged_rl_stage_says_so_in_the_report():
    metrics = {"guard/reward_hacking": 1.0, "guard/since_step": 0, "guard/fired_step": 12, "guard/reward_rise": 0.8,
               "guard/metric_drop": 0.15}
    ppo = StageOutcome("ppo", "ppo", "/m/ppo", "run-p", "k", False, metrics, {})
    built = reports.build_pipeline_report("parent", {"ppo": ppo}, eval_report(), {}, "sampled_accuracy")
    assert ("- reward hacking flagged: from step 0 to step 12 the training reward rose by 0.8 while the held-out "
            "check fell by 0.15 (--eval.stop_on_hacking stops training there)\n") in built.markdown
    stopped = StageOutcome("ppo", "ppo", "/m/ppo", "run-p", "k", False, {**metrics, "guard/stopped_step": 12}, {})
    built = reports.build_pipeline_report("parent", {"ppo": stopped}, eval_report(), {}, "sampled_accuracy")
    assert "fell by 0.15; training stopped at step 12\n" in built.markdown
    quiet = StageOutcome("ppo", "ppo", "/m/ppo", "run-p", "k", False, {"train/steps": 4}, {})
    assert "reward hacking" not in reports.build_pipeline_report("parent", {"ppo": quiet}, eval_report(), {},
                                                                 "sampled_accuracy").markdown


def log_history(client, run_id, series: dict[str, list[tuple[int, float]]]):
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, int(s)) for k, points in series.items()
                                      for s, v in points])


@pytest.fixture
def pipeline_runs(tmp_path):
    """A parent run with SFT, a cached RM (its history on the earlier run), a PPO and an eval child."""
    client = lineage.client()
    parent = lineage.start_pipeline_run("report-test", "pipeline-test", {}, {})
    runs = {stage: lineage.start_stage_run(parent, stage, stage, {}) for stage in ("sft", "ppo", "eval")}
    log_history(client, runs["sft"], {"train/loss": [(s, 3 * math.exp(-s / 20)) for s in range(1, 101)],
                                      "eval_initial/loss": [(0, 5.5)], "eval/loss": [(100, 0.05)]})
    log_history(client, runs["ppo"], {"rollout/reward_mean": [(s, 0.6 + s / 200) for s in range(1, 41)],
                                      "rollout/kl": [(s, s / 100) for s in range(1, 41)],
                                      "train/entropy": [(s, 0.4 - s / 400) for s in range(1, 41)],
                                      "train/clip_frac": [(s, 0.02) for s in range(1, 41)],
                                      "rollout/response_length": [(s, 11.0) for s in range(1, 41)]})
    earlier = lineage.start_stage_run(parent, "rm", "rm-earlier", {})
    log_history(client, earlier, {"train/loss": [(s, 0.7 - s / 1000) for s in range(1, 51)],
                                  "train/accuracy": [(s, 0.5 + s / 120) for s in range(1, 51)]})
    runs["rm"] = lineage.start_stage_run(parent, "rm", "rm", {"rlhf.cached_from": earlier})
    out = tmp_path / "eval"
    out.mkdir()
    (out / "eval.json").write_text(json.dumps(eval_report()))

    def outcome(stage, metrics=None, cached=False, uri="/m/x"):
        return StageOutcome(stage, stage, uri, runs[stage], "key", cached, metrics or {}, {})

    outcomes = {"sft": outcome("sft", {"eval_initial/loss": 5.5, "eval/loss": 0.05}), "rm": outcome("rm", cached=True),
                "ppo": outcome("ppo"), "eval": outcome("eval", uri=str(out))}
    return parent, outcomes, client


def test_pipeline_report_from_mlflow(pipeline_runs, monkeypatch, tmp_path):
    parent, outcomes, client = pipeline_runs
    published = []
    monkeypatch.setattr(reports, "create_markdown_artifact", lambda **kw: published.append(kw))

    markdown = reports.publish_pipeline_report(parent, outcomes, outcomes["eval"], "eval/policy/sampled_accuracy")

    # The headline answers the question with the numbers; the table and each stage follow.
    assert "## Did RLHF help?" in markdown and "`ppo`" in markdown
    assert "**+13.0 points**" in markdown and "**0.350 nats**" in markdown
    assert "| metric | `dpo` | `ppo` | `reference` |" in markdown
    assert "eval loss: 5.5 -> 0.05" in markdown and "(cached: reused an earlier run's output)" in markdown
    images = ["eval_comparison.png", "curves_sft.png", "curves_rm.png", "curves_ppo.png"]
    for name in images:
        assert f"]({name})" in markdown
    # MLflow: report.md and its images on the parent run; each stage's curves on its own run.
    listed = {a.path for a in client.list_artifacts(parent, "report")}
    assert listed == {f"report/{n}" for n in ["report.md", *images]}
    local = client.download_artifacts(parent, "report", str(tmp_path / "dl"))
    assert open(f"{local}/report.md", encoding="utf-8").read() == markdown
    for name in images:
        assert open(f"{local}/{name}", "rb").read()[:8] == PNG_MAGIC
    assert [a.path for a in client.list_artifacts(outcomes["ppo"].run_id)] == ["training_curves.png"]
    # The cached RM's curves came from the run that trained it (its history is there, not here).
    assert open(f"{local}/curves_rm.png", "rb").read() == reports.build_pipeline_report(
        parent, {"rm": outcomes["rm"]}, None, {"rm": reports.history_of(client, outcomes["rm"])}, "x").images[
        "curves_rm.png"]
    # Prefect: the same report with every image inline as a data URI.
    (artifact,) = published
    assert artifact["key"] == "rlhf-pipeline-report"
    embedded = artifact["markdown"]
    uris = re.findall(r"\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", embedded)
    assert len(uris) == len(images) and all(base64.b64decode(u)[:8] == PNG_MAGIC for u in uris)
    assert "**+13.0 points**" in embedded and "](curves_sft.png)" not in embedded


def test_report_history_matters_and_without_evaluation(pipeline_runs, monkeypatch):
    parent, outcomes, client = pipeline_runs
    sft = reports.history_of(client, outcomes["sft"])
    assert set(sft) == {"train/loss", "eval/loss", "eval_initial/loss"} and len(sft["train/loss"]) == 100
    rm = reports.history_of(client, outcomes["rm"])
    assert set(rm) == {"train/loss", "train/accuracy"} and len(rm["train/accuracy"]) == 50
    a = reports.build_pipeline_report(parent, {"sft": outcomes["sft"]}, None, {"sft": sft}, "x")
    b = reports.build_pipeline_report(parent, {"sft": outcomes["sft"]}, None,
                                      {"sft": {**sft, "train/loss": sft["train/loss"][:50]}}, "x")
    assert a.images["curves_sft.png"] != b.images["curves_sft.png"]
    assert "No evaluation ran in this pipeline run" in a.markdown and "eval_comparison.png" not in a.images


def test_publish_eval_report_embeds_the_chart(pipeline_runs, monkeypatch):
    parent, outcomes, client = pipeline_runs
    published = []
    monkeypatch.setattr(reports, "create_markdown_artifact", lambda **kw: published.append(kw))
    out = reports.publish_eval_report(outcomes["eval"], "eval/policy/sampled_accuracy")
    assert [p["name"] for p in out["policies"]] == ["dpo", "ppo"] and "| metric | `dpo` |" in out["markdown"]
    assert "data:image/png;base64," in published[0]["markdown"] and published[0]["key"] == "rlhf-eval"
    assert [a.path for a in client.list_artifacts(outcomes["eval"].run_id)] == ["eval_comparison.png"]
