import json
import math

import pytest

from rlhf_core.config import SFTConfig, build_config
from rlhf_core.distributed.engine import EngineSettings, cosine_schedule, deepspeed_config


def test_cosine_schedule_warms_up_then_decays_to_min_ratio():
    total, warmup, floor = 100, 10, 0.1
    assert cosine_schedule(0, total, warmup, floor) == pytest.approx(0.1)
    assert cosine_schedule(9, total, warmup, floor) == pytest.approx(1.0)
    assert cosine_schedule(10, total, warmup, floor) == pytest.approx(1.0)
    mid = 10 + 45
    assert cosine_schedule(mid, total, warmup, floor) == pytest.approx(floor + (1 - floor) * 0.5)
    assert cosine_schedule(total, total, warmup, floor) == pytest.approx(floor)
    values = [cosine_schedule(s, total, warmup, floor) for s in range(warmup, total)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert cosine_schedule(30, total, 0, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.3)))


def test_deepspeed_config_follows_the_stage_config():
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"},
                       {"train_batch_size": 64, "micro_train_batch_size": 8, "num_gpus_per_node": 2,
                        "zero_stage": 3, "adam_offload": True, "max_norm": 0.5})
    ds = deepspeed_config(EngineSettings.of(cfg))
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_clipping"] == 0.5
    assert deepspeed_config(EngineSettings.of(cfg), train=False)["zero_optimization"] == {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}


def test_openrlhfs_deepspeed_flags_reach_deepspeed_s_config_and_its_engine(capsys):
    """--overlap_comm, --zpg, --grad_accum_dtype go into the DeepSpeed config as OpenRLHF puts them,
    and a CPU engine built from it reads them back; --deepcompile needs CUDA: here one line says it
    was not applied."""
    import torch

    from rlhf_core.distributed.engine import init_distributed, initialize
    from rlhf_core.infra.not_applied import PREFIX

    flags = {"overlap_comm": True, "zpg": 2, "grad_accum_dtype": "fp32", "zero_stage": 3, "num_gpus_per_node": 2,
             "train_batch_size": 4, "micro_train_batch_size": 2}
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"}, flags)
    ds = deepspeed_config(EngineSettings.of(cfg))
    assert ds["zero_optimization"]["overlap_comm"] is True and ds["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "overlap_comm" not in deepspeed_config(EngineSettings.of(cfg), train=False)["zero_optimization"]

    init_distributed(0, 1, "127.0.0.1", None)
    one_rank = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"},
                            {"overlap_comm": True, "grad_accum_dtype": "fp32", "deepcompile": True, "adam_offload": True,
                             "train_batch_size": 1, "micro_train_batch_size": 1, "param_dtype": "fp32"})
    engine = initialize(torch.nn.Linear(4, 4), EngineSettings.of(one_rank), total_steps=2)
    assert engine.zero_overlap_comm() is True and engine.get_data_types()[1] == torch.float32
    if not torch.cuda.is_available():
        assert f"{PREFIX} --ds.deepcompile True needs a CUDA device" in capsys.readouterr().err


def test_one_rank_trains_zero_1_and_2_as_stage_0():
    from rlhf_core.distributed.engine import effective_zero_stage

    assert effective_zero_stage(2, 1, False) == 0 and effective_zero_stage(1, 1, False) == 0
    assert effective_zero_stage(2, 2, False) == 2  # two ranks: partitioning is the point
    assert effective_zero_stage(2, 1, True) == 2  # CPU Adam offload needs a ZeRO stage
    assert effective_zero_stage(3, 1, False) == 3
    assert effective_zero_stage(2, 1, False, on_gpu=True) == 2  # DeepSpeed's GPU bf16 path is stage-specific
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"}, {"zero_stage": 2})
    assert deepspeed_config(EngineSettings.of(cfg))["zero_optimization"]["stage"] == 0


