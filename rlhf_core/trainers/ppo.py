"""`rlhf train ppo`: the PPO family (PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO) as one stage.

The job's driver is the single controller (`rl/controller.py`); this module builds what it calls
(prompts, tokenizer, the roles the estimator needs, the rollout engine, the reward source, the
MLflow run) and saves the actor as the stage output, a plain `transformers` causal LM like the
other trainers'. Roles: always the actor; a critic for `gae`; a reference with a KL term; reward
models when they give the reward.

Where the roles run (`runs_on_ray`): with one rank per role and no cluster to join (or, with
`RLHF_RANKS_ON_RAY=0`, a cluster of one CPU node), in this process, with a transformers engine
holding its own copy of the policy. Otherwise each role is a Ray worker group placed by the
colocation flags (`rl/ray_roles.py`) and the engines are Ray actors (`rl/engines.py`: vLLM with
`--vllm.num_engines`, else one transformers engine). Either way the
controller and the saved model are the same.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch

from rlhf_core.algos.advantages import kl_controller
from rlhf_core.config import mixing_probs
from rlhf_core.data.loading import DataError
from rlhf_core.distributed.engine import init_distributed, precision_of
from rlhf_core.distributed.local_role_group import LocalRoleGroup
from rlhf_core.infra.hubs import use_modelscope
from rlhf_core.infra.manifests import code_version
from rlhf_core.infra.tracking import Tracker
from rlhf_core.rl.controller import RLController
from rlhf_core.rl.roles import ROLE_CLASSES, total_optimizer_steps
from rlhf_core.rl.scoring import ProcessRewardSource, RewardModelSource, TextRewardSource
from rlhf_core.trainers.common import attach_dashboards, local_model_path, seed_everything

# Sequences the transformers engine samples at once (a rollout step's prompts x samples, in chunks):
# generation is memory-light next to training, and bigger batches amortise the per-token overhead.
GENERATION_BATCH = 256


def load_prompts(cfg, tokenizer, split: str, dataset: str | None = None):
    """`(prompt_ids, labels, sources, left_out, texts)` of a prompt dataset, formatted like training
    data; `texts`: each kept prompt's own text (a conversation's last user turn), for a process
    reward model."""
    from rlhf_core.data.loading import DataError
    from rlhf_core.rollout.prompts import load_prompt_set, prompt_formatter

    data = cfg.data
    prompt_set = load_prompt_set(dataset or data.prompt_dataset, split, data.input_key, data.label_key,
                                 require_answers=(cfg.eval.task or cfg.reward.task) is not None, max_samples=data.max_samples,
                                 seed=cfg.train.seed, chat=data.apply_chat_template,
                                 probs=None if dataset else mixing_probs(data.prompt_probs))
    fmt = prompt_formatter(tokenizer, data.apply_chat_template, data.input_template, data.tokenizer_chat_template)
    ids, labels, texts, left_out = [], [], [], 0
    for prompt, label in zip(prompt_set.prompts, prompt_set.answers, strict=True):
        tokens = fmt.prompt_ids(prompt)
        if len(tokens) > data.prompt_max_len:
            left_out += 1
            continue
        ids.append(tokens)
        labels.append(label)
        texts.append(prompt if isinstance(prompt, str)
                     else next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), ""))
    if not ids:
        raise DataError(f"{dataset or data.prompt_dataset}: every prompt of the {split!r} split is longer than "
                        f"--data.prompt_max_len {data.prompt_max_len} tokens")
    return ids, labels, prompt_set.sources, left_out, texts


def rollout_steps(cfg, num_prompts: int) -> int:
    steps = max(1, num_prompts // cfg.rollout.batch_size) * cfg.train.num_episodes
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def build_reward_fn(cfg):
    """The reward source when no reward model scores the samples: a reward file, an HTTP server or a verifier."""
    from rlhf_core.rewards import build_reward_source

    if cfg.reward.normalize_enable:  # OpenRLHF's reward-function scripts give it; it normalizes reward models only
        print("note: --reward.normalize_enable (--normalize_reward) applies to reward models; the scores of "
              f"{'--reward.remote_url' if cfg.reward.remote_url else '--reward.task'} are used as given",
              file=sys.stderr, flush=True)
    return build_reward_source(None, cfg.reward.remote_url, cfg.reward.task)


def runs_on_ray(cfg) -> bool:
    """Roles as Ray role groups when a role has several ranks (a ring's or a tensor-parallel group's
    too), vLLM engines are asked for, or a cluster is joined (`RAY_ADDRESS`, as in a pipeline's Ray
    job) unless its one CPU node may hold them (`cluster.ranks_stay_in_driver`,
    `RLHF_RANKS_ON_RAY=0`); otherwise every role is in this process (one CPU rank needs no Ray
    actor, as one `deepspeed` process needs no launcher)."""
    roles = [cfg.actor, cfg.critic, cfg.ref, cfg.reward]
    ranks = max(role.world_size for role in roles)
    if cfg.vllm.num_engines > 0 or ranks > 1:
        return True
    if not os.environ.get("RAY_ADDRESS"):
        return False
    from rlhf_core.distributed.cluster import ranks_stay_in_driver

    return not ranks_stay_in_driver(ranks, pinned=any(role.resources for role in roles), what="every role runs")


@dataclass
class RoleGroups:
    """The role groups the controller calls (`RoleGroup`, or `LocalRoleGroup` in this process; None:
    the estimator or reward source does not need the role)."""

    actor: object
    critic: object | None
    ref: object | None
    reward_model: object | None
    engines: object
    pools: list = field(default_factory=list)

    def shutdown(self) -> None:
        for group in (self.engines, self.reward_model, self.ref, self.critic, self.actor):
            if group is not None:
                group.shutdown()
        for pool in self.pools:
            pool.remove()
        self.pools = []


def role_specs(cfg, pad_id: int, reward_paths: list[str], optimizer_steps: int,
               check_paths: list[str] = ()) -> dict[str, tuple]:
    """Each model role this config needs and its constructor's arguments (after `cfg, pad_id`): the
    reward role holds the reward models trained against and the gold one that checks held-out
    responses. Models are named as given (s3:// too): each rank resolves them on its node
    (`models_on_this_node`)."""
    specs = {"actor": (optimizer_steps,)}
    if cfg.uses_ref:
        specs["ref"] = (cfg.ref.model_name_or_path,)
    if cfg.uses_critic:
        specs["critic"] = (cfg.critic.model_name_or_path, optimizer_steps)
    if reward_paths or check_paths:
        specs["reward"] = (reward_paths, list(check_paths))
    return {kind: (cfg, pad_id, *args) for kind, args in specs.items()}


def models_on_this_node(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A role's constructor arguments with every s3:// model replaced by its download on the node
    that runs it (`local_model_path`: the node's own cache): the config's actor model, and model
    paths given as arguments, one or a list. Run on the rank (`RoleGroup(prepare_args=...)`), so no
    rank is handed a folder that only the driver's machine has."""
    from rlhf_core.infra import storage
    from rlhf_core.rl_config import PPOConfig

    def local(value):
        if isinstance(value, str) and storage.is_remote(value) and not value.startswith(("http://", "https://")):
            return local_model_path(value)
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return [local(v) for v in value]
        if isinstance(value, PPOConfig) and value.actor.model_name_or_path:
            actor = value.actor.model_copy(update={"model_name_or_path": local(value.actor.model_name_or_path)})
            return value.model_copy(update={"actor": actor})
        return value

    return tuple(local(a) for a in args), {k: local(v) for k, v in kwargs.items()}


def local_roles(cfg, specs: dict[str, tuple], actor_path: str) -> RoleGroups:
    from rlhf_core.infra.precision import Precision
    from rlhf_core.rl.engines import LocalEngines
    from rlhf_core.rollout.hf import TransformersEngine

    if not torch.distributed.is_initialized():
        init_distributed(0, 1, "127.0.0.1", None)
    made = {}
    for kind, args in specs.items():
        role = ROLE_CLASSES[kind](*models_on_this_node(args, {})[0])
        role.setup()
        made[kind] = LocalRoleGroup(role, kind)
    half = precision_of(cfg.ds) == Precision.BF16 and not torch.cuda.is_available()  # sample as the trainer computes
    engine = TransformersEngine.from_pretrained(actor_path, dtype=torch.float32, batch_size=GENERATION_BATCH,
                                                autocast_dtype=torch.bfloat16 if half else None)
    return RoleGroups(made["actor"], made.get("critic"), made.get("ref"), made.get("reward"),
                      LocalEngines(engine, cfg.vllm.enable_sleep))


def engine_options(cfg) -> tuple[str, dict]:
    """The rollout engines' backend and constructor options (`rl/engines.EngineWorker`). vLLM must
    be installed here (the nodes' hardware is each engine's own check: the CUDA build needs a GPU)."""
    if cfg.vllm.num_engines:
        import importlib.util

        from rlhf_core.infra.settings import ConfigError

        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"--vllm.num_engines {cfg.vllm.num_engines}: vLLM is not installed (GPUs: pip install "
                              "'rlhf-lifecycle[gpu]'; CPUs: vLLM's CPU build, README), or use --vllm.num_engines 0 "
                              "for the transformers engine")
        return "vllm", {"precision": cfg.ds.param_dtype, "gpu_memory_utilization": cfg.vllm.gpu_memory_utilization,
                        "enforce_eager": cfg.vllm.enforce_eager, "seed": cfg.train.seed,
                        "enable_sleep": cfg.vllm.enable_sleep, "tensor_parallel_size": cfg.vllm.tensor_parallel_size,
                        # given: as asked; not given: vLLM's own default (on, in its V1 engine)
                        "enable_prefix_caching": cfg.vllm.enable_prefix_caching or None, "use_ms": cfg.use_ms}
    return "transformers", {"batch_size": GENERATION_BATCH, "use_ms": cfg.use_ms}  # fp32 on CPU, bf16 on GPU


