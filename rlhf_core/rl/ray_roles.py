"""An RL stage's roles as Ray worker groups: where each runs, and one rank of each.

`rl_layout` (pure) turns the config into pools: `--{actor,critic,ref,reward}.num_nodes x
num_gpus_per_node` ranks per role, `--vllm.num_engines` rollout engines of
`--vllm.tensor_parallel_size` GPUs each (one transformers engine when there are none), and OpenRLHF's colocation flags (`--train.colocate_all` puts every model and
the engines on the actor's devices, `--train.colocate_actor_ref`, `--train.colocate_critic_reward`).
Devices come from the cluster, not the driver; on CPU the whole job shares the cluster's cores.

`RoleWorker` is one rank of a model role: the Ray actor is created first, and the role's model
and DeepSpeed engine are built in `setup()`, once every rank of the role exists (their process
group needs them all). Every rank seeds itself with `--train.seed`, as the in-process run does.
An actor rank is also the sending side of the weight sync (`rl/weight_sync.WeightSender`).
"""

from __future__ import annotations

import os

from rlhf_core.distributed.resources import Layout, colocation_groups, plan_layout
from rlhf_core.rollout.weight_sync import WeightSender

ROLE_KINDS = ("actor", "critic", "ref", "reward")


def role_world_sizes(cfg, reward_paths: list[str]) -> dict[str, int]:
    """Ranks per role this config needs (rollout: the engines), in the order pools are made."""
    sizes = {"actor": cfg.actor.world_size}
    if cfg.uses_ref:
        sizes["ref"] = cfg.ref.world_size
    if cfg.uses_critic:
        sizes["critic"] = cfg.critic.world_size
    if reward_paths:
        sizes["reward"] = cfg.reward.world_size
    sizes["rollout"] = max(1, cfg.vllm.num_engines)
    return sizes


def rl_layout(cfg, reward_paths: list[str], devices) -> Layout:
    """Pools and shares; a vLLM engine of `--vllm.tensor_parallel_size` tp is one rank of tp bundles
    (GPUs), so `--vllm.num_engines` E takes E x tp of them, colocated or in a pool of its own."""
    sizes = role_world_sizes(cfg, reward_paths)
    groups = colocation_groups(sizes, colocate_all_models=cfg.train.colocate_all,
                               colocate_actor_ref=cfg.train.colocate_actor_ref,
                               colocate_critic_reward=cfg.train.colocate_critic_reward)
    spans = {"rollout": cfg.vllm.tensor_parallel_size} if cfg.vllm.num_engines else {}
    return plan_layout(sizes, groups, devices=devices, bundles_per_rank=spans)


class RoleWorker(WeightSender):
    """One rank of an RL model role (`kind`: actor, critic, ref or reward) as a Ray actor."""

    def __init__(self, kind: str, cfg, *args):
        if kind not in ROLE_KINDS:
            raise ValueError(f"unknown RL role {kind!r} (one of {ROLE_KINDS})")
        self.kind, self.cfg, self.args = kind, cfg, args
        self.role = None

    def setup(self) -> dict:
        import torch.distributed as dist

        from rlhf_core.distributed.engine import init_distributed
        from rlhf_core.rl.roles import CriticRole, PolicyRole, ReferenceRole, RewardModelRole
        from rlhf_core.trainers.common import seed_everything

        env = os.environ  # RANK, WORLD_SIZE, MASTER_* set by the RoleGroup
        init_distributed(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                         local_rank=int(env["LOCAL_RANK"]))
        seed_everything(self.cfg.train.seed)
        cls = {"actor": PolicyRole, "critic": CriticRole, "ref": ReferenceRole, "reward": RewardModelRole}[self.kind]
        self.role = cls(self.cfg, *self.args, rank=dist.get_rank(), world_size=dist.get_world_size())
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "precision": self.role.precision.value}

    # the role's methods, as Ray calls them (explicit: a Ray actor exposes only its class's methods)
    def logprobs(self, samples):
        return self.role.logprobs(samples)

    def values(self, samples):
        return self.role.values(samples)

    def scores(self, samples):
        return self.role.scores(samples)

    def train_step(self, samples, epochs, **kwargs):
        return self.role.train_step(samples, epochs, **kwargs)

    def weights(self):
        return self.role.weights()

    def export(self):
        return self.role.export()

    def save_checkpoint(self, directory: str) -> None:
        self.role.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self.role.load_checkpoint(directory)

    # the weight sync's sources (WeightSender): every rank calls them
    def _sync_state(self):
        return self.role.weights()

    def _sync_state_local(self):
        """The full weights on this rank's own device (each rank feeds the engine on its GPU)."""
        import torch

        from rlhf_core.models.loading import _is_partitioned

        module = self.role.engine.module
        if not _is_partitioned(module):
            return {k: v.detach() for k, v in module.state_dict().items()}
        import deepspeed

        names_of: dict[int, list[str]] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(name)
        state = {}
        for _, param in module.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                full = param.detach().clone()
            for name in names_of.get(id(param), []):
                state[name] = full
        for name, tensor in module.state_dict().items():  # buffers
            state.setdefault(name, tensor.detach().to(torch.device("cuda", torch.cuda.current_device())))
        return state
