"""Stage configurations: one pydantic model per stage, filled from YAML and from flags.

The same models are the parameters of the Prefect flows (so the UI renders forms) and the
arguments of the `rlhf` CLI. The trainers are sectioned as OpenRLHF's CLI is (`model`, `ds`,
`train`, `adam`, `data`, `eval`, `ckpt`, `logger`; `rl_config` adds the RL roles), from section
classes shared by every stage: a field added to `DSConfig` is a flag of every stage. A field's
flags are its dotted path and the flat names on it (`flags.flat`). Precedence: defaults <
`--config FILE.yaml` < flags. Unknown keys are errors everywhere (`extra="forbid"`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from enum import Enum
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from rlhf_core.algos.names import STEP_AGGREGATES, DPOLossType, RewardLossType
from rlhf_core.flags import Spellings, flat, leaves
from rlhf_core.infra.manifests import NOT_SEMANTIC
from rlhf_core.infra.precision import Precision
from rlhf_core.infra.settings import ConfigError


def _field_title(name: str, field) -> str:
    """A section is titled by its key (`train`, as its flags spell it; the Prefect form labels it so
    rather than by its class name); other fields as pydantic titles them (`Max Steps`)."""
    section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    return name if section else name.title().replace("_", " ").strip()


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, field_title_generator=_field_title)


def check_probs(probs: str | None, datasets: str | None, name: str) -> None:
    """ValueError unless `probs` (comma-separated) gives each of `datasets` a finite, non-negative
    weight with a positive sum."""
    if probs is None or datasets is None:
        return
    given = [p.strip() for p in probs.split(",")]
    n = len([d for d in datasets.split(",") if d.strip()])
    if len(given) != n:
        raise ValueError(f"{name} has {len(given)} values for {n} datasets")
    try:
        values = [float(p) for p in given]
    except ValueError as e:
        raise ValueError(f"{name} must be numbers: {probs!r}") from e
    if not all(math.isfinite(v) for v in values) or any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError(f"{name} must be finite, non-negative, with a positive sum: {probs!r}")


def mixing_probs(probs: str | None) -> list[float] | None:
    """`--dataset_probs`-style weights, normalised (None: the datasets' own sizes)."""
    if probs is None:
        return None
    values = [float(p) for p in probs.split(",")]
    return [v / sum(values) for v in values]


def template_or_none(template: str | None) -> str | None:
    """A template with no braces at all (`""`, a bare prefix) has no place for the prompt: OpenRLHF
    drops it with a warning, and so does this (one line on stderr, once per process). A template
    with braces but no `{}` stays an error (`check_input_template`): most likely a typo."""
    if template is None or "{" in template or "}" in template:
        return template
    from rlhf_core.infra.not_applied import say_once

    say_once(f"warning: --input_template {template!r} has no {{}} for the prompt: no template is applied")
    return None


def check_aux_loss(section) -> None:
    """Reentrant gradient checkpointing runs each layer's forward without gradients: the routers'
    load-balancing loss would reach none of them (`models/moe.py` keeps only forwards with gradients)."""
    if section.aux_loss_coef > 0 and section.gradient_checkpointing_enable and section.gradient_checkpointing_reentrant:
        raise ValueError("aux_loss_coef: the load-balancing loss needs gradients through the routers, which "
                         "reentrant gradient checkpointing does not give; drop --gradient_checkpointing_use_reentrant")


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


class StageConfig(StrictModel):
    """What every stage's config shares: tracking, and validation from any of its spellings.

    A config validates from nested sections, dotted paths and flat names alike (`flags.Spellings`),
    so a YAML file, a pipeline's parameters and keyword arguments all read as the flags do.
    `ALIASES` names the spellings that are neither a field's path nor on the field (`flags.flat`).
    """

    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}
    # OpenRLHF's flags (both eras' spellings) of features not built yet -> why: refused, exit 2
    DEFERRED: ClassVar[dict[str, str]] = {}

    mlflow_experiment: str = Field("rlhf", json_schema_extra=NOT_SEMANTIC)
    mlflow_run_name: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    mlflow_parent_run_id: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    use_mlflow: bool = Field(True, json_schema_extra=NOT_SEMANTIC)

    @model_validator(mode="before")
    @classmethod
    def _from_any_spelling(cls, values):
        if not isinstance(values, dict):
            return values
        spellings = spellings_of(cls)
        stage = cls.model_fields["stage"].default if "stage" in cls.model_fields else cls.__name__
        return spellings.nest(spellings.to_paths(values, str(stage)))


# ---------------------------------------------------------------------------------------------
# Sections every stage that trains shares (OpenRLHF's `adam`, `ds`, `ckpt`, `logger`, `train`).
# A field added here is a flag of every stage that has the section.

class AdamConfig(StrictModel):
    """AdamW."""

    lr: float = Field(5e-6, gt=0, description="Peak learning rate (after warmup)")
    betas: tuple[float, float] = Field((0.9, 0.95), json_schema_extra=flat("adam_betas"))
    eps: float = Field(1e-8, gt=0, description="Added to the denominator of the update")
    weight_decay: float = Field(0.0, ge=0, json_schema_extra=flat("l2"))


class MuonConfig(StrictModel):
    """Muon (with `--optim muon`): momentum orthogonalised by Newton-Schulz iterations for the hidden
    weight matrices; embeddings, the LM head and every vector keep AdamW (`adam`, its own LR)."""

    lr: float = Field(0.02, gt=0, description="Peak learning rate of the Muon (matrix) group")
    momentum: float = Field(0.95, ge=0, lt=1, description="Momentum of the Muon group")
    ns_steps: int = Field(5, ge=1, description="Newton-Schulz iterations (DeepSpeed's Muon runs 5: another "
                          "value is not applied, said in one log line)")
    nesterov: bool = Field(True, description="Nesterov momentum (DeepSpeed's Muon always uses it: off is not "
                           "applied, said in one log line)")


class Optimiser(StrictModel):
    """Which optimiser one trained model gets: AdamW (`adam`), or Muon for its matrices with AdamW for
    the rest (`muon`, as OpenRLHF 0.11's `--optim`)."""

    optim: Literal["adam", "muon"] = Field("adam", description="adam: AdamW; muon: Muon for the hidden weight "
                                           "matrices (--muon.*), AdamW for the rest (--adam.*)")
    muon: MuonConfig = Field(default_factory=MuonConfig)


class Schedule(StrictModel):
    """The learning-rate schedule (linear warmup, cosine to `min_lr_ratio`) and gradient clipping
    of one optimiser."""

    lr_warmup_ratio: float = Field(0.03, ge=0, le=1, json_schema_extra=flat("lr_warmup_ratio"))
    min_lr_ratio: float = Field(0.1, ge=0, le=1, json_schema_extra=flat("min_lr_ratio"))
    max_norm: float = Field(1.0, gt=0, json_schema_extra=flat("max_norm"))
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine_with_min_lr", description="LR schedule after warmup: cosine to min_lr_ratio (default), cosine or "
        "linear to 0, constant (with or without warmup)", json_schema_extra=flat("lr_scheduler"))


