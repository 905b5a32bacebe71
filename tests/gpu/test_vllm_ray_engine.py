"""The RL stage's GPU path: vLLM engines as Ray actors, weight sync through the object store,
sleep/wake while colocated, and a short GRPO run with `--vllm.num_engines`.

Skipped without CUDA (conftest) or without the `gpu` extra (`pip install 'rlhf-lifecycle[gpu]'`).
"""

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def test_engines_take_new_weights_and_sleep(cluster, prepared):
    from rlhf_core.distributed.resources import create_pools, detect_devices, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rl.engines import EngineWorker, RayEngines

    class Actor:
        """Hands out the base model's weights with the LM head zeroed but one token's row."""

        def weights(self, checkpoint_format=False):
            state = load_causal_lm(prepared["base"]).state_dict()
            head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
            head.zero_()
            head[7] = 1.0  # every logit 0 except token 7's: greedy decoding must now pick 7
            return state

    layout = plan_layout({"actor": 1, "rollout": 1}, [["actor", "rollout"]], devices=detect_devices())
    pool = create_pools(layout)["actor+rollout"]
    share = layout.roles["rollout"].share
    engine_group = RoleGroup(EngineWorker, 1, pool, name="rollout", share=share, timeout_s=600,
                             args=("vllm", prepared["base"], {"gpu_memory_utilization": 0.2, "enforce_eager": True,
                                                              "enable_sleep": True}))
    actor = RoleGroup(Actor, 1, pool, name="actor", share=share, timeout_s=600)
    try:
        assert engine_group.call_all("setup") == ["cuda"]
        engines = RayEngines(engine_group, enable_sleep=True)
        before = engines.generate_ids([[1, 2, 3]], 1, 0.0, 4, 0)[0][0]
        engines.sleep()
        engines.sync(actor)  # wakes them up first
        assert not engines.asleep
        after = engines.generate_ids([[1, 2, 3]], 1, 0.0, 4, 0)[0][0]
        assert set(after.token_ids) == {7} and after.token_ids != before.token_ids
    finally:
        engine_group.shutdown()
        actor.shutdown()
        pool.remove()


def test_grpo_with_vllm_engines(cluster, rl_setting, tmp_path):
    from tests.gpu.conftest import assert_trained_with_synced_engines, grpo_on_sort

    manifest = grpo_on_sort(cluster, rl_setting, tmp_path / "out", "--vllm_num_engines", "1",
                            "--vllm_gpu_memory_utilization", "0.2", "--enforce_eager", "--colocate_all_models",
                            "--vllm_enable_sleep")
    assert_trained_with_synced_engines(manifest, rl_setting)
