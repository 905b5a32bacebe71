"""`rlhf batch_inference` (OpenRLHF 0.9's `openrlhf.cli.batch_inference`): sample, score, post-process.

- `--eval_task generate|generate_vllm`: `--best_of_n` responses per prompt from the transformers
  engine or vLLM, written as JSON lines `{"input": <prompt as the model saw it>, "output": <response>}`
  (plus the `--label_key` answer where the prompts have one). `--iter K` takes prompts
  [K x rollout_batch_size, (K + 1) x rollout_batch_size) only, so a script's rounds walk the data.
  `--enable_csft` appends `--csft_prompt` to every prompt (generation conditioned on a high score).
- `--eval_task rm`: scores rows `{input, output}` with a reward model (the raw head value, less the
  reward mean and over the std the model stores, as OpenRLHF's reward models are read; our
  extensions: `--task` scores with a built-in verifier instead, and `--placeholder_token` with
  `--reward_tokens` with a process reward model (`rlhf train prm`), each line of a response a
  step, the response's score its steps' P(right) by `--step_aggregate` (the weakest: min) and the
  steps' own in `step_rewards`; rows whose response is blank are left out and counted, as
  OpenRLHF drops them unsaid), then `--post_processor`:
  `rs` keeps the best response per prompt (SFT data; our `--min_reward`: a prompt whose best scores
  below it keeps none, e.g. 1 with a verifier: no wrong answer is learnt), `iter_dpo` the best and the
  worst (DPO pairs),
  `csft` writes each row's reward into its prompt through `--reward_template` (conditional SFT).

Where OpenRLHF 0.9 differs: its rm task no longer runs at any 0.9 tag (its SFT dataset changed
shape); `iter_dpo` there keeps prompts whose samples all tie (chosen = rejected, a pair with no
signal), here they are left out and counted; rows are written per prompt, all of a prompt's samples
together. The file is written whole or not at all (a temporary name, then renamed); `--save_path`
(ours) writes a stage folder instead, `train.jsonl` and `stage.json`, as the pipeline's stages do.
"""

from __future__ import annotations

import json
import math
import sys

from rlhf_core.config import BatchInferenceConfig, EvalTask, PostProcessor
from rlhf_core.infra import storage
from rlhf_core.infra.hubs import use_modelscope
from rlhf_core.infra.manifests import code_version

DEFAULT_REWARD_TEMPLATE = "{input} <rm_score>: {reward} "
# What only one kind of task reads: given to the other, each is said to be not applied (once).
GENERATION_ONLY = ("best_of_n", "iter", "rollout_batch_size", "enable_csft", "csft_prompt", "greedy_sampling", "top_p",
                   "temperature", "prompt_max_len", "max_new_tokens", "num_engines")
SCORING_ONLY = ("post_processor", "reward_template", "normalize_reward", "value_head_prefix", "micro_batch_size",
                "max_len", "task", "placeholder_token", "reward_tokens", "step_aggregate", "min_reward")
ROWS_FILE = "train.jsonl"  # in a --save_path stage folder: `json@<folder>` reads it


# -- pure parts ---------------------------------------------------------------------------------

def prompt_window(n_rows: int, iteration: int | None, rollout_batch_size: int) -> range:
    """The rows one `--iter` generates for: all of them without it."""
    if iteration is None:
        return range(n_rows)
    start = iteration * rollout_batch_size
    return range(min(start, n_rows), min(start + rollout_batch_size, n_rows))


def checked_window(n_rows: int, cfg) -> range:
    """`prompt_window` of a stage's `--iter` and `--rollout_batch_size` over `--dataset`'s `n_rows`
    prompts; a DataError naming them where the window starts past the last."""
    window = prompt_window(n_rows, cfg.iter, cfg.rollout_batch_size)
    if not window:
        from rlhf_core.data.loading import DataError

        raise DataError(f"--dataset {cfg.dataset}: {n_rows} prompts; --iter {cfg.iter} with "
                        f"--rollout_batch_size {cfg.rollout_batch_size} starts at prompt {window.start + 1}, past them")
    return window


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by their exact `input`, in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["input"], []).append(row)
    return groups