def ray_roles(cfg, specs: dict[str, tuple], actor_model: str, reward_role_models: list[str]) -> RoleGroups:
    from rlhf_core.distributed.resources import create_pools, detect_devices
    from rlhf_core.distributed.role_group import RoleGroup, gather_all, start_together
    from rlhf_core.rl.engines import EngineWorker, RayEngines
    from rlhf_core.rl.ray_roles import rl_layout
    from rlhf_core.trainers.stage_worker import stage_timeout_s

    backend, options = engine_options(cfg)
    layout = rl_layout(cfg, reward_role_models, detect_devices())
    pools = create_pools(layout)
    made: dict[str, RoleGroup] = {}
    try:
        for kind, args in [*specs.items(), ("rollout", None)]:
            place = layout.roles[kind]
            worker, worker_args = (ROLE_CLASSES[kind], args) if args is not None \
                else (EngineWorker, (backend, actor_model, options))
            made[kind] = RoleGroup(worker, place.world_size, pools[place.pool], name=kind, share=place.share,
                                   args=worker_args, timeout_s=stage_timeout_s(),
                                   bundles_per_rank=place.bundles_per_rank, prepare_args=models_on_this_node,
                                   wait=False, duplicates=cfg.duplicates(kind) if args is not None else 1)
        start_together(list(made.values()))  # the roles' processes start (import torch, ...) side by side
        # Models load in parallel; a model role's ranks first join its process group.
        reports = gather_all([group.call_all_async("setup", join=True) if kind in specs
                              else group.call_all_async("setup") for kind, group in made.items()])
    except BaseException:
        for group in made.values():
            group.shutdown()
        for pool in pools.values():
            pool.remove()
        raise
    placed = ", ".join(f"{k}: {p.world_size} x (cpu {p.num_cpus:g}, gpu {p.num_gpus:g}"
                       + (f" on each of {p.bundles_per_rank} GPUs" if p.bundles_per_rank > 1 else "") + f") in {p.pool}"
                       for k, p in layout.roles.items())
    print(f"rlhf: RL roles on Ray: {placed}", file=sys.stderr, flush=True)
    for kind, per_rank in zip(made, reports, strict=True):
        if kind in specs:  # each model role's forward, as its rank 0 reported it (its log is the worker's)
            print(f"rlhf: {per_rank[0]}", file=sys.stderr, flush=True)
    return RoleGroups(made["actor"], made.get("critic"), made.get("ref"), made.get("reward"),
                      RayEngines(made["rollout"], cfg.vllm.enable_sleep, sync_backend=cfg.vllm.sync_backend,
                                 bucket_mb=cfg.vllm.sync_bucket_mb, checkpoint_format=backend == "vllm"),
                      list(pools.values()))


