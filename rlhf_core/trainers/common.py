"""What every stage recipe does around its own math: rank setup, tracking, loading, saving.

Recipes compose these helpers instead of inheriting from a base class: each recipe module
stays readable top to bottom (setup -> train -> save), in the manner of torchtune.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from rlhf_core.config import TrainConfig
from rlhf_core.distributed.engine import device, init_distributed, precision_of
from rlhf_core.infra import storage
from rlhf_core.infra.manifests import code_version
from rlhf_core.infra.publishing import publish_output
from rlhf_core.infra.settings import state_dir
from rlhf_core.infra.tracking import Tracker
from rlhf_core.models import ring
from rlhf_core.models.lean import forward_report
from rlhf_core.models.loading import (
    apply_liger_kernel,
    apply_lora,
    export_model,
    load_tokenizer,
    model_writer,
)


@dataclass
class StageContext:
    cfg: TrainConfig
    rank: int
    world_size: int
    device: torch.device
    tracker: Tracker
    resume: dict | None = None  # where training started (`TrainLoop.resume`), into stage.json

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class StageData:
    """A stage's tokenizer and checked, tokenized examples, plus the dataset descriptors for lineage."""

    tokenizer: object
    train: list
    eval: list | None
    train_sources: list[dict]
    eval_sources: list[dict]

    @property
    def sources(self) -> list[dict]:
        return self.train_sources + self.eval_sources


def load_stage_data(cfg: TrainConfig, load) -> StageData:
    """`load(data_cfg, tokenizer, split, seed, eval_dataset=...)` for the train and eval splits (DataError on bad rows)."""
    tokenizer = load_tokenizer(local_model_path(cfg.pretrain), use_fast=not cfg.data.disable_fast_tokenizer)
    train, train_sources = load(cfg.data, tokenizer, cfg.data.dataset_split, cfg.train.seed)
    evaluation, eval_sources = load(cfg.data, tokenizer, cfg.eval.split, cfg.train.seed, eval_dataset=cfg.eval.dataset)
    return StageData(tokenizer, train, evaluation, train_sources, eval_sources)


def start_stage(cfg: TrainConfig, data: StageData) -> StageContext:
    """Join (or start, for one local rank) the process group, seed, open the MLflow run on rank 0."""
    if not torch.distributed.is_initialized() and cfg.world_size == 1:
        # One rank meets nobody: a free loopback port, never a MASTER_PORT inherited from a parent
        # process (one that trained in-process holds that port, and this run would fail to bind it).
        init_distributed(0, 1, "127.0.0.1", None)
    elif not torch.distributed.is_initialized():  # ranks started by a launcher that set the variables
        init_distributed(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                         os.environ.get("MASTER_ADDR", "127.0.0.1"),
                         int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"{world} ranks started for a config of {cfg.world_size} (--train.num_nodes x --train.num_gpus_per_node)")
    # before any model loads: their attention
    ring.setup(cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride, cfg.ds.tensor_parallel_size)
    seed_everything(cfg.train.seed + rank, cfg.train.full_determinism_enable)
    precision = precision_of(cfg.ds).value  # the one actually used, next to the param_dtype asked for
    tracker = Tracker(cfg.use_mlflow and rank == 0, cfg.mlflow_experiment, cfg.mlflow_run_name or cfg.stage,
                      cfg.mlflow_parent_run_id, tags={"rlhf.stage": cfg.stage, "rlhf.code_version": code_version(),
                                                      "rlhf.precision": precision})
    try:  # the recipe marks its run's end once it holds the context: until then, here
        if rank == 0:
            attach_dashboards(tracker, cfg)
        tracker.log_params({**cfg.model_dump(mode="json"), "precision": precision})
        tracker.log_datasets(data.train_sources, "training")
        tracker.log_datasets(data.eval_sources, "evaluation")
    except BaseException:
        tracker.finish("FAILED")
        raise
    return StageContext(cfg, rank, world, device(), tracker)


def attach_dashboards(tracker, cfg) -> None:
    """W&B and TensorBoard (`--logger.*`), fed what the stage's MLflow run gets (`infra/loggers.py`)."""
    from rlhf_core.infra.loggers import MetricSinks
    from rlhf_core.infra.redaction import redact

    tracker.attach_sinks(MetricSinks.for_stage(cfg, cfg.mlflow_run_name, redact(cfg.model_dump(mode="json"))))


def run_training(recipe) -> dict:
    """Run the shared optimisation loop for a recipe that has cfg, data, ctx and engine."""
    from rlhf_core.trainers.loop import TrainLoop

    loop = TrainLoop(recipe.cfg, recipe.engine, recipe, recipe.data.train, recipe.data.eval, recipe.ctx.tracker,
                     recipe.ctx.rank, recipe.ctx.world_size, tokenizer=recipe.data.tokenizer)
    summary = loop.run()
    recipe.ctx.resume = loop.resume
    return summary


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch; `deterministic` (`--train.full_determinism_enable`) also makes
    torch use deterministic kernels only (transformers' `enable_full_determinism`: cuDNN, cuBLAS
    workspace, `torch.use_deterministic_algorithms`), slower on a GPU."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        from transformers import enable_full_determinism

        enable_full_determinism(seed, warn_only=True)


