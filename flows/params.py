"""Parameters of the `rlhf` flow: pipeline settings plus one pydantic model per stage.

The stage models are the CLI's own configs (`rlhf_core.config`), so a field means the same thing
in `rlhf train sft --micro_train_batch_size 8`, in a YAML file and in the Prefect UI's form. In a
pipeline, `pretrain`, `save_path` and `dataset` may stay empty: the flow fills them from the
upstream stage (prep's data and base model, SFT's model, ...). A value given wins.

Defaults are sized for the embedded default (a 1M-parameter model on a small CPU, the pipeline in
minutes). Bad values are rejected by pydantic before anything runs.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from rlhf_core.config import DPOConfig, KDConfig, PRMConfig, RMConfig, SFTConfig, StrictModel, spellings_of
from rlhf_core.models.families import FAMILIES
from rlhf_core.models.sizes import MODEL_SIZES
from rlhf_core.rl_config import PPOConfig

# Tuned on the tiny model and the sort task (figures: benchmarks/README.md), as dotted paths. The
# reward model trains two epochs (one was unstable) at 5e-4 (at 1e-3 its held-out accuracy hung on
# the seed: 94.5% at seed 0, and PPO against it lost 10 points); DPO keeps an NLL term on the chosen response
# (RPO: without it DPO hurt exact match). Prep makes 30% of SFT demonstrations wrong, so the SFT
# policy errs when sampled and RL has room, while the reward model (always-correct pairs) still
# ranks well.
PREP = {"n_train": 16000, "n_test": 200, "demo_error_rate": 0.3}
COMMON = {"ds.zero_stage": 2, "train.seed": 0, "data.apply_chat_template": True, "data.max_len": 64,
          "ds.packing_samples": True, "lr_warmup_ratio": 0.05}
TUNED = {
    "sft": {**COMMON, "train.batch_size": 32, "train.micro_batch_size": 32, "adam.lr": 1e-3, "train.max_epochs": 2},
    "rm": {**COMMON, "train.batch_size": 64, "train.micro_batch_size": 32, "adam.lr": 5e-4, "train.max_epochs": 2},
    "dpo": {**COMMON, "train.batch_size": 64, "train.micro_batch_size": 32, "adam.lr": 1e-4, "train.max_epochs": 1,
            "model.beta": 0.1, "model.nll_loss_coef": 1.0, "data.max_samples": 4000},
    # The distilled student (a size below the policy, from prep's student base) on the SFT rows,
    # half NLL, half the teacher's distribution: tests/learning/test_kd_learning.py's nano recipe.
    "kd": {**COMMON, "train.batch_size": 32, "train.micro_batch_size": 32, "adam.lr": 2e-3, "train.max_epochs": 2,
           "model.kd_coef": 0.5},
    # A process reward model from the SFT model on prep's step-labelled rows (a task of steps:
    # addition_steps), read at `ки` over `+`/`-`: tests/learning/test_prm_learning.py's recipe.
    # The rows are text as they are (no chat template).
    "prm": {"ds.zero_stage": 2, "train.seed": 0, "data.max_len": 64, "ds.packing_samples": True,
            "lr_warmup_ratio": 0.05, "train.batch_size": 32, "train.micro_batch_size": 32, "adam.lr": 1e-3,
            "train.max_epochs": 3, "data.placeholder_token": "ки", "data.reward_tokens": ["+", "-"]},
    # PPO, critic initialised from the reward model (OpenRLHF's default), rewards from the reward
    # model normalised by its stored mean/std (the flow turns that on when it fills in the run's
    # reward model): the recipe tests/learning/test_rl_stage.py guards.
    "ppo": {
        "algo.advantage.estimator": "gae", "algo.advantage.lambd": 0.95, "algo.kl.init_coef": 0.01,
        "rollout.n_samples_per_prompt": 4, "rollout.batch_size": 32,
        "rollout.micro_batch_size": 64, "train.batch_size": 64, "train.micro_batch_size": 32,
        "actor.adam.lr": 5e-5, "critic.adam.lr": 2e-4, "critic.freezing_steps": 10, "train.max_steps": 80,
        "train.seed": 0, "eval.temperature": 1.0, "eval.n_samples_per_prompt": 2, "ds.zero_stage": 2,
        "data.apply_chat_template": True,
    },
}


def with_tuned_defaults(cls, values):
    """`values` (a partial stage section, in any spelling the stage's flags take) over the
    pipeline's tuned defaults for `cls`'s stage, as dotted paths.

    Prefect replaces a whole parameter when a run overrides part of it, so the defaults have to
    be merged where the section is validated, not only in the parameter's default value.
    """
    if not isinstance(values, dict):
        return values
    spellings = spellings_of(cls)
    stage = cls.model_fields["stage"].default
    return spellings.nest({**TUNED[stage], **spellings.to_paths(values, stage)})


class PipelineSFTConfig(SFTConfig):
    """`rlhf train sft`'s config with the pipeline's tuned defaults under what a run gives."""

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)


class PipelineRMConfig(RMConfig):
    """`rlhf train rm`'s config with the pipeline's tuned defaults under what a run gives."""

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)


class PipelineDPOConfig(DPOConfig):
    """`rlhf train dpo`'s config with the pipeline's tuned defaults under what a run gives."""

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)


class PipelinePRMConfig(PRMConfig):
    """`rlhf train prm`'s config (section `prm`) with the pipeline's tuned defaults under what a run
    gives. Left empty, the flow starts it from the run's SFT model on prep's step-labelled rows."""

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)


class PipelineKDConfig(KDConfig):
    """`rlhf train kd`'s config (section `distill`) with the pipeline's tuned defaults under what a
    run gives. Left empty, the flow fills the student from prep's student base (a size below the
    policy's), the teacher from the run's policy (PPO, else DPO, else rejection sampling, else SFT) and
    the rows from prep's SFT data."""

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)