class DSConfig(StrictModel):
    """DeepSpeed and the numerics of training."""

    zero_stage: int = Field(2, ge=0, le=3, json_schema_extra=flat("zero_stage"))
    param_dtype: Precision = Field(Precision.AUTO, description="Training precision: auto (bf16 where the device "
                                   "computes it natively, else fp32), bf16, fp16 (GPU) or fp32",
                                   json_schema_extra=flat("param_dtype"))
    adam_offload: bool = Field(False, json_schema_extra=flat("adam_offload"))
    flash_attn: bool = Field(False, description="Same as --ds.attn_implementation flash_attention_2 (OpenRLHF "
                             "<= 0.8's flag)", json_schema_extra=flat("flash_attn", gpu="CUDA and flash-attn; "
                                                                      "elsewhere SDPA"))
    attn_implementation: str | None = Field(
        None, description="Attention kernel given to transformers: sdpa (default), eager, flex_attention, "
        "flash_attention_2 or _3 (a GPU with flash-attn; elsewhere sdpa, said in one log line)",
        json_schema_extra=flat("attn_implementation", gpu="flash_attention_2/3 need CUDA and their package; "
                               "elsewhere SDPA"))
    experts_implementation: Literal["eager", "batched_mm", "grouped_mm", "deepgemm"] | None = Field(
        None, description="MoE experts' kernel given to transformers (grouped_mm and deepgemm need a GPU; "
        "elsewhere transformers' default, said in one log line)", json_schema_extra=flat(
            "experts_implementation", gpu="grouped_mm and deepgemm need CUDA; elsewhere transformers' default"))
    use_liger_kernel: bool = Field(False, description="Liger's fused kernels in the trained causal LMs (a GPU with "
                                   "liger-kernel installed; elsewhere not applied, said in one log line)",
                                   json_schema_extra=flat("use_liger_kernel", gpu="Triton kernels: CUDA and "
                                                          "liger-kernel; elsewhere the model's own"))
    overlap_comm: bool = Field(False, description="DeepSpeed ZeRO: overlap the gradient reduction with the "
                               "backward", json_schema_extra=flat("overlap_comm"))
    zpg: int = Field(1, ge=1, description="ZeRO++ hierarchical partition size (ZeRO-3's secondary weight "
                     "partition per group of this many ranks)", json_schema_extra=flat("zpg"))
    grad_accum_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="DeepSpeed's gradient accumulation dtype (default: its own)",
        json_schema_extra=flat("grad_accum_dtype"))
    deepcompile: bool = Field(False, description="DeepSpeed's DeepCompile (its engine compiled with "
                              "torch.compile; CUDA, elsewhere not applied, said in one log line)",
                              json_schema_extra=flat("deepcompile", gpu="CUDA; elsewhere uncompiled"))
    load_in_4bit: bool = Field(False, description="QLoRA: load the stage's models with 4-bit NF4 weights "
                               "(bitsandbytes, double quantisation, computing in the training precision) and train "
                               "LoRA adapters on them (needs --lora_rank; not with ZeRO-3); the output is the "
                               "adapters merged into the dequantised weights, a plain model",
                               json_schema_extra=flat("load_in_4bit"))

    use_universal_ckpt: bool = Field(False, description="Resume through DeepSpeed's universal checkpoint format, so "
                                     "the number of ranks may differ from the run that wrote it (the tag loaded is "
                                     "converted once, into <tag>/universal); keeps the ZeRO stage asked for on one "
                                     "CPU rank too", json_schema_extra=flat("use_ds_universal_ckpt"))

    def problems(self) -> list[str]:
        """Why `load_in_4bit` or `use_universal_ckpt` cannot run with these settings (none: they can)."""
        found = []
        if self.use_universal_ckpt and self.zero_stage == 0:
            found.append("--ds.use_universal_ckpt (--use_ds_universal_ckpt) converts ZeRO's per-rank slices: give "
                         "--zero_stage 1, 2 or 3")
        if not self.load_in_4bit:
            return found
        if getattr(self, "lora", None) is None or self.lora.rank <= 0:
            found.append("--ds.load_in_4bit (--load_in_4bit) trains LoRA adapters on frozen 4-bit weights: give "
                         "--ds.lora.rank (--lora_rank) > 0")
        if self.zero_stage == 3:
            found.append("--ds.load_in_4bit (--load_in_4bit) cannot shard 4-bit weights with ZeRO-3: use "
                         "--zero_stage 0, 1 or 2")
        return found

    @property
    def attention(self) -> str:
        """The attention implementation asked for (`--ds.attn_implementation`, else `--ds.flash_attn`'s)."""
        return self.attn_implementation or ("flash_attention_2" if self.flash_attn else "sdpa")


class ValueHead(StrictModel):
    value_head_prefix: str = Field("score", description="Name of the value head in reward/critic weights",
                                   json_schema_extra=flat("value_head_prefix"))


CHECKPOINT_SCHEMES = ("s3",)  # object stores checkpoints go to (trainers/checkpoints.py); local paths otherwise


class CkptConfig(StrictModel):
    output_dir: str | None = Field(None, description="Stage output: local directory or s3:// URI (required; a "
                                   "pipeline fills it in)",
                                   json_schema_extra=flat("save_path", **NOT_SEMANTIC))
    path: str | None = Field(None, description="Training-state checkpoints (for save_steps, load_enable)",
                             json_schema_extra=flat("ckpt_path", **NOT_SEMANTIC))
    save_steps: int = Field(-1, description="Checkpoint every N steps (-1: never)",
                            json_schema_extra=flat("save_steps", **NOT_SEMANTIC))
    max_num: int = Field(3, gt=0, json_schema_extra=flat("max_ckpt_num", **NOT_SEMANTIC))
    max_mem: float | None = Field(None, gt=0, description="GB this run's checkpoints may take: the oldest go "
                                  "first (the newest always stays; default: no limit)",
                                  json_schema_extra=flat("max_ckpt_mem", **NOT_SEMANTIC))
    load_enable: bool = Field(False, description="Resume from the latest checkpoint under ckpt.path",
                              json_schema_extra=flat("load_checkpoint", **NOT_SEMANTIC))
    save_hf: bool = Field(False, description="Also write the trained model (RL: the actor) in Hugging Face format "
                          "into each checkpoint, as <tag>/hf (with its tokenizer; loads in plain transformers)",
                          json_schema_extra=flat("save_hf_ckpt", **NOT_SEMANTIC))
    disable_ds: bool = Field(False, description="Checkpoints hold the Hugging Face model only (--ckpt.save_hf), no "
                             "DeepSpeed training state: smaller, and nothing to resume from",
                             json_schema_extra=flat("disable_ds_ckpt", **NOT_SEMANTIC))

    @field_validator("path")
    @classmethod
    def _local_path_of_file_uri(cls, path: str | None) -> str | None:
        return path.removeprefix("file://") if path and path.startswith("file://") else path

    def problems(self) -> list[str]:
        found = [f"--ckpt.{name} needs --ckpt.path (--ckpt_path)" for name, on in
                 (("save_steps", self.save_steps > 0), ("load_enable", self.load_enable)) if on and not self.path]
        if self.disable_ds and self.save_steps > 0 and not self.save_hf:
            found.append("--ckpt.disable_ds (--disable_ds_ckpt) leaves the checkpoints nothing to hold: add "
                         "--ckpt.save_hf (--save_hf_ckpt)")
        if self.disable_ds and self.load_enable:
            found.append("--ckpt.load_enable (--load_checkpoint) cannot resume from checkpoints without training "
                         "state (--ckpt.disable_ds)")
        scheme = self.path.split("://", 1)[0] if self.path and "://" in self.path else None
        if scheme is not None and scheme not in CHECKPOINT_SCHEMES:
            found.append(f"--ckpt.path (--ckpt_path) {self.path}: checkpoints go to a local folder (shared by "
                         f"every node of a multi-node run) or to {', '.join(s + '://' for s in CHECKPOINT_SCHEMES)}; "
                         f"{scheme}:// is not supported")
        return found


