"""The experience passes skip what training computes anyway and change no update: a GRPO run whose
first optimizer step of each rollout takes its old log-probs from the training forward (and whose
chunks are packed once for every pass) ends with exactly the weights of a run that recomputes them
all in a separate pass."""

import pytest
import torch

from rlhf_core.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_chunk_collated_again_is_the_same_batch_and_other_tokens_are_not():
    from rlhf_core.rl.experience import RolloutSample, collate

    def samples(last):
        return [RolloutSample([1, 5, 6], [7, 8, last], g, torch.zeros(3), True) for g in range(2) for _ in range(2)]

    first = collate(samples(9), 0, True, 64)
    assert collate(samples(9), 0, True, 64) is first  # new objects, same tokens: packed once
    other = collate(samples(10), 0, True, 64)
    assert other is not first and other[0].input_ids.flatten().tolist().count(10) == 4
    assert collate(samples(9), 0, False, 64) is not first  # another layout


def test_the_kl_and_mismatch_metrics_are_sums_that_ranks_add_before_one_division():
    """`old_logprob_sums` (the controller's pass and the actor's training call both): per token
    |engine - trainer|, per sample the summed KL estimate; two ranks' shares summed give the
    whole batch's metrics, as the all-reduce does."""
    from rlhf_core.rl.experience import old_logprob_metrics, old_logprob_sums

    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    engine = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])]
    ref = [torch.tensor([-1.25, -1.0]), torch.tensor([-0.5])]
    whole = old_logprob_metrics(old_logprob_sums(old, engine, old, ref, "k1"))
    assert whole["rollout/logprob_mismatch"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert whole["rollout/kl"] == pytest.approx((0.25 - 1.0 + 0.0) / 2)  # k1: old - ref, summed per sample
    halves = sum(old_logprob_sums(o, e, o, r, "k1") for o, e, r in (
        (old[:1], engine[:1], ref[:1]), (old[1:], engine[1:], ref[1:])))
    assert old_logprob_metrics(halves) == pytest.approx(whole)
    no_ref = old_logprob_metrics(old_logprob_sums(old, engine, old, None, "k1"))
    assert no_ref["rollout/kl"] == 0.0 and no_ref["rollout/logprob_mismatch"] == whole["rollout/logprob_mismatch"]
    assert old_logprob_metrics(old_logprob_sums([], [], [], None, "k1")) == {"rollout/logprob_mismatch": 0.0,
                                                                           "rollout/kl": 0.0}


def test_samples_and_returned_rows_cross_processes_as_arrays_and_arrive_equal_and_writable():
    """What Ray pickles between the controller and the roles every step: no torch storage
    serialization (a file written per small tensor, tens of milliseconds a step), and the values,
    dtypes (bfloat16 too) and `None`s as they were, in tensors the receiver may modify."""
    import pickle

    from rlhf_core.rl.experience import RolloutSample, unstack

    sample = RolloutSample([1, 5], [7, 8, 9], 3, torch.tensor([-0.5, -1.0, -2.0]), True, reward=0.25,
                           old_logprobs=torch.tensor([-0.1, -0.2, -0.3], dtype=torch.bfloat16),
                           advantages=torch.arange(3.0), extra={"penalty": -1.0})
    wire = pickle.dumps([sample], protocol=5)
    assert b"_rebuild_tensor" not in wire and b"_load_from_bytes" not in wire
    (back,) = pickle.loads(wire)
    assert back.old_logprobs.dtype == torch.bfloat16 and torch.equal(back.old_logprobs, sample.old_logprobs)
    assert torch.equal(back.rollout_logprobs, sample.rollout_logprobs) and torch.equal(back.advantages,
                                                                                         sample.advantages)
    assert back.ref_logprobs is None and back.extra == {"penalty": -1.0} and back.reward == 0.25
    back.advantages += 1  # its own memory
    assert torch.equal(sample.advantages, torch.arange(3.0))

    rows = unstack(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), [3, 1])
    wire = pickle.dumps(rows, protocol=5)
    assert b"_rebuild_tensor" not in wire
    assert [r.tolist() for r in pickle.loads(wire)] == [[1.0, 2.0, 3.0], [4.0]]


