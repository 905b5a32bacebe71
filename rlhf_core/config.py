"""Stage configurations: one pydantic model per stage, filled from YAML and from flags.

The same models are the parameters of the Prefect flows (so the UI renders forms) and the
arguments of the `rlhf` CLI. Flag names are the field names, which follow OpenRLHF
(`--pretrain`, `--micro_train_batch_size`, `--zero_stage`, ...). Precedence: defaults <
`--config FILE.yaml` < flags. Unknown keys are errors everywhere (`extra="forbid"`).
"""

from __future__ import annotations

import functools
import math
import os
from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf_core.algos.names import DPOLossType, RewardLossType
from rlhf_core.flags import Spellings
from rlhf_core.infra.manifests import NOT_SEMANTIC
from rlhf_core.infra.precision import Precision
from rlhf_core.infra.settings import ConfigError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_input_template(template: str | None, name: str) -> None:
    """ValueError unless `template` formats one prompt: exactly one `{}` and no other field."""
    if template is None:
        return
    if "{}" not in template:
        raise ValueError(f"{name} must contain '{{}}' where the prompt goes")
    try:
        template.format("prompt")
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"{name} {template!r} cannot format a prompt ({type(e).__name__}: {e}); "
                         "write literal braces as {{ and }}") from None


class DataConfig(StrictModel):
    """Where the examples come from and how they become token ids."""

    dataset: str | None = Field(None, description="Comma-separated datasets: jsonl/json/parquet files, json@DIR, or "
                                "hub names (required; a pipeline fills it from the upstream stage)",
                                json_schema_extra=NOT_SEMANTIC)
    dataset_probs: str | None = Field(None, description="Comma-separated mixing probabilities, one per dataset")
    dataset_split: str = "train"
    eval_dataset: str | None = Field(None, description="Held-out data; default: the 'test' split of --dataset when it has one",
                                     json_schema_extra=NOT_SEMANTIC)
    eval_split: str = "test"
    input_key: str = "prompt"
    output_key: str = "response"
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    label_key: str = "label"
    margin_key: str | None = Field(None, description="Reward-model margin column (optional)")
    input_template: str | None = Field(None, description="Python format string with one {} for the prompt")
    apply_chat_template: bool = False
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template that replaces the tokenizer's")
    max_samples: int = Field(100_000_000, gt=0)
    max_eval_samples: int = Field(100_000_000, gt=0)
    max_len: int = Field(512, gt=1)
    truncate: bool = Field(False, description="Truncate rows longer than max_len instead of failing")
    packing_samples: bool = False

    @model_validator(mode="after")
    def _check_probs(self) -> DataConfig:
        if self.dataset_probs is not None and self.dataset is not None:
            probs = [p.strip() for p in self.dataset_probs.split(",")]
            n = len([d for d in self.dataset.split(",") if d.strip()])
            if len(probs) != n:
                raise ValueError(f"dataset_probs has {len(probs)} values for {n} datasets")
            try:
                values = [float(p) for p in probs]
            except ValueError as e:
                raise ValueError(f"dataset_probs must be numbers: {self.dataset_probs!r}") from e
            if not all(math.isfinite(v) for v in values) or any(v < 0 for v in values) or sum(values) <= 0:
                raise ValueError(f"dataset_probs must be finite, non-negative, with a positive sum: {self.dataset_probs!r}")
        check_input_template(self.input_template, "input_template")
        return self

    @property
    def probs(self) -> list[float] | None:
        if self.dataset_probs is None:
            return None
        values = [float(p) for p in self.dataset_probs.split(",")]
        return [v / sum(values) for v in values]