def run_ppo(cfg, on_ray: bool | None = None) -> dict:
    """Train, evaluate and save; returns the stage manifest. `on_ray`: default `runs_on_ray(cfg)`."""
    from rlhf_core.models.loading import load_tokenizer

    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    use_modelscope(cfg.use_ms)
    actor_path = local_model_path(cfg.actor.model_name_or_path)
    tokenizer = load_tokenizer(actor_path, use_fast=not cfg.data.disable_fast_tokenizer)
    prompt_ids, labels, sources, left_out, texts = load_prompts(cfg, tokenizer, cfg.data.prompt_split)
    raw_prompts = dict(zip(map(tuple, prompt_ids), texts, strict=True))
    eval_ids = eval_labels = None
    eval_sources: list[dict] = []
    if cfg.eval.dataset:
        from rlhf_core.rollout.prompts import held_out_split

        split = cfg.eval.split or held_out_split(cfg.eval.dataset)
        eval_ids, eval_labels, eval_sources, _, eval_texts = load_prompts(cfg, tokenizer, split, cfg.eval.dataset)
        raw_prompts.update(zip(map(tuple, eval_ids), eval_texts, strict=True))
    if len(prompt_ids) < cfg.rollout.batch_size:
        raise DataError(f"--data.prompt_dataset: {len(prompt_ids)} usable prompts, fewer than one rollout batch "
                         f"(--rollout.batch_size {cfg.rollout.batch_size})")
    steps = rollout_steps(cfg, len(prompt_ids))
    optimizer_steps = total_optimizer_steps(steps, cfg)

    precision = precision_of(cfg.ds).value
    tracker = Tracker(cfg.use_mlflow, cfg.mlflow_experiment, cfg.mlflow_run_name or cfg.stage, cfg.mlflow_parent_run_id,
                      tags={"rlhf.stage": cfg.stage, "rlhf.code_version": code_version(), "rlhf.precision": precision})
    roles = agent = None
    started_ray = False
    try:
        attach_dashboards(tracker, cfg)
        tracker.log_params({**cfg.model_dump(mode="json"), "precision": precision})
        tracker.log_datasets(sources, "training")
        tracker.log_datasets(eval_sources, "evaluation")
        if left_out:
            print(f"rlhf: {left_out} prompts longer than --data.prompt_max_len {cfg.data.prompt_max_len} tokens were "
                  "left out", file=sys.stderr, flush=True)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        reward_paths = cfg.reward_models
        check_paths = cfg.gold_reward_models
        specs = role_specs(cfg, pad_id, reward_paths, optimizer_steps, check_paths)
        if on_ray is None:
            on_ray = runs_on_ray(cfg)  # may connect to the cluster: inside, so a failure closes the run as FAILED
        if on_ray:
            from rlhf_core.distributed.cluster import ensure_ray

            started_ray = ensure_ray()
            # models are resolved on each node
            roles = ray_roles(cfg, specs, cfg.actor.model_name_or_path, reward_paths + check_paths)
        else:
            roles = local_roles(cfg, specs, actor_path)
        if cfg.train.agent_func_path:
            from rlhf_core.rl.agents import AgentRewardSource, make_agent_rollouts

            agent = make_agent_rollouts(cfg.train.agent_func_path, tokenizer, cfg.data.max_len,
                                        cfg.rollout.max_new_tokens, cfg.train.agent_max_turns,
                                        cfg.train.agent_timeout_s, raw_prompts, cfg.train.agent_turn_rewards,
                                        cfg.train.agent_tool_call_parser)
            rewards = AgentRewardSource()
        elif cfg.reward.placeholder_token is not None:
            rewards = ProcessRewardSource(roles.reward_model, tokenizer, raw_prompts, cfg.reward.step_aggregate,
                                          cfg.reward.process_enable)
        elif reward_paths:
            rewards = RewardModelSource(roles.reward_model)
        else:
            rewards = TextRewardSource(build_reward_fn(cfg), tokenizer)
        roles.engines.sync(roles.actor)
        controller = RLController(cfg, prompt_ids, labels, eval_ids, eval_labels, tokenizer, roles.engines,
                                  roles.actor, roles.critic, roles.ref, rewards, tracker,
                                  kl_controller(cfg.algo.kl.init_coef, cfg.algo.kl.target, cfg.algo.kl.horizon), steps,
                                  agent=agent, check=RewardModelSource(roles.reward_model, "check_scores") if check_paths else None)
        metrics = controller.run()
        manifest = save_policy(cfg, roles.actor, tokenizer, metrics, sources + eval_sources, tracker, precision,
                               resume=controller.resume, critic=roles.critic)
    except BaseException:
        tracker.finish("FAILED")
        raise
    finally:
        if agent is not None:
            agent.close()
        if roles is not None:
            roles.shutdown()
        if started_ray:
            import ray

            ray.shutdown()
    tracker.finish("FINISHED")
    return manifest