DERIVED_PPO_FIELDS = frozenset({"critic.model_name_or_path", "ref.model_name_or_path", "rollout.max_new_tokens",
                                "data.max_len", "eval.task"})


class PipelinePPOConfig(PPOConfig):
    """`rlhf train ppo`'s config with the pipeline's tuned defaults under what a run gives.

    Any spelling `rlhf train ppo` takes works (nested sections, dotted paths, OpenRLHF's flat
    flags). Left empty, the flow fills actor and reference from SFT, prompts from prep, the output
    from the run's area, and the reward from the run's reward model unless the section names
    another source (`reward.task`, `reward.remote_url`, `reward.model_name_or_path`). The critic
    (gae) starts from the reward model, or from SFT when the reward is not a model.
    """

    @model_validator(mode="before")
    @classmethod
    def _tuned(cls, values):
        return with_tuned_defaults(cls, values)

    @model_validator(mode="wrap")
    @classmethod
    def _open_until_filled(cls, values, handler):
        """Keep the fields `rlhf train ppo` derives from its inputs empty while the inputs are.

        `DERIVED_PPO_FIELDS` are derived from the actor, reward and task, which the flow fills in
        later. Derived from nothing now, they would be frozen (1024 new tokens, no critic) by every
        JSON dump of the parameters (Prefect stores deployments' so) and never derived again.

        Prefect also validates a flow's parameters when it calls the flow, and is given the instance
        itself: its fields are read as given values here, never validated in place (the checks after
        validation would derive, into the caller's instance, what is still open).
        """
        if isinstance(values, PPOConfig):
            values = values.model_dump()
        spellings = spellings_of(cls)
        given = {k for k, v in spellings.to_paths(values, "ppo").items() if v is not None} \
            if isinstance(values, dict) else None
        cfg = handler(values)
        if given is not None and cfg.actor.model_name_or_path is None:
            for path in DERIVED_PPO_FIELDS - given:
                section, name = path.split(".")
                object.__setattr__(getattr(cfg, section), name, None)
        return cfg


class Stage(str, Enum):
    PREP = "prep"
    SFT = "sft"
    RM = "rm"
    PRM = "prm"
    DPO = "dpo"
    PPO = "ppo"
    REJECTION_SAMPLING = "rejection_sampling"
    CONDITIONAL_SFT = "conditional_sft"
    DISTILL = "distill"
    EVAL = "eval"
    ITERATIVE_DPO = "iterative_dpo"
    ONLINE_RL = "online_rl"