class WandbConfig(StrictModel):
    """Weights & Biases (`infra/loggers.py`): on when a key is given."""

    key: SecretStr | None = Field(None, description="W&B API key (OpenRLHF's --use_wandb takes it); turns W&B on. "
                                  "Kept out of every record; 'true' logs in as W&B would without one",
                                  json_schema_extra=flat("use_wandb", **NOT_SEMANTIC))
    org: str | None = Field(None, description="W&B entity", json_schema_extra=flat("wandb_org", **NOT_SEMANTIC))
    group: str | None = Field(None, json_schema_extra=flat("wandb_group", **NOT_SEMANTIC))
    project: str | None = Field(None, description="W&B project (default rlhf_<stage>)",
                                json_schema_extra=flat("wandb_project", **NOT_SEMANTIC))
    run_name: str | None = Field(None, description="Run name in W&B and TensorBoard (default: the MLflow run's)",
                                 json_schema_extra=flat("wandb_run_name", **NOT_SEMANTIC))
    mode: Literal["online", "offline"] | None = Field(None, description="W&B mode (default: WANDB_MODE, else online; "
                                                      "a run that cannot reach W&B goes on offline)",
                                                      json_schema_extra=NOT_SEMANTIC)

    def with_defaults(self, stage: str) -> WandbConfig:
        return self.model_copy(update={"project": self.project or f"rlhf_{stage}"})


class LoggerConfig(StrictModel):
    logging_steps: int = Field(1, gt=0, json_schema_extra=flat("logging_steps", **NOT_SEMANTIC))
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard_dir: str | None = Field(None, description="TensorBoard event files under DIR/<run name>",
                                        json_schema_extra=flat("use_tensorboard", **NOT_SEMANTIC))


class TrainLoopConfig(StrictModel):
    """Batches, epochs and the seed of a training loop."""

    batch_size: int = Field(32, gt=0, description="Global batch: micro x accumulation x ranks",
                            json_schema_extra=flat("train_batch_size"))
    micro_batch_size: int | None = Field(None, gt=0, description="Samples per forward/backward on one rank "
                                         "(default: as many as train.max_tokens_per_gpu tokens hold)",
                                         json_schema_extra=flat("micro_train_batch_size"))
    max_tokens_per_gpu: int = Field(16192, gt=0, description="Token slots per training micro-batch on one rank when "
                                    "micro-batches go by tokens (packed: their tokens; padded: rows x the longest; "
                                    "OpenRLHF's default)", json_schema_extra=flat("train_max_tokens_per_gpu"))
    max_epochs: int = Field(1, ge=1, json_schema_extra=flat("max_epochs"))
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps",
                                  json_schema_extra=flat("max_steps"))
    seed: int = Field(42, json_schema_extra=flat("seed"))
    full_determinism_enable: bool = Field(False, description="Deterministic kernels only (transformers' "
                                          "enable_full_determinism): reproducible across runs, slower on a GPU",
                                          json_schema_extra=flat("full_determinism"))


# Accepted and read by nothing, by design (OpenRLHF's scripts give them): the reason is on the field
# (`flat(..., noop=...)`), and docs/openrlhf-flags.md lists them.
NOOP_LOCAL_RANK = "DeepSpeed's launcher passes it; every rank here learns its rank from Ray or the environment"
NOOP_DATALOADER = "datasets are read, tokenized and checked once, in memory, before training: no loader workers"


class TrainingStageConfig(StageConfig):
    """A stage that trains (the trainers, PPO): its output and checkpoints under `ckpt`, its numerics
    under `ds` (a subclass's `DSConfig`)."""

    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    use_ms: bool = Field(False, description="Hub names of models and datasets resolve on ModelScope instead of the "
                         "Hugging Face Hub (modelscope's patch_hub in every process that loads them; "
                         "pip install modelscope)", json_schema_extra=flat("use_ms", **NOT_SEMANTIC))
    local_rank: int = Field(-1, description="Accepted for DeepSpeed's launcher; not read",
                            json_schema_extra=flat("local_rank", noop=NOOP_LOCAL_RANK, **NOT_SEMANTIC))

    @model_validator(mode="after")
    def _default_checkpoint_path(self):
        """Checkpoints asked for (`--ckpt.save_steps`, `--ckpt.load_enable`, a `--ckpt.best_metric_key`
        by name) without `--ckpt.path` go
        where OpenRLHF puts them: `./ckpt/checkpoints_<stage>` (`ppo_ray` for RL) in the working
        directory the command runs in (made absolute here, so every rank and job reads the same)."""
        ckpt = self.ckpt
        best = getattr(ckpt, "best_metric_key", "") not in ("", "none")  # the RL stage's, asked for by name
        if ckpt.path is None and (ckpt.save_steps > 0 or ckpt.load_enable or best):
            stage = getattr(self, "stage", "")
            ckpt.path = os.path.abspath(os.path.join("ckpt", f"checkpoints_{'ppo_ray' if stage == 'ppo' else stage}"))
        return self

    # The names every stage config answers to (storage's destination checks, manifests, pipelines).
    @property
    def save_path(self) -> str | None:
        return self.ckpt.output_dir

    @property
    def ckpt_path(self) -> str | None:
        return self.ckpt.path

    @property
    def param_dtype(self) -> Precision:
        return self.ds.param_dtype


# `--bf16` is `--ds.param_dtype bf16`; `--bf16 false` says nothing.
BF16 = {"bf16": (("ds.param_dtype",), lambda on: Precision.BF16.value if on else None,
                 "Older spelling of --ds.param_dtype bf16")}



def no_nesterov(path: str) -> tuple[tuple[str, ...], Callable, str]:
    """`--muon.no_nesterov` (OpenRLHF's) is `--muon.nesterov false`; `--muon.no_nesterov false` says nothing."""
    return (path,), lambda on: False if on else None, f"--{path} false"


# ---------------------------------------------------------------------------------------------
# The supervised trainers: `rlhf train sft|rm|dpo|kto`, in OpenRLHF's sections.