def best_of(rows: list[dict]) -> list[dict]:
    """Rejection sampling: each prompt's highest-reward row (the first of equals)."""
    return [max(group, key=lambda r: r["reward"]) for group in _groups(rows).values()]


def best_and_worst(group: list, score) -> tuple | None:
    """Iterative DPO's pair of one prompt: its highest- and lowest-scoring candidates (the first of
    equals), or None when every score ties (nothing to prefer). `rlhf pairs` pairs the same way."""
    best, worst = max(group, key=score), min(group, key=score)
    return None if score(best) == score(worst) else (best, worst)


def preference_pairs(rows: list[dict]) -> tuple[list[dict], int]:
    """Iterative DPO: per prompt the highest-reward response as `chosen` and the lowest as
    `rejected` (the first of equals); prompts whose rewards all tie are skipped and counted."""
    pairs, ties = [], 0
    for prompt, group in _groups(rows).items():
        pair = best_and_worst(group, lambda r: r["reward"])
        if pair is None:
            ties += 1
            continue
        best, worst = pair
        pairs.append({"prompt": prompt, "chosen": best["output"], "chosen_reward": best["reward"],
                      "rejected": worst["output"], "rejected_reward": worst["reward"]})
    return pairs, ties


def unread_flags(cfg: BatchInferenceConfig) -> list[str]:
    """The flags given that the task does not read (OpenRLHF ignores them unsaid)."""
    unread = SCORING_ONLY if cfg.eval_task != EvalTask.RM else GENERATION_ONLY
    if cfg.eval_task == EvalTask.RM and cfg.task is not None and not cfg.apply_chat_template:
        unread += ("pretrain",)  # a verifier scores: only a chat template would read its tokenizer
    return [name for name in unread if name in cfg.model_fields_set]


def say_what_is_not_read(cfg: BatchInferenceConfig) -> None:
    from rlhf_core.infra.not_applied import PREFIX, say_once

    for name in unread_flags(cfg):
        say_once(f"{PREFIX} --{name} is not read by --eval_task {cfg.eval_task.value}")


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1; 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0


def z_scores(values: list[float]) -> list[float]:
    """(v - mean) / std over all values (all equal: 0 each)."""
    mean, std = mean_std(values)
    return [(v - mean) / std if std > 0 else 0.0 for v in values]


def conditioned(rows: list[dict], template: str | None, normalize: bool) -> list[dict]:
    """Conditional SFT: each row's reward (z-scored over all rows with `normalize`), to two decimals,
    written into its input through the template (`{reward}` first, then `{input}`, as plain text)."""
    template = template or DEFAULT_REWARD_TEMPLATE
    rewards = z_scores([r["reward"] for r in rows]) if normalize else [r["reward"] for r in rows]
    out = []
    for row, reward in zip(rows, rewards, strict=True):
        text = template.replace("{reward}", written_reward(reward)).replace("{input}", row["input"])
        out.append({**row, "input": text, "reward": reward})
    return out


# Percentiles of the rewards csft writes, reported so a run can ask for a score the rows hold:
# the pipeline's conditional SFT conditions generation on one of them (flows/conditional.py).
CONDITION_PERCENTILES = (10, 25, 50, 75, 90, 95, 99)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile (0 < q <= 100): the smallest value with at least q% of the
    values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def written_reward(reward: float) -> str:
    """A reward as csft writes it into a prompt."""
    return f"{reward:.2f}"


def condition_suffix(template: str | None, reward: float) -> str:
    """What csft appends to a prompt for `reward`, for a template that starts with `{input}`: the
    text a conditioned model is asked with at generation."""
    template = template or DEFAULT_REWARD_TEMPLATE
    if not template.startswith("{input}"):
        raise ValueError(f"reward_template {template!r} puts text before {{input}}: the condition cannot follow the "
                         "prompt's generation prompt (start the template with {input})")
    return template.removeprefix("{input}").replace("{reward}", written_reward(reward))