class TrainConfig(StrictModel):
    """What every trainer shares: model, engine, optimisation, checkpoints, tracking."""

    # Required to train; None in a pipeline's parameters means "filled in from the upstream stage".
    pretrain: str | None = Field(None, description="Model to start from (HF directory, s3:// URI or hub name)",
                                 json_schema_extra=NOT_SEMANTIC)
    save_path: str | None = Field(None, description="Stage output: local directory or s3:// URI",
                                  json_schema_extra=NOT_SEMANTIC)
    data: DataConfig = Field(default_factory=DataConfig)

    # Engine and parallelism.
    zero_stage: int = Field(2, ge=0, le=3)
    adam_offload: bool = False
    param_dtype: Precision = Field(Precision.AUTO, description="Training precision: auto (bf16 where the device "
                                   "computes it natively, else fp32), bf16, fp16 (GPU) or fp32")
    bf16: bool = Field(False, description="Older spelling of --param_dtype bf16")
    gradient_checkpointing: bool = False
    flash_attn: bool = False
    num_nodes: int = Field(1, ge=1)
    num_gpus_per_node: int = Field(1, ge=1, description="Ranks per node (on CPU: worker processes)")

    # Optimisation (docs/algorithms.md defaults).
    train_batch_size: int = Field(32, gt=0, description="Global batch: micro x accumulation x ranks")
    micro_train_batch_size: int = Field(8, gt=0)
    learning_rate: float = Field(5e-6, gt=0)
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    l2: float = Field(0.0, ge=0, description="Weight decay")
    max_norm: float = Field(1.0, gt=0)
    max_epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps")
    seed: int = 42

    # LoRA (merged into the base weights on save).
    lora_rank: int = Field(0, ge=0)
    lora_alpha: int = Field(16, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: str = Field("all-linear", description="Comma-separated module names or 'all-linear'")

    # Checkpoints and evaluation.
    save_steps: int = Field(-1, description="Checkpoint every N steps (-1: never)",
                            json_schema_extra=NOT_SEMANTIC)
    ckpt_path: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    max_ckpt_num: int = Field(3, gt=0, json_schema_extra=NOT_SEMANTIC)
    load_checkpoint: bool = Field(False, json_schema_extra=NOT_SEMANTIC)
    eval_steps: int = Field(-1, description="Evaluate every N steps (-1: at the end only)",
                            json_schema_extra=NOT_SEMANTIC)
    logging_steps: int = Field(1, gt=0, json_schema_extra=NOT_SEMANTIC)

    # Tracking.
    mlflow_experiment: str = Field("rlhf", json_schema_extra=NOT_SEMANTIC)
    mlflow_run_name: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    mlflow_parent_run_id: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    use_mlflow: bool = Field(True, json_schema_extra=NOT_SEMANTIC)

    @model_validator(mode="after")
    def _check_batches(self) -> TrainConfig:
        if self.bf16:  # an alias: folded into param_dtype, which alone says what was asked for
            if self.param_dtype not in (Precision.AUTO, Precision.BF16):
                raise ValueError(f"--bf16 contradicts --param_dtype {self.param_dtype.value}: give one of them")
            object.__setattr__(self, "param_dtype", Precision.BF16)
            object.__setattr__(self, "bf16", False)
        per_step = self.micro_train_batch_size * self.world_size
        if self.train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"micro_train_batch_size x ranks ({self.micro_train_batch_size} x {self.world_size})"
            )
        if self.save_steps > 0 and not self.ckpt_path:
            raise ValueError("save_steps needs ckpt_path")
        if self.load_checkpoint and not self.ckpt_path:
            raise ValueError("load_checkpoint needs ckpt_path")
        return self

    def check_complete(self) -> None:
        """Raise ConfigError naming every input/output a run still needs (pretrain, save_path, dataset)."""
        missing = [f"--{name}" for name, value in (("pretrain", self.pretrain), ("save_path", self.save_path),
                                                  ("dataset", self.data.dataset)) if not value]
        if missing:
            raise ConfigError(f"{self.stage}: " + "; ".join(f"{name}: required" for name in missing))

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    @property
    def accumulation_steps(self) -> int:
        return self.train_batch_size // (self.micro_train_batch_size * self.world_size)