class TokenizingOptions(StrictModel):
    """How a stage's data is read and tokenized (shared by the trainers' and RL's `data`)."""

    disable_fast_tokenizer: bool = Field(False, description="transformers' Python tokenizer where the model has one")
    dataloader_num_workers: int = Field(0, ge=0, description="Accepted for OpenRLHF's scripts; not read",
                                        json_schema_extra={"noop": NOOP_DATALOADER, **NOT_SEMANTIC})


class DataConfig(TokenizingOptions):
    """Where the examples come from and how they become token ids (each field also has its bare
    name as a flat flag: `--max_len` is `--data.max_len`)."""

    dataset: str | None = Field(None, description="Comma-separated datasets: jsonl/json/parquet files, json@DIR, or "
                                "hub names (required; a pipeline fills it from the upstream stage)",
                                json_schema_extra=NOT_SEMANTIC)
    dataset_probs: str | None = Field(None, description="Comma-separated mixing probabilities, one per dataset")
    dataset_split: str = "train"
    input_key: str = "prompt"
    output_key: str = "response"
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    label_key: str = "label"
    margin_key: str | None = Field(None, description="Reward-model margin column (optional)")
    input_template: str | None = Field(None, description="Python format string with one {} for the prompt")

    @field_validator("input_template")
    @classmethod
    def _braceless_template_is_none(cls, template: str | None) -> str | None:
        return template_or_none(template)
    apply_chat_template: bool = False
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template that replaces the tokenizer's")
    max_samples: int = Field(100_000_000, gt=0)
    max_eval_samples: int = Field(100_000_000, gt=0)
    max_len: int = Field(512, gt=1)
    truncate: bool = Field(False, description="Truncate rows longer than max_len instead of failing")

    @model_validator(mode="after")
    def _check_probs(self) -> DataConfig:
        check_probs(self.dataset_probs, self.dataset, "dataset_probs")
        check_input_template(self.input_template, "input_template")
        return self

    @property
    def probs(self) -> list[float] | None:
        return mixing_probs(self.dataset_probs)


class HeldOutConfig(StrictModel):
    """A trainer's held-out data and how often it is evaluated."""

    dataset: str | None = Field(None, description="Held-out data; default: the 'test' split of --dataset when it "
                                "has one", json_schema_extra=flat("eval_dataset", **NOT_SEMANTIC))
    split: str = Field("test", json_schema_extra=flat("eval_split"))
    steps: int = Field(-1, description="Evaluate every N steps (-1: at the end only)",
                       json_schema_extra=flat("eval_steps", **NOT_SEMANTIC))


class LoraConfig(StrictModel):
    """LoRA adapters, merged into the base weights on save (rank 0: off)."""

    rank: int = Field(0, ge=0, json_schema_extra=flat("lora_rank"))
    alpha: int = Field(16, gt=0, json_schema_extra=flat("lora_alpha"))
    dropout: float = Field(0.0, ge=0, lt=1, json_schema_extra=flat("lora_dropout"))
    target_modules: list[str] = Field(["all-linear"], description="Module names (several after the flag, as "
                                      "OpenRLHF takes them, or comma-separated) or 'all-linear'",
                                      json_schema_extra=flat("target_modules"))

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, value):
        """`q_proj,v_proj` (one string, as YAML and older configs give it) or a list of names."""
        items = [value] if isinstance(value, str) else list(value)
        names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
        if not names:
            raise ValueError("name at least one module, or 'all-linear'")
        return names


class RingAttention(StrictModel):
    """Ring attention (`models/ring.py`): OpenRLHF's `--ring_attn_size` / `--ds.ring_attn_size`."""

    ring_attn_size: int = Field(1, ge=1, description="Ring attention (sequence parallelism): this many ranks "
                                "split each row's tokens, gathering keys and values in every layer, and see the "
                                "same batches (the data-parallel ranks are the ranks / this)",
                                json_schema_extra=flat("ring_attn_size"))
    ring_attn_head_stride: int = Field(1, ge=1, description="Ring attention: key/value heads gathered at a time "
                                       "(fewer gathers, more memory; more than the model has: all at once)",
                                       json_schema_extra=flat("ring_head_stride"))


class TensorParallel(StrictModel):
    """DeepSpeed's AutoTP (`--ds.tensor_parallel_size`, OpenRLHF's `--ds_tensor_parallel_size`) for the
    trained models; with ring attention (`RingAttention`) and LoRA (`lora`) beside it in a DS section."""

    tensor_parallel_size: int = Field(1, ge=1, description="DeepSpeed AutoTP: each linear layer's weights split "
                                      "over this many ranks, which see the same batches (the data-parallel ranks "
                                      "are the ranks / this); with ZeRO 0-2", json_schema_extra=flat(
                                          "ds_tensor_parallel_size"))

    def layout_problem(self, ranks: int, where: str, tensor_parallel: bool = True) -> str | None:
        """Why `ranks` ranks (`where`: what they are) cannot hold this layout's blocks of ranks that see
        the same batches, a ring's times a tensor-parallel group's (`tensor_parallel`: where AutoTP
        splits the model), or None."""
        tp = self.tensor_parallel_size if tensor_parallel else 1
        if ranks % (tp * self.ring_attn_size) == 0:
            return None
        sizes = [f"--ds.tensor_parallel_size (--ds_tensor_parallel_size) {tp}"] * (tp > 1) + \
            [f"--ds.ring_attn_size (--ring_attn_size) {self.ring_attn_size}"] * (self.ring_attn_size > 1)
        return f"{' x '.join(sizes)} must divide the {where}"

    def tensor_parallel_problems(self) -> list[str]:
        """What DeepSpeed's AutoTP cannot combine with (`--ds.tensor_parallel_size` > 1)."""
        found = []
        if self.tensor_parallel_size == 1:
            return found
        flag = "--ds.tensor_parallel_size (--ds_tensor_parallel_size)"
        if self.zero_stage == 3:
            found.append(f"{flag}: DeepSpeed's AutoTP does not shard its layers under ZeRO-3; use --zero_stage 0, 1 or 2")
        if self.lora.rank > 0:
            found.append(f"{flag}: AutoTP replaces the linear layers LoRA adapts; train without --lora_rank")
        if self.use_universal_ckpt:
            found.append(f"{flag}: universal checkpoints of tensor-parallel slices are not converted here; leave out "
                         "--ds.use_universal_ckpt")
        return found


class TrainerDSConfig(DSConfig, RingAttention, TensorParallel):
    packing_samples: bool = Field(False, description="Pack several examples into one row (no padding)",
                                  json_schema_extra=flat("packing_samples"))
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @property
    def duplicates(self) -> int:
        """How many ranks see each batch: a tensor-parallel group's times a ring's."""
        return self.tensor_parallel_size * self.ring_attn_size

    def problems(self) -> list[str]:
        return super().problems() + self.tensor_parallel_problems()


class RMDSConfig(TrainerDSConfig, ValueHead):
    pass


class TrainerLoopConfig(TrainLoopConfig):
    num_nodes: int = Field(1, ge=1, json_schema_extra=flat("num_nodes"))
    num_gpus_per_node: int = Field(1, ge=1, description="Ranks per node (on CPU: worker processes)",
                                   json_schema_extra=flat("num_gpus_per_node"))