def test_a_share_of_samples_crosses_column_by_column_and_arrives_equal():
    """A role's share of a step (`Samples`): each per-token field of every sample in one array, the
    rest as lists; the samples arrive equal (a field that is None in some samples too), in memory of
    their own, and a shard of a `Samples` is one (`sharding.shards`)."""
    import pickle

    from rlhf_core.distributed.sharding import shards
    from rlhf_core.rl.experience import RolloutSample, Samples, _Column

    sent = Samples(RolloutSample([1, 5], list(range(n)), n, torch.randn(n), n % 2 == 0, reward=float(n),
                                 old_logprobs=None if n == 3 else torch.randn(n).to(torch.bfloat16),
                                 advantages=torch.randn(n), extra={"turn": n}) for n in (2, 3, 5))
    wire = pickle.dumps(sent, protocol=5)
    assert b"_rebuild_tensor" not in wire and b"_load_from_bytes" not in wire
    assert isinstance(sent.__reduce__()[1][1]["advantages"], _Column)  # one array for the field
    back = pickle.loads(wire)
    assert isinstance(back, Samples) and len(back) == 3
    for a, b in zip(sent, back, strict=True):
        assert vars(a).keys() == vars(b).keys()
        for k, v in vars(a).items():
            assert (torch.equal(v, vars(b)[k]) and v.dtype == vars(b)[k].dtype) if isinstance(v, torch.Tensor) \
                else v == vars(b)[k]
    back[0].advantages.add_(1)
    assert not torch.equal(back[0].advantages, sent[0].advantages)
    assert torch.equal(back[1].advantages, sent[1].advantages)  # a view of its own sample's values only
    assert all(isinstance(part, Samples) for part in shards(sent, 2, pad=True))
    sent[1].late = 1  # a field one sample alone has: the share still arrives whole, sample by sample
    assert [vars(s).get("late") for s in pickle.loads(pickle.dumps(sent))] == [None, 1, None]


def test_weights_sent_to_the_engines_cross_as_arrays_and_load_as_they_were():
    """The actor's `weights()` (each weight sync through Ray's object store): no torch storage
    serialization; every tensor arrives equal, in its dtype, in memory the engine may load into."""
    import pickle

    from rlhf_core.rl.experience import TensorDict

    state = TensorDict({"w": torch.randn(4, 3), "b": torch.randn(3).to(torch.bfloat16), "step": torch.tensor(7)})
    wire = pickle.dumps(state, protocol=5)
    assert b"_rebuild_tensor" not in wire and b"_load_from_bytes" not in wire
    back = pickle.loads(wire)
    assert back.keys() == state.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in state.items())
    back["w"].zero_()
    assert state["w"].abs().sum() > 0


# A reward with variance inside every group (a digest of the response): group advantages are not
# zero, so the PPO ratio, and through it the old log-probs, shape every update.
REWARD_FILE = """
import zlib
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([(zlib.crc32(q.encode()) % 100) / 100 for q in queries])
"""