class SFTConfig(TrainConfig):
    stage: Literal["sft"] = "sft"
    learning_rate: float = Field(1e-5, gt=0)
    pretrain_mode: bool = Field(False, description="Continued pretraining: loss on every token")


class RMConfig(TrainConfig):
    stage: Literal["rm"] = "rm"
    learning_rate: float = Field(9e-6, gt=0)
    loss: RewardLossType = RewardLossType.SIGMOID
    value_head_prefix: str = Field("score", description="Name of the value head in the pretrained weights")


class DPOConfig(TrainConfig):
    stage: Literal["dpo"] = "dpo"
    learning_rate: float = Field(5e-7, gt=0)
    ref_pretrain: str | None = Field(None, description="Reference model (default: --pretrain)",
                                     json_schema_extra=NOT_SEMANTIC)
    beta: float = Field(0.1, gt=0)
    loss_type: DPOLossType = DPOLossType.SIGMOID
    ipo: bool = Field(False, description="Same as --loss_type ipo")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO epsilon")
    nll_loss_coef: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _resolve(self) -> DPOConfig:
        if self.ipo and self.loss_type != DPOLossType.IPO:
            object.__setattr__(self, "loss_type", DPOLossType.IPO)
        if self.ref_pretrain is None:
            object.__setattr__(self, "ref_pretrain", self.pretrain)
        if self.label_smoothing and self.loss_type != DPOLossType.SIGMOID:
            raise ValueError("label_smoothing (cDPO) applies to the sigmoid loss only")
        return self


class KTOConfig(TrainConfig):
    stage: Literal["kto"] = "kto"
    learning_rate: float = Field(5e-7, gt=0)
    ref_pretrain: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    beta: float = Field(0.1, gt=0)
    desirable_loss_weight: float = Field(1.0, gt=0)
    undesirable_loss_weight: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _resolve(self) -> KTOConfig:
        if self.ref_pretrain is None:
            object.__setattr__(self, "ref_pretrain", self.pretrain)
        return self


STAGE_CONFIGS: dict[str, type[TrainConfig]] = {
    "sft": SFTConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
}


# ---------------------------------------------------------------------------------------------
# Flags and YAML -> config. Flags are the flat field names; data fields may be given flat too.

# The trainers' fields under OpenRLHF's dotted flag names (train_sft.py, train_rm.py, train_dpo.py),
# besides the flat names, which stay their flags.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "pretrain": ("--model.model_name_or_path",),
    "ref_pretrain": ("--ref.model_name_or_path",),
    "save_path": ("--ckpt.output_dir",),
    "zero_stage": ("--ds.zero_stage",),
    "adam_offload": ("--ds.adam_offload",),
    "param_dtype": ("--ds.param_dtype",),
    "gradient_checkpointing": ("--model.gradient_checkpointing_enable",),
    "train_batch_size": ("--train.batch_size",),
    "micro_train_batch_size": ("--train.micro_batch_size",),
    "learning_rate": ("--adam.lr",),
    "adam_betas": ("--adam.betas",),
    "l2": ("--adam.weight_decay",),
    "max_epochs": ("--train.max_epochs",),
    "seed": ("--train.seed",),
    "lora_rank": ("--ds.lora.rank",),
    "lora_alpha": ("--ds.lora.alpha",),
    "lora_dropout": ("--ds.lora.dropout",),
    "target_modules": ("--ds.lora.target_modules",),
    "save_steps": ("--ckpt.save_steps",),
    "ckpt_path": ("--ckpt.path",),
    "max_ckpt_num": ("--ckpt.max_num",),
    "load_checkpoint": ("--ckpt.load_enable",),
    "eval_steps": ("--eval.steps",),
    "logging_steps": ("--logger.logging_steps",),
    "pretrain_mode": ("--model.pretrain_mode_enable",),  # sft
    "loss": ("--model.loss_type",),  # rm
    "value_head_prefix": ("--ds.value_head_prefix",),  # rm
    "beta": ("--model.beta",),  # dpo (kto)
    "ipo": ("--model.ipo_enable",),  # dpo
    "label_smoothing": ("--model.label_smoothing",),  # dpo
    "nll_loss_coef": ("--model.nll_loss_coef",),  # dpo
    # data
    "dataset": ("--data.dataset",),
    "dataset_probs": ("--data.dataset_probs",),
    "dataset_split": ("--data.dataset_split",),
    "eval_dataset": ("--eval.dataset",),
    "eval_split": ("--eval.split",),
    "input_key": ("--data.input_key",),
    "output_key": ("--data.output_key",),
    "prompt_key": ("--data.prompt_key",),
    "chosen_key": ("--data.chosen_key",),
    "rejected_key": ("--data.rejected_key",),
    "input_template": ("--data.input_template",),
    "apply_chat_template": ("--data.apply_chat_template",),
    "tokenizer_chat_template": ("--data.tokenizer_chat_template",),
    "max_samples": ("--data.max_samples",),
    "max_len": ("--data.max_len",),
    "packing_samples": ("--ds.packing_samples",),
}