class ModelConfig(StrictModel):
    model_name_or_path: str | None = Field(None, description="Model to start from (HF directory, s3:// URI or hub "
                                           "name; required, a pipeline fills it in)",
                                           json_schema_extra=flat("pretrain", **NOT_SEMANTIC))
    gradient_checkpointing_enable: bool = Field(False, json_schema_extra=flat("gradient_checkpointing"))
    gradient_checkpointing_reentrant: bool = Field(False, description="torch's reentrant checkpointing variant",
                                                   json_schema_extra=flat("gradient_checkpointing_use_reentrant"))
    aux_loss_coef: float = Field(0.0, ge=0, description="Weight of a Mixture-of-Experts model's router "
                                 "load-balancing loss (Switch Transformer's), added to the training loss; 0: off",
                                 json_schema_extra=flat("aux_loss_coef"))

    @model_validator(mode="after")
    def _aux_loss_needs_gradients(self) -> ModelConfig:
        check_aux_loss(self)
        return self


class RefModelConfig(StrictModel):
    model_name_or_path: str | None = Field(None, description="Reference model (default: the trained model's start)",
                                           json_schema_extra=flat("ref_pretrain", **NOT_SEMANTIC))
    offload: bool = Field(False, description="Keep the reference's weights in CPU memory between uses (a GPU, "
                          "ZeRO-3's parameter offload; on a CPU they are there already, said in one log line)",
                          json_schema_extra=flat("ref_offload", gpu="ZeRO-3 parameter offload on CUDA; on a CPU "
                                                 "the weights are in CPU memory already"))


def _deferred(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


# OpenRLHF flags of this stage's own features still to build (refused by name, not as unknown).
NOT_BUILT_FLAGS = {
}


# The supervised stages ring attention trains here (tests/integration/test_parallel_training.py), as
# OpenRLHF's (its kto, kd and prm never had it); the RL stage's model roles have it too (rl_config.py).
RING_ATTENTION_STAGES = ("sft", "rm", "dpo")


class TrainConfig(TrainingStageConfig, Schedule, Optimiser):
    """What every supervised trainer shares. Flags: each field's dotted path (`--adam.lr`), and
    OpenRLHF's flat names (`--learning_rate`)."""

    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "learning_rate": ("adam.lr",),
        **{name: (f"data.{name}",) for name in DataConfig.model_fields},
        # where these fields were before they had sections (YAML files and pipeline parameters)
        "data.packing_samples": ("ds.packing_samples",),
        "data.eval_dataset": ("eval.dataset",),
        "data.eval_split": ("eval.split",),
        "train_split": ("data.dataset_split",),  # OpenRLHF's name for the training split
    }
    DEFERRED: ClassVar[dict[str, str]] = dict(NOT_BUILT_FLAGS)

    model: ModelConfig = Field(default_factory=ModelConfig)
    ds: TrainerDSConfig = Field(default_factory=TrainerDSConfig)
    train: TrainerLoopConfig = Field(default_factory=TrainerLoopConfig)
    adam: AdamConfig = Field(default_factory=AdamConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: HeldOutConfig = Field(default_factory=HeldOutConfig)

    @model_validator(mode="after")
    def _check_batches(self) -> TrainConfig:
        tp, ring = self.ds.tensor_parallel_size, self.ds.ring_attn_size
        if ring > 1 and self.stage not in RING_ATTENTION_STAGES:
            raise ValueError(f"--ds.ring_attn_size (--ring_attn_size) {ring}: not built for `rlhf train {self.stage}` "
                             f"(ring attention trains {', '.join(RING_ATTENTION_STAGES)})")
        if ring > 1 and self.model.aux_loss_coef > 0:
            raise ValueError("--ds.ring_attn_size (--ring_attn_size) with --aux_loss_coef: each rank of a ring "
                             "sees part of every row, so its router statistics are not the batch's; not built")
        if tp * ring > self.world_size and "num_gpus_per_node" not in self.train.model_fields_set:
            # OpenRLHF's launcher starts a rank per GPU of the node; here the ranks are asked for:
            # a tensor-parallel (or ring) size alone asks for one group of that many per node
            object.__setattr__(self.train, "num_gpus_per_node", tp * ring)
        layout = self.ds.layout_problem(self.world_size, f"ranks (--train.num_nodes x --train.num_gpus_per_node = "
                                                         f"{self.world_size})")
        if layout:
            raise ValueError(layout)
        micro = self.train.micro_batch_size
        if micro is None and self.train.batch_size % self.data_parallel_size:
            raise ValueError(f"--train.batch_size (--train_batch_size) ({self.train.batch_size}) must be a multiple "
                             f"of the data-parallel ranks ({self.data_parallel_size})")
        if micro is not None and self.train.batch_size % (micro * self.data_parallel_size):
            raise ValueError(
                f"--train.batch_size (--train_batch_size) ({self.train.batch_size}) must be a multiple of "
                f"--train.micro_batch_size (--micro_train_batch_size) x data-parallel ranks "
                f"({micro} x {self.data_parallel_size})"
            )
        problems = self.ckpt.problems() + self.ds.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def required(self) -> dict[str, str | None]:
        """The inputs and output a run needs, by field path: their values (None or "" when not given)."""
        return {"model.model_name_or_path": self.pretrain, "ckpt.output_dir": self.save_path,
                "data.dataset": self.data.dataset}

    def check_complete(self) -> None:
        """Raise ConfigError naming every input/output a run still needs (`required`)."""
        missing = [spellings_of(type(self)).flag_name((path,)) for path, value in self.required().items() if not value]
        if missing:
            raise ConfigError(f"{self.stage}: " + "; ".join(f"{name}: required" for name in missing))

    @property
    def pretrain(self) -> str | None:
        return self.model.model_name_or_path

    @property
    def world_size(self) -> int:
        return self.train.num_nodes * self.train.num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: the ranks of a tensor-parallel group, or of a ring, see the same ones."""
        return self.world_size // self.ds.duplicates

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on one rank; by tokens, any number (DeepSpeed is told 1:
        `trainers/loop.optimizer_step` sets the boundary)."""
        return self.train.batch_size // ((self.train.micro_batch_size or self.per_rank_batch) * self.data_parallel_size)

    @property
    def per_rank_batch(self) -> int:
        """Samples of an optimizer step on one data-parallel rank."""
        return self.train.batch_size // self.data_parallel_size


class SFTModelConfig(ModelConfig):
    pretrain_mode_enable: bool = Field(False, description="Continued pretraining: loss on every token",
                                       json_schema_extra=flat("pretrain_mode"))


class SFTAdam(AdamConfig):
    lr: float = Field(1e-5, gt=0, description="Peak learning rate (after warmup)")


class SFTDataConfig(DataConfig):
    multiturn: bool = Field(False, description="Each row's input column is a whole conversation (with the output "
                            "column's message appended where present); the loss is on every assistant turn as the "
                            "chat template writes it (needs --apply_chat_template)",
                            json_schema_extra=flat("multiturn"))


class SFTConfig(TrainConfig):
    stage: Literal["sft"] = "sft"
    model: SFTModelConfig = Field(default_factory=SFTModelConfig)
    adam: SFTAdam = Field(default_factory=SFTAdam)
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)

    @model_validator(mode="after")
    def _check_multiturn(self) -> SFTConfig:
        if self.data.multiturn and not self.data.apply_chat_template:
            raise ValueError("--data.multiturn (--multiturn) needs --apply_chat_template: the chat template marks "
                             "where each assistant turn starts and ends")
        if self.data.multiturn and self.model.pretrain_mode_enable:
            raise ValueError("--data.multiturn (--multiturn) and --pretrain_mode exclude each other (a loss on the "
                             "assistant turns, or on every token)")
        return self


