"""`rlhf train ppo`: the PPO family (PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO) as one stage.

The job's driver is the single controller (`rl/controller.py`); this module sets it up and
tears it down: prompts, tokenizer, the roles the estimator needs (actor always; a critic for
`gae`; a reference when a KL term is used; reward models when the reward comes from them), the
rollout engine, the reward source, the MLflow run, and at the end the actor saved as the stage
output (a plain `transformers` causal LM + tokenizer + `stage.json`), exactly like the other
trainers' outputs.

With one rank per role and no cluster to join, every role lives in this process (colocated, as
`--train.colocate_all` asks for on a cluster) and the rollout engine is a transformers engine
holding its own copy of the policy, refreshed from the actor after every step.
"""

from __future__ import annotations

import sys

import torch

from rlhf_core.advantages import kl_controller
from rlhf_core.distributed.engine import init_distributed, precision_of
from rlhf_core.rl.controller import RLController
from rlhf_core.rl.groups import LocalGroup
from rlhf_core.rl.roles import CriticRole, PolicyRole, ReferenceRole, RewardModelRole, total_optimizer_steps
from rlhf_core.tracking import Tracker
from rlhf_core.trainers.common import local_model_path, seed_everything
from rlhf_core.version import code_version, stage_manifest

# Sequences the transformers engine samples at once (a rollout step's prompts x samples, in chunks):
# generation is memory-light next to training, and bigger batches amortise the per-token overhead.
GENERATION_BATCH = 256


def load_prompts(cfg, tokenizer, split: str, dataset: str | None = None):
    """`(prompt_ids, labels, sources, left_out)` of a prompt dataset, formatted like training data."""
    from rlhf_core.data.loading import DataError
    from rlhf_core.rollout.prompts import load_prompt_set, prompt_formatter

    data = cfg.data
    prompt_set = load_prompt_set(dataset or data.prompt_dataset, split, data.input_key, data.label_key,
                                 require_answers=(cfg.eval.task or cfg.reward.task) is not None, max_samples=data.max_samples,
                                 seed=cfg.train.seed, chat=data.apply_chat_template)
    fmt = prompt_formatter(tokenizer, data.apply_chat_template, data.input_template)
    ids, labels, left_out = [], [], 0
    for prompt, label in zip(prompt_set.prompts, prompt_set.answers, strict=True):
        tokens = fmt.prompt_ids(prompt)
        if len(tokens) > data.prompt_max_len:
            left_out += 1
            continue
        ids.append(tokens)
        labels.append(label)
    if not ids:
        raise DataError(f"{dataset or data.prompt_dataset}: every prompt of the {split!r} split is longer than "
                        f"--data.prompt_max_len {data.prompt_max_len} tokens")
    return ids, labels, prompt_set.sources, left_out


def rollout_steps(cfg, num_prompts: int) -> int:
    steps = max(1, num_prompts // cfg.rollout.batch_size) * cfg.train.num_episodes
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


def build_reward_fn(cfg):
    """The reward source when no reward model scores the samples: a reward file, an HTTP server or a verifier."""
    from rlhf_core.rewards import build_reward_source

    return build_reward_source(None, cfg.reward.remote_url, cfg.reward.task)


def run_ppo(cfg) -> dict:
    """Train, evaluate and save; returns the stage manifest."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout.hf import TransformersEngine

    if not torch.distributed.is_initialized():
        init_distributed(0, 1, "127.0.0.1", None)
    seed_everything(cfg.train.seed)
    actor_path = local_model_path(cfg.actor.model_name_or_path)
    tokenizer = load_tokenizer(actor_path)
    prompt_ids, labels, sources, left_out = load_prompts(cfg, tokenizer, cfg.data.prompt_split)
    eval_ids = eval_labels = None
    eval_sources: list[dict] = []
    if cfg.eval.dataset:
        from rlhf_core.rollout.prompts import held_out_split

        split = cfg.eval.split or held_out_split(cfg.eval.dataset)
        eval_ids, eval_labels, eval_sources, _ = load_prompts(cfg, tokenizer, split, cfg.eval.dataset)
    if len(prompt_ids) < cfg.rollout.batch_size:
        raise ValueError(f"--data.prompt_dataset: {len(prompt_ids)} usable prompts, fewer than one rollout batch "
                         f"(--rollout.batch_size {cfg.rollout.batch_size})")
    steps = rollout_steps(cfg, len(prompt_ids))
    optimizer_steps = total_optimizer_steps(steps, cfg)

    precision = precision_of(cfg.ds).value
    tracker = Tracker(cfg.use_mlflow, cfg.mlflow_experiment, cfg.mlflow_run_name or cfg.stage, cfg.mlflow_parent_run_id,
                      tags={"rlhf.stage": cfg.stage, "rlhf.code_version": code_version(), "rlhf.precision": precision})
    try:
        tracker.log_params({**cfg.model_dump(mode="json"), "precision": precision})
        tracker.log_datasets(sources, "training")
        tracker.log_datasets(eval_sources, "evaluation")
        if left_out:
            print(f"rlhf: {left_out} prompts longer than --data.prompt_max_len {cfg.data.prompt_max_len} tokens were "
                  "left out", file=sys.stderr, flush=True)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        reward_paths = [local_model_path(p.strip()) for p in (cfg.reward.model_name_or_path or "").split(",")
                        if p.strip()]
        actor = LocalGroup(PolicyRole(cfg, pad_id, optimizer_steps))
        critic = None
        if cfg.uses_critic:
            critic = LocalGroup(CriticRole(cfg, pad_id, local_model_path(cfg.critic.model_name_or_path),
                                           optimizer_steps))
        ref = LocalGroup(ReferenceRole(cfg, pad_id, local_model_path(cfg.ref.model_name_or_path))) \
            if cfg.uses_ref else None
        reward_model = LocalGroup(RewardModelRole(cfg, pad_id, reward_paths)) if reward_paths else None
        reward_fn = None if reward_paths else build_reward_fn(cfg)
        engine = TransformersEngine.from_pretrained(actor_path, dtype=torch.float32,
                                                    batch_size=GENERATION_BATCH)
        engine.update_weights(actor.call_rank0("weights"))
        controller = RLController(cfg, prompt_ids, labels, eval_ids, eval_labels, tokenizer, engine, actor, critic, ref,
                                  reward_model, reward_fn, tracker,
                                  kl_controller(cfg.algo.kl.init_coef, cfg.algo.kl.target, cfg.algo.kl.horizon), steps)
        metrics = controller.run()
        manifest = save_policy(cfg, actor, tokenizer, metrics, sources + eval_sources, tracker, precision)
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")
    return manifest


def save_policy(cfg, actor, tokenizer, metrics: dict, sources: list[dict], tracker, precision: str) -> dict:
    """The actor as the stage output: HF model + tokenizer + stage.json, published atomically."""
    from rlhf_core.models.loading import export_model
    from rlhf_core.trainers.common import publish_model

    model = export_model(actor.worker.engine.module, 0)
    inputs = {"pretrain": cfg.actor.model_name_or_path, "reward_pretrain": cfg.reward.model_name_or_path,
              "datasets": sources}
    manifest = stage_manifest(cfg, inputs, metrics, tracker.run_id, precision=precision)
    publish_model(cfg, model, tokenizer, manifest, tracker)
    return manifest