def save_policy(cfg, actor, tokenizer, metrics: dict, sources: list[dict], tracker, precision: str,
                resume: dict | None = None, critic=None) -> dict:
    """The actor as the stage output: HF model + tokenizer + stage.json, published atomically.
    `resume`: where training started (`RLController.resume`), recorded in stage.json. With
    `--critic.save_value_network` the trained critic goes into the output too, as `critic/` (a
    one-label sequence classifier with the tokenizer, as `rlhf train rm` writes one)."""
    from rlhf_core.infra.publishing import publish_output
    from rlhf_core.models.loading import load_causal_lm, load_reward_model, model_writer

    state = actor.call_all("export")[0]  # rank 0's; every rank takes part in a ZeRO-3 gather
    model = load_causal_lm(local_model_path(cfg.actor.model_name_or_path))
    model.load_state_dict(state, strict=True)
    writers = [model_writer(model, tokenizer)]
    if cfg.critic.save_value_network and critic is not None:
        critic_state = critic.call_all("export")[0]
        value_model = load_reward_model(local_model_path(cfg.critic.model_name_or_path), tokenizer.pad_token_id)
        value_model.load_state_dict(critic_state, strict=True)
        write_critic = model_writer(value_model, tokenizer)
        writers.append(lambda folder: write_critic(folder / "critic"))
    inputs = {"pretrain": cfg.actor.model_name_or_path, "reward_pretrain": cfg.reward.model_name_or_path,
              "datasets": sources}
    return publish_output(cfg, tracker, inputs, metrics, write=lambda folder: [w(folder) for w in writers],
                          precision=precision, resume=resume, trained=True)