@pytest.mark.slow
def test_old_log_probs_left_to_training_give_the_same_updates(prepared, tmp_path, monkeypatch, capsys):
    """Where the old log-probs come from changes no update and no metric: a separate experience
    pass of the actor (before this controller's change, and still with the KL in the reward), the
    actor's training call computing them first (`StepPlan.old_in_training`), and the first optimizer
    step's left to its training forward. The control, old log-probs 0.2 off, changes the updates."""
    import dataclasses
    import re

    from safetensors.torch import load_file

    from rlhf_core.rl.controller import RLController
    from rlhf_core.rl.plan import StepPlan
    from rlhf_core.rl.roles import PolicyRole

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    recomputed = []
    logprobs = PolicyRole.logprobs
    on_policy = StepPlan.on_policy
    plan_step = RLController.plan_step
    weights, metrics = {}, {}
    # separate: every old log-prob from a pass of their own; all: from the training call, before its
    # first update; left: the first step's left to the training forward; shifted (the control): as
    # `all`, each 0.2 off.
    for name, skip, shift, in_training in (("separate", False, 0.0, False), ("all", False, 0.0, True),
                                           ("left", True, 0.0, True), ("shifted", False, 0.2, True)):
        monkeypatch.setattr(StepPlan, "on_policy", on_policy if skip else lambda self, world: set())
        monkeypatch.setattr(PolicyRole, "logprobs", lambda self, samples, sampled=False, shift=shift:
                            recomputed.append(len(samples)) or [lp + shift for lp in logprobs(self, samples, sampled)])
        monkeypatch.setattr(RLController, "plan_step", lambda self, count, keep=in_training: dataclasses.replace(
            plan_step(self, count), old_in_training=keep and plan_step(self, count).old_in_training))
        recomputed.clear()
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--remote_rm_url", str(reward), "--eval.task", "addition", "--advantage_estimator", "group_norm",
                     "--n_samples_per_prompt", "4",
                     "--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "8",
                     "--micro_rollout_batch_size", "8", "--generate_max_len", "6", "--use_kl_loss",
                     "--init_kl_coef", "0.01", "--actor_learning_rate", "1e-3", "--param_dtype", "fp32",
                     "--max_steps", "2", "--use_mlflow", "false", "--save_path", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
        metrics[name] = re.findall(r"\[rl step \d+/\d+\] .*?(kl=\S+ logprob_mismatch=\S+)", err)
        # 32 samples a rollout in optimizer steps of 16: the first step's 16 are not recomputed.
        assert sum(recomputed) == (16 + 16 if skip else 32 + 32), recomputed
    assert len(metrics["separate"]) == 2 and "kl=0," not in metrics["separate"][1], metrics
    for name in ("all", "left"):
        assert weights["separate"].keys() == weights[name].keys()
        for key, value in weights["separate"].items():
            assert torch.equal(value, weights[name][key]), (name, key)
    assert metrics["all"] == metrics["separate"], metrics  # the step's KL to the reference and the mismatch
    assert any(not torch.equal(value, weights["shifted"][key]) for key, value in weights["all"].items()), \
        "old log-probs 0.2 off changed no update: the check above would hold whatever they are"


@pytest.mark.slow
def test_a_token_budget_gives_the_updates_of_fixed_micro_batches(prepared, tmp_path, capsys):
    """`--use_dynamic_batch`: micro-batches of at most `--train_max_tokens_per_gpu` tokens (the
    experience chunks of `--rollout_max_tokens_per_gpu`) instead of a sample count. The loss is
    normalised by the whole step's units, so the weights equal the fixed split's (float rounding of
    the accumulation aside); a budget under one sample's length still trains (one sample a pass)."""
    from safetensors.torch import load_file

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    weights = {}
    for name, flags in (("fixed", ["--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"]),
                        ("budget", ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "64",
                                    "--rollout_max_tokens_per_gpu", "100"]),
                        ("tiny budget", ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "1"])):
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
                     "4", "--rollout_batch_size", "4", "--train_batch_size", "16", "--generate_max_len", "6",
                     "--actor_learning_rate", "1e-3", "--param_dtype", "fp32", "--max_steps", "2", "--use_mlflow",
                     "false", "--save_path", str(tmp_path / name), *flags])
        assert code == 0, capsys.readouterr().err[-3000:]
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
    base = load_file(str(prepared["base"] + "/model.safetensors"))
    moved = max((weights["fixed"][k] - base[k]).abs().max().item() for k in base)
    assert moved > 1e-3, "the runs trained"
    for name in ("budget", "tiny budget"):  # Adam's normalised steps carry the rounding: 1e-5 of 1e-3 moved
        gap = max((weights["fixed"][k] - weights[name][k]).abs().max().item() for k in base)
        assert gap < 0.05 * moved, (name, gap, moved)


