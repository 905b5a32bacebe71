"""Evaluation: policies side by side against a reference on held-out prompts (`rlhf eval`).

Every model answers the same held-out prompts greedily and `K = n_samples_per_prompt` times at
`temperature`. Per model, under `eval/<name>/<metric>` (the reference as `eval/reference/...`):
- `greedy_accuracy`: the task's exact verifier on the greedy response;
- `sampled_accuracy`: the verifier's mean over the K samples of every prompt;
- `pass_at_<K>`: share of prompts with at least one correct sample (Chen et al.'s unbiased
  estimator with n = k);
- `reward`: the reward model's mean score of the greedy responses;
- `response_len`: mean greedy response length in generated tokens, EOS included;
and for the policies only:
- `win_rate`: share of prompts where the RM scores the policy's greedy response above the
  reference's, ties 1/2 (a model against itself: exactly 0.5);
- `kl`: KL(policy || reference), k1 on K samples per prompt from the policy at temperature 1:
  mean over samples of sum_t (log pi - log pi_ref), from exact forward passes of both models,
  unclamped (unbiased; a model against itself: exactly 0).

One engine at a time (a vLLM engine holds its GPU share until closed): the policies, each scoring
its own KL samples, then the reference, scoring every policy's; then the reward model. Every model
samples with the same seed. The report is `save_path/eval.json`; torch is imported only inside the
functions that run models, so the orchestration layer can read and render reports without it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_core.config import REFERENCE_NAME, EvalConfig
from rlhf_core.infra.settings import ConfigError

if TYPE_CHECKING:
    import torch

    from rlhf_core.rollout import PromptSet
    from rlhf_core.rollout.base import Sample

NUM_SAMPLE_ROWS = 5
REPORT = "eval.json"


# --- pure metrics ------------------------------------------------------------------------------


def metric_key(name: str, metric: str) -> str:
    """The flat MLflow key of a model's metric: `eval/<name>/<metric>`."""
    return f"eval/{name}/{metric}"


def pass_at_k_metric(k: int) -> str:
    """`pass_at_<k>`: MLflow metric keys may not contain '@'."""
    return f"pass_at_{k}"


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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is
    correct: 1 - C(n-c, k) / C(n, k), the unbiased pass@k estimator; with n = k, 1 if c > 0 else 0."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) as a product, never forming the binomials
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(correct: list[list[float]], k: int) -> float:
    """pass@k averaged over prompts; `correct[prompt]` holds the verifier's 0/1 for each of its n samples."""
    if not correct:
        raise ValueError("pass@k needs at least one prompt")
    return mean([pass_at_k(len(group), round(sum(group)), k) for group in correct])


def sampled_accuracy(correct: list[list[float]]) -> float:
    """The verifier's mean over every prompt's samples, averaged over prompts."""
    if not correct or any(not group for group in correct):
        raise ValueError("sampled accuracy needs at least one sample for every prompt")
    return mean([mean(group) for group in correct])


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
    from rlhf_core.infra.publishing import publish_output
    from rlhf_core.rollout import load_prompt_set
    from rlhf_core.rollout.prompts import held_out_split
    from rlhf_core.rollout.stage import stage_run

    cfg.check_complete()
    policies = cfg.policies()
    prompts = load_prompt_set(cfg.dataset, held_out_split(cfg.dataset), cfg.input_key, cfg.label_key,
                              require_answers=cfg.task is not None, max_samples=cfg.max_samples, seed=cfg.seed,
                              chat=cfg.apply_chat_template)
    with stage_run(cfg, prompts.sources) as tracker:
        report = evaluate(cfg, prompts)
        _print_summary(report["metrics"])
        inputs = {"pretrain": cfg.pretrain, "policies": [{"name": n, "uri": u} for n, u in policies],
                  "ref_pretrain": cfg.ref_pretrain, "reward_pretrain": cfg.reward_pretrain,
                  "datasets": prompts.sources}
        return publish_output(cfg, tracker, inputs, report["metrics"],
                              files={REPORT: json.dumps(report, indent=2, ensure_ascii=False)})