class TeacherModelConfig(StrictModel):
    model_name_or_path: str | None = Field(None, description="The teacher of knowledge distillation: a causal LM "
                                           "over the student's vocabulary (required)",
                                           json_schema_extra=flat("teacher_model", **NOT_SEMANTIC))
    offload: bool = Field(False, description="Keep the teacher's weights in CPU memory between uses (a GPU, "
                          "ZeRO-3's parameter offload; on a CPU they are there already, said in one log line)",
                          json_schema_extra=flat("teacher_offload", gpu="ZeRO-3 parameter offload on CUDA; on a "
                                                 "CPU the weights are in CPU memory already"))


class KDModelConfig(SFTModelConfig):
    kd_coef: float = Field(0.4, ge=0, le=1, description="The loss is (1 - kd_coef) x the NLL of the data's "
                           "responses + kd_coef x the cross-entropy to the teacher's next-token distribution",
                           json_schema_extra=flat("kd_coef"))


class KDAdam(AdamConfig):
    lr: float = Field(5e-6, gt=0, description="Peak learning rate (after warmup)")


class KDConfig(SFTConfig):
    """Knowledge distillation (OpenRLHF's `train_kd`): SFT of the student on the data's responses,
    mixed with the cross-entropy to a frozen teacher's distribution at every response token."""

    stage: Literal["kd"] = "kd"
    model: KDModelConfig = Field(default_factory=KDModelConfig)
    adam: KDAdam = Field(default_factory=KDAdam)
    teacher: TeacherModelConfig = Field(default_factory=TeacherModelConfig)

    @property
    def teacher_pretrain(self) -> str | None:
        return self.teacher.model_name_or_path

    def required(self) -> dict[str, str | None]:
        return {**super().required(), "teacher.model_name_or_path": self.teacher_pretrain}


def reward_token_list(value, at_least: int = 1) -> list[str] | None:
    """`--reward_tokens`: several after the flag (OpenRLHF's `--reward_tokens + -`) or a list, each once."""
    if value is None or value == []:
        return None
    tokens = [value] if isinstance(value, str) else list(value)
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"reward_tokens {tokens}: each token once")
    if len(tokens) < at_least:
        raise ValueError(f"reward_tokens {tokens}: a process reward model is read over at least {at_least} (e.g. + -), "
                         "the first meaning a right step")
    return tokens


class PRMDataConfig(DataConfig):
    """Process-reward rows (OpenRLHF's `train_prm`): a text whose steps each end with the placeholder
    token, and a label per placeholder."""

    input_key: str = "input"
    label_key: str = Field("label", description="A list per row, one label per placeholder: reward tokens "
                           "('+'/'-') or probabilities of the first reward token (soft labels)")
    placeholder_token: str | None = Field(None, description="The token that ends each step; the model's output "
                                          "there is the step's score (required; one token, e.g. ки)",
                                          json_schema_extra=flat("placeholder_token"))
    reward_tokens: list[str] | None = Field(None, description="The tokens a step's score is read over, the first "
                                            "meaning a right step (e.g. + -); none: the whole vocabulary "
                                            "(hard labels only)", json_schema_extra=flat("reward_tokens"))

    @field_validator("reward_tokens", mode="before")
    @classmethod
    def _tokens(cls, value):
        return reward_token_list(value)

    @model_validator(mode="after")
    def _raw_text(self) -> PRMDataConfig:
        """Its rows are read as they are (OpenRLHF's `train_prm` has no template flags): a template asked
        for would be silently unread."""
        given = [f"--{name}" for name in ("apply_chat_template", "input_template", "tokenizer_chat_template")
                 if getattr(self, name)]
        if given:
            raise ValueError(f"{', '.join(given)}: `rlhf train prm` reads each row's text as it is, placeholders "
                             "included (no template, no BOS); write the rows as the model should read them")
        return self


class PRMAdam(AdamConfig):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (after warmup)")


class PRMConfig(TrainConfig):
    """A process reward model (OpenRLHF's `train_prm`): a causal LM whose output at each step's
    placeholder token, over the reward tokens, is trained toward the step's label."""

    stage: Literal["prm"] = "prm"
    data: PRMDataConfig = Field(default_factory=PRMDataConfig)
    adam: PRMAdam = Field(default_factory=PRMAdam)

    def required(self) -> dict[str, str | None]:
        return {**super().required(), "data.placeholder_token": self.data.placeholder_token}


class RMModelConfig(ModelConfig):
    loss_type: RewardLossType = Field(RewardLossType.SIGMOID, json_schema_extra=flat("loss"))
    margin_loss_enable: bool = Field(False, description="Subtract each pair's margin inside the loss (the column "
                                     "--data.margin_key names; 'margin' when none is given)",
                                     json_schema_extra=flat("margin_loss"))
    compute_fp32_loss_enable: bool = Field(False, description="Accepted for OpenRLHF's scripts: the scores and the "
                                           "loss are always fp32 here", json_schema_extra=flat(
                                               "compute_fp32_loss", noop="scores and loss are computed in fp32 always"))


class RMAdam(AdamConfig):
    lr: float = Field(9e-6, gt=0, description="Peak learning rate (after warmup)")


class RMConfig(TrainConfig):
    stage: Literal["rm"] = "rm"
    model: RMModelConfig = Field(default_factory=RMModelConfig)
    ds: RMDSConfig = Field(default_factory=RMDSConfig)
    adam: RMAdam = Field(default_factory=RMAdam)

    @model_validator(mode="after")
    def _margin_column(self) -> RMConfig:
        """`--margin_loss` without a column named: OpenRLHF's, `margin`."""
        if self.model.margin_loss_enable and not self.data.margin_key:
            self.data.margin_key = "margin"
        return self


class PreferenceAdam(AdamConfig):
    lr: float = Field(5e-7, gt=0, description="Peak learning rate (after warmup)")


class PreferenceConfig(TrainConfig):
    """DPO and KTO: a policy trained against a frozen reference."""

    ref: RefModelConfig = Field(default_factory=RefModelConfig)
    adam: PreferenceAdam = Field(default_factory=PreferenceAdam)

    @property
    def ref_pretrain(self) -> str | None:
        return self.ref.model_name_or_path

    @model_validator(mode="after")
    def _default_reference(self) -> PreferenceConfig:
        if self.ref.model_name_or_path is None:
            object.__setattr__(self.ref, "model_name_or_path", self.model.model_name_or_path)
        return self