def _train_spellings(config_cls: type[TrainConfig]) -> Spellings:
    """A trainer config's spellings: data fields by their flat name (`--max_len`) and their path
    (`--data.max_len`), every field by OpenRLHF's dotted name in `FLAG_ALIASES`."""
    paths = {name: (f"data.{name}" if name in DataConfig.model_fields else name)
             for name in [*config_cls.model_fields, *DataConfig.model_fields]}
    aliases = {name: (f"data.{name}",) for name in DataConfig.model_fields}
    for name, flags in FLAG_ALIASES.items():
        if name in paths:
            aliases.update({flag[2:]: (paths[name],) for flag in flags if flag[2:] != paths[name]})
    return Spellings(config_cls, aliases)


def add_config_flags(parser, config_cls: type[BaseModel]) -> None:
    """Register `--config` and every field's flags on an argparse parser (`flags.Spellings`)."""
    spellings_of(config_cls).add_flags(parser, "YAML file with any of these fields (flat, dotted or nested)")


def load_yaml(path: str | os.PathLike) -> dict:
    import yaml

    try:
        if "://" in str(path):  # a config written next to a pipeline's outputs, e.g. on s3://
            import fsspec

            with fsspec.open(str(path)) as f:
                loaded = yaml.safe_load(f) or {}
        else:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
    except FileNotFoundError as e:
        raise ConfigError(f"--config: file not found: {path}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML{where}: {problem}") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise ConfigError(f"--config {path}: not a YAML text file ({type(e).__name__})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value, got {type(loaded).__name__}")
    return loaded


def build_config(config_cls: type[BaseModel], yaml_values: dict | None, flag_values: dict,
                 complete: bool = True):
    """Merge YAML (lower precedence) and flags, in any spelling, into a validated config, or raise
    ConfigError. `complete=False` allows leaving out pretrain/save_path/dataset (a pipeline fills them in).
    """
    return spellings_of(config_cls).build(yaml_values, flag_values, complete)


def with_updates(cfg: TrainConfig, **updates) -> TrainConfig:
    """A copy of `cfg` with top-level or data fields replaced, validated again (derived defaults follow)."""
    values = cfg.model_dump()
    values["data"].update({k: updates.pop(k) for k in list(updates) if k in DataConfig.model_fields})
    values.update(updates)
    return type(cfg).model_validate(values)


# ---------------------------------------------------------------------------------------------
# In-process stages that generate with a rollout engine: `rlhf eval` and `rlhf pairs`. Their
# configs are flat (no `data` section): they read prompts, never train on tokenized examples.

