"""Where an RL stage's roles and rollout engines run on Ray.

`rl_layout` (pure) turns the config into pools: `--{actor,critic,ref,reward}.num_nodes x
num_gpus_per_node` ranks per role, `--vllm.num_engines` engines of `--vllm.tensor_parallel_size`
GPUs each (one transformers engine when there are none), and the colocation flags
(`--train.colocate_all`: every model and the engines on the actor's devices, the models only
with `--train.async_enable`;
`--train.colocate_actor_ref`, `--train.colocate_critic_reward`). Devices come from the cluster,
not the driver; on CPU the whole job shares the cluster's cores. `--{actor,critic,ref,reward}.resources`
(custom Ray resources, JSON) pin a role's pool to the nodes that have them.
"""

from __future__ import annotations

from rlhf_core.distributed.resources import Layout, colocation_groups, plan_layout


def role_world_sizes(cfg, reward_role_models: list[str]) -> dict[str, int]:
    """Ranks per role this config needs (rollout: the engines), in the order pools are made; the
    reward role's where it has models (trained against, or a gold one checking held-out responses)."""
    sizes = {"actor": cfg.actor.world_size}
    if cfg.uses_ref:
        sizes["ref"] = cfg.ref.world_size
    if cfg.uses_critic:
        sizes["critic"] = cfg.critic.world_size
    if reward_role_models:
        sizes["reward"] = cfg.reward.world_size
    sizes["rollout"] = max(1, cfg.vllm.num_engines)
    return sizes


def rl_layout(cfg, reward_role_models: list[str], devices) -> Layout:
    """Pools and shares; a vLLM engine of `--vllm.tensor_parallel_size` tp is one rank of tp bundles
    (GPUs), so `--vllm.num_engines` E takes E x tp of them, colocated or in a pool of its own."""
    sizes = role_world_sizes(cfg, reward_role_models)
    # Asynchronous training samples while the models train: --train.colocate_all then colocates the
    # DeepSpeed models only, and the engines keep devices of their own (OpenRLHF's rule).
    colocated = [role for role in sizes if role != "rollout"] if cfg.train.async_enable else sizes
    groups = colocation_groups(colocated, colocate_all_models=cfg.train.colocate_all,
                               colocate_actor_ref=cfg.train.colocate_actor_ref,
                               colocate_critic_reward=cfg.train.colocate_critic_reward)
    spans = {"rollout": cfg.vllm.tensor_parallel_size} if cfg.vllm.num_engines else {}
    pinned = {role: getattr(cfg, role).resources for role in sizes if role != "rollout"}
    return plan_layout(sizes, groups, devices=devices, bundles_per_rank=spans, resources=pinned)