class DPOModelConfig(ModelConfig):
    beta: float = Field(0.1, gt=0, json_schema_extra=flat("beta"))
    loss_type: DPOLossType = Field(DPOLossType.SIGMOID, json_schema_extra=flat("loss_type"))
    ipo_enable: bool = Field(False, description="Same as --loss_type ipo", json_schema_extra=flat("ipo"))
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="cDPO epsilon",
                                   json_schema_extra=flat("label_smoothing"))
    nll_loss_coef: float = Field(0.0, ge=0, json_schema_extra=flat("nll_loss_coef"))

    @model_validator(mode="after")
    def _resolve(self) -> DPOModelConfig:
        if self.ipo_enable and self.loss_type != DPOLossType.IPO:
            object.__setattr__(self, "loss_type", DPOLossType.IPO)
        if self.label_smoothing and self.loss_type != DPOLossType.SIGMOID:
            raise ValueError("label_smoothing (cDPO) applies to the sigmoid loss only")
        return self


class DPOConfig(PreferenceConfig):
    stage: Literal["dpo"] = "dpo"
    model: DPOModelConfig = Field(default_factory=DPOModelConfig)


class KTOModelConfig(ModelConfig):
    beta: float = Field(0.1, gt=0, json_schema_extra=flat("beta"))
    desirable_loss_weight: float = Field(1.0, gt=0, json_schema_extra=flat("desirable_loss_weight"))
    undesirable_loss_weight: float = Field(1.0, gt=0, json_schema_extra=flat("undesirable_loss_weight"))


class KTOConfig(PreferenceConfig):
    stage: Literal["kto"] = "kto"
    model: KTOModelConfig = Field(default_factory=KTOModelConfig)


STAGE_CONFIGS: dict[str, type[TrainConfig]] = {
    "sft": SFTConfig,
    "rm": RMConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "kd": KDConfig,
    "prm": PRMConfig,
}


def add_config_flags(parser, config_cls: type[BaseModel]) -> None:
    """Register `--config` and every field's flags on an argparse parser (`flags.Spellings`)."""
    spellings_of(config_cls).add_flags(parser)


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


def with_updates(cfg: StageConfig, **updates) -> StageConfig:
    """A copy of `cfg` with fields replaced, named by any spelling (`pretrain`, `ckpt.output_dir`),
    validated again (derived defaults follow)."""
    spellings = spellings_of(type(cfg))
    values = spellings.to_paths(cfg.model_dump(), cfg.stage)
    return type(cfg).model_validate(spellings.nest({**values, **spellings.to_paths(updates, cfg.stage)}))


# ---------------------------------------------------------------------------------------------
# In-process stages that generate with a rollout engine: `rlhf eval` and `rlhf pairs`. Their
# configs are flat (no `data` section): they read prompts, never train on tokenized examples.