def conditioned_chat_template(chat_template: str, suffix: str) -> str:
    """A chat template that appends `suffix` after its generation prompt, so anyone who renders
    the prompt (evaluation, vLLM, plain transformers) asks the model what csft trained it to
    answer at that score."""
    return chat_template + "{% if add_generation_prompt %}{{ " + json.dumps(suffix) + " }}{% endif %}"


def post_process(rows: list[dict], cfg: BatchInferenceConfig) -> tuple[list[dict], dict]:
    """The scored rows as the post-processor writes them, and what it did (metrics)."""
    if cfg.post_processor is None:
        return rows, {}
    if cfg.post_processor == PostProcessor.RS:
        best = best_of(rows)
        kept = [r for r in best if cfg.min_reward is None or r["reward"] >= cfg.min_reward]
        metrics = {"batch_inference/kept_rows": len(kept), "batch_inference/below_min_reward": len(best) - len(kept)}
        if kept:
            metrics["batch_inference/kept_reward_mean"] = sum(r["reward"] for r in kept) / len(kept)
        return kept, metrics
    if cfg.post_processor == PostProcessor.ITER_DPO:
        pairs, ties = preference_pairs(rows)
        return pairs, {"batch_inference/pairs": len(pairs), "batch_inference/tied_prompts": ties}
    rows = conditioned(rows, cfg.reward_template, cfg.normalize_reward)
    written = [float(written_reward(r["reward"])) for r in rows]
    metrics = {f"batch_inference/written_reward_p{q}": percentile(written, q) for q in CONDITION_PERCENTILES}
    return rows, {**metrics, "batch_inference/written_reward_min": min(written),
                  "batch_inference/written_reward_max": max(written)}


# -- engines and files --------------------------------------------------------------------------

def run_batch_inference(cfg: BatchInferenceConfig) -> dict:
    """Generate or score (and post-process); write `cfg.output_path`; returns the run's metrics."""
    from rlhf_core.data.loading import DataError
    from rlhf_core.infra.tracking import Tracker

    cfg.check_complete()
    say_what_is_not_read(cfg)
    use_modelscope(cfg.use_ms)  # a model named by hub id, policy or reward model alike
    if cfg.save_path is not None:
        storage.check_stage_output(cfg)  # refuse to write over what is not ours before anything runs
    else:
        storage.check_output_file(cfg.output_path, storage.stage_inputs(cfg))
    tracker = Tracker(cfg.use_mlflow, cfg.mlflow_experiment, cfg.mlflow_run_name or cfg.stage,
                      cfg.mlflow_parent_run_id, tags={"rlhf.stage": cfg.stage, "rlhf.code_version": code_version()})
    try:
        tracker.log_params(cfg.model_dump(mode="json"))
        if cfg.eval_task == EvalTask.RM:
            rows, sources, blank = score(cfg)
            mean, std = mean_std([r["reward"] for r in rows])
            metrics = {"batch_inference/rows": len(rows), "batch_inference/blank_outputs": blank,
                       "batch_inference/reward_mean": mean, "batch_inference/reward_std": std}
            rows, more = post_process(rows, cfg)
            metrics.update(more)
            if not rows:
                why = (f"no prompt's best reached --min_reward {cfg.min_reward}" if cfg.min_reward is not None
                       else "every prompt's responses scored the same")
                raise DataError(f"--dataset {cfg.dataset}: {why}: no {cfg.post_processor.value} rows to write")
        else:
            rows, sources = generate(cfg)
            metrics = {"batch_inference/rows": len(rows)}
        tracker.log_datasets(sources, "training")
        if cfg.save_path is not None:
            from rlhf_core.infra.publishing import publish_output

            inputs = {"pretrain": cfg.pretrain, "datasets": sources}
            publish_output(cfg, tracker, inputs, metrics, files={ROWS_FILE: storage.jsonl_text(rows)})
        else:  # whole or not at all
            storage.write_text_atomic(cfg.output_path, storage.jsonl_text(rows))
            tracker.log_metrics(metrics, step=0)
            tracker.set_tags({"rlhf.output_uri": cfg.output_path})
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    print(f"[batch_inference] {cfg.eval_task.value}: {len(rows)} rows -> {cfg.save_path or cfg.output_path}",
          file=sys.stderr, flush=True)
    return metrics


