"""The optimisation loop every supervised/preference recipe shares.

A recipe counts the loss units of some examples (tokens for SFT, pairs for RM/DPO, examples for
KTO) and computes the *sum* of the loss over a micro-batch; `optimizer_step` divides by the global
count of units in the step, so loss and gradient do not depend on micro-batching or ranks.

Checkpoints (`--save_steps`) hold model, optimizer and scheduler (DeepSpeed's format), the step
(which fixes the data position, `BatchPlan`) and every rank's RNG states, so a resumed run ends
with the weights of an uninterrupted one; `--max_ckpt_num` rotates only this run's tags
(`checkpoints.py`). With `--ckpt_path s3://...` each rank stages its part on its own node and
uploads it, rank 0 writes `latest` once all have, and a resume downloads the tag `latest` names
onto each node. `resume` (`{"requested", "checkpoint", "start_step"}`, into `stage.json`) and
the summary's `train/start_step` and `train/steps_run` show where a run started, so a
`--load_checkpoint` that loaded nothing shows; with no checkpoint yet it starts at step 0.

`RLHF_TEST_KILL_AT_STEP=N[:RANK]` (a test hook) makes the rank (default: every rank) SIGKILL itself
in optimizer step N, after the forward of its last micro-batch: gradients accumulated, no update.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Protocol

import torch

from rlhf_core.data.batching import BatchPlan
from rlhf_core.data.token_budget import consecutive_chunks
from rlhf_core.distributed.engine import all_reduce_sum, autocast, barrier, precision_of
from rlhf_core.distributed.failures import FollowOnError
from rlhf_core.distributed.sharding import share
from rlhf_core.infra import heap
from rlhf_core.models.moe import router_balance
from rlhf_core.trainers import checkpoints, universal


class Recipe(Protocol):
    """May also define `prepare_step(model, micro_batches)`: called on every rank before an optimizer
    step (train mode) and before an evaluation (eval mode) with all of this rank's micro-batches,
    for a quantity of the whole step (KTO's KL reference point)."""

    def count(self, examples: list) -> int: ...

    def micro_step(self, model, examples: list) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """(loss summed over units, metric sums, tokens processed) for one micro-batch."""


class TrainLoop:
    def __init__(self, cfg, engine, recipe: Recipe, train_examples: list, eval_examples: list | None,
                 tracker, rank: int, world_size: int, tokenizer=None):
        self.cfg, self.engine, self.recipe, self.tokenizer = cfg, engine, recipe, tokenizer
        self.train_examples, self.eval_examples = train_examples, eval_examples or []
        self.tracker, self.rank, self.world_size = tracker, rank, world_size
        # The ranks of a tensor-parallel group (consecutive, as DeepSpeed's AutoTP groups them) or of a
        # ring (models/ring.py) see the same batches: batches go by data-parallel rank, and sums over
        # all ranks count each group once. DeepSpeed averages gradients over the ranks outside a
        # tensor-parallel group (a ring's ranks each hold a share of the group's gradient).
        self.duplicates = cfg.ds.duplicates
        self.dp_rank, self.dp_size = rank // self.duplicates, world_size // self.duplicates
        self.averaged_over = world_size // cfg.ds.tensor_parallel_size
        by_tokens = cfg.train.micro_batch_size is None
        self.plan = BatchPlan(len(train_examples), cfg.train.batch_size, cfg.train.micro_batch_size,
                              self.dp_rank, self.dp_size, cfg.train.seed,
                              tuple(e.lengths for e in train_examples) if by_tokens else (),
                              cfg.train.max_tokens_per_gpu, padded=not cfg.ds.packing_samples)
        if self.plan.steps_per_epoch == 0:
            raise ValueError(f"{len(train_examples)} training examples are fewer than one global batch "
                             f"(--train.batch_size {cfg.train.batch_size})")
        self.total_steps = total_steps(cfg, len(train_examples))
        self.step = 0
        self.steps_run = 0  # optimizer steps this process executed (a resume runs total - start)
        self.resume = {"requested": bool(cfg.ckpt.load_enable), "checkpoint": None, "start_step": 0}
        self.history: list[dict] = []

    # -- training --------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        if self.cfg.ckpt.load_enable:
            self.step = self.load_checkpoint()
        self.resume["start_step"] = start = self.step
        initial = self.evaluate(prefix="eval_initial/") if self.step == 0 and self.eval_examples else {}
        self._log(initial)
        bar = self._progress_bar()
        heap.settle()  # the model, optimizer and data are built: later collector passes skip them
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            metrics, tokens = self.train_step()
            self.step += 1
            self.steps_run += 1
            elapsed = time.perf_counter() - t0
            metrics.update({"train/lr": self.engine.get_lr()[0], "train/tokens_per_s": tokens / elapsed,
                            "train/samples_per_s": self.cfg.train.batch_size / elapsed, "train/epoch":
                            self.step / self.plan.steps_per_epoch})
            if self.step % self.cfg.logger.logging_steps == 0 or self.step == self.total_steps:
                self._log(metrics)
            if bar is not None:
                # Postfix first without a refresh: update() then redraws at most every mininterval.
                bar.set_postfix(loss=f"{metrics['train/loss']:.4f}", tok_s=f"{metrics['train/tokens_per_s']:.0f}",
                                refresh=False)
                bar.update(1)
            if self.cfg.eval.steps > 0 and self.step % self.cfg.eval.steps == 0 and self.step < self.total_steps:
                self._log(self.evaluate())
            if self.cfg.ckpt.save_steps > 0 and self.step % self.cfg.ckpt.save_steps == 0:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        final = self.evaluate() if self.eval_examples else {}
        self._log(final)
        summary = {**initial, **final}
        summary.update({"train/steps": self.step, "train/start_step": start, "train/steps_run": self.steps_run})
        if self.history:
            summary["train/final_loss"] = self.history[-1].get("train/loss", float("nan"))
        return summary

    def train_step(self) -> tuple[dict[str, float], int]:
        epoch, index = divmod(self.step, self.plan.steps_per_epoch)
        micro = [[self.train_examples[i] for i in mb] for mb in self.plan.micro_batches(epoch, index)]
        prepare = getattr(self.recipe, "prepare_step", None)
        if prepare is not None:
            self.engine.train()
            with autocast(precision_of(self.cfg.ds)):
                prepare(self.engine, micro)
        micro_step = self.recipe.micro_step
        if kill_requested(self.step + 1, self.rank):
            micro_step = killing_on_last(micro_step, len(micro))
        sums, units, tokens = optimizer_step(self.engine, micro, self.recipe.count, micro_step,
                                             self.averaged_over, precision_of(self.cfg.ds),
                                             duplicates=self.duplicates)
        return {f"train/{k}": (v / units).item() for k, v in sums.items()}, tokens

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, prefix: str = "eval/") -> dict[str, float]:
        """Held-out metrics, averaged over the recipe's units across all ranks."""
        mine = share(self.eval_examples, self.dp_rank, self.dp_size)  # distributed/sharding.py
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
        units = 0
        self.engine.eval()
        micro = no_grad_chunks(self.cfg, mine)
        prepare = getattr(self.recipe, "prepare_step", None)
        if prepare is not None:
            with autocast(precision_of(self.cfg.ds)):
                prepare(self.engine, micro)
        for examples in micro:
            with autocast(precision_of(self.cfg.ds)):
                _, stats, _ = self.recipe.micro_step(self.engine, examples)
            for k, v in stats.items():
                sums[k] = sums[k] + v.detach().float().cpu()
            units += self.recipe.count(examples)
        if not sums:
            return {}
        keys = sorted(sums)
        totals = all_reduce_sum(torch.stack([sums[k] for k in keys] + [torch.tensor(float(units))])) / self.duplicates
        return {f"{prefix}{k}": (v / totals[-1]).item() for k, v in zip(keys, totals[:-1], strict=True)}

    # -- checkpoints -----------------------------------------------------------------------
    checkpoint_run: str | None = None  # the id this run's tags are recorded under (checkpoints.py), rank 0

    def save_checkpoint(self) -> None:
        """Write this step's checkpoint whole or not at all (`checkpoints.begin/commit`): every rank
        writes into the partial folder, rank 0 renames it into place after all have, and only then
        updates `latest` and rotates. A full disk removes the partial folder and raises DiskFullError.
        On s3:// each rank uploads its own part and rank 0 writes `latest` after all have (`_save_remote`)."""
        from rlhf_core.infra import storage
        self._stop_if_abandoned()
        if checkpoints.is_remote(self.cfg.ckpt.path):
            self._save_remote()
            self._record_and_rotate(self.cfg.ckpt.path, f"global_step{self.step}")
            return
        ckpt = Path(self.cfg.ckpt.path)
        tag = f"global_step{self.step}"
        kept = f"the checkpoint in progress ({tag}) was removed; earlier ones and `latest` are as they were"
        # Any rank that fails removes the partial folder: the others wait at the barrier (no commit)
        # until the group stops them, and a full disk gets its space back.
        with storage.saving("--ckpt_path", ckpt, f"checkpoint {tag}", kept,
                            cleanup=lambda: checkpoints.abandon(ckpt, tag)):
            if self.rank == 0:
                checkpoints.begin(ckpt, tag)
            barrier()
            partial = checkpoints.partial_tag(tag)
            try:
                if not self.cfg.ckpt.disable_ds:
                    torch.save(checkpoints.rng_state(), ckpt / partial / f"rng_state_rank{self.rank}.pt")
                    self.engine.save_checkpoint(str(ckpt), tag=partial, client_state={"step": self.step},
                                                save_latest=False)
                self._save_hf(ckpt / partial)
            except Exception as e:
                if (ckpt / partial).is_dir():
                    raise
                # Another rank failed (a full disk, say) and removed the folder under this one's writes.
                raise FollowOnError(f"checkpoint {tag}: its folder was removed by another rank's failure while "
                                    f"rank {self.rank} wrote ({type(e).__name__}: {e})") from e
            barrier()
            if self.rank == 0:
                checkpoints.commit(ckpt, tag, resumable=not self.cfg.ckpt.disable_ds)
        self._record_and_rotate(ckpt, tag)

    def _stop_if_abandoned(self) -> None:
        """Before a checkpoint: every rank stops (AttemptAbandoned) when rank 0 finds the stage's run
        ended by another process, so an attempt its orchestrator gave up and retries writes and rotates
        nothing more in the checkpoint folder the retry resumes from."""
        from rlhf_core.infra.tracking import AttemptAbandoned

        status = self.tracker.ended_elsewhere() if self.rank == 0 and self.tracker is not None else None
        if all_reduce_sum(torch.tensor(float(status is not None))).item() == 0:
            return
        doing = (f"it stopped at step {self.step} of {self.total_steps}: checkpoint global_step{self.step} was not "
                 "written and nothing was published")
        if self.rank == 0:
            raise self.tracker.abandoned(status, doing)
        raise AttemptAbandoned(f"rank 0 found the stage's MLflow run ended by another process; {doing}")

    def _save_hf(self, folder: Path) -> None:
        """`--ckpt.save_hf`: the model in Hugging Face format at `folder/hf` (every rank gathers, rank 0 writes)."""
        if self.cfg.ckpt.save_hf:
            from rlhf_core.models.loading import write_hf_checkpoint

            write_hf_checkpoint(self.engine.module, self.tokenizer, folder, self.rank)

    def _save_remote(self) -> None:
        """This step's checkpoint on S3: each rank writes its part into a staging folder of its own
        on its node, uploads it to `<ckpt_path>/<tag>/` and removes the folder; after every rank has
        uploaded, rank 0 writes `latest` (the checkpoint's last object). A rank that fails leaves the
        others at the barrier until the group is stopped: no `latest` names a half-uploaded tag."""
        from rlhf_core.infra import storage
        uri, tag = self.cfg.ckpt.path.rstrip("/"), f"global_step{self.step}"
        if self.rank == 0:
            checkpoints.begin_remote(uri, tag)
        barrier()
        local = checkpoints.staging_dir(f"rank{self.rank}")
        kept = f"nothing of checkpoint {tag} was uploaded; earlier ones and `latest` at {uri} are as they were"
        try:
            with storage.saving("--ckpt_path", local, f"checkpoint {tag} (staged before its upload to {uri})", kept):
                (local / tag).mkdir()
                if not self.cfg.ckpt.disable_ds:
                    torch.save(checkpoints.rng_state(), local / tag / f"rng_state_rank{self.rank}.pt")
                    self.engine.save_checkpoint(str(local), tag=tag, client_state={"step": self.step},
                                                save_latest=False)
                self._save_hf(local / tag)
            checkpoints.upload_part(local / tag, uri, tag)  # the tag only: DeepSpeed's script beside it stays here
        finally:
            shutil.rmtree(local, ignore_errors=True)
        barrier()
        if self.rank == 0:
            if not self.cfg.ckpt.disable_ds:
                checkpoints.write_latest(uri, tag)
            print(f"checkpoint {tag} uploaded to {uri}/{tag}", file=sys.stderr, flush=True)

    def _record_and_rotate(self, ckpt, tag: str) -> None:
        """Rank 0 lists `tag` as this run's and rotates this run's own checkpoints only: others may share ckpt_path."""
        from rlhf_core.infra import storage
        if self.rank != 0:
            return
        with storage.saving("--ckpt_path", ckpt, checkpoints.CHECKPOINTS, f"checkpoint {tag} is whole and "
                            "`latest` names it; only its entry for rotation is missing"):
            if self.checkpoint_run is None:
                self.checkpoint_run = checkpoints.new_run_id()
            checkpoints.record_tag(ckpt, tag, self.checkpoint_run, self.cfg.stage, self.step)
            checkpoints.rotate(ckpt, self.checkpoint_run, self.cfg.ckpt.max_num, self.cfg.ckpt.max_mem)

    def load_checkpoint(self) -> int:
        """Restore the checkpoint `latest` names (every rank; on s3:// each node downloads it
        first, `checkpoints.fetch`); returns its step, 0 when there is none yet."""
        ckpt = self.cfg.ckpt.path
        tag = checkpoints.latest_tag(ckpt)
        if tag is None:
            if self.rank == 0:
                print(f"--load_checkpoint: no checkpoint in {ckpt} yet; starting from step 0 "
                      "(stage.json records resume.checkpoint null)", file=sys.stderr, flush=True)
            return 0
        # DeepSpeed reads `<folder>/<tag>/`: a download's folder is named by its cache key, not the tag.
        local = checkpoints.fetch(ckpt, tag) if checkpoints.is_remote(ckpt) else Path(ckpt) / tag
        client = universal.load_engine(self.engine, local, local / f"rng_state_rank{self.rank}.pt",
                                       self.cfg.ds.use_universal_ckpt, "--load_checkpoint")
        where = checkpoints.location(ckpt, tag)
        if self.rank == 0:
            # The same run, continued: its earlier tags (and the one resumed from) keep rotating.
            self.checkpoint_run = checkpoints.run_of(ckpt, tag) or checkpoints.new_run_id()
            checkpoints.record_tag(ckpt, tag, self.checkpoint_run, self.cfg.stage, int(client["step"]))
            print(f"resumed from {where} at step {client['step']}", file=sys.stderr, flush=True)
        self.resume["checkpoint"] = where
        return int(client["step"])

    # -- reporting -------------------------------------------------------------------------
    def _log(self, metrics: dict[str, float]) -> None:
        if not metrics:
            return
        if any(k.startswith("train/") for k in metrics):
            self.history.append(metrics)
        if self.rank == 0:
            self.tracker.log_metrics(metrics, step=self.step)
            if not any(k.startswith("train/") for k in metrics):
                shown = ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items()))
                print(f"[step {self.step}] {shown}", file=sys.stderr, flush=True)

    def _progress_bar(self):
        if self.rank != 0 or os.environ.get("RLHF_NO_PROGRESS"):
            return None
        from tqdm import tqdm

        # Under an orchestrator (a Ray job's log, not a terminal) RLHF_PROGRESS_SECONDS spaces the updates.
        return tqdm(total=self.total_steps, initial=self.step, desc=f"{self.cfg.stage} steps", file=sys.stderr,
                    mininterval=float(os.environ.get("RLHF_PROGRESS_SECONDS", "2")), dynamic_ncols=True)


