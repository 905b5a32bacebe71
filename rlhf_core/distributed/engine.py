"""DeepSpeed ZeRO engine setup, the same on GPU (NCCL) and CPU (gloo).

Each rank is one process (a Ray actor, or the current process for a single local rank) with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set before `deepspeed.init_distributed`.
The precision (`precision_of`: `--param_dtype` resolved on this rank's hardware,
rlhf_core/infra/precision.py) is, on CPU, bf16 autocast around the forward with fp32 master
weights (DeepSpeed's bf16 optimizer is a GPU path); on GPU, DeepSpeed's bf16 or fp16 (with its
dynamic loss scaling).

The LR schedule (docs/algorithms.md): linear warmup, then cosine down to `min_lr_ratio` x LR.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch

from rlhf_core.config import AdamConfig, DSConfig, MuonConfig, Schedule, TrainConfig
from rlhf_core.infra.network import rendezvous_port
from rlhf_core.infra.not_applied import not_applied
from rlhf_core.infra.precision import Precision, resolve_here
from rlhf_core.infra.settings import ConfigError


@dataclass(frozen=True)
class EngineSettings:
    """What `initialize` reads for one trainable model: its optimiser, schedule, batches and ZeRO
    (a supervised trainer's config, or one role of the RL stage's)."""

    adam: AdamConfig
    schedule: Schedule
    ds: DSConfig
    batch_size: int
    micro_batch_size: int
    world_size: int
    muon: MuonConfig | None = None  # None: AdamW; else Muon for the matrices, AdamW (`adam`) for the rest
    aux_loss_coef: float = 0.0  # > 0: an MoE model's load-balancing loss, weighted so (models/moe.py)
    tensor_parallel: int = 1  # AutoTP: ranks per group that split each linear layer and see the same batches
    ring: int = 1  # ring attention: ranks per ring that split each row's tokens and see the same batches

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_parallel * self.ring)

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // (self.micro_batch_size * self.data_parallel_size)

    @classmethod
    def of(cls, cfg: TrainConfig) -> EngineSettings:
        # micro-batches by tokens: any number a step (`trainers/loop.optimizer_step` sets the boundary);
        # DeepSpeed is told one
        return cls(cfg.adam, cfg, cfg.ds, cfg.train.batch_size, cfg.train.micro_batch_size or cfg.per_rank_batch,
                   cfg.world_size, cfg.muon if cfg.optim == "muon" else None, cfg.model.aux_loss_coef,
                   cfg.ds.tensor_parallel_size, cfg.ds.ring_attn_size)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1",
                     master_port: int | None = None, local_rank: int | None = None) -> None:
    """Set the rank variables and start the process group (idempotent)."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank if local_rank is None else local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port or rendezvous_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world_size == 1:  # nobody to meet: an in-memory store, so a one-rank job opens no port at all
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    with _no_shm_op_for_one_cpu_rank(world_size):
        deepspeed.init_distributed(dist_backend=backend)  # takes over the group started above


@contextlib.contextmanager
def _no_shm_op_for_one_cpu_rank(world_size: int):
    """DeepSpeed's CPU backend builds and loads a shared-memory all-reduce extension when the
    process group starts (a C++ build on the first run). It speeds up collectives between ranks on
    one host; one rank has none, so there it is not built (DeepSpeed then uses gloo)."""
    import importlib

    try:  # the submodule (`from deepspeed.comm import torch` is the torch package itself)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: leave it alone
        yield
        return
    build = getattr(ds_torch_comm, "build_shm_op", None)
    if world_size != 1 or torch.cuda.is_available() or build is None:
        yield
        return
    ds_torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_comm.build_shm_op = build


def cosine_schedule(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at `step`: linear warmup to 1, then cosine decay to `min_ratio`."""
    return lr_factor("cosine_with_min_lr", step, total_steps, warmup_steps, min_ratio)


def lr_factor(kind: str, step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at `step` for `--lr_scheduler` (transformers' schedules of those names):
    `cosine_with_min_lr` (the default) warms up linearly, then decays by a cosine to `min_ratio`;
    `cosine` and `linear` decay to 0; `constant_with_warmup` warms up, then holds; `constant` holds."""
    if kind == "constant":
        return 1.0
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant_with_warmup":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    floor = min_ratio if kind == "cosine_with_min_lr" else 0.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def effective_zero_stage(stage: int, world_size: int, adam_offload: bool, on_gpu: bool = False,
                         universal: bool = False) -> int:
    """The ZeRO stage DeepSpeed is given.

    ZeRO-1/2 partition optimizer state and gradients across ranks; a single CPU rank has nothing
    to partition and would pay only for their flattening and bucketing, so it trains with stage 0:
    the same math (weights match a real ZeRO-2 to float tolerance:
    `test_one_cpu_rank_at_stage_0_trains_like_zero_2` in tests/unit/test_trainers.py).
    Kept as asked for: several ranks, GPUs (DeepSpeed's bf16 path differs between stages there),
    CPU Adam offload (it needs a ZeRO stage), stage 3, and universal checkpoints (`universal`: they
    are converted from ZeRO's slices and loaded by ZeRO's optimizers).
    """
    if world_size == 1 and stage in (1, 2) and not adam_offload and not on_gpu and not universal:
        return 0
    return stage