def generate(cfg: BatchInferenceConfig) -> tuple[list[dict], list[dict]]:
    from rlhf_core.config import mixing_probs
    from rlhf_core.data.examples import prompt_token_ids
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout import load_prompt_set, make_engine, prompt_formatter
    from rlhf_core.trainers.common import local_model_path

    prompts = load_prompt_set(cfg.dataset, "train", cfg.input_key, cfg.label_key, max_samples=cfg.max_samples,
                              seed=cfg.seed, chat=cfg.apply_chat_template, probs=mixing_probs(cfg.dataset_probs))
    window = checked_window(len(prompts.prompts), cfg)
    path = local_model_path(cfg.pretrain)
    tokenizer = load_tokenizer(path, use_fast=not cfg.disable_fast_tokenizer)
    fmt = prompt_formatter(tokenizer, cfg.apply_chat_template, cfg.input_template)
    suffix = cfg.csft_prompt.strip() + " " if cfg.enable_csft else ""
    texts = [fmt.prompt_text(prompts.prompts[i], row=i + 1) + suffix for i in window]
    ids = [prompt_token_ids(tokenizer, t, cfg.apply_chat_template)[-cfg.prompt_max_len:] for t in texts]
    backend = "vllm" if cfg.eval_task == EvalTask.GENERATE_VLLM else "transformers"
    temperature = 0.0 if cfg.greedy_sampling else cfg.temperature
    if cfg.num_engines > 1:
        from rlhf_core.rl.engines import generate_on_engines

        groups = generate_on_engines(backend, path, ids, cfg.best_of_n, temperature, cfg.max_new_tokens, cfg.seed,
                                     cfg.num_engines, top_p=cfg.top_p)
    else:
        engine = make_engine(path, backend, not cfg.apply_chat_template)
        try:
            groups = engine.generate_ids(ids, cfg.best_of_n, temperature, cfg.max_new_tokens, cfg.seed, top_p=cfg.top_p)
        finally:
            engine.close()
    rows = []
    # The prompt as the dataset has it travels too (a process reward model reads the plain prompt).
    raw = cfg.input_key not in ("input", "output", cfg.label_key)
    for i, text, group in zip(window, texts, groups, strict=True):
        answer = prompts.answers[i]
        for sample in group:
            row = {"input": text, "output": tokenizer.decode(sample.token_ids, skip_special_tokens=True)}
            if raw:
                row[cfg.input_key] = prompts.prompts[i]
            rows.append(row if answer is None else {**row, cfg.label_key: answer})
    return rows, prompts.sources