class RolloutBackend(str, Enum):
    """Generation engine: auto (vLLM on a GPU with vLLM installed, else transformers: on CPUs it is the
    faster one at the sizes measured), transformers anywhere, or vLLM (its CUDA or CPU build)."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"


class RewardSourceName(str, Enum):
    VERIFIER = "verifier"
    REWARD_MODEL = "reward_model"


class RolloutStageConfig(StageConfig):
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

    @model_validator(mode="after")
    def _resolve_generation_budget(self) -> RolloutStageConfig:
        if self.task is not None:
            from rlhf_core.data.synthetic import get_task

            try:
                budget = get_task(self.task).new_tokens
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


PROMPT_WINDOW = Field(None, ge=0, description="Generate for prompts [iter x rollout_batch_size, (iter + 1) x "
                      "rollout_batch_size) only")


class PairsConfig(RolloutStageConfig):
    """`rlhf pairs`: sample the policy, score, keep (best, worst) per prompt: online/iterative DPO data."""

    stage: Literal["pairs"] = "pairs"
    reward: RewardSourceName = RewardSourceName.VERIFIER
    reward_pretrain: str | None = Field(None, description="Reward model (with --reward reward_model)",
                                        json_schema_extra=NOT_SEMANTIC)
    normalize_reward: bool = Field(False, description="Normalise scores with the RM's stored reward_mean/std")
    n_samples_per_prompt: int = Field(4, ge=2)
    temperature: float = Field(1.0, gt=0)
    num_engines: int = Field(1, ge=1, description="Rollout engines on Ray (a local one when no cluster is given), "
                             "each sampling a contiguous share of the prompts; 1: one engine in this process")
    allow_no_pairs: bool = Field(False, description="Where every prompt's samples score alike, publish an empty "
                                 "train.jsonl (pairs/num_pairs 0) and exit 0 instead of failing with exit 2: an "
                                 "iterative-DPO round then ends the run, saying why")
    iter: int | None = PROMPT_WINDOW
    rollout_batch_size: int = Field(512, gt=0, description="Prompts per --iter window")

    @model_validator(mode="after")
    def _check_reward(self) -> PairsConfig:
        if self.reward == RewardSourceName.VERIFIER and self.task is None:
            raise ValueError("--reward verifier needs --task")
        if self.reward == RewardSourceName.REWARD_MODEL and not self.reward_pretrain:
            raise ValueError("--reward reward_model needs --reward_pretrain")
        if self.normalize_reward and self.reward != RewardSourceName.REWARD_MODEL:
            raise ValueError("normalize_reward applies to --reward reward_model only")
        return self


# ---------------------------------------------------------------------------------------------
# `rlhf batch_inference`: OpenRLHF 0.9's `openrlhf.cli.batch_inference`, flat flags, its defaults.

class EvalTask(str, Enum):
    GENERATE = "generate"  # the transformers engine
    GENERATE_VLLM = "generate_vllm"  # vLLM (its CUDA or CPU build)
    RM = "rm"  # score rows with a reward model (or `--task`'s verifier), then post-process


class PostProcessor(str, Enum):
    RS = "rs"  # rejection sampling: the best response per prompt (SFT data)
    CSFT = "csft"  # conditional SFT: the score written into the prompt (`--reward_template`)
    ITER_DPO = "iter_dpo"  # the best and the worst response per prompt (DPO pairs)


NOOP_ENGINE = "the engine's own settings (precision by the device; one process) decide this here"


class BatchInferenceConfig(StageConfig):
    """`rlhf batch_inference`: generate `--best_of_n` responses per prompt, or score rows and turn
    them into rejection-sampling, conditional-SFT or DPO data (`stages/batch_inference.py`)."""

    stage: Literal["batch_inference"] = "batch_inference"
    eval_task: EvalTask | None = Field(None, description="generate (transformers), generate_vllm (vLLM) or rm "
                                       "(score rows, then --post_processor)")
    pretrain: str | None = Field(None, description="The policy (generate) or the reward model (rm): a local HF "
                                 "directory or s3:// URI", json_schema_extra=NOT_SEMANTIC)
    dataset: str | None = Field(None, description="Prompts (generate) or rows with a prompt and a response (rm)",
                                json_schema_extra=NOT_SEMANTIC)
    dataset_probs: str | None = None
    input_key: str = "input"
    output_key: str = "output"
    label_key: str = Field("answer", description="Reference answers (kept with generated rows; --task's verifier "
                           "reads them)")
    task: str | None = Field(None, description="rm: score with this built-in task's verifier against --label_key "
                             "instead of a reward model (--pretrain then names only the tokenizer whose chat "
                             "template --apply_chat_template writes the prompts with)")
    apply_chat_template: bool = False
    input_template: str | None = Field(None, description="Python format string with one {} for the prompt (empty: "
                                       "none)")
    max_samples: int = Field(100_000_000, gt=0)
    output_path: str | None = Field(None, description="The JSON-lines file written (local or s3://)",
                                    json_schema_extra=NOT_SEMANTIC)
    save_path: str | None = Field(None, description="Instead of --output_path: a stage folder with train.jsonl and "
                                  "stage.json (what a pipeline stage writes; `json@DIR` reads it)",
                                  json_schema_extra=NOT_SEMANTIC)
    prompt_max_len: int = Field(1024, gt=0, description="Longer prompts keep their last tokens")
    max_new_tokens: int = Field(1024, gt=0)
    max_len: int = Field(2048, gt=1, description="rm: longer prompt + response texts keep their first tokens")
    greedy_sampling: bool = False
    top_p: float = Field(1.0, gt=0, le=1)
    temperature: float = Field(1.0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0, description="Only 1.0 (no penalty): neither engine here applies one")
    best_of_n: int = Field(1, ge=1, description="Responses per prompt")
    num_engines: int = Field(1, ge=1, description="generate: rollout engines on Ray (a local one when no cluster is "
                             "given), each generating a contiguous share of the prompts; 1: one engine in this process")
    post_processor: PostProcessor | None = None
    iter: int | None = PROMPT_WINDOW
    rollout_batch_size: int = Field(2048, gt=0)
    normalize_reward: bool = Field(False, description="csft: z-score the rewards over all rows before writing them")
    reward_template: str | None = Field(None, description="csft: where {input} and {reward} go (default "
                                        "'{input} <rm_score>: {reward} ')")
    enable_csft: bool = Field(False, description="Generate conditioned on --csft_prompt, appended to each prompt")
    csft_prompt: str = "<rm_score>: 5.00"
    value_head_prefix: str | None = Field(None, description="rm: the reward head's weight prefix (default: the model "
                                          "config's value_head_prefix, else score)")
    micro_batch_size: int = Field(16, gt=0, description="rm: rows scored at once")
    placeholder_token: str | None = Field(None, description="rm with a process reward model (`rlhf train prm`): "
                                          "the token it reads after each step (e.g. ки); each line of a response is "
                                          "a step, the prompt is --input_key's text")
    reward_tokens: list[str] | None = Field(None, description="rm with a process reward model: its reward tokens, "
                                            "the first meaning a right step (e.g. + -)")
    min_reward: float | None = Field(None, description="rs: a prompt whose best row scores below this keeps none "
                                     "(counted as below_min_reward); e.g. 1 with --task: only right answers are kept")
    step_aggregate: str = Field("min", pattern="^(" + "|".join(STEP_AGGREGATES) + ")$", description="rm with a process reward "
                                "model: a response's score from its steps' P(right): the weakest (min), their "
                                "product, the last, the mean")
    seed: int = 1234
    disable_fast_tokenizer: bool = False
    zero_stage: int = Field(0, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    bf16: bool = Field(False, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    param_dtype: str | None = Field(None, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    attn_implementation: str | None = Field(None, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    flash_attn: bool = Field(False, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    tp_size: int | None = Field(None, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    max_num_seqs: int | None = Field(None, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    enable_prefix_caching: bool = Field(False, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    full_determinism: bool = Field(False, json_schema_extra={"noop": NOOP_ENGINE, **NOT_SEMANTIC})
    local_rank: int = Field(-1, json_schema_extra={"noop": "one process, no DeepSpeed launcher", **NOT_SEMANTIC})
    use_ms: bool = Field(False, description="Load models named by a hub id from ModelScope")

    @field_validator("input_template")
    @classmethod
    def _braceless_template_is_none(cls, template: str | None) -> str | None:
        return template_or_none(template)

    @field_validator("reward_tokens", mode="before")
    @classmethod
    def _tokens(cls, value):
        return reward_token_list(value, at_least=2)

    @model_validator(mode="after")
    def _check(self) -> BatchInferenceConfig:
        check_probs(self.dataset_probs, self.dataset, "dataset_probs")
        check_input_template(self.input_template, "input_template")
        if self.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty: only 1.0 (none) here; neither generation engine applies a penalty")
        if self.reward_template is not None and not ("{input}" in self.reward_template
                                                     and "{reward}" in self.reward_template):
            raise ValueError(f"reward_template {self.reward_template!r} must contain {{input}} and {{reward}}")
        if (self.placeholder_token is None) != (not self.reward_tokens):
            raise ValueError("placeholder_token and reward_tokens: a process reward model needs both")
        if self.placeholder_token is not None and self.task is not None:
            raise ValueError("placeholder_token (a process reward model scores) and task (a verifier scores): one")
        if self.task is not None:
            from rlhf_core.data.synthetic import get_task

            try:
                get_task(self.task)
            except ValueError as e:
                raise ValueError(f"task: {e}") from None
        return self

    def check_complete(self) -> None:
        """ConfigError naming everything a run still needs."""
        needs = ["eval_task", "dataset"]
        if not (self.eval_task == EvalTask.RM and self.task is not None):
            needs.append("pretrain")
        missing = [f"--{name}: required" for name in needs if getattr(self, name) is None]
        if self.eval_task == EvalTask.RM and self.task is not None and self.apply_chat_template and not self.pretrain:
            missing.append("--apply_chat_template with --task: give --pretrain, a model whose tokenizer's chat "
                           "template writes the prompts (a verifier reads no model)")
        if (self.output_path is None) == (self.save_path is None):
            missing.append("--output_path (a file) or --save_path (a stage folder): give one")
        if self.min_reward is not None and self.post_processor != PostProcessor.RS:
            missing.append("--min_reward: a floor for the rows --post_processor rs keeps")
        if self.post_processor is not None and self.eval_task not in (None, EvalTask.RM):
            missing.append(f"--post_processor {self.post_processor.value}: post-processes scored rows (--eval_task rm)")
        if missing:
            raise ConfigError("batch_inference: " + "; ".join(missing))


ROLLOUT_STAGE_CONFIGS: dict[str, type[RolloutStageConfig]] = {"eval": EvalConfig, "pairs": PairsConfig}


@functools.cache
def spellings_of(config_cls: type[StageConfig]) -> Spellings:
    """A stage config's spellings (`flags.Spellings`): its paths, the flat names on its fields and
    its `ALIASES`; `--bf16` where it has a `ds` section."""
    transforms = dict(BF16) if "ds" in config_cls.model_fields else {}
    transforms.update({f"{path[:-len('nesterov')]}no_nesterov": no_nesterov(path)
                       for path in leaves(config_cls) if path.endswith("muon.nesterov")})
    return Spellings(config_cls, config_cls.ALIASES, transforms=transforms, deferred=config_cls.DEFERRED)
