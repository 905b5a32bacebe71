"""The schedule of rollouts sampled ahead (`rl/ahead.py`): which policy samples which step's batch,
that the sampling runs while the step trains, that its errors reach the training thread, and
that a checkpoint keeps the waiting batches."""

import threading

import pytest

from rlhf_core.rl.ahead import Rollout, RolloutsAhead


class Engines:
    """A stand-in for the engines: records which policy version sampled each step's batch; a
    step's sampling may be held until the test releases it."""

    def __init__(self):
        self.version = 0
        self.sampled: dict[int, int] = {}
        self.hold: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}

    def produce(self, step: int) -> Rollout:
        self.started.setdefault(step, threading.Event()).set()
        if step in self.hold:
            assert self.hold[step].wait(10)
        self.sampled[step] = self.version
        return Rollout([f"sample of {step}"], {}, {}, self.version)


def train(depth: int, steps: int, engines: Engines | None = None, ahead: RolloutsAhead | None = None,
          start: int = 0, last: int | None = None) -> list[tuple[int, int]]:
    """The controller's order for steps `start` to `steps` of a run of `last` steps (default
    `steps`): take, start ahead, (train), wait, sync. Returns (step, staleness)."""
    engines = engines or Engines()
    ahead = ahead or RolloutsAhead(engines.produce, depth)
    out = []
    for step in range(start, steps):
        batch = ahead.take(step)
        ahead.start(step, last or steps)
        ahead.wait()
        engines.version += 1  # the weight sync after the step's training
        out.append((step, engines.version - 1 - batch.version))
    return out


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_each_batch_is_sampled_by_the_policy_depth_updates_before_the_one_that_trains_on_it(depth):
    engines = Engines()
    staleness = train(depth, 8, engines)
    assert engines.sampled == {b: max(0, b - depth) for b in range(8)}
    assert staleness == [(s, min(s, depth)) for s in range(8)]


def test_the_next_batch_is_sampled_while_the_current_step_trains():
    engines = Engines()
    ahead = RolloutsAhead(engines.produce, 1)
    engines.hold[1] = threading.Event()
    ahead.take(0)
    ahead.start(0, 4)
    assert engines.started.setdefault(1, threading.Event()).wait(10)  # step 1's sampling began ...
    assert 1 not in engines.sampled  # ... and is still going while step 0 "trains" here
    engines.hold[1].set()
    ahead.wait()
    assert engines.sampled[1] == 0 and 1 in ahead.ready


def test_nothing_is_sampled_past_the_last_step():
    engines = Engines()
    train(2, 3, engines)
    assert sorted(engines.sampled) == [0, 1, 2]


def test_an_error_while_sampling_ahead_is_raised_in_the_training_thread():
    def produce(step):
        if step == 1:
            raise RuntimeError("engine 0 died")
        return Rollout([], {}, {}, 0)

    ahead = RolloutsAhead(produce, 1)
    ahead.take(0)
    ahead.start(0, 4)
    with pytest.raises(RuntimeError, match="engine 0 died"):
        ahead.wait()
    ahead.start(0, 4)
    ahead.abandon()  # after a failure in training: waits, and the training's error is the one raised
    assert ahead._thread is None


def test_a_checkpoint_keeps_the_waiting_batches_and_a_resume_trains_on_them():
    whole = Engines()
    expected = train(2, 6, whole)

    first = Engines()
    ahead = RolloutsAhead(first.produce, 2)
    train(2, 3, first, ahead, last=6)  # steps 0-2 of 6; batches 3 and 4 wait, sampled by policies 1 and 2
    state = ahead.state_dict()
    assert sorted(state["ready"]) == [3, 4] and state["next_step"] == 5

    resumed = Engines()
    resumed.version = 3  # the restored actor's weights, pushed to the engines
    ahead = RolloutsAhead(resumed.produce, 2)
    ahead.load_state_dict(state, 3)
    assert train(2, 6, resumed, ahead, start=3) == expected[3:]
    assert sorted(resumed.sampled) == [5]  # 3 and 4 came from the checkpoint, not sampled again


def test_a_checkpoint_of_the_synchronous_loop_has_nothing_ahead():
    engines = Engines()
    ahead = RolloutsAhead(engines.produce, 1)
    ahead.load_state_dict(None, 4)
    assert ahead.take(4).version == 0 and ahead.next_step == 5


TIMED_REWARD = '''
import time
from pathlib import Path

import torch

LOG = Path(__file__).with_suffix(".calls")

def reward_func(queries, prompts, labels, **kwargs):
    with LOG.open("a") as log:
        log.write(f"{time.monotonic()}\\n")
    return torch.zeros(len(queries))
'''


def test_a_real_run_samples_the_next_batch_while_the_step_trains(prepared, tmp_path, capsys, monkeypatch,
                                                                 one_torch_thread):
    """`rlhf train ppo --async_train`: the next batch's reward call, after its generation, begins
    between the start of a step and the end of its training (held 1 s longer here), so sampling
    ran beside the experience passes and the training; synchronously it never does."""
    import time

    from rlhf_core.cli import main
    from rlhf_core.rl.controller import RLController

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    starts: list[float] = []
    ends: list[float] = []
    train, train_step = RLController.train, RLController.train_step

    def slow_train(self, samples, plan):
        out = train(self, samples, plan)
        time.sleep(1.0)
        ends.append(time.monotonic())
        return out

    def timed_step(self):
        starts.append(time.monotonic())
        return train_step(self)

    monkeypatch.setattr(RLController, "train", slow_train)
    monkeypatch.setattr(RLController, "train_step", timed_step)
    overlaps = {}
    for mode, extra in (("sync", []), ("async", ["--async_train"])):
        reward = tmp_path / f"{mode}_reward.py"
        reward.write_text(TIMED_REWARD)
        starts.clear()
        ends.clear()
        assert main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--input_key", "prompt", "--label_key", "answer", "--remote_rm_url", str(reward),
                     "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                     "--generate_max_len", "4", "--max_steps", "3", "--save_path", str(tmp_path / mode),
                     "--use_mlflow", "false", *extra]) == 0, capsys.readouterr().err[-3000:]
        calls = [float(t) for t in reward.with_suffix(".calls").read_text().split()]
        assert len(calls) == 3  # one reward call per batch, each batch sampled once
        # batch t + 1's reward call began inside step t's training
        steps = enumerate(zip(starts[:-1], ends[:-1], strict=True))
        overlaps[mode] = [start < calls[t + 1] < end for t, (start, end) in steps]
    assert overlaps == {"sync": [False, False], "async": [True, True]}, overlaps