def test_one_cpu_rank_clips_gradients_as_deepspeed_does_in_fewer_kernels():
    """One CPU rank at stage 0 in fp32 clips with torch's multi-tensor clip (`_fast_clip`):
    DeepSpeed's global norm and scaling, to float rounding."""
    import torch
    from deepspeed.runtime.utils import clip_grad_norm_

    from rlhf_core.distributed.engine import _fast_clip, init_distributed, initialize

    init_distributed(0, 1, "127.0.0.1", None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"},
                       {"train_batch_size": 1, "micro_train_batch_size": 1, "max_norm": 0.05, "param_dtype": "fp32"})
    engine = initialize(model, EngineSettings.of(cfg), total_steps=10)
    assert engine.clip_fp32_gradients.__qualname__ == "_fast_clip.<locals>.clip"  # the replacement is in place
    for max_norm in (0.05, 1e6):  # clipped, and left as they are
        engine.module.zero_grad()
        engine.module(torch.randn(32, 8)).pow(2).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        for g in expected:
            g.requires_grad_(False)
        reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
        for p, g in zip(reference, expected, strict=True):
            p.grad = g
        norm = clip_grad_norm_(reference, max_norm)
        engine.clip_fp32_gradients = _fast_clip(engine, max_norm)
        ours = engine.clip_fp32_gradients()
        assert torch.allclose(ours, norm.reshape(()), rtol=1e-5)
        for p, r in zip(model.parameters(), reference, strict=True):
            assert torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-8)
        if max_norm < 1:
            assert norm > max_norm  # the clipping case really clipped
    engine.zero_grad()  # the one-rank replacement: every parameter's grad gone, as DeepSpeed's does
    assert engine.zero_grad.__qualname__ == "initialize.<locals>.zero_grad"
    assert all(p.grad is None for p in model.parameters())


def test_one_cpu_rank_does_not_build_deepspeed_s_shared_memory_all_reduce():
    """A C++ build of minutes on a fresh machine's first run, for collectives one rank never makes."""
    import importlib

    from deepspeed import comm

    from rlhf_core.distributed.engine import _no_shm_op_for_one_cpu_rank, init_distributed

    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    original = ds_torch_comm.build_shm_op
    with _no_shm_op_for_one_cpu_rank(1):
        assert ds_torch_comm.build_shm_op() is None
    with _no_shm_op_for_one_cpu_rank(2):
        assert ds_torch_comm.build_shm_op is original  # several ranks: DeepSpeed's own
    assert ds_torch_comm.build_shm_op is original
    init_distributed(0, 1, "127.0.0.1", None)
    assert comm.comm.cdb is not None and comm.comm.cdb.shm_comm_op is None


def test_a_one_rank_process_group_listens_on_no_port_beyond_loopback():
    """torch's TCP rendezvous store listens on every interface; one rank meets nobody, so its group
    starts on an in-memory store. (A process of its own: this one may hold a group already.)"""
    import subprocess
    import sys

    code = ("import json, psutil, deepspeed.comm as dc\n"
            "from rlhf_core.distributed.engine import init_distributed\n"
            "init_distributed(0, 1, '127.0.0.1', None)\n"
            "assert dc.is_initialized() and dc.get_world_size() == 1\n"
            "print(json.dumps([c.laddr.ip for c in psutil.Process().net_connections(kind='tcp')"
            " if c.status == psutil.CONN_LISTEN]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    listening = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(listening) <= {"127.0.0.1", "::1"}, listening


def test_an_optimizer_step_is_the_same_whatever_the_micro_batches():
    """`optimizer_step` normalises by the whole step's units and sets DeepSpeed's accumulation
    boundary itself: one step over 8 examples in 1, 2 or 3 micro-batches of any sizes (the engine
    configured for 4 of 2) gives the same loss and the same update."""
    import deepspeed
    import torch

    from rlhf_core.distributed.engine import init_distributed
    from rlhf_core.infra.precision import Precision
    from rlhf_core.trainers.loop import optimizer_step

    init_distributed(0, 1, "127.0.0.1", None)
    examples = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def micro_step(engine, chunk):
        out = engine(torch.stack(chunk))
        return out.pow(2).sum(), {"loss": out.pow(2).sum().detach()}, len(chunk)

    results = []
    for split in ([8], [3, 5], [1, 1, 6], [2, 2, 2, 2]):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
            "zero_optimization": {"stage": 0}, "steps_per_print": 10**9})
        cuts = [sum(split[:i]) for i in range(len(split) + 1)]
        micro = [examples[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        sums, units, tokens = optimizer_step(engine, micro, len, micro_step, 1, Precision.FP32)
        assert units.item() == 8 and tokens == 8
        results.append((sums["loss"].item(), model.weight.detach().clone()))
        assert engine.global_steps == 1, split  # the optimizer stepped once, at the last micro-batch
    for loss, weight in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-6)
        assert torch.allclose(weight, results[0][1], rtol=1e-6, atol=1e-7)


def test_each_lr_scheduler_is_transformers_schedule_of_that_name():
    """`--lr_scheduler`: the schedules transformers gives these names (warmup 10 of 100 steps)."""
    from transformers import get_scheduler

    from rlhf_core.distributed.engine import lr_factor

    for kind in ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_min_lr"):
        extra = {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}} if kind == "cosine_with_min_lr" else {}
        import torch

        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        theirs = get_scheduler(kind, opt, num_warmup_steps=0 if kind == "constant" else 10, num_training_steps=100,
                               **extra)
        for step in range(100):
            expected = opt.param_groups[0]["lr"]
            ours = lr_factor(kind, step, 100, 10, 0.1)
            # transformers' warmup starts at 0 (step 0's lr is 0); ours at 1/warmup (no wasted step)
            if kind != "constant" and step < 10:
                assert ours == pytest.approx((step + 1) / 10)
            else:
                assert ours == pytest.approx(expected, abs=1e-6), (kind, step)
            opt.step()
            theirs.step()