@pytest.mark.slow
def test_lora_on_the_actor_and_critic_trains_syncs_merged_weights_and_saves_them_merged(prepared, tmp_path,
                                                                                         capsys):
    """`--lora_rank` in train ppo (OpenRLHF's flags): adapters on the actor and the critic (PPO with a
    critic, GAE). The rollout engine gets the merged weights after every step: the engine's log-probs
    stay the trainer's (a sync of the base weights alone would leave them apart once the adapters
    move); the published policy is a plain model with the adapters merged in, not the base."""
    import re

    from safetensors.torch import load_file

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(reward), "--advantage_estimator", "gae", "--critic_pretrain", prepared["base"],
                 "--rollout_batch_size", "8", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                 "--generate_max_len", "6", "--actor_learning_rate", "5e-3", "--critic_learning_rate", "5e-3",
                 "--param_dtype", "fp32", "--max_steps", "3", "--use_mlflow", "false", "--lora_rank", "8",
                 "--lora_alpha", "16", "--target_modules", "q_proj", "v_proj", "--save_value_network",
                 "--save_path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    mismatch = [float(v) for v in re.findall(r"\[rl step \d+/3\].*logprob_mismatch=([0-9.e+-]+)", err)]
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, mismatch
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    base = load_file(str(prepared["base"] + "/model.safetensors"))
    assert out.keys() == base.keys()  # a plain model: no adapter weights
    moved = [k for k in base if not torch.equal(out[k], base[k])]
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in moved), moved
    # --save_value_network: the trained critic (adapters merged) in the output, as a reward model loads
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "critic")
    assert critic.config.num_labels == 1
    weights = critic.state_dict()
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], base["model.layers.0.self_attn.k_proj.weight"])


def test_moving_average_is_openrlhfs_ema():
    from rlhf_core.rl.roles import moving_average

    ema, current = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 6.0])}
    moving_average(ema, current, 0.75)
    assert torch.allclose(ema["w"], torch.tensor([1.5, 3.0]))


def test_with_ema_no_rank_takes_part_in_a_gather_of_the_policy_at_export(monkeypatch):
    """With `--enable_ema` the output is rank 0's average: a rank that holds none (every rank but 0)
    must not enter the collective gather of split weights (ZeRO-3's or tensor parallelism's) that
    exporting the policy would be, or it waits for rank 0 forever (found with 2 tensor-parallel ranks)."""
    from types import SimpleNamespace

    from rlhf_core.rl import roles

    gathers = []
    monkeypatch.setattr(roles._Checkpointed, "export", lambda self: gathers.append(self.rank) or {"policy": 1})
    for rank, ema in ((0, {"w": torch.ones(1)}), (1, None)):
        role = object.__new__(roles.PolicyRole)
        role.cfg, role.rank, role.ema = SimpleNamespace(train=SimpleNamespace(enable_ema=True)), rank, ema
        assert (role.export() is None) == (rank != 0)
    assert gathers == []
    role.cfg.train.enable_ema = False  # without it every rank exports (gathers) the policy
    assert role.export() == {"policy": 1} and gathers == [1]


@pytest.mark.slow
def test_with_ema_the_output_is_the_moving_average_not_the_policy(prepared, tmp_path, capsys):
    """`--enable_ema --ema_beta 1`: the average never leaves the starting weights, so the output is
    the base model exactly, while the policy (whose samples the engine draws) trained."""
    import re

    from safetensors.torch import load_file

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4",
                 "--rollout_batch_size", "4", "--train_batch_size", "8", "--generate_max_len", "6", "--use_kl_loss",
                 "--init_kl_coef", "0.01", "--actor_learning_rate", "1e-2", "--param_dtype", "fp32", "--max_steps",
                 "2", "--use_mlflow", "false", "--enable_ema", "--ema_beta", "1", "--save_path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    kl = [float(v) for v in re.findall(r"\[rl step \d+/2\].* kl=([0-9.e+-]+)", err)]
    assert kl[-1] > 0, "the policy moved away from the reference (the start)"
    out, base = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(prepared["base"] + "/model.safetensors")
    assert all(torch.equal(out[k], base[k]) for k in base)
