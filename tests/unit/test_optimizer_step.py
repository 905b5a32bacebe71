"""trainers/loop.optimizer_step, the one normaliser of every trainer: the loss of a step is the
whole batch's, in value and gradient, however it is split into micro-batches and ranks."""

import threading

import pytest
import torch

from rlhf_core.algos.losses import aggregate_loss, loss_units, sft_loss
from rlhf_core.algos.names import LossAggMode
from rlhf_core.infra.precision import Precision
from rlhf_core.trainers import loop
from rlhf_core.trainers.loop import optimizer_step

B, T, L_MAX = 8, 9, 12
LENGTHS = [9, 2, 5, 1, 0, 7, 3, 8]  # uneven token counts; one empty row


class ThreadRanks:
    """`world` ranks as threads, with the sum all-reduce `optimizer_step` calls."""

    def __init__(self, world: int):
        self.world, self.barrier, self.slots, self.local = world, threading.Barrier(world), [None] * world, threading.local()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        self.slots[self.local.rank] = value.clone()
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0])
        self.barrier.wait()
        return total

    def run(self, fn) -> list:
        out, errors = [None] * self.world, []

        def target(rank):
            self.local.rank = rank
            try:
                out[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


class AccumulatingEngine:
    """What `optimizer_step` relies on of a DeepSpeed engine: `backward` divides the loss by the
    configured accumulation steps, and the step at the accumulation boundary (set by the caller)
    averages gradients over ranks."""

    def __init__(self, weights: torch.Tensor, accumulation_steps: int, ranks: ThreadRanks):
        self.weights = weights.detach().clone().requires_grad_(True)
        self.accumulation_steps, self.ranks, self.grad, self.boundary = accumulation_steps, ranks, None, False

    def train(self):
        pass

    def gradient_accumulation_steps(self):
        return self.accumulation_steps

    def set_gradient_accumulation_boundary(self, boundary: bool):
        self.boundary = boundary

    def backward(self, loss):
        (loss / self.accumulation_steps).backward()

    def step(self):
        if self.boundary:
            self.grad = self.ranks.all_reduce_sum(self.weights.grad) / self.ranks.world


def run_step(split, weights, mask, micro_loss, count, monkeypatch, reduce=True):
    """split: ranks → micro-batches → rows. Each rank's averaged gradient after one step."""
    ranks = ThreadRanks(len(split))
    monkeypatch.setattr(loop, "all_reduce_sum", ranks.all_reduce_sum if reduce else lambda v: v)

    def rank_step(rank):
        engine = AccumulatingEngine(weights, len(split[rank]), ranks)

        def micro_step(eng, rows):
            width = max(max(LENGTHS[r] for r in rows), 1)  # trimmed to its own padded length, as a loader would
            idx = torch.tensor(rows)
            return micro_loss(eng.weights[idx, :width], mask[idx, :width]), {}, len(rows)

        optimizer_step(engine, split[rank], count, micro_step, len(split), Precision.FP32)
        return engine.grad

    return ranks.run(rank_step)


SPLITS = {"micro-batches": [[[0, 1, 2], [3, 4], [5, 6, 7]]],
          "two ranks": [[[0, 1], [2, 3, 4]], [[5], [6, 7]]]}


@pytest.mark.parametrize("mode", list(LossAggMode))
@pytest.mark.parametrize("split", SPLITS)
def test_rl_aggregation_through_optimizer_step_is_split_invariant(mode, split, monkeypatch):
    torch.manual_seed(16)
    weights = torch.randn(B, T, dtype=torch.float64)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).double()

    def micro_loss(w, m):
        return aggregate_loss(w**2, m, mode, L_MAX)

    def count(rows):
        return loss_units(torch.tensor([float(LENGTHS[r]) for r in rows]), mode)

    whole_w = weights.clone().requires_grad_(True)
    whole = aggregate_loss(whole_w**2, mask, mode, L_MAX) / loss_units(mask.sum(-1), mode)
    (expected,) = torch.autograd.grad(whole, whole_w)

    grads = run_step(SPLITS[split], weights, mask, micro_loss, count, monkeypatch)
    for g in grads:  # every rank holds the same averaged gradient: the whole batch's
        torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-9)
    # Not vacuous: normalising by each rank's own units (no all-reduce) gives other gradients.
    if split == "two ranks":
        local = run_step(SPLITS[split], weights, mask, micro_loss, count, monkeypatch, reduce=False)
        assert (local[0] - expected).abs().max() > 1e-3


def test_sft_loss_through_optimizer_step_is_the_mean_nll_of_the_batch(monkeypatch):
    torch.manual_seed(17)
    logps = -torch.rand(B, T, dtype=torch.float64) * 4
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).double()

    whole_w = logps.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(sft_loss(whole_w, mask) / mask.sum(), whole_w)
    assert torch.equal(sft_loss(logps, mask), -(logps * mask).sum())  # what SFTRecipe summed inline

    grads = run_step(SPLITS["two ranks"], logps, mask, sft_loss,
                     lambda rows: sum(LENGTHS[r] for r in rows), monkeypatch)
    for g in grads:
        torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-9)