@dataclass
class Generated:
    """What one model produced on the prompts, and the summed log-probs of its KL samples."""

    greedy: list[Sample]  # one per prompt
    sampled: list[list[Sample]] | None = None  # [prompt][K] at cfg.temperature (with a task)
    kl_samples: list[list[Sample]] | None = None  # [prompt][K] at temperature 1 (policies, with a reference)
    own_logps: torch.Tensor | None = None  # `(prompts * K,)` under the model itself
    ref_logps: torch.Tensor | None = None  # `(prompts * K,)` under the reference
    texts: list[str] = field(default_factory=list)  # decoded greedy responses


def evaluate(cfg: EvalConfig, prompts: PromptSet) -> dict:
    """The eval report (metrics and sample rows) of every policy and the reference on a prompt set."""
    from rlhf_core.data.examples import prompt_token_ids
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rewards import RewardModelReward, VerifierReward
    from rlhf_core.rollout import prompt_formatter
    from rlhf_core.trainers.common import local_model_path

    policies = cfg.policies()
    paths = {uri: local_model_path(uri) for uri in dict.fromkeys([u for _, u in policies] + [cfg.ref_pretrain])
             if uri}
    ref_path = paths[cfg.ref_pretrain] if cfg.ref_pretrain else None
    policy_paths = {name: paths[uri] for name, uri in policies}
    first = ref_path or policy_paths[policies[0][0]]
    tokenizer = load_tokenizer(first)
    vocab = tokenizer.get_vocab()
    # Each model is asked as its own chat template asks (a conditional SFT model's appends the score
    # it asks for); the vocabularies must agree, so KL compares the same response tokens.
    prompt_ids: dict[str, list[list[int]]] = {}
    for uri, path in paths.items():
        own = tokenizer if path == first else load_tokenizer(path)
        if own.get_vocab() != vocab:
            flag = "--ref_pretrain" if uri == cfg.ref_pretrain else "--pretrain"
            raise ConfigError(f"{flag} {uri}: its tokenizer differs from the others'; the models are compared "
                              "on the same response tokens (and KL over them)")
        fmt = prompt_formatter(own, cfg.apply_chat_template)
        prompt_ids[path] = [prompt_token_ids(own, fmt.prompt_text(p), cfg.apply_chat_template)
                            for p in prompts.prompts]
    k = cfg.n_samples_per_prompt

    # Generation, one engine at a time: policies, then the reference (which scores their KL samples).
    order = [p for p in dict.fromkeys(policy_paths.values()) if p != ref_path] + ([ref_path] if ref_path else [])
    generated: dict[str, Generated] = {}
    for path in order:
        generated[path] = _generate(cfg, path, prompt_ids[path], tokenizer.pad_token_id,
                                    is_policy=path in policy_paths.values(), ref_path=ref_path, generated=generated)
    for g in generated.values():
        g.texts = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in g.greedy]

    scores: dict[str, list[float]] = {}
    if cfg.reward_pretrain:
        rm = RewardModelReward(local_model_path(cfg.reward_pretrain), cfg.apply_chat_template, cfg.normalize_reward)
        scores = {path: rm.score(prompts.prompts, g.texts) for path, g in generated.items()}
        del rm
    correct: dict[str, list[float]] = {}
    sampled_correct: dict[str, list[list[float]]] = {}
    if cfg.task:
        verifier = VerifierReward(cfg.task)
        for path, g in generated.items():
            correct[path] = verifier.score(prompts.prompts, g.texts, prompts.answers)
            flat = verifier.score([p for p, group in zip(prompts.prompts, g.sampled, strict=True) for _ in group],
                                  [tokenizer.decode(s.token_ids, skip_special_tokens=True)
                                   for group in g.sampled for s in group],
                                  [a for a, group in zip(prompts.answers, g.sampled, strict=True) for _ in group])
            sampled_correct[path] = [flat[i * k : (i + 1) * k] for i in range(len(prompts))]

    models = [*((name, policy_paths[name]) for name, _ in policies), *([(REFERENCE_NAME, ref_path)] if ref_path else [])]
    metrics: dict[str, float] = {}
    for name, path in models:
        g = generated[path]
        if path in correct:
            metrics[metric_key(name, "greedy_accuracy")] = mean(correct[path])
            metrics[metric_key(name, "sampled_accuracy")] = sampled_accuracy(sampled_correct[path])
            metrics[metric_key(name, pass_at_k_metric(k))] = mean_pass_at_k(sampled_correct[path], k)
        if path in scores:
            metrics[metric_key(name, "reward")] = mean(scores[path])
        if name != REFERENCE_NAME and ref_path is not None:
            if path in scores:
                metrics[metric_key(name, "win_rate")] = win_rate(scores[path], scores[ref_path])
            metrics[metric_key(name, "kl")] = k1_kl(g.own_logps, g.ref_logps)
        metrics[metric_key(name, "response_len")] = mean([len(s.token_ids) for s in g.greedy])

    from rlhf_core.models.loading import stored_parameters

    return {
        "policies": [{"name": name, "uri": uri, "parameters": stored_parameters(policy_paths[name]),
                      **({"asked_as": tokenizer.decode(prompt_ids[policy_paths[name]][0])}
                         if prompt_ids[policy_paths[name]] != prompt_ids[first] else {})}
                     for name, uri in policies],
        "reference": cfg.ref_pretrain, "reward_model": cfg.reward_pretrain,
        "reference_parameters": stored_parameters(ref_path) if ref_path else None,
        "task": cfg.task, "dataset": cfg.dataset, "num_prompts": len(prompts),
        "n_samples_per_prompt": k, "temperature": cfg.temperature,
        "num_kl_samples": len(prompts) * k if ref_path else 0,
        "metrics": metrics,
        "samples": _sample_rows(prompts, models, generated, scores, correct, sampled_correct),
    }


