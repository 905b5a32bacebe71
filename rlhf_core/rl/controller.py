"""The RL stage's single controller: rollout -> rewards -> reference and values -> advantages ->
PPO epochs over actor and critic -> weight sync, once per rollout step.

It runs on the job's driver and owns the loop, the prompt order, the KL coefficient, the MLflow
run and the checkpoints; the models live in role groups (`distributed/role_group.py`). Each step is planned
once (`rl/plan.StepPlan`: the epochs' orders, each rank's share, the on-policy samples), and the
experience passes and the roles' training read that plan; each pass returns its statistics.
Rewards come from one interface (`rl/scoring.py`), whatever the source.

Choices, and why:
- Prompts are read once, formatted like the trainers' data and visited in a seeded order per
  episode; the position is part of the checkpoint. Prompts longer than `--data.prompt_max_len`
  tokens are left out (counted and reported), as OpenRLHF does.
- The engine's log-probs are kept next to the trainer's recomputation (`old_logprobs`), and their
  mean absolute difference per token is logged (`rollout/logprob_mismatch`).
- The experience passes run in the first epoch's training order, so a chunk is packed once for
  every pass (`experience.collate`). Where nothing reads the old log-probs before training (the KL
  outside the reward), the actor computes them at the start of its training call, and the first
  optimizer step's are its training forward's own (`plan_step`).
- Dynamic filtering drops prompts whose samples all score the same (no signal for a group
  estimator) and draws more prompts until the rollout is full, giving up after
  `MAX_FILTER_ROUNDS` rounds with what it has (at least one group).
"""

from __future__ import annotations

import logging
import random
import sys
import time

import torch

from rlhf_core.algos.advantages import compute_advantages, dynamic_filter_mask
from rlhf_core.algos.losses import kl_penalty
from rlhf_core.algos.names import AdvantageEstimator
from rlhf_core.algos.nucleus import filtering
from rlhf_core.data.synthetic import get_task
from rlhf_core.infra import heap
from rlhf_core.infra.not_applied import not_applied, say_once
from rlhf_core.rl import checkpoint, guard, selection
from rlhf_core.rl.agents import agent_stats
from rlhf_core.rl.ahead import Rollout, RolloutsAhead
from rlhf_core.rl.experience import (
    RolloutSample,
    Samples,
    old_logprob_metrics,
    old_logprob_sums,
    stack,
    step_reward_matrix,
    unstack,
)
from rlhf_core.rl.partial import sample_in_segments, staleness_stats
from rlhf_core.rl.plan import StepPlan
from rlhf_core.rl_config import CHECK_METRICS
from rlhf_core.rollout.base import Budget, budget_slice

log = logging.getLogger(__name__)

MAX_FILTER_ROUNDS = 8


class PromptStream:
    """Prompt indices in a seeded order per episode; `position` is how many have been drawn."""

    def __init__(self, num_prompts: int, seed: int):
        self.num_prompts, self.seed, self.position = num_prompts, seed, 0
        self._cached: tuple[int, tuple[int, ...]] | None = None  # (episode, its order): one shuffle per episode

    def order(self, episode: int) -> tuple[int, ...]:
        if self._cached is None or self._cached[0] != episode:
            rng = random.Random(f"{self.seed}-episode-{episode}")
            order = list(range(self.num_prompts))
            rng.shuffle(order)
            self._cached = (episode, tuple(order))
        return self._cached[1]

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            episode, offset = divmod(self.position, self.num_prompts)
            out.append(self.order(episode)[offset])
            self.position += 1
        return out


def truncation_penalty(rewards: torch.Tensor, finished: torch.Tensor, coef: float | None) -> torch.Tensor:
    """`--reward.stop_properly_penalty_coef`: a response cut off by the token budget (no EOS) gets its
    reward times `coef` when `coef >= 0`, and exactly `coef` when it is negative (OpenRLHF's rule)."""
    if coef is None:
        return rewards
    cut = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(finished, rewards, cut)


def overlong_penalty(raw: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int,
                     overlong_buffer_len: float | None, overlong_penalty_factor: float) -> torch.Tensor:
    """The source's rewards with DAPO's soft overlong penalty: a response longer than
    `max_new_tokens - buffer` loses `factor * excess / buffer`, at most `factor`. (Clipping to
    `--reward.clip_range` comes after group shaping, in `compute_advantages`, as in OpenRLHF.)"""
    rewards = raw.float()
    if overlong_buffer_len:
        excess = (lengths.float() - (max_new_tokens - overlong_buffer_len)).clamp(min=0)
        rewards = rewards - (excess / overlong_buffer_len * overlong_penalty_factor).clamp(max=overlong_penalty_factor)
    return rewards


def as_eval(metrics: dict[str, float]) -> dict[str, float]:
    """Selection metrics under the `eval/` names the best-metric key and the guard use."""
    return {k.replace("select/", "eval/", 1): v for k, v in metrics.items()}


