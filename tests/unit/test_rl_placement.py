"""Where an RL stage's roles run (pure): pools from the config's ranks and colocation flags, and
how batches and prompts are split over ranks and engines."""

import pytest

from rlhf_core.distributed.resources import ClusterDevices
from rlhf_core.distributed.sharding import shards, share
from rlhf_core.rl.engines import prompt_shards
from rlhf_core.rl.ray_roles import rl_layout, role_world_sizes
from rlhf_core.rl_config import build_ppo_config

CPU2 = ClusterDevices(use_gpu=False, gpus=0, cpus=2)
GPU8 = ClusterDevices(use_gpu=True, gpus=8, cpus=64)


def config(*flags: str):
    values = {"actor.model_name_or_path": "m", "data.prompt_dataset": "p", "ckpt.output_dir": "o",
              "reward.task": "sort"}
    it = iter(flags)
    for key in it:
        values[key] = next(it)
    return build_ppo_config(None, values)


def test_the_roles_follow_the_estimator_and_the_reward_source():
    grpo = config("algo.advantage.estimator", "group_norm", "rollout.n_samples_per_prompt", "4",
                  "algo.kl.init_coef", "0")
    assert role_world_sizes(grpo, []) == {"actor": 1, "rollout": 1}  # no KL: no reference
    ppo = config("algo.advantage.estimator", "gae", "algo.kl.init_coef", "0.01", "vllm.num_engines", "2")
    assert role_world_sizes(ppo, ["rm"]) == {"actor": 1, "ref": 1, "critic": 1, "reward": 1, "rollout": 2}


def test_separate_roles_split_two_cpus_and_colocate_all_shares_one_bundle():
    cfg = config("algo.advantage.estimator", "gae", "algo.kl.init_coef", "0.01")
    layout = rl_layout(cfg, [], CPU2)
    assert set(layout.pools) == {"actor", "ref", "critic", "rollout"}
    assert {p.num_cpus for p in layout.roles.values()} == {0.5}
    cfg = config("algo.advantage.estimator", "gae", "algo.kl.init_coef", "0.01", "train.colocate_all", True)
    layout = rl_layout(cfg, [], CPU2)
    assert list(layout.pools) == ["actor+ref+critic+rollout"]
    assert {p.share for p in layout.roles.values()} == {0.25}
    assert {p.num_cpus for p in layout.roles.values()} == {0.5}


def test_with_async_training_colocate_all_leaves_the_engines_a_pool_of_their_own():
    """As OpenRLHF: the engines sample while the models train, so only the DeepSpeed models share."""
    cfg = config("algo.advantage.estimator", "gae", "algo.kl.init_coef", "0.01", "train.colocate_all", True,
                 "train.async_enable", True, "vllm.num_engines", "2")  # 2 engines against 1 actor rank: allowed
    layout = rl_layout(cfg, [], GPU8)
    assert set(layout.pools) == {"actor+ref+critic", "rollout"}
    assert layout.roles["rollout"].world_size == 2 and layout.roles["rollout"].share == 1


def test_role_resources_pin_each_pool_to_the_nodes_that_have_them():
    """`--actor.resources '{"node_a": 1}'` (JSON, as `ray start --resources`) goes into every bundle of
    the actor's pool; colocated roles' bundles take the largest amount of each; unpinned roles and
    the engines get none; CPU/GPU shares are as without it."""
    grpo = ("algo.advantage.estimator", "group_norm", "rollout.n_samples_per_prompt", "4", "algo.kl.init_coef", "0.01")
    layout = rl_layout(config(*grpo, "actor.resources", '{"node_a": 1}', "ref.resources", '{"node_b": 0.5}'), [], CPU2)
    assert layout.pools["actor"].bundle() == {"CPU": layout.pools["actor"].cpus, "node_a": 1.0}
    assert layout.pools["ref"].bundle() == {"CPU": layout.pools["ref"].cpus, "node_b": 0.5}
    assert layout.pools["rollout"].bundle() == {"CPU": layout.pools["rollout"].cpus}
    assert layout.roles == rl_layout(config(*grpo), [], CPU2).roles  # the same shares, pinned or not
    together = rl_layout(config(*grpo, "train.colocate_actor_ref", True, "actor.resources", '{"node_a": 1, "x": 0.25}',
                                "ref.resources", '{"x": 0.5}'), [], CPU2)
    assert dict(together.pools["actor+ref"].resources) == {"node_a": 1.0, "x": 0.5}
    for bad in ('{"CPU": 1}', "not json"):
        with pytest.raises(ValueError, match="actor.resources"):
            config("actor.resources", bad)
    # a role this run does not start cannot be pinned: refused rather than accepted and never read
    for role in ("critic", "reward"):
        with pytest.raises(ValueError, match=rf"--{role}.resources: this run starts no {role} role"):
            config(*grpo, f"{role}.resources", '{"node_b": 1}')
    with pytest.raises(ValueError, match=r"--ref.resources: this run starts no ref role"):
        config("algo.advantage.estimator", "group_norm", "rollout.n_samples_per_prompt", "4", "algo.kl.init_coef", "0",
               "ref.resources", '{"node_b": 1}')