# The lifecycle the product card names: SFT -> reward model -> PPO. DPO is one `settings.stages`
# away (`[prep, sft, rm, dpo, eval]`, or both policy stages side by side: `[..., dpo, ppo, eval]`).
FULL_PIPELINE = [Stage.PREP, Stage.SFT, Stage.RM, Stage.PPO, Stage.EVAL]
# They register `rlhf-policy` versions; the champion is one of them.
POLICY_STAGES = (Stage.DPO, Stage.PPO, Stage.REJECTION_SAMPLING, Stage.CONDITIONAL_SFT)
EVALUATED_STAGES = (*POLICY_STAGES, Stage.DISTILL)  # the eval stage compares these with the reference
# The run's policy a `distill` stage learns from, first found first: RL, then DPO, rejection sampling,
# SFT. Not conditional SFT: it answers as trained only when asked for a score, which a student's
# prompts (its own chat template) do not ask.
TEACHER_STAGES = (Stage.PPO, Stage.DPO, Stage.REJECTION_SAMPLING, Stage.SFT)


class PrepParams(StrictModel):
    """The built-in task's data, tokenizer and base model (`rlhf prep`)."""

    task: str = "sort"
    seed: int = 0
    model_size: str = Field("tiny", pattern="^(" + "|".join(MODEL_SIZES) + ")$")
    model_family: str | None = Field(None, pattern="^(" + "|".join(FAMILIES) + ")$", examples=["qwen3"],
                                     description="Build the base in the shape of a model family (its special tokens "
                                     "and chat template): " + ", ".join(FAMILIES) + "; empty: the built-in tiny Llama")
    n_train: int = Field(PREP["n_train"], gt=0)
    n_test: int = Field(PREP["n_test"], gt=0)
    demo_error_rate: float = Field(PREP["demo_error_rate"], ge=0, lt=1,
                                   description="Fraction of SFT demonstrations made wrong (room for RL)")
    student_size: str | None = Field(None, pattern="^(" + "|".join(MODEL_SIZES) + ")$", examples=["nano"],
                                     description="Also build a student base of this size (stage distill's start); "
                                     "default: the size below model_size when the run's stages include distill")


# `rlhf eval` reports `eval/<policy name>/<metric>` and `eval/reference/<metric>` for these metrics
# (`pass_at_<k>` for the sample count k); win_rate and kl only for policies, against the reference.
EVAL_METRICS = ("greedy_accuracy", "sampled_accuracy", "reward", "win_rate", "kl", "response_len")
# Promote metrics of the single-policy evaluation before policies were compared side by side.
OLD_PROMOTE_METRICS = {"eval/policy_exact_match": "greedy_accuracy", "eval/policy_reward": "reward",
                       "eval/policy_response_len": "response_len", "eval/win_rate": "win_rate", "eval/kl": "kl"}


def promote_metric_name(value: str) -> str:
    """A promote metric as a bare metric name; old `eval/policy_*` names mapped, others refused."""
    import re

    if value in OLD_PROMOTE_METRICS:
        return OLD_PROMOTE_METRICS[value]
    if value in EVAL_METRICS or re.fullmatch(r"pass_at_[1-9][0-9]*", value):
        return value
    hint = ""
    if value.startswith("eval/"):
        tail = value.rsplit("/", 1)[-1]
        hint = (f" (policies are compared side by side now: write the metric name without `eval/<name>/`, e.g. "
                f"{tail!r})" if tail in EVAL_METRICS else "")
        if value.startswith("eval/reference_"):
            hint = " (the reference's metrics cannot promote a policy)"
    raise ValueError(f"promote_metric {value!r} is not a metric of `rlhf eval`{hint}; valid: "
                     f"{', '.join(EVAL_METRICS)}, pass_at_<k>")


