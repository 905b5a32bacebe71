import math

import pytest

from rlhf_core.config import SFTConfig, build_config
from rlhf_core.distributed.engine import cosine_schedule, deepspeed_config


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
    ds = deepspeed_config(cfg)
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_clipping"] == 0.5
    assert deepspeed_config(cfg, train=False)["zero_optimization"] == {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}


def test_one_rank_trains_zero_1_and_2_as_stage_0():
    from rlhf_core.distributed.engine import effective_zero_stage

    assert effective_zero_stage(2, 1, False) == 0 and effective_zero_stage(1, 1, False) == 0
    assert effective_zero_stage(2, 2, False) == 2  # two ranks: partitioning is the point
    assert effective_zero_stage(2, 1, True) == 2  # CPU Adam offload needs a ZeRO stage
    assert effective_zero_stage(3, 1, False) == 3
    assert effective_zero_stage(2, 1, False, on_gpu=True) == 2  # DeepSpeed's GPU bf16 path is stage-specific
    cfg = build_config(SFTConfig, {"pretrain": "m", "save_path": "o", "dataset": "d"}, {"zero_stage": 2})
    assert deepspeed_config(cfg)["zero_optimization"]["stage"] == 0