class RLController:
    def __init__(self, cfg, prompt_ids: list[list[int]], labels: list, eval_prompt_ids: list[list[int]] | None,
                 eval_labels: list | None, tokenizer, engines, actor, critic, ref, reward_source, tracker,
                 kl_controller, rollout_steps: int, agent=None, check=None):
        self.cfg, self.tokenizer, self.engines = cfg, tokenizer, engines
        self.agent = agent  # multi-turn episodes (`rl/agents.AgentRollouts`), or None: one response a prompt
        self.check = check  # a gold reward model scoring held-out responses (`scoring.RewardModelSource` of `check_scores`), or None
        self.prompt_ids, self.labels = prompt_ids, labels
        self.eval_prompt_ids, self.eval_labels = eval_prompt_ids or [], eval_labels or []
        self.actor, self.critic, self.ref, self.reward_source = actor, critic, ref, reward_source
        self.tracker, self.kl = tracker, kl_controller
        self.estimator = AdvantageEstimator(cfg.algo.advantage.estimator)
        # rewards placed at tokens inside a response: a process reward model's steps, an agent's turns
        self.step_rewards = cfg.reward.process_enable or cfg.train.agent_turn_rewards
        self.prompts = PromptStream(len(prompt_ids), cfg.train.seed)
        self.rollout_steps = rollout_steps
        self.step = 0
        self.steps_run = 0  # rollout steps this process executed (a resume runs total - start)
        # Where training started, recorded in stage.json: a --load_checkpoint that found nothing says so.
        self.resume = {"requested": bool(cfg.ckpt.load_enable), "checkpoint": None, "start_step": 0}
        self.checkpoint_run: str | None = None  # the run id this run's checkpoint tags are recorded under
        # The run's held-out check by default: the verifier's sampled accuracy, else the gold reward
        # model's sampled score (`--eval.reward_model_name_or_path`).
        default_check = checkpoint.BestMetric.AUTO if cfg.eval.task is not None or check is None \
            else "eval/sampled_gold_reward"
        self.best = checkpoint.BestMetric(cfg.ckpt.best_metric_key, default_check)  # the best evaluation's checkpoint
        self.history: list[dict] = []
        # The reward-hacking guard watches a held-out check (`rl/guard.py`): the one the best checkpoint
        # is chosen by where it is one, else the default (a held-out `sampled_reward` would be the
        # training reward's own judge).
        key = cfg.ckpt.best_metric_key
        metric = key if key.removeprefix("eval/") in CHECK_METRICS else default_check
        # Evaluations during training (the guard's, the best policy's): every `eval_every` steps, on the
        # selection prompts where there are some; the evaluations before and after, on the rest (`rl/selection.py`).
        watched = bool(self.eval_prompt_ids) and cfg.has_held_out_check and \
            (cfg.eval.hacking_guard_enable or cfg.eval.publish_best)
        self.eval_every = selection.eval_every(cfg.eval.steps, rollout_steps, watched)
        chosen, reported = selection.selection_split(len(self.eval_prompt_ids), cfg.eval.selection_fraction,
                                                     cfg.train.seed) if self.eval_every else ([], [])
        # the responses of each evaluation during training: a fall must exceed their noise
        responses = selection.responses_per_evaluation(len(chosen) or len(self.eval_prompt_ids), metric,
                                                       cfg.eval.n_samples_per_prompt)
        self.guard = guard.HackingGuard(metric, cfg.eval.hacking_window, cfg.eval.hacking_min_drop, responses) \
            if cfg.eval.hacking_guard_enable else None
        self.stopped_by_guard: int | None = None  # the step training stopped at (--eval.stop_on_hacking)
        self.selection: tuple[list, list] | None = None
        # which prompts the evaluations during training were on: a resume on others starts the best afresh
        self.evaluated_on = {"all": len(self.eval_prompt_ids)}
        if chosen:
            self.selection = ([self.eval_prompt_ids[i] for i in chosen], [self.eval_labels[i] for i in chosen])
            self.eval_prompt_ids = [self.eval_prompt_ids[i] for i in reported]
            self.eval_labels = [self.eval_labels[i] for i in reported]
            self.evaluated_on = {"selection": len(chosen), "reported": len(reported), "seed": cfg.train.seed,
                                 "fraction": cfg.eval.selection_fraction}
        elif self.eval_every and self.eval_prompt_ids and cfg.eval.selection_fraction > 0:
            say_once(f"rlhf: --eval.selection_fraction {cfg.eval.selection_fraction}: {len(self.eval_prompt_ids)} "
                     f"held-out prompts leave fewer than {selection.MIN_SELECTION} to choose on: every evaluation "
                     "is on all of them, and the last policy is published")
        self.publishing = self.selection is not None and cfg.eval.publish_best
        if self.publishing and cfg.train.enable_ema:
            self.publishing = False
            not_applied("eval.publish_best", True, "an evaluated policy", "with --train.enable_ema the output is "
                        "the moving average of the weights, which no evaluation saw: the last one is published")
        if cfg.eval.stop_on_hacking and not self.eval_every:  # e.g. the online round's default on a short run
            not_applied("eval.stop_on_hacking", True, "evaluations during training (--eval.steps N; a tenth of "
                        f"this run of {rollout_steps} steps is under one)", "the guard has nothing to stop on")
        for field_ in ("agent_max_turns", "agent_timeout_s", "agent_tool_call_parser"):
            if field_ in cfg.train.model_fields_set and not cfg.train.agent_func_path:
                not_applied(f"train.{field_}", getattr(cfg.train, field_), "--train.agent_func_path (--agent_func_path)",
                            "every rollout is one response a prompt")
        if "async_queue_size" in cfg.train.model_fields_set and not cfg.train.async_enable:
            not_applied("train.async_queue_size", cfg.train.async_queue_size, "--train.async_enable (--async_train)",
                        "each batch is sampled at its step")
        self.published_step: int | None = None  # the step whose policy is the output
        # Actor updates the engines hold; a batch sampled `staleness` updates before it trains.
        self.policy_version = 0
        self.ahead = RolloutsAhead(self._sample, cfg.train.async_queue_size if cfg.train.async_enable else 0,
                                   partial=cfg.train.partial_rollout_enable)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        if cfg.ckpt.load_enable:
            self.checkpoint_run = checkpoint.load(self, cfg.ckpt.path)  # the resumed run's tags keep rotating
            if self.checkpoint_run is not None:
                self.sync_weights(force=True)
        self.resume["start_step"] = start = self.step
        initial = self.evaluate("eval_initial/") if self.step == 0 else {}
        self._log(initial)
        if self.step == 0 and self.selection is not None:
            self._check()  # the policy before training: a candidate too
        elif initial and self.guard is not None:
            self.guard.evaluated(0, {k.replace("eval_initial/", "eval/", 1): v for k, v in initial.items()})
        heap.settle()  # the model, optimizer and data are built: later collector passes skip them
        evaluated = None
        while self.step < self.rollout_steps and self.stopped_by_guard is None:
            try:
                metrics = self.train_step()
            except BaseException:
                self.ahead.abandon()  # no sampling left running while the roles shut down
                raise
            self.step += 1
            self.steps_run += 1
            self._log(metrics)
            if self.guard is not None and "rollout/reward_mean" in metrics:
                self.guard.rollout(metrics["rollout/reward_mean"])
            evaluated = None
            if self.eval_every and self.step % self.eval_every == 0 and self.step < self.rollout_steps:
                self.ahead.wait()  # partial rollouts: the engines are the evaluation's alone
                evaluated = self._check()
            # after the evaluation: the checkpoint holds what it changed (the best, the guard's window)
            if cfg.ckpt.save_steps > 0 and self.step % cfg.ckpt.save_steps == 0:
                self.ahead.wait()  # partial rollouts: the batch being sampled is saved whole
                # an attempt its orchestrator gave up writes nothing more where its retry resumes from
                self.tracker.stop_if_ended_elsewhere(f"it stopped at step {self.step}: its checkpoint was not "
                                                     "written and nothing was published")
                self.checkpoint_run = checkpoint.save(self, cfg.ckpt.path, self.checkpoint_run)
        self.ahead.wait()
        if self.stopped_by_guard is None or evaluated is None:  # else just evaluated: the guard stopped there
            evaluated = self._check()
        self.published_step = self._publish_best(as_eval(evaluated))
        final = evaluated
        if self.selection is not None:  # the reported evaluation, on the prompts no choice was made on
            final = {**evaluated, **self.evaluate()}
            self._log({k: v for k, v in final.items() if k.startswith("eval/")})
        summary = {**initial, **final, "train/steps": self.step, "train/start_step": start,
                   "train/steps_run": self.steps_run, "published/step": self.published_step}
        if self.best.step is not None:
            summary.update({"best/step": self.best.step, "best/value": self.best.value})
        if self.guard is not None and self.guard.fired is not None:
            fired = self.guard.fired
            summary.update({"guard/reward_hacking": 1.0, "guard/fired_step": fired.step,
                            "guard/since_step": fired.since_step, "guard/reward_rise": fired.reward_rise,
                            "guard/metric_drop": fired.metric_drop})
            if self.stopped_by_guard is not None:
                summary["guard/stopped_step"] = self.stopped_by_guard
        trained = [m for m in self.history if "rollout/reward_mean" in m]
        if trained:  # the last step's rollout and training numbers
            summary.update({k: v for k, v in trained[-1].items() if k.startswith(("rollout/", "train/"))})
        return summary

    def _check(self) -> dict[str, float]:
        """An evaluation during training (or of the last policy, for the choice): on the selection
        prompts (`select/`, greedy only where the best is chosen by a greedy metric: the guard reads
        the sampled accuracy) where there are some, else on all of them (`eval/`)."""
        metrics = self.evaluate("select/", *self.selection, greedy="greedy" in self.best.metric) \
            if self.selection is not None else self.evaluate()
        self._evaluated(metrics)
        return metrics

    def _evaluated(self, metrics: dict[str, float]) -> None:
        """Log an evaluation during training; where it is the best so far, keep its policy to publish
        (`--eval.publish_best`) and, where checkpoints have a place (`--ckpt.path`), its checkpoint
        (`--ckpt.best_metric_key`); then the guard. Both read selection metrics under `eval/` names."""
        self._log(metrics)
        view = as_eval(metrics)
        if self.best.improves(view, self.step):
            if self.publishing:
                self.actor.call_all("keep_best")
            if self.cfg.ckpt.path and self.step > 0:  # step 0's policy is the stage's input
                self.checkpoint_run = checkpoint.save(self, self.cfg.ckpt.path, self.checkpoint_run, best=True)
        if self.guard is not None:
            self._guard(view)

    def _publish_best(self, last: dict[str, float]) -> int:
        """The step whose policy becomes the output: the best evaluation's (`--eval.publish_best`),
        put back into the actor and the engines, where it is not the last and beat the last by more
        than the noise (`selection.beats_the_last`); else the last. `last`: the last policy's
        evaluation on the selection prompts, under `eval/` names."""
        best = self.best
        if not self.publishing or best.step is None or best.step == self.step:
            return self.step
        metric = best.metric
        responses = selection.responses_per_evaluation(len(self.selection[0]), metric, self.cfg.eval.n_samples_per_prompt)
        if metric in last and not selection.beats_the_last(best.value, last[metric], metric, responses,
                                                           (best.spread, selection.spread_of(last, metric))):
            print(f"rlhf: the best evaluation (step {best.step}, {metric}={best.value:.4f}) is within the noise of the "
                  f"last ({last[metric]:.4f} over {responses} responses on the selection prompts): the last policy is "
                  "published", file=sys.stderr, flush=True)
            return self.step
        if not all(self.actor.call_all("has_best")):  # resumed from a checkpoint written without them
            print(f"rlhf: the best evaluation (step {best.step}) has no kept weights in this run's checkpoint: the "
                  "last policy is published", file=sys.stderr, flush=True)
            return self.step
        self.actor.call_all("restore_best")
        self.sync_weights(force=True)  # the reported evaluation samples the published policy
        print(f"rlhf: publishing the policy of step {best.step} ({metric}={best.value:.4f} on the "
              f"selection prompts), the best evaluation of the run, rather than the last (step {self.step})",
              file=sys.stderr, flush=True)
        return best.step

    def _guard(self, metrics: dict[str, float]) -> None:
        """The reward-hacking guard on this evaluation: a metric per evaluation, and where it fires
        first, one warning line and an MLflow tag; with `--eval.stop_on_hacking`, training stops."""
        first = self.guard.fired is None
        found = self.guard.evaluated(self.step, metrics)
        if self.guard.metric not in metrics:
            return
        self.tracker.log_metrics({"guard/reward_hacking": float(found is not None)}, step=self.step)
        if found is None or not first:
            return
        message = found.message(self.guard.metric)
        stop = self.cfg.eval.stop_on_hacking and self.step < self.rollout_steps
        print(f"rlhf: WARNING {message}" + ("; training stops (--eval.stop_on_hacking)" if stop else
                                            " (--eval.stop_on_hacking stops training here)"),
              file=sys.stderr, flush=True)
        self.tracker.set_tags({"rlhf.reward_hacking": message})
        if stop:
            self.stopped_by_guard = self.step

    def _trainable(self) -> list:
        return [group for group in (self.actor, self.critic) if group is not None]

    def _trainers_sleep(self) -> None:
        """`--ds.enable_sleep`: the trainable roles' DeepSpeed states off the GPU while the engines
        generate; where a rank cannot, one line says what was missing."""
        if not self.cfg.ds.enable_sleep:
            return
        if self.ahead.depth:
            not_applied("ds.enable_sleep", True, "engines that take turns with the trainers", "with "
                        "--train.async_enable they sample while the trainers train, and the states stay on the devices")
            return
        for group in self._trainable():
            for missing in {m for m in group.call_all("offload_states") if m}:
                not_applied("ds.enable_sleep", True, missing, "the trainers' states stay where they are")

    def _trainers_wake(self) -> None:
        if self.cfg.ds.enable_sleep and not self.ahead.depth:
            for group in self._trainable():
                group.call_all("reload_states")

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        self._trainers_sleep()
        batch = self.ahead.take(self.step)  # sampled ahead (--train.async_enable), or now
        self._trainers_wake()
        times["rollout_wait"] = time.perf_counter() - t0
        self.ahead.start(self.step, self.rollout_steps)  # the next batches, while this one trains
        samples = batch.samples
        rollout_stats = {**batch.stats, "rollout/staleness": float(self.policy_version - batch.version)}
        if self.ahead.partial:  # per token: a response may have been sampled by two policies
            # (a batch sampled whole, e.g. kept by a checkpoint of a run without partial rollouts: its version)
            rollout_stats.update(staleness_stats([s.extra.get("versions", [batch.version] * s.response_len)
                                                  for s in samples], self.policy_version))
        times.update(batch.times)
        plan = self.plan_step(len(samples))
        t = time.perf_counter()
        experience_stats = self.make_experience(samples, plan)
        times["experience"] = time.perf_counter() - t
        t = time.perf_counter()
        train_stats = self.train(samples, plan)
        times["train"] = time.perf_counter() - t
        experience_stats.update({k: train_stats.pop(k) for k in list(train_stats) if k.startswith("rollout/")})
        t = time.perf_counter()
        with self.ahead.held_for_sync():  # the weights of the batches sampled ahead are kept until then
            times["ahead_wait"] = time.perf_counter() - t
            t = time.perf_counter()
            self.sync_weights()
        times["sync"] = time.perf_counter() - t
        self.kl.update(experience_stats["rollout/kl"], len(samples))
        elapsed = time.perf_counter() - t0
        metrics = {**rollout_stats, **experience_stats, **train_stats, "train/kl_coef": self.kl.value,
                   **{f"time/{k}_s": v for k, v in times.items()}, "time/step_s": elapsed,
                   "perf/samples_per_s": len(samples) / elapsed}
        if (self.step + 1) % cfg.logger.logging_steps == 0 or self.step + 1 == self.rollout_steps:
            shown = ", ".join(f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in
                              ("rollout/reward_mean", "rollout/kl", "rollout/logprob_mismatch",
                               *(("rollout/staleness",) if self.ahead.depth else ()), "train/policy_loss",
                               "train/value_loss", "perf/samples_per_s")
                              if k in metrics)
            shown += " | s: " + " ".join(f"{k}={v:.2f}" for k, v in times.items())
            print(f"[rl step {self.step + 1}/{self.rollout_steps}] {shown}", file=sys.stderr, flush=True)
        return metrics

    # -- rollout and rewards ----------------------------------------------------------------
    def _sample(self, step: int) -> Rollout:
        """The rollout of `step` from the engines' current weights (`RolloutsAhead.produce`: in the
        background with --train.async_enable, where nothing else calls the engines meanwhile)."""
        times: dict[str, float] = {}
        version = self.policy_version
        samples, stats = self.rollout(times)
        return Rollout(samples, stats, times, version)

    def rollout(self, times: dict[str, float]) -> tuple[list[RolloutSample], dict[str, float]]:
        cfg = self.cfg
        n, want = cfg.rollout.n_samples_per_prompt, cfg.rollout.batch_size
        kept: list[RolloutSample] = []
        drawn_groups = passed_groups = 0
        times["generate"] = times["reward"] = 0.0
        for round_ in range(MAX_FILTER_ROUNDS if cfg.algo.dynamic_filtering_enable else 1):
            indices = self.prompts.take(want - len(kept) // n)
            t = time.perf_counter()
            fresh = self.draw([self.prompt_ids[i] for i in indices], indices, [self.labels[i] for i in indices], n,
                              cfg.rollout.temperature, seed=cfg.train.seed * 1_000_003 + self.prompts.position * 7 + round_,
                              top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, training=True)
            times["generate"] += time.perf_counter() - t
            t = time.perf_counter()
            self.score(fresh)
            times["reward"] += time.perf_counter() - t
            drawn_groups += len(indices)
            if cfg.algo.dynamic_filtering_enable:
                low, high = cfg.algo.dynamic_filtering_range
                keep = dynamic_filter_mask(torch.tensor([s.score for s in fresh]), n, low, high)
                fresh = [s for g, ok in enumerate(keep.tolist()) if ok for s in fresh[g * n : (g + 1) * n]]
            passed_groups += len(fresh) // n
            kept += fresh
            if len(kept) >= want * n:
                break
        self.engines.sleep()  # while the models train (--vllm.enable_sleep; otherwise nothing)
        if not kept:
            raise RuntimeError(f"dynamic filtering: every one of {drawn_groups} prompts gave samples that all "
                               "scored the same; widen --algo.dynamic_filtering_range or turn it off")
        kept = kept[: want * n]
        rewards = torch.tensor([s.reward for s in kept])
        scores = torch.tensor([s.score for s in kept])
        lengths = torch.tensor([float(s.response_len) for s in kept])
        stats = {"rollout/reward_mean": rewards.mean().item(), "rollout/reward_std": rewards.std(unbiased=False).item(),
                 "rollout/score_mean": scores.mean().item(), "rollout/response_length": lengths.mean().item(),
                 "rollout/truncated_frac": sum(not s.finished for s in kept) / len(kept)}
        if cfg.algo.dynamic_filtering_enable:
            stats["rollout/filter_pass_rate"] = passed_groups / drawn_groups
        stats.update(agent_stats(kept))
        return kept, stats

    def score(self, samples: list[RolloutSample], labels: list | None = None) -> None:
        """Fill in each sample's score (the source's) and reward (with the overlong penalty);
        `labels`: of the prompts the samples index (default: the training prompts')."""
        cfg = self.cfg
        raw, scores = self.reward_source.score(samples, self.labels if labels is None else labels)
        lengths = torch.tensor([s.response_len for s in samples])
        rewards = overlong_penalty(raw, lengths, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer_len,
                                   cfg.reward.overlong_penalty_factor)
        rewards = truncation_penalty(rewards, torch.tensor([s.finished for s in samples]),
                                     cfg.reward.stop_properly_penalty_coef)
        for s, r, sc, before in zip(samples, rewards.tolist(), scores.tolist(), raw.tolist(), strict=True):
            s.reward, s.score = r, sc
            if self.step_rewards:  # step rewards: the penalties go on the last token (`step_reward_matrix`)
                s.extra["penalty"] = r - before

    # -- experience -------------------------------------------------------------------------
    def plan_step(self, count: int) -> StepPlan:
        """This step's epoch orders, and where the old log-probs come from. The first optimizer
        step's are left to its training forward only with one epoch (a later one revisits the
        samples after updates), an actor that trains this step, the KL outside the reward (which
        needs them before training), and a second optimizer step to keep the KL and mismatch
        metrics measured. The others are computed by the actor at the start of its training
        (`PolicyRole.train_step`), not in a pass of their own, whenever it trains this step and
        the KL is outside the reward: nothing on the controller reads them before training, and
        one call fewer a step leaves the actor less idle."""
        cfg = self.cfg
        seeds = tuple(cfg.train.seed * 1_000_003 + self.step * 101 + e for e in range(cfg.train.max_epochs))
        kl_outside_reward = self.ref is None or cfg.algo.kl.use_loss
        trains = self.step >= cfg.critic.freezing_steps
        leave = cfg.train.max_epochs == 1 and trains and count >= 2 * cfg.train.batch_size and kl_outside_reward
        return StepPlan(count, cfg.train.batch_size, cfg.rollout.n_samples_per_prompt, seeds, leave,
                        old_in_training=trains and kl_outside_reward)

    def make_experience(self, samples: list[RolloutSample], plan: StepPlan) -> dict[str, float]:
        """Old log-probs (actor), reference log-probs, values, then advantages and returns, set on
        the samples; returns the step's KL and log-prob mismatch."""
        cfg = self.cfg
        # In the first epoch's training order, so each chunk is packed once for every pass (`collate`).
        order = plan.experience_order(self.actor.data_parallel_size)
        left = plan.on_policy(self.actor.data_parallel_size)
        arranged = Samples(samples[i] for i in order)
        recomputed = [] if plan.old_in_training else [i for i in order if i not in left]
        # With top-k/top-p the engines report log-probs of the filtered distribution: the policy's
        # pass gives those as well, to compare like with like (`roles.PolicyRole._logprobs`).
        sampled = filtering(cfg.rollout.top_k, cfg.rollout.top_p)
        futures = {}
        if recomputed:
            futures["old"] = self.actor.call_sharded_async("logprobs", Samples(samples[i] for i in recomputed),
                                                           sampled=sampled)
        if self.ref is not None:
            futures["ref"] = self.ref.call_sharded_async("logprobs", arranged)
        if self.critic is not None:
            futures["values"] = self.critic.call_sharded_async("values", arranged)
        results = {k: pending.gather() for k, pending in futures.items()}
        old_of = dict(zip(recomputed, results.get("old", []), strict=True))
        engine_view = {}  # the policy's log-probs under the engines' (filtered) distribution
        if sampled:
            engine_view = {i: both[1] for i, both in old_of.items()}
            old_of = {i: both[0] for i, both in old_of.items()}
        for j, i in enumerate(order):
            s = samples[i]
            s.old_logprobs = old_of.get(i)
            s.ref_logprobs = results["ref"][j] if "ref" in results else None
            s.values = results["values"][j] if "values" in results else None
        lengths = [s.response_len for s in samples]
        mask = stack([torch.ones(n) for n in lengths])
        width = mask.shape[1]
        kl = torch.zeros_like(mask)  # rows left out only where the KL is not in the reward (`plan_step`)
        stats = {}  # with old_in_training, the actor reports the KL and mismatch metrics
        if recomputed:
            # The KL and mismatch metrics are over the samples whose old log-probs were computed here:
            # all of them, unless the first optimizer step's are left to training.
            measured = [i for i, s in enumerate(samples) if s.old_logprobs is not None]
            estimator = "k1" if not cfg.algo.kl.use_loss else cfg.algo.kl.estimator
            old = [samples[i].old_logprobs for i in measured]
            ref = [samples[i].ref_logprobs for i in measured] if self.ref is not None else None
            if ref is not None:
                kl[measured] = kl_penalty(stack(old, width), stack(ref, width), estimator) * mask[measured]
            stats = old_logprob_metrics(old_logprob_sums(
                old, [samples[i].rollout_logprobs for i in measured],
                [engine_view[i] for i in measured] if sampled else old, ref, estimator))
        kl_in_reward = 0.0 if cfg.algo.kl.use_loss else self.kl.value
        steps = step_reward_matrix(samples, width) if self.step_rewards else None
        advantages, returns = compute_advantages(
            self.estimator, torch.tensor([s.reward for s in samples]), kl, mask, kl_coef=kl_in_reward,
            n=cfg.rollout.n_samples_per_prompt, gamma=cfg.algo.advantage.gamma, lambd=cfg.algo.advantage.lambd,
            values=stack([s.values for s in samples]) if self.critic is not None else None,
            std_norm=not cfg.algo.advantage.no_std_norm, reward_clip=tuple(cfg.reward.clip_range),
            step_rewards=steps)
        for s, a, r in zip(samples, unstack(advantages, lengths), unstack(returns, lengths), strict=True):
            s.advantages, s.returns = a, r
        if steps is not None:  # the rewards per sample the advantages were computed from
            stats["rollout/step_rewards_per_sample"] = steps[1].sum().item() / len(samples)
        return stats

    # -- training ---------------------------------------------------------------------------
    def train(self, samples: list[RolloutSample], plan: StepPlan) -> dict[str, float]:
        """Every trainable role's PPO epochs: each rank gets its samples and epoch orders once and
        loops over the epochs itself; the stats are rank 0's (every rank's are all-reduced). With
        `plan.old_in_training` the actor first computes its samples' old log-probs and reports the
        step's KL and mismatch metrics (`rollout/...`)."""
        calls = []
        if self.step >= self.cfg.critic.freezing_steps:
            ranks = None
            if plan.old_in_training:
                sampled = filtering(self.cfg.rollout.top_k, self.cfg.rollout.top_p)
                ranks = [{"old_for": positions, "sampled": sampled}
                         for positions in plan.old_positions(self.actor.data_parallel_size)]
            calls.append(self._train_role(self.actor, samples, plan, ranks, kl_coef=self.kl.value))
        if self.critic is not None:
            calls.append(self._train_role(self.critic, samples, plan))
        return {k if k.startswith("rollout/") else f"train/{k}": v for pending in calls for k, v in pending.first().items()}

    @staticmethod
    def _train_role(group, samples: list[RolloutSample], plan: StepPlan, ranks: list[dict] | None = None, **kwargs):
        """`ranks`: keyword arguments of each data-parallel rank's own, beside `kwargs`."""
        work = plan.work(group.data_parallel_size)  # the ranks of a ring (models/ring.py) take the same
        ranks = ranks or [{}] * len(work)
        return group.call_each_async("train_step", [((Samples(samples[i] for i in w.samples), w.epochs), {**kwargs, **own})
                                                    for w, own in zip(work, ranks, strict=True)
                                                    for _ in range(group.world_size // len(work))])

    def sync_weights(self, force: bool = False) -> None:
        """Every rollout engine gets the actor's new weights (none while the actor is frozen;
        `rl/engines.py`: from the object store, with a deadline, woken up first when asleep)."""
        if self.step < self.cfg.critic.freezing_steps and not force:
            return
        self.engines.sync(self.actor)
        if not force:
            self.policy_version += 1  # the actor trained this step (it is frozen until freezing_steps)

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(self, prefix: str = "eval/", prompt_ids: list | None = None, labels: list | None = None,
                 greedy: bool = True) -> dict[str, float]:
        """Held-out prompts (default: the reported ones), sampled at `--eval.temperature` and (with
        `greedy`) greedy: the mean reward; with a task verifier (`--eval.task`, default
        `--reward.task`) the exact-match accuracy; with a gold reward model its mean score
        (`_gold_reward`) and their standard deviation (`_gold_reward_std`, the noise the guard and
        the choice of the best policy weigh)."""
        prompt_ids = self.eval_prompt_ids if prompt_ids is None else prompt_ids
        labels = self.eval_labels if labels is None else labels
        if not prompt_ids:
            return {}
        cfg = self.cfg
        verifier = get_task(cfg.eval.task) if cfg.eval.task else None
        out = {}
        for name, temperature, n in (("sampled", cfg.eval.temperature, cfg.eval.n_samples_per_prompt),
                                     ("greedy", 0.0, 1))[: 2 if greedy else 1]:
            samples = self.draw(prompt_ids, list(range(len(prompt_ids))), labels, n, temperature, seed=cfg.train.seed + 17)
            self.score(samples, labels)
            out[f"{prefix}{name}_reward"] = sum(s.score for s in samples) / len(samples)
            if self.check is not None:
                gold = torch.tensor(self.check.scores(samples), dtype=torch.float64)
                out[f"{prefix}{name}_gold_reward"] = gold.mean().item()
                out[f"{prefix}{name}_gold_reward_std"] = gold.std(unbiased=False).item()
            out.update({f"{prefix}{name}_{k.removeprefix('rollout/')}": v for k, v in agent_stats(samples).items()})
            if verifier is not None:  # an episode's answer is its last action
                responses = [s.extra["final_text"] if "final_text" in s.extra else
                             self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
                out[f"{prefix}{name}_accuracy"] = sum(
                    verifier.score(r, labels[s.prompt_index]) for r, s in zip(responses, samples, strict=True)
                ) / len(samples)
        self.engines.sleep()
        return out

    def draw(self, prompt_ids: list[list[int]], indices: list[int], labels: list, n: int, temperature: float,
             seed: int, top_k: int = -1, top_p: float = 1.0, training: bool = False) -> list[RolloutSample]:
        """`n` samples of each prompt (`prompt_ids[k]` is prompt `indices[k]` of its set): one response
        each, or with an agent one episode each (its rewards in `extra`, read by the agent's reward source).
        `training`: a rollout batch (with partial rollouts: sampled in segments, its tokens' versions kept)."""
        partial = self.ahead.partial and training
        if self.agent is not None:  # with partial rollouts a weight sync may come between two turns
            return self.agent.run(prompt_ids, indices, labels, n, temperature, seed, top_k=top_k, top_p=top_p,
                                  generate=self.generate_one, between=self._between_segments if partial else None)
        if partial:
            groups = sample_in_segments(
                prompt_ids, n, self.cfg.rollout.max_new_tokens, seed,
                lambda ids, budget, sd: self.generate_one(ids, temperature, budget, sd, top_k, top_p),
                self._between_segments)
            return [RolloutSample(list(p), r.token_ids, i, torch.tensor(r.logprobs), r.finished,
                                  extra={"versions": r.versions})
                    for i, p, group in zip(indices, prompt_ids, groups, strict=True) for r in group]
        groups = self.generate(prompt_ids, n, temperature, seed, top_k=top_k, top_p=top_p)
        return [RolloutSample(list(p), list(s.token_ids), i, torch.tensor(s.logprobs), s.finished)
                for i, p, group in zip(indices, prompt_ids, groups, strict=True) for s in group]

    def _between_segments(self) -> int:
        """Where a pending weight sync takes effect (partial rollouts); the version the next tokens get."""
        self.ahead.yield_point()
        return self.policy_version

    def generate_one(self, prompt_ids: list[list[int]], temperature: float, max_new_tokens: Budget, seed: int,
                     top_k: int = -1, top_p: float = 1.0) -> list:
        """One continuation of each sequence, at most `max_new_tokens` (one budget, or each sequence's
        own: an agent's turn, a segment)."""
        return [group[0] for group in self.generate(prompt_ids, 1, temperature, seed, top_k, top_p, max_new_tokens)]

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, seed: int, top_k: int = -1,
                 top_p: float = 1.0, max_new_tokens: Budget | None = None):
        self.engines.wake_up()
        size = self.cfg.rollout.vllm_generate_batch_size or len(prompt_ids) or 1
        budget = self.cfg.rollout.max_new_tokens if max_new_tokens is None else max_new_tokens
        out = []
        for start in range(0, len(prompt_ids), size):  # `--rollout.vllm_generate_batch_size` prompts a call
            # seed + start: one vLLM engine seeds prompt i with seed + i, so a split draws what one call would
            part = range(start, min(start + size, len(prompt_ids)))
            out += self.engines.generate_ids(prompt_ids[start : start + size], n, temperature,
                                             budget_slice(budget, part), seed + start, top_k=top_k, top_p=top_p)
        return out

    # -- reporting --------------------------------------------------------------------------
    def _log(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        self.history.append(metrics)
        self.tracker.log_metrics(metrics, step=self.step)
        if not any(k.startswith(("train/", "rollout/")) for k in metrics):
            shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
            print(f"[rl step {self.step}] {shown}", file=sys.stderr, flush=True)