def optimizer_step(engine, micro_batches: list, count, micro_step, world_size: int, precision, duplicates: int = 1
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """One optimizer step of `engine` over this rank's micro-batches, the loss normalised by the
    global count of loss units; every trainer (supervised, preference, RL) uses it.

    `count(micro_batch)`: its loss units (tokens, pairs, samples...); `micro_step(engine,
    micro_batch)`: `(loss summed over its units, metric sums, tokens)`. The sum is divided by the
    units of all micro-batches of all ranks, so the gradient does not depend on the split.
    DeepSpeed divides by its accumulation steps and averages over ranks; the scale multiplies both
    back. The last micro-batch is the accumulation boundary (set explicitly, so a step may have any
    number of micro-batches: `--use_dynamic_batch`; every rank must have the same number, as ZeRO
    reduces at the boundary on all). An MoE model's load-balancing loss (`--aux_loss_coef`,
    `models/moe.py`) joins each micro-batch's loss weighted by its units, and is reported as
    `aux_loss`. `world_size`: the ranks DeepSpeed averages gradients over (each rank of a ring
    holds a share of its group's gradient: they sum to it); `duplicates`: how many ranks see each
    batch (a tensor-parallel group's, a ring's), so sums over all ranks are divided by it. Returns `(metric sums over all ranks, global units, global tokens)`.
    """
    units = all_reduce_sum(torch.tensor(float(sum(count(m) for m in micro_batches)))) / duplicates
    scale = world_size * engine.gradient_accumulation_steps() / units.clamp(min=1.0)
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
    tokens = 0
    balance = router_balance(engine)
    engine.train()
    for i, examples in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
        with autocast(precision), balance.collecting() if balance else contextlib.nullcontext():
            loss_sum, stats, n_tok = micro_step(engine, examples)
        if balance is not None:  # weighted by the micro-batch's units: the step's unit-weighted mean
            aux = balance.loss().to(loss_sum.device) * count(examples)
            loss_sum, stats = loss_sum + balance.coef * aux, {**stats, "aux_loss": aux.detach()}
        engine.backward(loss_sum * scale.to(loss_sum.device))
        engine.step()
        for k, v in stats.items():
            sums[k] = sums[k] + v.detach().float().cpu()
        tokens += n_tok
    keys = sorted(sums)
    totals = all_reduce_sum(torch.stack([sums[k] for k in keys] + [torch.tensor(float(tokens))])) / duplicates
    return dict(zip(keys, totals[:-1], strict=True)), units, int(totals[-1].item())


def no_grad_chunks(cfg, examples: list) -> list[list]:
    """`examples` in consecutive chunks for the passes without gradients (evaluation, statistics):
    `--train.micro_batch_size` each where it is given, else within `--train.max_tokens_per_gpu`
    token slots (`data/token_budget.consecutive_chunks`)."""
    micro = cfg.train.micro_batch_size
    if micro is not None:
        return [examples[i : i + micro] for i in range(0, len(examples), micro)]
    runs = consecutive_chunks([e.lengths for e in examples], cfg.train.max_tokens_per_gpu,
                              padded=not cfg.ds.packing_samples)
    return [[examples[i] for i in run] for run in runs]


KILL_ENV = "RLHF_TEST_KILL_AT_STEP"


def kill_requested(step: int, rank: int) -> bool:
    """Whether `RLHF_TEST_KILL_AT_STEP` (`N` or `N:RANK`) asks this rank to die in step `step` (1-based)."""
    spec = os.environ.get(KILL_ENV, "").strip()
    if not spec:
        return False
    want_step, _, want_rank = spec.partition(":")
    return int(want_step) == step and (not want_rank or int(want_rank) == rank)


def killing_on_last(micro_step, n_micro: int):
    """`micro_step` that SIGKILLs this process after the forward of the `n_micro`-th call (a test hook)."""
    calls = [0]

    def wrapped(model, examples):
        out = micro_step(model, examples)
        calls[0] += 1
        if calls[0] == n_micro:
            print(f"{KILL_ENV}: SIGKILL mid-step (pid {os.getpid()})", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    return wrapped


def total_steps(cfg, num_examples: int) -> int:
    steps = (num_examples // cfg.train.batch_size) * cfg.train.max_epochs
    return min(steps, cfg.train.max_steps) if cfg.train.max_steps else steps