class EvalParams(StrictModel):
    """`rlhf eval` on held-out prompts: every policy stage of the run against its reference (SFT)."""

    max_samples: int = Field(200, gt=0)
    n_samples_per_prompt: int = Field(4, ge=1, description="Samples per prompt at temperature 1: sampled "
                                      "accuracy (their mean), pass@k and the KL estimate")
    promote_metric: str = Field("sampled_accuracy", examples=["greedy_accuracy", "pass_at_4", "reward"],
                                description="Metric that decides whether a policy becomes the champion (higher "
                                "wins): greedy_accuracy, sampled_accuracy, pass_at_<k>, reward, win_rate, kl, "
                                "response_len (older names such as eval/policy_exact_match are mapped)")

    @model_validator(mode="before")
    @classmethod
    def _older_spelling(cls, values):
        """`n_kl_samples` (pipeline YAMLs before policies were compared) is `n_samples_per_prompt`."""
        if isinstance(values, dict) and "n_kl_samples" in values:
            values = dict(values)
            older = values.pop("n_kl_samples")
            if "n_samples_per_prompt" in values and values["n_samples_per_prompt"] != older:
                raise ValueError(f"n_kl_samples ({older}) is the older spelling of n_samples_per_prompt "
                                 f"({values['n_samples_per_prompt']}): give one of them")
            values["n_samples_per_prompt"] = older
        return values

    @model_validator(mode="after")
    def _metric_name(self) -> EvalParams:
        object.__setattr__(self, "promote_metric", promote_metric_name(self.promote_metric))
        return self


# A sampling round's engines (iterative DPO's pairs, rejection sampling's generation).
ROUND_ENGINES = Field(1, ge=1, description="Rollout engines the round's sampling spreads over (Ray actors of the "
                      "job's cluster, each a contiguous share of the prompts at seed + e x 1,000,003: a different "
                      "number of engines draws different samples)")


class IterativeDPOParams(StrictModel):
    """Online DPO rounds: sample from the current policy, score, pair best vs worst, train DPO, evaluate."""

    rounds: int = Field(1, gt=0)
    n_prompts: int = Field(512, gt=0, description="Training prompts sampled per round: a window of the training "
                           "prompts that the round's sampling seed picks (scheduled runs sample other prompts)")
    n_samples_per_prompt: int = Field(4, ge=2)
    temperature: float = Field(1.0, gt=0)
    num_engines: int = ROUND_ENGINES
    reward: str = Field("verifier", pattern="^(verifier|reward_model)$")
    start_from: str = Field("champion", pattern="^(champion|sft)$",
                            description="Start from the registered champion policy (falls back to SFT) or SFT")
    learning_rate: float = Field(2e-5, gt=0, description="DPO on the round's pairs (the `dpo` section's other "
                                 "settings): lower than that section's, which starts from SFT; a round starts "
                                 "from a policy RL already moved")
    seed: int | None = Field(None, description="Sampling seed (default: drawn per pipeline run, so every "
                             "scheduled run samples fresh pairs)")
    stop_early: bool = Field(True, description="Stop after a round that does not beat the registered champion, "
                             "saying why (the next round would start from the same champion); false: every round")


class RejectionSamplingParams(StrictModel):
    """Rejection sampling (stage `rejection_sampling`, OpenRLHF's script): per round, best-of-N samples
    of the current policy on fresh training prompts, scored, each prompt's best kept, SFT on them."""

    rounds: int = Field(1, gt=0)
    n_prompts: int = Field(2048, gt=0, description="Training prompts per round (round r takes the r-th window)")
    best_of_n: int = Field(4, ge=2, description="Samples per prompt")
    temperature: float = Field(1.0, gt=0)
    num_engines: int = ROUND_ENGINES
    reward: str = Field("reward_model", pattern="^(verifier|reward_model|prm)$",
                        description="Who picks the best: the run's reward model, its process reward model (stage "
                        "prm: each line a step, the weakest step's score), or the task's verifier")
    start_from: str = Field("sft", pattern="^(champion|sft)$",
                            description="The policy the first round samples and trains: the run's SFT model, or the "
                            "registered champion (falls back to SFT)")
    learning_rate: float = Field(2e-4, gt=0, description="SFT on the kept rows (the `sft` section's other settings)")
    max_epochs: int = Field(3, gt=0)
    seed: int | None = Field(None, description="Sampling seed (default: drawn per pipeline run)")