def _generate(cfg: EvalConfig, path: str, prompt_ids: list[list[int]], pad_id: int, is_policy: bool,
              ref_path: str | None, generated: dict[str, Generated]) -> Generated:
    """Greedy and sampled responses of the model at `path`, and the log-probs the KL needs: its own
    on its KL samples (a policy), the reference's on every earlier policy's (the reference)."""
    from rlhf_core.rollout import make_engine

    engine = make_engine(path, cfg.rollout_backend.value, not cfg.apply_chat_template)
    try:
        budget = {"max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}
        out = Generated([group[0] for group in engine.generate_ids(prompt_ids, 1, 0.0, **budget)])
        if cfg.task:
            out.sampled = engine.generate_ids(prompt_ids, cfg.n_samples_per_prompt, cfg.temperature, **budget)
        if is_policy and ref_path is not None:
            out.kl_samples = out.sampled if out.sampled is not None and cfg.temperature == 1.0 else \
                engine.generate_ids(prompt_ids, cfg.n_samples_per_prompt, 1.0, **budget)
        scored = [g for g in generated.values() if g.kl_samples is not None] if path == ref_path else []
        if out.kl_samples is None and not scored:
            return out
        lm = _scoring_model(engine, path)

        def logps(samples: list[list[Sample]]) -> torch.Tensor:
            return response_logprobs(lm, [prompt_ids[i] for i, group in enumerate(samples) for _ in group],
                                     [list(s.token_ids) for group in samples for s in group], pad_id)

        if out.kl_samples is not None:
            out.own_logps = logps(out.kl_samples)
            if path == ref_path:  # a policy given as its own reference: KL exactly 0
                out.ref_logps = out.own_logps
        for g in scored:
            g.ref_logps = logps(g.kl_samples)
        return out
    finally:
        engine.close()


def _scoring_model(engine, path: str):
    """The engine's own model (transformers), or a fresh load once a vLLM engine has given its GPU
    share back, for exact log-probs."""
    from rlhf_core.rollout import TransformersEngine

    if isinstance(engine, TransformersEngine):
        return engine.model
    engine.close()
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rollout.base import inference_device, inference_dtype

    device = inference_device()
    return load_causal_lm(path, dtype=inference_dtype(device)).to(device).eval()


def _sample_rows(prompts: PromptSet, models: list[tuple[str, str]], generated: dict[str, Generated],
                 scores: dict, correct: dict, sampled_correct: dict) -> list[dict]:
    rows = []
    for i in range(min(NUM_SAMPLE_ROWS, len(prompts))):
        responses = {}
        for name, path in models:
            response = {"text": generated[path].texts[i]}
            if path in scores:
                response["score"] = scores[path][i]
            if path in correct:
                response["correct"] = bool(correct[path][i])
                response["sampled_correct"] = int(round(sum(sampled_correct[path][i])))
            responses[name] = response
        rows.append({"prompt": prompts.prompts[i], "answer": prompts.answers[i], "responses": responses})
    return rows


def _print_summary(metrics: dict[str, float]) -> None:
    shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
    print(f"[eval] {shown}", file=sys.stderr, flush=True)


# --- reading and rendering reports ---------------------------------------------------------------


def read_eval_report(uri: str) -> dict:
    """The `eval.json` report of a finished eval stage at `uri` (local directory or s3://)."""
    from rlhf_core.infra import storage

    if not storage.is_remote(uri):
        from pathlib import Path

        report = json.loads((Path(storage.normalize_uri(uri)) / REPORT).read_text(encoding="utf-8"))
    else:
        import fsspec

        with fsspec.open(f"{uri.rstrip('/')}/{REPORT}", "r") as f:
            report = json.load(f)
    if "policies" not in report:
        raise ValueError(f"{uri}/{REPORT} was written by an earlier `rlhf eval` (one policy, metrics "
                         "eval/policy_*): rerun the evaluation (e.g. `--force_stages eval`) to compare policies")
    return report


def model_names(report: dict) -> list[str]:
    """The report's columns: its policies in order, then the reference when there is one."""
    return [p["name"] for p in report["policies"]] + ([REFERENCE_NAME] if report.get("reference") else [])


def metric_rows(report: dict) -> list[tuple[str, str, str]]:
    """`(label, metric, format)` of the table's rows, in order."""
    k = report.get("n_samples_per_prompt", 1)
    temperature = report.get("temperature", 1.0)
    return [("greedy accuracy (verifier)", "greedy_accuracy", "{:.1%}"),
            (f"sampled accuracy (mean of {k} at T={temperature:g})", "sampled_accuracy", "{:.1%}"),
            (f"pass@{k} (T={temperature:g})", pass_at_k_metric(k), "{:.1%}"),
            ("reward-model score (greedy)", "reward", "{:.4f}"),
            ("win rate vs reference (reward model, ties 1/2)", "win_rate", "{:.1%}"),
            ("KL(policy ‖ reference), nats (k1, T=1)", "kl", "{:.4f}"),
            ("response length (tokens, greedy)", "response_len", "{:.1f}")]


def _cell(value, limit: int = 120) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n") or " "


def format_eval_markdown(report: dict) -> str:
    """A markdown summary of an eval report: one table with the models side by side, the samples."""
    m = report["metrics"]
    names = model_names(report)
    policies = ", ".join(f"`{p['name']}`" for p in report["policies"])
    lines = [f"## Evaluation of {policies}" + (" against the reference" if report.get("reference") else ""), "",
             f"{report['num_prompts']} held-out prompts from `{report['dataset']}`"
             + (f", task `{report['task']}`" if report.get("task") else "") + ".", ""]
    lines += ["| metric | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for label, metric, fmt in metric_rows(report):
        values = [m.get(metric_key(n, metric)) for n in names]
        if all(v is None for v in values):
            continue
        lines.append(f"| {label} | " + " | ".join("—" if v is None else fmt.format(v) for v in values) + " |")
    lines += ["", "Models:"]
    lines += [f"- `{p['name']}`: `{p['uri']}`" + (f", asked as its chat template asks: `{_cell(p['asked_as'])}`"
                                                  if p.get("asked_as") else "") for p in report["policies"]]
    if report.get("reference"):
        lines.append(f"- `{REFERENCE_NAME}`: `{report['reference']}`")
    if report.get("reward_model"):
        lines.append(f"- reward model: `{report['reward_model']}`")
    if report.get("num_kl_samples"):
        lines.append(f"- KL estimated on {report['num_kl_samples']} samples per policy")
    samples = report.get("samples") or []
    if samples:
        k = report.get("n_samples_per_prompt", 1)
        lines += ["", "### Sample generations (greedy; reward-model score, verifier, correct of "
                  f"{k} samples)", "", "| prompt | answer | " + " | ".join(f"`{n}`" for n in names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for row in samples:
            cells = [_cell(row["prompt"]), _cell(row.get("answer") or "")]
            for name in names:
                response = row["responses"].get(name)
                if response is None:
                    cells.append("—")
                    continue
                extra = [f"{response['score']:.3f}"] if "score" in response else []
                extra += ["✓" if response["correct"] else "✗"] if "correct" in response else []
                extra += [f"{response['sampled_correct']}/{k}"] if "sampled_correct" in response else []
                cells.append(_cell(response["text"]) + (f" ({', '.join(extra)})" if extra else ""))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