def local_model_path(uri: str) -> str:
    """Models on s3:// are downloaded once into the state directory's cache."""
    return storage.local_copy(uri, state_dir() / "cache")


def local_tokenizer_path(uri: str) -> str:
    """A model's folder for its tokenizer only: on s3://, its top-level files without the weights."""
    return storage.local_copy(uri, state_dir() / "cache", keep=storage.tokenizer_file)


def prepare_trainable(model, cfg: TrainConfig, is_reward_model: bool = False):
    if cfg.ds.use_liger_kernel:
        apply_liger_kernel(model)
    if cfg.model.gradient_checkpointing_enable:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": cfg.model.gradient_checkpointing_reentrant})
        model.config.use_cache = False
    lora = cfg.ds.lora
    if lora.rank > 0:
        if cfg.model.gradient_checkpointing_enable:
            model.enable_input_require_grads()
        model = apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, is_reward_model)
    return model


def report_forward(ctx: StageContext, role: str, model, sequence_classifier: bool = False) -> None:
    """Say on rank 0's log, and as the MLflow tag `rlhf.forward.<role>`, which forward `model`'s
    passes run (`models/lean.forward_report`): a user bringing a new architecture sees why it is
    not on the lean path."""
    choice, line = forward_report(role, model, sequence_classifier)
    if ctx.rank == 0:
        print(line, file=sys.stderr, flush=True)
    ctx.tracker.set_tags({f"rlhf.forward.{role}": choice})


def packs_into_one_row(cfg: TrainConfig) -> bool:
    """flash-attn's variable-length kernels take one packed row and no dense mask."""
    from rlhf_core.models.loading import FLASH_PACKAGES, attention_implementation

    return attention_implementation(cfg.ds.attention) in FLASH_PACKAGES


def batch_builder(cfg: TrainConfig, tokenizer, device: torch.device):
    """`sequences -> Batch` on `device`: padded, or packed (one row with flash-attn, else rows of max_len)."""
    from rlhf_core.data.batching import make_batch

    capacity = None if packs_into_one_row(cfg) else cfg.data.max_len
    multiple = batch_width_multiple(cfg, device)

    def build(sequences):
        return make_batch([s.input_ids for s in sequences], [s.loss_mask for s in sequences], tokenizer.pad_token_id,
                          cfg.ds.packing_samples, capacity).widened(multiple, tokenizer.pad_token_id).to(device)

    return build


def batch_width_multiple(cfg: TrainConfig, device: torch.device) -> int:
    """What a stage's batch widths are rounded up to (`models/shapes.py`); 1 in one flash-attn row."""
    from rlhf_core.models.shapes import width_multiple

    return 1 if packs_into_one_row(cfg) else width_multiple(device, precision_of(cfg.ds))


def pair_batch_builder(cfg: TrainConfig, tokenizer, device: torch.device):
    """`(chosen, rejected) -> Batch` of 2n samples (chosen i is sample i, rejected i is n + i).

    Packed with dense masks (SDPA/eager), each pair's shared prompt is computed once (`pack_pairs`,
    rows of up to 2 x max_len). Padded, or in one flash-attn row (whose masks cannot express a
    shared prompt), it is `batch_builder` on chosen + rejected.
    """
    from rlhf_core.data.batching import pack_pairs

    plain = batch_builder(cfg, tokenizer, device)
    if not cfg.ds.packing_samples or packs_into_one_row(cfg):
        return lambda chosen, rejected: plain(list(chosen) + list(rejected))
    multiple = batch_width_multiple(cfg, device)

    def build(chosen, rejected):
        return pack_pairs([s.input_ids for s in chosen], [s.input_ids for s in rejected],
                          [s.loss_mask for s in chosen], [s.loss_mask for s in rejected], 2 * cfg.data.max_len,
                          tokenizer.pad_token_id).widened(multiple, tokenizer.pad_token_id).to(device)

    return build


def save_stage(ctx: StageContext, module, tokenizer, metrics: dict, inputs: dict,
               config_updates: dict | None = None) -> dict | None:
    """Publish the stage output (HF model + tokenizer + stage.json, `publish_output`) from rank 0;
    returns the manifest. Every rank must call this: ZeRO-3 parameters are gathered collectively."""
    model = export_model(module, ctx.rank)
    manifest = None
    if ctx.is_main:
        for key, value in (config_updates or {}).items():
            setattr(model.config, key, value)
        manifest = publish_output(ctx.cfg, ctx.tracker, inputs, metrics, write=model_writer(model, tokenizer),
                                  precision=precision_of(ctx.cfg.ds).value, resume=ctx.resume, trained=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return manifest