class ConditionalSFTParams(StrictModel):
    """Conditional SFT (stage `conditional_sft`, OpenRLHF's script, arXiv:2308.12050): the run's reward
    model (or the task's verifier) scores prep's SFT rows, each row's score is written into its
    prompt, the base model learns on them (the `sft` section's recipe), and the model saved asks, at
    generation, for a high score."""

    reward: str = Field("reward_model", pattern="^(reward_model|verifier)$",
                        description="Who scores the rows: the run's reward model, or prep's task verifier (each "
                        "row's response against its `answer` column: 1 right, 0 wrong)")
    normalize_reward: bool = Field(True, description="Write z-scores (over all rows) rather than raw rewards")
    reward_template: str = Field("{input} <rm_score>: {reward} ", description="Where the prompt and its score go; "
                                 "starts with {input}, so the condition follows the prompt")
    condition_percentile: int = Field(90, description="Generation asks for this percentile of the training rows' "
                                      "written scores (10, 25, 50, 75, 90, 95 or 99)")
    learning_rate: float | None = Field(None, gt=0, description="Default: the `sft` section's")
    max_epochs: int | None = Field(None, gt=0, description="Default: the `sft` section's")

    @model_validator(mode="after")
    def _usable(self) -> ConditionalSFTParams:
        from rlhf_core.stages.batch_inference import CONDITION_PERCENTILES, condition_suffix

        if self.condition_percentile not in CONDITION_PERCENTILES:
            raise ValueError(f"condition_percentile {self.condition_percentile}: one of "
                             f"{', '.join(map(str, CONDITION_PERCENTILES))}")
        if "{reward}" not in self.reward_template:
            raise ValueError(f"reward_template {self.reward_template!r} must contain {{reward}}")
        condition_suffix(self.reward_template, 0.0)  # text before {input}: refused, with why
        return self


class OnlineRLParams(StrictModel):
    """Online RL (stage `online_rl`): PPO (the `ppo` section) continued from the champion on fresh prompts."""

    start_from: str = Field("champion", pattern="^(champion|sft)$",
                            description="Continue from the registered champion policy (falls back to SFT) or SFT")
    seed: int | None = Field(None, description="Training seed: prompt order and sampling (default: drawn per "
                             "pipeline run, so every scheduled run sees fresh prompts first)")
    stop_on_hacking: bool = Field(True, description="Stop the round where the reward-hacking guard fires (the "
                                  "`ppo` section's eval.stop_on_hacking): a round that drives the champion off a "
                                  "cliff ends early, the report says why, and the champion stays")
    reward: str = Field("reward_model", pattern="^(reward_model|verifier)$",
                        description="What the round trains against where the `ppo` section names no reward: the "
                        "run's reward model, or prep's task verifier (the critic then starts from the policy)")


class PipelineSettings(StrictModel):
    stages: list[Stage] = Field(default_factory=lambda: list(FULL_PIPELINE),
                                description="Stages to run, in lifecycle order")
    from_run: str | None = Field(None, description="Reuse upstream outputs of this earlier pipeline run "
                                 "(its MLflow parent run id or Prefect flow run id)")
    output_root: str | None = Field(None, description="Where stage outputs go: a local directory or s3:// URI "
                                    "(default: <state dir>/pipelines)")
    experiment: str = "rlhf"
    force: bool = Field(False, description="Rerun every stage even when its cached output is still valid")
    force_stages: list[Stage] = Field(default_factory=list, description="Rerun these stages even when cached")
    register_models: bool = True
    rollout_gpus: float = Field(0, ge=0, description="GPUs reserved for the driver of eval and pairs jobs, which "
                                "generate in-process (set 1 on a GPU cluster)")
    retries: int = Field(2, ge=0, description="Retries of a stage job after an infrastructure failure")
    retry_delay_seconds: float = Field(10.0, ge=0, description="Delay before the first retry; doubles each retry")
    stage_timeout_minutes: float | None = Field(None, gt=0, description="Fail (and stop) a stage job that runs "
                                                "longer than this; it is then retried like any infrastructure failure")
    checkpoint_steps: int = Field(20, ge=0, description="RL stages save their whole state every N steps in the run's "
                                  "output area (checkpoints/<stage>), so a retried attempt resumes there instead of "
                                  "at step 0 (0: never; a local or s3:// output_root)")
    supervised_checkpoint_steps: int = Field(200, ge=0, description="SFT, reward model and DPO save their whole "
                                             "state every N optimizer steps in the run's output area "
                                             "(checkpoints/<stage>), so a retried attempt resumes there (0: never; "
                                             "a local or s3:// output_root)")


STAGE_PARAMS = {"sft": PipelineSFTConfig, "rm": PipelineRMConfig, "prm": PipelinePRMConfig, "dpo": PipelineDPOConfig,
                "ppo": PipelinePPOConfig, "distill": PipelineKDConfig}