def score(cfg: BatchInferenceConfig) -> tuple[list[dict], list[dict], int]:
    """Rows `{input, output, reward}` (and the answer where there is one) of the dataset's train
    split, its sources, and how many rows were left out for a blank response."""
    from rlhf_core.config import mixing_probs
    from rlhf_core.data.loading import DataError, check_rows, load_mixture

    required = [cfg.input_key] + ([cfg.label_key] if cfg.task else [])
    # A response may be blank (a sample that stopped at once): present as a string, left out below.
    ds, sources = load_mixture(cfg.dataset, "train", mixing_probs(cfg.dataset_probs), cfg.max_samples, cfg.seed,
                               # answers travel too, and the prompt as generation wrote it ("input")
                               list(dict.fromkeys([*required, cfg.output_key, cfg.label_key, "input"])),
                               lambda d, where: check_rows(d, where, required, {cfg.output_key: (str,)},
                                                           chat_keys={cfg.input_key} if cfg.apply_chat_template
                                                           else set()))
    kept = [i for i, o in enumerate(ds[cfg.output_key]) if o.strip()]
    blank = len(ds) - len(kept)
    if not kept:
        raise DataError(f"{cfg.dataset}: no rows with a response ({cfg.output_key!r}) to score")
    ds = ds.select(kept)
    inputs, outputs = list(ds[cfg.input_key]), list(ds[cfg.output_key])
    answers = [str(a) for a in ds[cfg.label_key]] if cfg.label_key in ds.column_names else None
    steps = None
    if cfg.placeholder_token is not None:
        from rlhf_core.rewards.process import ProcessRewardModel, aggregate
        from rlhf_core.trainers.common import local_model_path

        if not all(isinstance(p, str) for p in inputs):
            raise DataError(f"--dataset {cfg.dataset}: a process reward model reads {cfg.input_key!r} as text; these "
                            "rows hold chat messages")
        prm = ProcessRewardModel.load(local_model_path(cfg.pretrain), cfg.placeholder_token, cfg.reward_tokens,
                                 batch_size=cfg.micro_batch_size, max_len=cfg.max_len,
                                 use_fast=not cfg.disable_fast_tokenizer)
        steps = prm.step_scores(inputs, outputs)
        rewards = [aggregate(s, cfg.step_aggregate) for s in steps]
        # Rows keep the prompt they were generated for, so a prompt's samples group together.
        texts = list(ds["input"]) if "input" in ds.column_names and cfg.input_key != "input" else inputs
    elif cfg.task is not None:
        from rlhf_core.rewards import VerifierReward

        if not all(isinstance(p, str) for p in inputs):
            raise DataError(f"--dataset {cfg.dataset}: --task scores rows whose {cfg.input_key!r} is text; these hold "
                            "chat messages (score them with a reward model and --apply_chat_template)")
        texts = written_prompts(cfg, inputs, lambda: verifier_formatter(cfg))
        rewards = VerifierReward(cfg.task).score(inputs, outputs, answers)
    else:
        rm = reward_model(cfg)
        texts = written_prompts(cfg, inputs, lambda: rm.formatter)
        rewards = rm.score_sequences([s[: cfg.max_len] for s in rm.sequences_from_text(texts, outputs)])
    rows = [{"input": t, "output": o, "reward": float(r)} for t, o, r in zip(texts, outputs, rewards, strict=True)]
    if steps is not None:
        rows = [{**row, "step_rewards": s} for row, s in zip(rows, steps, strict=True)]
    if answers is not None:
        rows = [{**row, cfg.label_key: a} for row, a in zip(rows, answers, strict=True)]
    return rows, sources, blank


def written_prompts(cfg: BatchInferenceConfig, inputs: list[str], formatter) -> list[str]:
    """The prompts scored rows are written with, whoever scores them: the chat template (of
    `formatter()`'s tokenizer), else `--input_template`, else as they are (rows generated here
    hold the prompt as generation wrote it)."""
    if cfg.apply_chat_template:
        fmt = formatter()
        return [fmt.prompt_text(p) for p in inputs]
    return [cfg.input_template.format(p) for p in inputs] if cfg.input_template else inputs


def verifier_formatter(cfg: BatchInferenceConfig):
    """A verifier reads no model: `--pretrain` names the tokenizer whose chat template writes the
    prompts (only its tokenizer is loaded, and from s3:// only its files are fetched)."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout.prompts import prompt_formatter
    from rlhf_core.trainers.common import local_tokenizer_path

    return prompt_formatter(load_tokenizer(local_tokenizer_path(cfg.pretrain), use_fast=not cfg.disable_fast_tokenizer),
                            True)


def reward_model(cfg: BatchInferenceConfig):
    """The reward model, its scores less the mean and over the std it stores (when it stores them:
    `rlhf train rm` and OpenRLHF both save them), as OpenRLHF's batch scoring reads them."""
    from rlhf_core.rewards import RewardModelReward
    from rlhf_core.trainers.common import local_model_path

    rm = RewardModelReward(local_model_path(cfg.pretrain), cfg.apply_chat_template, normalize=False,
                           batch_size=cfg.micro_batch_size, value_head_prefix=cfg.value_head_prefix,
                           use_fast=not cfg.disable_fast_tokenizer)
    mean, std = (getattr(rm.model.config, k, None) for k in ("reward_mean", "reward_std"))
    if mean is not None and std:
        rm.shift, rm.scale = float(mean), float(std)
    return rm