def precision_of(ds: DSConfig) -> Precision:
    """The precision this rank trains in: `ds.param_dtype` resolved on this device."""
    return resolve_here(Precision(ds.param_dtype).value)


def deepspeed_config(settings: EngineSettings, train: bool = True) -> dict:
    ds = settings.ds
    precision = precision_of(ds)
    on_gpu = torch.cuda.is_available()
    stage = effective_zero_stage(ds.zero_stage, settings.world_size, ds.adam_offload, on_gpu, ds.use_universal_ckpt)
    zero: dict = {"stage": stage if train else (3 if stage == 3 else 0)}
    if train and ds.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero["stage"] == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if train and ds.overlap_comm:
        zero["overlap_comm"] = True
    if train and ds.zpg > 1:
        zero["zero_hpz_partition_size"] = ds.zpg  # ZeRO++ hierarchical partitioning (ZeRO-3)
    extra: dict = {}
    if train and settings.muon is not None:
        # On a CPU without offload, torch's AdamW for the rest (DeepSpeed's FusedAdam is a C++ build
        # of a minute on a fresh machine, for the same update)
        extra["optimizer"] = muon_optimizer_config(settings.muon, settings.adam,
                                                   torch_adam=not on_gpu and not ds.adam_offload)
    if train and ds.use_universal_ckpt:  # a resume reads the converted tag (trainers/universal.py)
        extra["checkpoint"] = {"load_universal": True}
    if train and ds.grad_accum_dtype:
        extra["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    if train and ds.deepcompile and on_gpu:
        extra["compile"] = {"deepcompile": True}
    if train and settings.tensor_parallel > 1:
        # The LM head's logits gathered whole on every rank: the losses here read full-vocabulary
        # log-probs (a vocabulary-sharded head, DeepSpeed's choice for tied embeddings, leaves each
        # rank half the vocabulary and its own loss function to use)
        extra["tensor_parallel"] = {"autotp_size": settings.tensor_parallel, "vocab_parallel_lm_head": False}
    return {**extra,
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.accumulation_steps,
        # DeepSpeed counts every rank, a tensor-parallel group's and a ring's too (they see the same batches)
        "train_batch_size": settings.batch_size * settings.tensor_parallel * settings.ring,
        "gradient_clipping": settings.schedule.max_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": on_gpu and precision == Precision.BF16},
        "fp16": {"enabled": on_gpu and precision == Precision.FP16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def muon_optimizer_config(muon: MuonConfig, adam: AdamConfig, torch_adam: bool = False) -> dict:
    """DeepSpeed's Muon (MuonWithAuxAdam): it tags every parameter of two or more dimensions whose
    name has neither `embed` nor `lm_head` for Muon (`muon.lr`, `muon.momentum`) and gives the rest
    AdamW (`adam.lr`, betas, eps); one weight decay for both. It runs 5 Newton-Schulz steps with
    Nesterov momentum whatever it is told, so other values are said not to apply."""
    if muon.ns_steps != 5:
        not_applied("muon.ns_steps", muon.ns_steps, "a Muon that takes a step count (DeepSpeed's runs 5)",
                    "5 Newton-Schulz steps run")
    if not muon.nesterov:
        not_applied("muon.nesterov", False, "a Muon with plain momentum (DeepSpeed's is Nesterov's)",
                    "Nesterov momentum runs")
    return {"type": "Muon", "params": {
        "lr": muon.lr, "muon_lr": muon.lr, "momentum": muon.momentum, "adam_lr": adam.lr,
        "betas": list(adam.betas), "eps": adam.eps, "weight_decay": adam.weight_decay,
        **({"torch_adam": True} if torch_adam else {})}}


def build_optimizer(params, adam: AdamConfig, offload: bool):
    trainable = [p for p in params if p.requires_grad]
    kwargs = dict(lr=adam.lr, betas=tuple(adam.betas), eps=adam.eps, weight_decay=adam.weight_decay)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(trainable, adamw_mode=True, **kwargs)
    # On CPU torch's default is the per-tensor loop; the fused kernel is one vectorised pass per tensor.
    return torch.optim.AdamW(trainable, fused=not torch.cuda.is_available(), **kwargs)


def mark_convertible(model) -> None:
    """Tag `model` so DeepSpeed writes into every checkpoint the state its universal-checkpoint
    converter requires (`--ds.use_universal_ckpt`, trainers/universal.py)."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    setattr(model, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def initialize(model, settings: EngineSettings, total_steps: int):
    """Wrap `model` in a DeepSpeed engine with its optimiser (AdamW, or DeepSpeed's Muon) and the
    warmup-then-decay schedule (each parameter group from its own peak LR); with `aux_loss_coef`,
    an MoE model's routers are watched for their load-balancing loss (`models/moe.RouterBalance`)."""
    import deepspeed

    schedule = settings.schedule
    warmup = math.ceil(schedule.lr_warmup_ratio * total_steps)
    if settings.aux_loss_coef > 0:
        from rlhf_core.models.moe import RouterBalance, router_modules

        if not router_modules(model):
            raise ConfigError(f"--aux_loss_coef {settings.aux_loss_coef:g}: {type(model).__name__} is not a "
                              "Mixture-of-Experts model (no router), so it has no load-balancing loss; leave it at 0")
        RouterBalance(model, settings.aux_loss_coef)
    if settings.ds.use_universal_ckpt:
        mark_convertible(model)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(schedule.lr_scheduler, s, total_steps, warmup, schedule.min_lr_ratio))

    if settings.muon is None:
        optimizer = build_optimizer(model.parameters(), settings.adam, settings.ds.adam_offload)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler(optimizer),
                                          config=deepspeed_config(settings))
    else:
        if not torch.cuda.is_available():
            # DeepSpeed's Muon update is a torch.compile'd function: on a CPU, compiling it costs tens
            # of seconds per weight shape and buys nothing at these sizes, so it runs eagerly here.
            torch.compiler.set_stance("force_eager")
        engine, *_ = deepspeed.initialize(model=model, lr_scheduler=scheduler, config=deepspeed_config(settings),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
    if settings.ds.deepcompile:
        if torch.cuda.is_available():
            engine.compile()
        else:
            not_applied("ds.deepcompile", True, "a CUDA device", "the engine runs uncompiled")
    if engine.zero_optimization_stage() == 0 and engine.world_size == 1:
        # Stage 0 all-reduces gradients after every backward, on one rank too: it flattens them,
        # "reduces" over a group of one and copies them back.
        engine.enable_backward_allreduce = False
        if not (engine.fp16_enabled() or engine.bfloat16_enabled()) and schedule.max_norm > 0:
            # Its fp32 clipping takes one norm kernel per parameter and an all-reduce over the
            # group of one; torch's does the same math (the global 2-norm, grads scaled by
            # min(1, max_norm / (norm + 1e-6))) in a few multi-tensor kernels.
            engine.clip_fp32_gradients = _fast_clip(engine, schedule.max_norm)
        if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
            # Its stage-0 zero_grad walks named_parameters() (every module) after every step to
            # set each grad to None: the same on a list taken once.
            params = list(engine.module.parameters())

            def zero_grad() -> None:
                for p in params:
                    p.grad = None

            engine.zero_grad = zero_grad
    return engine


def _fast_clip(engine, max_norm: float):
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def clip() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm, foreach=True)

    return clip


def initialize_frozen(model, settings: EngineSettings, offload: bool = False, flag: str = "ref.offload"):
    """A frozen model (reference, reward model): sharded with ZeRO-3 when training uses it, else
    plain. `offload` (`--ref.offload`, `--reward.offload`): its weights in CPU memory between uses
    (ZeRO-3's parameter offload, so with a GPU a ZeRO-3 engine is built for it whatever the stage);
    on a CPU they are there already, said in one line."""
    model.requires_grad_(False).eval()
    offload_here = offload and torch.cuda.is_available()
    if offload and not offload_here:
        not_applied(flag, True, "a CUDA device", "the model is in CPU memory already")
    if settings.ds.zero_stage != 3 and not offload_here:
        return model.to(device())
    import deepspeed

    ds_cfg = deepspeed_config(settings, train=False)
    if offload_here:
        ds_cfg["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_cfg)
    engine.eval()
    return engine


def autocast(precision: Precision):
    """Half-precision autocast on CPU (where DeepSpeed's half-precision modes do not apply); no-op
    otherwise. CPU fp16 only comes here when forced (RLHF_ALLOW_EMULATED_HALF): no loss scaling."""
    if precision.is_half and not torch.cuda.is_available():
        return torch.autocast("cpu", dtype=torch.bfloat16 if precision == Precision.BF16 else torch.float16)
    return contextlib.nullcontext()


def barrier() -> None:
    """Wait for every rank of this process group (nothing to wait for without one)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_reduce(value: torch.Tensor, op=None) -> torch.Tensor:
    """`value` reduced over the ranks (SUM by default), on the device it came from; itself with one
    rank. NCCL reduces CUDA tensors only: a CPU tensor (the trainers' statistics) goes through the
    rank's GPU there."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    on_gpu = torch.distributed.get_backend() == "nccl"
    out = value.to(torch.device("cuda", torch.cuda.current_device()), copy=True) if on_gpu else value.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM if op is None else op)
    return out.to(value.device)


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    return all_reduce(value)


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return all_reduce_sum(value) / world
