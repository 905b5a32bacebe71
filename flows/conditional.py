"""Conditional SFT (stage `conditional_sft`) inside the `rlhf` flow: OpenRLHF's conditional script
(arXiv:2308.12050, SteerLM-style) as two jobs.

`rlhf batch_inference --eval_task rm --post_processor csft` scores the SFT rows (prep's, or the `sft`
section's dataset) with the run's reward model, or with prep's task verifier (`reward: verifier`:
each row's response against its `answer`, which prep's SFT rows carry), and writes each row's score
into its prompt through the reward template (`{input} <rm_score>: {reward} `, z-scored by default:
with a verifier, two values, the right rows' above the wrong ones') -> `rlhf train sft` of the
base model on those rows (the `sft` section's recipe; this stage's learning rate and epochs where
given), as OpenRLHF's script trains from the base.

At generation the model is asked for a high score: the scoring job reports percentiles of the
scores it wrote, and the trained model's chat template appends the `condition_percentile`-th after
its generation prompt (`--tokenizer_chat_template`, saved with the model). Whoever renders a prompt
with that template (the evaluation, vLLM, plain transformers) asks what the model learnt to answer
at that score, with nothing else to know. The model is a policy of the run: evaluated beside the
others, registered as an `rlhf-policy` version, champion when it beats the current one.
"""

from __future__ import annotations

import json

from flows.jobs import PipelineError, prep_paths, train_job
from flows.params import ConditionalSFTParams, PipelineSettings, PrepParams
from orchestration.stages import PipelineContext, StageJob, StageOutcome
from rlhf_core.config import SFTConfig, with_updates
from rlhf_core.infra import storage
from rlhf_core.infra.manifests import params_hash
from rlhf_core.stages.batch_inference import condition_suffix, conditioned_chat_template

STAGE = "conditional_sft"
SCORE = f"{STAGE}-score"
# What the scoring does not depend on: which of its reported scores generation asks for, and the SFT.
SCORING_NOT_IN_KEY = frozenset({"condition_percentile", "learning_rate", "max_epochs"})


def stored_chat_template(uri: str) -> str | None:
    """The chat template of a model: a folder's (local or s3://) read from its tokenizer files alone
    (`chat_template.jinja`, else `tokenizer_config.json`), so the flow loads no weights; a hub
    name's from its tokenizer. The default one of named templates. None when there is none."""
    from pathlib import Path

    if not storage.is_remote(uri) and not Path(storage.normalize_uri(uri)).exists():  # a hub name
        from rlhf_core.models.loading import load_tokenizer

        template = load_tokenizer(uri).chat_template
    else:
        root = uri.rstrip("/")
        template = storage.read_text(f"{root}/chat_template.jinja")
        if template is None:
            config = storage.read_text(f"{root}/tokenizer_config.json")
            try:
                template = json.loads(config).get("chat_template") if config is not None else None
            except ValueError as e:
                raise PipelineError(f"{STAGE}: {root}/tokenizer_config.json is not JSON ({e})") from None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def written(scored: StageOutcome, name: str) -> float:
    """A figure the scoring job reported of the scores it wrote (`p90`, `min`, `max`)."""
    key = f"batch_inference/written_reward_{name}"
    if key not in scored.metrics:
        raise PipelineError(f"{STAGE}: the scoring output {scored.output_uri} reports no {key} (written by an older "
                            f"`rlhf batch_inference`): force it again (settings.force_stages: [{STAGE}])")
    return float(scored.metrics[key])


def run_conditional_sft(ctx: PipelineContext, settings: PipelineSettings, prep: PrepParams, sft: SFTConfig,
                        params: ConditionalSFTParams, need, run, outcomes: dict) -> StageOutcome:
    if not sft.data.apply_chat_template:
        raise PipelineError(f"{STAGE}: the `sft` section applies no chat template (data.apply_chat_template), so "
                            "nothing could ask the trained model for a high score at generation")
    if STAGE in ctx.force:  # forcing the stage rescores as well
        ctx.force = [*ctx.force, SCORE]
    upstream: dict[str, StageOutcome] = {}
    base = sft.pretrain or prep_paths(need("prep"))["base"]
    if params.reward == "verifier":  # the base's tokenizer writes the prompts (its chat template)
        scorer = ["--task", prep.task, "--label_key", "answer", "--pretrain", base]
    else:
        upstream["reward"] = need("rm")
        scorer = ["--pretrain", upstream["reward"].output_uri]
    dataset = sft.data.dataset
    if dataset is None:
        upstream["data"] = need("prep")
        dataset = prep_paths(upstream["data"])["sft"]
    out = ctx.output(SCORE)
    data = sft.data
    probs = ["--dataset_probs", data.dataset_probs] if data.dataset_probs else []
    # The rows scored: the `sft` section's columns and sample count are in the key with the settings.
    key = params_hash(params, exclude=SCORING_NOT_IN_KEY, task=prep.task, input_key=data.input_key,
                      output_key=data.output_key, max_samples=data.max_samples, dataset_probs=data.dataset_probs)
    scored = outcomes[SCORE] = run(StageJob(
        "batch_inference", SCORE,
        ["batch_inference", "--eval_task", "rm", *scorer, "--dataset", dataset, *probs,
         "--input_key", data.input_key, "--output_key", data.output_key, "--apply_chat_template",
         "--post_processor", "csft", *(["--normalize_reward"] if params.normalize_reward else []),
         "--reward_template", params.reward_template, "--max_samples", str(data.max_samples),
         "--save_path", out, "--mlflow_run_name", SCORE, "--mlflow_experiment", ctx.experiment],
        out, key, None, dataset, upstream, num_gpus=ctx.rollout_gpus))

    template = sft.data.tokenizer_chat_template or stored_chat_template(base)
    if template is None:
        raise PipelineError(f"{STAGE}: the base model {base} stores no chat template; give one in the `sft` "
                            "section (data.tokenizer_chat_template)")
    suffix = condition_suffix(params.reward_template, written(scored, f"p{params.condition_percentile}"))
    # The rows hold the prompt as the reward model's template wrote it, with its own score: trained as
    # they are. A score lengthens its row by at most its suffix's UTF-8 bytes in tokens, the longest
    # suffix being the lowest or the highest score's.
    longest = max(len(condition_suffix(params.reward_template, written(scored, x)).encode("utf-8"))
                  for x in ("min", "max"))
    updates = {"save_path": None, "ckpt_path": None, "data.input_key": "input", "data.output_key": "output",
               "data.apply_chat_template": False, "data.input_template": None, "data.dataset_probs": None,
               "data.tokenizer_chat_template": conditioned_chat_template(template, suffix),
               "data.max_len": data.max_len + longest}
    if params.learning_rate is not None:
        updates["adam.lr"] = params.learning_rate
    if params.max_epochs is not None:
        updates["train.max_epochs"] = params.max_epochs
    return run(train_job(ctx, settings, with_updates(sft, **updates), need, name=STAGE,
                         data_from=(scored, f"json@{scored.output_uri}")))