class RolloutBackend(str, Enum):
    """Generation engine: vLLM when CUDA and vllm are there (auto), or transformers anywhere."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"


class RewardSourceName(str, Enum):
    VERIFIER = "verifier"
    REWARD_MODEL = "reward_model"


class RolloutStageConfig(StrictModel):
    """What eval and pairs share: a policy, prompts (with answers), generation and tracking."""

    # Required to run; None in a pipeline's parameters means "filled in from the upstream stage".
    pretrain: str | None = Field(None, description="Policy model: local HF directory or s3:// URI",
                                 json_schema_extra=NOT_SEMANTIC)
    dataset: str | None = Field(None, description="Prompts: jsonl/json/parquet with prompt (and answer) keys, "
                                "or json@DIR", json_schema_extra=NOT_SEMANTIC)
    save_path: str | None = Field(None, description="Stage output: local directory or s3:// URI",
                                  json_schema_extra=NOT_SEMANTIC)
    input_key: str = "prompt"
    label_key: str = Field("answer", description="Reference answer column (the verifier's input)")
    apply_chat_template: bool = True
    task: str | None = Field(None, description="Built-in task whose exact verifier scores responses")
    max_samples: int = Field(100_000_000, gt=0, description="Use the first N prompts")
    max_new_tokens: int | None = Field(None, gt=0, description="Default: the task's longest answer + EOS")
    seed: int = 42
    rollout_backend: RolloutBackend = RolloutBackend.AUTO

    mlflow_experiment: str = Field("rlhf", json_schema_extra=NOT_SEMANTIC)
    mlflow_run_name: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    mlflow_parent_run_id: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    use_mlflow: bool = Field(True, json_schema_extra=NOT_SEMANTIC)

    @model_validator(mode="after")
    def _resolve_generation_budget(self) -> RolloutStageConfig:
        if self.task is not None:
            from rlhf_core.data.synthetic import get_task

            try:
                budget = get_task(self.task).max_answer_len + 1
            except ValueError as e:
                raise ValueError(f"--task: {e}") from None
            if self.max_new_tokens is None:
                object.__setattr__(self, "max_new_tokens", budget)
        elif self.max_new_tokens is None:
            raise ValueError("--max_new_tokens is required without --task")
        return self

    def check_complete(self) -> None:
        """Raise ConfigError naming every input/output a run still needs (pretrain, dataset, save_path)."""
        missing = [f"--{name}" for name in ("pretrain", "dataset", "save_path") if not getattr(self, name)]
        if missing:
            raise ConfigError(f"{self.stage}: " + "; ".join(f"{name}: required" for name in missing))


class EvalConfig(RolloutStageConfig):
    """`rlhf eval`: policies side by side against a reference on held-out prompts.

    `pretrain` may list several policies (comma-separated); `policy_names` names them in the same
    order (metrics `eval/<name>/<metric>`; default `policy`, or `policy1..N` for several)."""

    stage: Literal["eval"] = "eval"
    pretrain: str | None = Field(None, description="Policy model(s), comma-separated: local HF directories or "
                                 "s3:// URIs, evaluated side by side", json_schema_extra=NOT_SEMANTIC)
    policy_names: str | None = Field(None, description="Comma-separated names of the --pretrain policies, in "
                                     "order (default: policy, or policy1,policy2,... for several)")
    ref_pretrain: str | None = Field(None, description="Reference model (usually the SFT model)",
                                     json_schema_extra=NOT_SEMANTIC)
    reward_pretrain: str | None = Field(None, description="Reward model (scores, win rate)",
                                        json_schema_extra=NOT_SEMANTIC)
    normalize_reward: bool = Field(False, description="Normalise scores with the RM's stored reward_mean/std")
    n_samples_per_prompt: int = Field(4, ge=1, description="Samples per prompt at --temperature: sampled accuracy, "
                                      "pass@k, and the KL estimate (drawn at temperature 1)")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of sampled accuracy and pass@k")
    n_kl_samples: int | None = Field(None, ge=1, description="Deprecated spelling of --n_samples_per_prompt "
                                     "(the KL estimate uses those samples)")

    @model_validator(mode="after")
    def _check_reward(self) -> EvalConfig:
        if self.normalize_reward and not self.reward_pretrain:
            raise ValueError("normalize_reward needs reward_pretrain")
        if self.n_kl_samples is not None:
            if "n_samples_per_prompt" in self.model_fields_set and self.n_kl_samples != self.n_samples_per_prompt:
                raise ValueError(f"n_kl_samples ({self.n_kl_samples}) is the older spelling of n_samples_per_prompt "
                                 f"({self.n_samples_per_prompt}): give one of them")
            object.__setattr__(self, "n_samples_per_prompt", self.n_kl_samples)
            object.__setattr__(self, "n_kl_samples", None)
        if self.policy_names is not None:
            _check_policy_names(_split_list(self.policy_names))
            if self.pretrain:
                self.policies()
        return self

    def policies(self) -> list[tuple[str, str]]:
        """`(name, model URI)` of each policy, in `--pretrain` order; ConfigError on a bad name list."""
        uris = _split_list(self.pretrain or "")
        if self.policy_names is None:
            names = ["policy"] if len(uris) == 1 else [f"policy{i + 1}" for i in range(len(uris))]
        else:
            names = _split_list(self.policy_names)
            _check_policy_names(names)
            if len(names) != len(uris):
                raise ConfigError(f"--policy_names: {len(names)} names ({', '.join(names)}) for {len(uris)} "
                                  f"--pretrain models; give one name per policy, in the same order")
        return list(zip(names, uris, strict=True))


REFERENCE_NAME = "reference"  # the name `rlhf eval` reports the reference under (reserved for it)


def _split_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _check_policy_names(names: list[str]) -> None:
    if not names:
        raise ConfigError("--policy_names: empty; give one name per --pretrain policy")
    for name in names:
        if name == REFERENCE_NAME:
            raise ConfigError(f"--policy_names: {REFERENCE_NAME!r} is reserved for --ref_pretrain; name the "
                              "policy otherwise")
        if not (name.isascii() and all(c.isalnum() or c in "_.-" for c in name)):
            raise ConfigError(f"--policy_names: {name!r} is not a valid name (letters, digits, '_', '-', '.'; "
                              "it becomes part of the metric keys eval/<name>/...)")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"--policy_names: {', '.join(repeated)} given more than once; names must be unique")


class PairsConfig(RolloutStageConfig):
    """`rlhf pairs`: sample the policy, score, keep (best, worst) per prompt: online/iterative DPO data."""

    stage: Literal["pairs"] = "pairs"
    reward: RewardSourceName = RewardSourceName.VERIFIER
    reward_pretrain: str | None = Field(None, description="Reward model (with --reward reward_model)",
                                        json_schema_extra=NOT_SEMANTIC)
    normalize_reward: bool = Field(False, description="Normalise scores with the RM's stored reward_mean/std")
    n_samples_per_prompt: int = Field(4, ge=2)
    temperature: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check_reward(self) -> PairsConfig:
        if self.reward == RewardSourceName.VERIFIER and self.task is None:
            raise ValueError("--reward verifier needs --task")
        if self.reward == RewardSourceName.REWARD_MODEL and not self.reward_pretrain:
            raise ValueError("--reward reward_model needs --reward_pretrain")
        if self.normalize_reward and self.reward != RewardSourceName.REWARD_MODEL:
            raise ValueError("normalize_reward applies to --reward reward_model only")
        return self


ROLLOUT_STAGE_CONFIGS: dict[str, type[RolloutStageConfig]] = {"eval": EvalConfig, "pairs": PairsConfig}


@functools.cache
def spellings_of(config_cls: type[BaseModel]) -> Spellings:
    """A stage config's spellings (`flags.Spellings`): a trainer's with OpenRLHF's names, eval's and
    pairs' their field names only (also for subclasses, e.g. a pipeline's sections)."""
    return _train_spellings(config_cls) if issubclass(config_cls, TrainConfig) else Spellings(config_cls, {})