def test_gpu_placement_counts_gpus_and_refuses_what_does_not_fit():
    cfg = config("algo.advantage.estimator", "gae", "algo.kl.init_coef", "0.01", "actor.num_gpus_per_node", "4",
                 "ref.num_gpus_per_node", "4", "train.colocate_actor_ref", True, "vllm.num_engines", "2")
    layout = rl_layout(cfg, ["rm"], GPU8)
    assert layout.roles["actor"].num_gpus == layout.roles["ref"].num_gpus == 0.5
    assert layout.pools["actor+ref"].bundles == 4
    assert layout.roles["rollout"].num_gpus == 1 and layout.pools["rollout"].bundles == 2
    with pytest.raises(ValueError, match=r"the roles need 11 GPUs \(actor: 8, ref: 1, critic: 1, rollout: 1\)"):
        rl_layout(config("algo.advantage.estimator", "gae", "actor.num_gpus_per_node", "8"), [], GPU8)


def test_shards_are_equal_and_contiguous_padded_with_the_last_item_or_cut_short():
    assert shards([1, 2, 3, 4, 5], 2, pad=True) == [[1, 2, 3], [4, 5, 5]]
    assert shards([1, 2, 3, 4], 2, pad=True) == [[1, 2], [3, 4]]
    assert shards([1], 3, pad=True) == [[1], [1], [1]]
    assert shards([1, 2, 3, 4, 5], 2, pad=False) == [[1, 2], [3, 4]]  # the remainder goes to nobody
    assert [share(list(range(7)), r, 3) for r in range(3)] == shards(list(range(7)), 3, pad=False)


def test_prompts_split_over_engines_in_contiguous_parts():
    assert prompt_shards(5, 2) == [range(0, 3), range(3, 5)]
    assert prompt_shards(2, 4) == [range(0, 1), range(1, 2)]


def test_each_rank_resolves_remote_models_on_its_own_node(monkeypatch):
    """A role is handed models as named (s3:// too) and downloads them where it runs
    (`models_on_this_node`, run on the rank): never a folder of the driver's machine."""
    from rlhf_core.trainers import ppo

    monkeypatch.setattr(ppo, "local_model_path", lambda uri: "/node-cache/" + uri.removeprefix("s3://"))
    cfg = config("actor.model_name_or_path", "s3://b/sft")
    args, kwargs = ppo.models_on_this_node((cfg, 0, "s3://b/rm", ["s3://b/rm1", "/local/rm2"], "transformers", 7),
                                           {"path": "s3://b/x", "url": "http://rm:8000"})
    assert args[0].actor.model_name_or_path == "/node-cache/b/sft" and cfg.actor.model_name_or_path == "s3://b/sft"
    assert args[1:] == (0, "/node-cache/b/rm", ["/node-cache/b/rm1", "/local/rm2"], "transformers", 7)
    assert kwargs == {"path": "/node-cache/b/x", "url": "http://rm:8000"}
    specs = ppo.role_specs(config("algo.advantage.estimator", "gae", "critic.model_name_or_path", "s3://b/c",
                                  "actor.model_name_or_path", "s3://b/sft"), 0, ["s3://b/rm"], 4)
    assert specs["critic"][2] == "s3://b/c" and specs["reward"][2] == ["s3://b/rm"]  # not resolved on the driver
