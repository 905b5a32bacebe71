"""Evaluation: a policy against a reference on held-out prompts (`rlhf eval`), and exact match.

For the policy, and for the reference when one is given, greedy responses are scored by the
reward model (mean score), checked by the task's exact verifier (exact-match accuracy) and
measured (mean length in generated tokens, EOS included). Between the two:
- win rate: how often the reward model scores the policy's response above the reference's on
  the same prompt, ties counting 1/2 (so a model against itself scores exactly 0.5);
- KL(policy || reference): the k1 estimator on responses *sampled* from the policy at
  temperature 1, i.e. the mean over samples of the summed per-token log pi - log pi_ref. The
  log-probs are exact forward passes of both models over the sampled token ids (not generation
  scores, which depend on the engine and its batching), not clamped, so the estimate is
  unbiased; a model against itself gives exactly 0.

Greedy decoding makes every number but the KL deterministic. Prompts are formatted like the
training data (chat template by default), read from the `test` split when the dataset has one.
The report goes to `save_path/eval.json` with a few sample rows, and `format_eval_markdown`
renders it for people (the orchestration layer publishes it as an artifact). This module imports
torch only inside the functions that run models, so the orchestration layer can read and render
reports without it.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from rlhf_core.config import ConfigError, EvalConfig

if TYPE_CHECKING:
    import torch

    from rlhf_core.rollout import Completion, PromptSet

NUM_SAMPLE_ROWS = 5
REPORT = "eval.json"


# --- pure metrics ------------------------------------------------------------------------------


def win_rate(policy_scores: list[float], reference_scores: list[float]) -> float:
    """Fraction of prompts where the policy scores higher; ties count 1/2."""
    if len(policy_scores) != len(reference_scores) or not policy_scores:
        raise ValueError(f"win rate needs equal, non-empty score lists ({len(policy_scores)} vs "
                         f"{len(reference_scores)})")
    wins = sum(1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy_scores, reference_scores, strict=True))
    return wins / len(policy_scores)


def k1_kl(policy_logps: torch.Tensor, reference_logps: torch.Tensor) -> float:
    """KL(pi || pi_ref) from samples of pi: mean of summed log pi - log pi_ref, `(num_samples,)` each."""
    return (policy_logps.double() - reference_logps.double()).mean().item()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def response_logprobs(model, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                      batch_size: int = 32) -> torch.Tensor:
    """Summed log-prob of each response given its prompt under `model`: `(num_samples,)` float32 on CPU."""
    import torch

    from rlhf_core.data.batching import pad_batch
    from rlhf_core.models.forward import per_sample_sum, token_logprobs

    device = next(model.parameters()).device
    out = []
    for i in range(0, len(prompt_ids), batch_size):
        prompts, responses = prompt_ids[i : i + batch_size], response_ids[i : i + batch_size]
        seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
        masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)]
        batch = pad_batch(seqs, masks, pad_id).to(device)
        with torch.no_grad():
            out.append(per_sample_sum(token_logprobs(model, batch), batch).float().cpu())
    return torch.cat(out)


# --- `rlhf eval` -------------------------------------------------------------------------------


def run_eval(cfg: EvalConfig) -> dict:
    """Evaluate, write `eval.json` + `stage.json` to `cfg.save_path`, log to MLflow; returns the manifest."""
    from rlhf_core.rollout import load_prompt_set
    from rlhf_core.rollout.prompts import held_out_split
    from rlhf_core.rollout.stage import publish_stage, stage_run

    cfg.check_complete()
    prompts = load_prompt_set(cfg.dataset, held_out_split(cfg.dataset), cfg.input_key, cfg.label_key,
                              require_answers=cfg.task is not None, max_samples=cfg.max_samples, seed=cfg.seed,
                              chat=cfg.apply_chat_template)
    with stage_run(cfg, prompts.sources) as tracker:
        report = evaluate(cfg, prompts)
        _print_summary(report["metrics"])
        inputs = {"pretrain": cfg.pretrain, "ref_pretrain": cfg.ref_pretrain, "reward_pretrain": cfg.reward_pretrain,
                  "datasets": prompts.sources}
        return publish_stage(cfg, tracker, {REPORT: json.dumps(report, indent=2, ensure_ascii=False)},
                             report["metrics"], inputs)


def evaluate(cfg: EvalConfig, prompts: PromptSet) -> dict:
    """The eval report (metrics and sample rows) for a loaded prompt set."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rewards import RewardModelReward, VerifierReward
    from rlhf_core.rollout import make_engine, prompt_formatter
    from rlhf_core.trainers.common import local_model_path

    policy_path = local_model_path(cfg.pretrain)
    ref_path = local_model_path(cfg.ref_pretrain) if cfg.ref_pretrain else None
    same_ref = ref_path is not None and cfg.ref_pretrain == cfg.pretrain
    tokenizer = load_tokenizer(policy_path)
    if ref_path is not None and not same_ref and load_tokenizer(ref_path).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"--ref_pretrain {cfg.ref_pretrain}: its tokenizer differs from the policy's; "
                         "win rate and KL compare models over the same tokens")
    fmt = prompt_formatter(tokenizer, cfg.apply_chat_template)
    formatted = [fmt.prompt_text(p) for p in prompts.prompts]
    generation = {"max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}
    with_kl = ref_path is not None and cfg.n_kl_samples > 0

    # Generation first, one engine at a time (a vLLM engine holds a share of the GPU until closed).
    engines = {"policy": make_engine(policy_path, cfg.rollout_backend.value, not cfg.apply_chat_template)}
    greedy = {"policy": [g[0] for g in engines["policy"].generate(formatted, 1, 0.0, **generation)]}
    sampled = engines["policy"].generate(formatted, cfg.n_kl_samples, 1.0, **generation) if with_kl else None
    if same_ref:
        engines["reference"], greedy["reference"] = engines["policy"], greedy["policy"]
    elif ref_path is not None:
        _release(engines["policy"])
        engines["reference"] = make_engine(ref_path, cfg.rollout_backend.value, not cfg.apply_chat_template)
        greedy["reference"] = [g[0] for g in engines["reference"].generate(formatted, 1, 0.0, **generation)]
        _release(engines["reference"])

    metrics: dict[str, float] = {}
    if with_kl:
        prompt_ids = [tokenizer(t, add_special_tokens=not cfg.apply_chat_template)["input_ids"] for t in formatted]
        flat_prompts = [prompt_ids[i] for i, group in enumerate(sampled) for _ in group]
        flat_responses = [list(c.token_ids) for group in sampled for c in group]
        policy_lm = _causal_lm(engines["policy"], policy_path)
        policy_logps = response_logprobs(policy_lm, flat_prompts, flat_responses, tokenizer.pad_token_id)
        ref_lm = policy_lm if same_ref else _causal_lm(engines["reference"], ref_path)
        ref_logps = policy_logps if same_ref else response_logprobs(ref_lm, flat_prompts, flat_responses,
                                                                    tokenizer.pad_token_id)
        metrics["eval/kl"] = k1_kl(policy_logps, ref_logps)
        del policy_lm, ref_lm
    for engine in engines.values():
        engine.close()

    texts = {who: [c.text for c in completions] for who, completions in greedy.items()}
    scores: dict[str, list[float]] = {}
    correct: dict[str, list[float]] = {}
    if cfg.reward_pretrain:
        rm = RewardModelReward(local_model_path(cfg.reward_pretrain), cfg.apply_chat_template, cfg.normalize_reward)
        for who in texts:
            scores[who] = scores["policy"] if who == "reference" and same_ref else rm.score(prompts.prompts,
                                                                                            texts[who])
        del rm
    if cfg.task:
        verifier = VerifierReward(cfg.task)
        correct = {who: verifier.score(prompts.prompts, texts[who], prompts.answers) for who in texts}
    for who in texts:
        if who in scores:
            metrics[f"eval/{who}_reward"] = mean(scores[who])
        if who in correct:
            metrics[f"eval/{who}_exact_match"] = mean(correct[who])
        metrics[f"eval/{who}_response_len"] = mean([len(c.token_ids) for c in greedy[who]])
    if "reference" in scores:
        metrics["eval/win_rate"] = win_rate(scores["policy"], scores["reference"])

    return {
        "policy": cfg.pretrain, "reference": cfg.ref_pretrain, "reward_model": cfg.reward_pretrain,
        "task": cfg.task, "dataset": cfg.dataset, "num_prompts": len(prompts),
        "num_kl_samples": sum(len(g) for g in sampled) if sampled else 0,
        "metrics": metrics,
        "samples": _sample_rows(prompts, greedy, scores, correct),
    }


def _release(engine) -> None:
    """Free a vLLM engine's GPU share before the next model loads; a transformers engine is kept for log-probs."""
    from rlhf_core.rollout import TransformersEngine

    if not isinstance(engine, TransformersEngine):
        engine.close()


def _causal_lm(engine, path: str):
    """The engine's own model (transformers) or a fresh load (after vLLM) for exact log-probs."""
    from rlhf_core.rollout import TransformersEngine

    if isinstance(engine, TransformersEngine):
        return engine.model
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rollout.base import inference_device, inference_dtype

    device = inference_device()
    return load_causal_lm(path, dtype=inference_dtype(device)).to(device).eval()


def _sample_rows(prompts: PromptSet, greedy: dict[str, list[Completion]], scores: dict, correct: dict) -> list[dict]:
    rows = []
    for i in range(min(NUM_SAMPLE_ROWS, len(prompts))):
        row = {"prompt": prompts.prompts[i], "answer": prompts.answers[i]}
        for who in greedy:
            row[f"{who}_response"] = greedy[who][i].text
            if who in scores:
                row[f"{who}_score"] = scores[who][i]
            if who in correct:
                row[f"{who}_correct"] = bool(correct[who][i])
        rows.append(row)
    return rows


def _print_summary(metrics: dict[str, float]) -> None:
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
    print(f"[eval] {shown}", file=sys.stderr, flush=True)


# --- reading and rendering reports ---------------------------------------------------------------


def read_eval_report(uri: str) -> dict:
    """The `eval.json` report of a finished eval stage at `uri` (local directory or s3://)."""
    from rlhf_core import storage

    if not storage.is_remote(uri):
        from pathlib import Path

        return json.loads((Path(storage.normalize_uri(uri)) / REPORT).read_text(encoding="utf-8"))
    import fsspec

    with fsspec.open(f"{uri.rstrip('/')}/{REPORT}", "r") as f:
        return json.load(f)


ROWS = (("reward-model score", "reward", "{:.4f}"), ("exact match", "exact_match", "{:.1%}"),
        ("response length (tokens)", "response_len", "{:.1f}"))


def _cell(value, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n") or " "


def format_eval_markdown(report: dict) -> str:
    """A markdown summary of an eval report: policy vs reference table, win rate, KL, samples."""
    m = report["metrics"]
    has_ref = report.get("reference") is not None
    lines = [f"## Evaluation of `{report['policy']}`" + (f" against `{report['reference']}`" if has_ref else ""),
             "", f"{report['num_prompts']} prompts from `{report['dataset']}`"
             + (f", task `{report['task']}`" if report.get("task") else "") + ".", ""]
    lines += ["| metric | policy | reference |", "|---|---|---|"]
    for label, key, fmt in ROWS:
        values = [m.get(f"eval/{who}_{key}") for who in ("policy", "reference")]
        if values[0] is None:
            continue
        lines.append(f"| {label} | " + " | ".join("—" if v is None else fmt.format(v) for v in values) + " |")
    lines.append("")
    if "eval/win_rate" in m:
        lines.append(f"- win rate of the policy over the reference (reward model, ties count 1/2): "
                     f"**{m['eval/win_rate']:.1%}**")
    if "eval/kl" in m:
        lines.append(f"- KL(policy ‖ reference), k1 estimate on {report.get('num_kl_samples', '?')} samples at "
                     f"temperature 1: **{m['eval/kl']:.4f} nats**")
    samples = report.get("samples") or []
    if samples:
        whos = ["policy", "reference"] if has_ref else ["policy"]
        lines += ["", "### Sample generations (greedy)", "",
                  "| prompt | answer | " + " | ".join(whos) + " |", "|---|---|" + "---|" * len(whos)]
        for row in samples:
            cells = [_cell(row["prompt"]), _cell(row.get("answer") or "")]
            for who in whos:
                extra = [f"{row[f'{who}_score']:.3f}"] if f"{who}_score" in row else []
                extra += ["✓" if row[f"{who}_correct"] else "✗"] if f"{who}_correct" in row else []
                cells.append(_cell(row[f"{who}_response"]) + (f" ({', '.join(extra)})" if extra else ""))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
