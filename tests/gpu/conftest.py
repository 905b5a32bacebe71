"""What the GPU tests share: a local Ray for the vLLM engines (skipped where vLLM is not installed)."""

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    """Without vLLM, the tests of its engines (test_vllm_*: every user of `cluster` and
    `vllm_engine`) are skipped before their session fixtures (an SFT'd RL policy takes a minute to
    build) are set up for nothing."""
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed")
    for item in items:
        if item.nodeid.startswith("tests/gpu/test_vllm"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("vllm")
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(include_dashboard=False, log_to_driver=False)
    yield context
    ray.shutdown()


def grpo_on_sort(cluster, rl_setting, out_dir, *flags: str) -> dict:
    """A 3-step GRPO run from the RL setting's SFT policy (sort, 30% wrong demonstrations: sampled
    answers are right about two times in three, so the verifier's rewards vary and every step
    trains) through `rlhf train ppo` on the GPU cluster; returns the stage manifest.

    The actor's learning rate is high on purpose: one step moves the policy far, so engines that
    kept their old weights (a weight sync that did nothing) would sample with log-probs far from the
    trainer's, and `rollout/logprob_mismatch` would be well above the bf16 noise it is otherwise."""
    import json
    import os

    from rlhf_core.cli import main

    os.environ["RAY_ADDRESS"] = cluster.address_info["address"]
    try:
        code = main(["train", "ppo", "--pretrain", rl_setting["sft"], "--prompt_data", f"json@{rl_setting['prompts']}",
                     "--task", "sort", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
                     "--rollout_batch_size", "16", "--train_batch_size", "64", "--micro_train_batch_size", "8",
                     "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
                     "--max_steps", "3", "--use_mlflow", "false", "--save_path", str(out_dir), *flags])
    finally:
        os.environ.pop("RAY_ADDRESS", None)
    assert code == 0
    return json.loads((out_dir / "stage.json").read_text())


def assert_trained_with_synced_engines(manifest: dict, rl_setting) -> None:
    """Rewards varied, the policy moved away from SFT, and the engines sampled with its weights.

    Checked on CPU with the same run on transformers engines over Ray (fp32): synced, the last
    step's mismatch was 3.5e-7; with the engines' weight sync made a no-op, 0.97 (at a learning
    rate of 5e-4 it was 0.33: too little movement to tell, hence 1e-3)."""
    import torch
    from safetensors.torch import load_file

    metrics = manifest["metrics"]
    start = load_file(f"{rl_setting['sft']}/model.safetensors")
    trained = load_file(f"{manifest['output_uri'].removeprefix('file://')}/model.safetensors")
    # Without a KL term only rewards that vary give a gradient: a moved policy had them.
    assert max((trained[k].float() - start[k].float()).abs().max().item() for k in start) > 1e-3
    # bf16 vLLM against the trainer's recomputation: close, not equal; a stale engine: far
    assert 0 < metrics["rollout/logprob_mismatch"] < 0.5
    assert torch.isfinite(torch.tensor(metrics["train/policy_loss"]))