def test_full_determinism_turns_on_deterministic_kernels():
    import torch

    from rlhf_core.trainers.common import seed_everything

    try:
        seed_everything(3)
        assert not torch.are_deterministic_algorithms_enabled()
        seed_everything(3, deterministic=True)  # --train.full_determinism_enable
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_muon_orthogonalises_the_hidden_matrices_and_adamw_steps_the_rest(capsys):
    """`--optim muon`: DeepSpeed's Muon holds the hidden weight matrices (their first update is an
    orthogonalised matrix: the singular values of update / muon.lr near 1 or 0, where AdamW's
    sign-like first step has a spectral norm of several), AdamW at `adam.lr` the embeddings, norms and LM head; each group follows the
    schedule from its own peak LR; the loss on a fixed batch falls; values DeepSpeed's Muon fixes
    are said not to apply."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.distributed.engine import init_distributed, initialize
    from rlhf_core.infra.not_applied import PREFIX

    init_distributed(0, 1, "127.0.0.1", None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False))
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"},
                       {"optim": "muon", "muon.lr": 0.02, "muon.momentum": 0.9, "muon.ns_steps": 3,
                        "muon.no_nesterov": True, "learning_rate": 1e-3, "train_batch_size": 4,
                        "micro_train_batch_size": 4, "param_dtype": "fp32", "lr_warmup_ratio": 0.0,
                        "lr_scheduler": "constant"})
    assert cfg.muon.nesterov is False  # OpenRLHF's --muon.no_nesterov
    engine = initialize(model, EngineSettings.of(cfg), total_steps=20)
    assert type(engine.optimizer).__name__ == "MuonWithAuxAdam"
    if not torch.cuda.is_available():  # torch's AdamW for the rest: no C++ build of DeepSpeed's FusedAdam
        assert type(engine.optimizer.aux_optimizer) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["use_muon"]: g for g in engine.optimizer.param_groups}
    muon_names = {names[id(p)] for p in groups[True]["params"]}
    adam_names = {names[id(p)] for p in groups[False]["params"]}
    assert "model.layers.0.self_attn.q_proj.weight" in muon_names and "model.layers.1.mlp.down_proj.weight" in muon_names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adam_names
    assert (groups[True]["lr"], groups[True]["momentum"], groups[False]["lr"]) == (0.02, 0.9, 1e-3)
    err = capsys.readouterr().err
    assert f"{PREFIX} --muon.ns_steps 3 needs" in err and f"{PREFIX} --muon.nesterov False needs" in err

    batch = torch.randint(0, 64, (4, 12))
    q = model.model.layers[0].self_attn.q_proj.weight
    before, losses = q.detach().clone(), []
    for _ in range(20):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if len(losses) == 1:
            singular = torch.linalg.svdvals((before - q.detach()) / 0.02)
            # (the first gradient of a tiny batch is rank-deficient: its null directions stay 0)
            assert 0.5 < singular.max() < 1.5 and (singular > 0.5).float().mean() > 0.5, singular
    assert losses[-1] < 0.85 * losses[0], losses


def test_prefill_batches_keep_each_calls_prompts_within_one_scheduler_step():
    from rlhf_core.rollout.vllm_engine import prefill_batches

    assert prefill_batches([3, 3, 3, 3], 6) == [range(0, 2), range(2, 4)]
    assert prefill_batches([3, 9, 2], 6) == [range(0, 1), range(1, 2), range(2, 3)]  # too long: alone
    assert prefill_batches([1] * 5, 100) == [range(0, 5)] and prefill_batches([], 10) == []
