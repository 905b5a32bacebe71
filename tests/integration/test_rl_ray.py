"""The RL stage on Ray worker groups (a 2-CPU local Ray): the same run whatever the placement.

- colocated roles (`--train.colocate_all`: actor, reference, critic and the rollout engine share
  one bundle), separate pools, and rings of two ranks for every model role (`--ring_attn_size 2`:
  the actor, reference and critic split each row's tokens, `models/ring.py`) make the same first
  step (losses, KL, rewards) and weights;
- 2 actor ranks (gloo all-reduce, each its half of every optimizer step) make the same updates as 1,
  and so do rings of 2 ranks (`--ring_attn_size 2`: the actor splits each row's tokens,
  `models/ring.py`) and 2 tensor-parallel ranks (`--ds_tensor_parallel_size 2`: DeepSpeed's AutoTP
  splits the actor's layers; the engine gets the gathered weights);
- a run whose reward function raises fails with the file named; resumed from its checkpoint on
  Ray, it ends with exactly the weights of an uninterrupted run;
- a weight sync to an engine that hangs or dies fails with `EngineSyncError` naming the engine.

`RAY_ADDRESS` is set as in a pipeline's Ray job, and `RLHF_RANKS_ON_RAY=1`, so `rlhf train ppo`
puts every role on Ray (with 0, one rank per role on this one-node CPU cluster stays in the driver).
"""

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

REWARD_FILE = '''
import os
from pathlib import Path
import torch

COUNTER = Path(__file__).with_suffix(".calls")
FAIL_AT = int(os.environ.get("TEST_FAIL_AT_CALL", "0"))

def reward_func(queries, prompts, labels, **kwargs):
    calls = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(calls))
    if calls == FAIL_AT:
        raise RuntimeError("the grader is down")
    out = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):].replace("<|eos|>", "").strip()
        out.append(1.0 if response == label else 0.1 * (len(response) % 3))  # a signal for a random model
    return torch.tensor(out)
'''


@pytest.fixture(scope="module")
def cluster():
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # As a pipeline's Ray job, with Ray actors asked for even where one rank each would stay in the
    # driver on this one-node CPU cluster (`cluster.ranks_stay_in_driver`)
    values = {"RAY_ADDRESS": context.address_info["address"], "RLHF_RANKS_ON_RAY": "1"}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield context
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray.shutdown()


def ppo(prepared, tmp_path, name: str, *flags, capsys, fail_at: int = 0) -> tuple[int, dict | None, str]:
    reward = tmp_path / f"{name}_reward.py"
    if not reward.exists():
        reward.write_text(REWARD_FILE)
    os.environ["TEST_FAIL_AT_CALL"] = str(fail_at)  # the driver calls the reward function
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(reward), "--rollout_batch_size", "8", "--train_batch_size", "8",
                 "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8", "--generate_max_len", "5",
                 "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--param_dtype", "fp32",
                 "--use_mlflow", "false", "--seed", "3", "--save_path", str(tmp_path / f"{name}_out"), *flags])
    captured = capsys.readouterr()
    manifest = json.loads(captured.out) if code == 0 else None
    return code, manifest, captured.err


def weights(tmp_path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / f"{name}_out" / "model.safetensors"))


PPO = ("--advantage_estimator", "gae", "--init_kl_coef", "0.05", "--max_epochs", "2")


def test_colocated_and_separate_roles_make_the_same_first_step(cluster, prepared, tmp_path, capsys, monkeypatch):
    """Also in the driver: what a pipeline's job does on its flow's local Ray (RLHF_RANKS_ON_RAY=0)."""
    runs, errs = {}, {}
    variants = (("separate", ()), ("colocated", ("--colocate_all_models",)), ("ring", ("--ring_attn_size", "2")),
                ("driver", ()))
    for name, extra in variants:
        if name == "driver":  # as a pipeline's job on the local Ray its flow started
            monkeypatch.setenv("RLHF_RANKS_ON_RAY", "0")
        code, manifest, errs[name] = ppo(prepared, tmp_path, name, *PPO, "--max_steps", "1", *extra, capsys=capsys)
        assert code == 0, errs[name][-3000:]
        assert ("RL roles on Ray" in errs[name]) == (name != "driver"), errs[name][-3000:]
        runs[name] = manifest["metrics"]
    assert "every role runs in the job's driver" in errs["driver"]
    assert "in actor+ref+critic+rollout" in errs["colocated"]  # one pool for every role
    for role in ("actor", "reference", "critic"):
        assert f"forward ({role}, " in errs["ring"] and "ring attention (2 ranks" in errs["ring"].split(
            f"forward ({role}, ")[1].splitlines()[0], role
    first = {k: v for k, v in runs["separate"].items() if k.startswith(("train/", "rollout/"))}
    assert {"train/policy_loss", "train/value_loss", "rollout/kl", "rollout/reward_mean"} <= set(first)
    a = weights(tmp_path, "separate")
    # a ring attends by matmul over gathered keys, one rank by the lean forward's SDPA; the driver
    # computes on all its cores (an actor on its CPU share's one thread): sums in another order,
    # which Adam's first step turns into weights ~2e-5 apart (Intel Xeon, AMX), 8.5e-5 for the ring
    # on an AMD EPYC (Zen 4, AVX-512)
    for name, rel, atol in (("colocated", 1e-5, 1e-6), ("driver", 1e-5, 5e-5), ("ring", 1e-4, 2e-4)):
        for key, value in first.items():
            assert runs[name][key] == pytest.approx(value, rel=rel, abs=1e-6 if name == "ring" else 1e-7), (name, key)
        b = weights(tmp_path, name)
        assert all(torch.allclose(a[k], b[k], atol=atol) for k in a), name


def test_two_actor_ranks_or_rings_of_two_make_the_same_updates_as_one(cluster, prepared, tmp_path, capsys):
    # No KL term: where a prompt's samples are alike, their advantages are then exactly zero on every
    # layout. (With one, the actor's tensor-parallel forward and the whole reference's differ in the
    # last bits, so such a micro-batch gets a gradient of ~1e-9 where one rank gets none, and Adam's
    # first step makes that a step of the learning rate's size.)
    grpo = ("--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--init_kl_coef", "0",
            "--max_steps", "2")
    code, one, err = ppo(prepared, tmp_path, "one", *grpo, capsys=capsys)
    assert code == 0, err[-3000:]
    base = load_file(os.path.join(prepared["base"], "model.safetensors"))
    a = weights(tmp_path, "one")
    assert any(not torch.equal(a[k], base[k]) for k in a)  # it trained
    # A ring attends by matmul over gathered keys where one rank runs the lean forward's SDPA: Adam's
    # first steps amplify the rounding where gradients are near zero (1.5e-5 on a v_proj, a 2-core
    # Intel Xeon with AMX, fp32)
    # Tensor parallelism: the actor's layers split over 2 ranks (all-reduced sums in another order,
    # 3.6e-5 apart after Adam's steps on an AMD EPYC, Zen 4 class, fp32); the rollout of step 2 is
    # sampled by the weights gathered from the slices, the output saved whole from them. Both (four
    # actor ranks: a ring of two tensor-parallel pairs): 1.4e-5 apart, the same machine.
    for name, flags, says, atol in [("two", ("--actor_num_gpus_per_node", "2"), "actor: 2 x", 1e-5),
                                    ("ring", ("--ring_attn_size", "2"), "with ring attention (2 ranks", 5e-5),
                                    ("tp", ("--ds_tensor_parallel_size", "2"), "tensor-parallel layers", 5e-5),
                                    ("ring_tp", ("--ring_attn_size", "2", "--ds_tensor_parallel_size", "2"),
                                     "with ring attention (2 ranks split each row; keys and values gathered 1 head(s) "
                                     "at a time) and tensor-parallel layers", 5e-5)]:
        code, run, err = ppo(prepared, tmp_path, name, *grpo, *flags, capsys=capsys)
        assert code == 0, err[-3000:]
        assert says in err
        b = weights(tmp_path, name)
        for k in a:
            assert torch.allclose(a[k], b[k], atol=atol), (name, k, (a[k] - b[k]).abs().max())
        for key in ("train/policy_loss", "rollout/kl", "rollout/reward_mean"):
            assert run["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-5), (name, key)


def test_a_failed_run_resumes_on_ray_to_the_same_weights(cluster, prepared, tmp_path, capsys):
    ckpt = ("--save_steps", "2", "--max_steps", "4")
    code, _, err = ppo(prepared, tmp_path, "whole", *PPO, *ckpt, "--ckpt_path", str(tmp_path / "whole_ckpt"),
                       capsys=capsys)
    assert code == 0, err[-3000:]
    split = ("--ckpt_path", str(tmp_path / "split_ckpt"))
    code, _, err = ppo(prepared, tmp_path, "split", *PPO, *ckpt, *split, capsys=capsys, fail_at=3)
    assert code != 0
    assert "split_reward.py" in err and "the grader is down" in err
    assert (tmp_path / "split_ckpt" / "latest").read_text() == "global_step2"
    assert not (tmp_path / "split_out" / "stage.json").exists()
    code, _, err = ppo(prepared, tmp_path, "split", *PPO, *ckpt, *split, "--load_checkpoint", capsys=capsys)
    assert code == 0, err[-3000:]
    assert "at step 2" in err
    assert (tmp_path / "split_reward.calls").read_text() == "5"  # steps 3 and 4 only, after the failed call
    a, b = weights(tmp_path, "whole"), weights(tmp_path, "split")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_gold_reward_model_alone_starts_the_reward_role_and_is_the_held_out_check(cluster, prepared, tmp_path,
                                                                                   capsys):
    """No verifier, and a reward file trained against: `--eval.reward_model_name_or_path` starts the
    reward role on Ray for the gold model alone; by default the stage evaluates every tenth of the
    run (a check is watched), scores the held-out responses with it (mean and spread), and keeps
    the best policy by its sampled score on the selection prompts."""
    import re

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("\n".join(open(f"{prepared['prompts']}/test.jsonl").read().splitlines()[:16]) + "\n")
    code, manifest, err = ppo(prepared, tmp_path, "gold", "--advantage_estimator", "group_norm",
                              "--n_samples_per_prompt", "2", "--init_kl_coef", "0", "--max_steps", "10",
                              "--eval_dataset", str(held_out), "--eval.reward_model_name_or_path", prepared["base"],
                              capsys=capsys)
    assert code == 0, err[-3000:]
    placed = next(line for line in err.splitlines() if "RL roles on Ray" in line)
    assert "reward: 1 x" in placed and "ref:" not in placed, placed
    m = manifest["metrics"]
    for prefix in ("eval_initial/", "eval/"):  # the reported prompts, before and after
        assert m[f"{prefix}sampled_gold_reward_std"] > 0 and f"{prefix}sampled_gold_reward" in m, m
        assert f"{prefix}sampled_accuracy" not in m  # no verifier
    chosen = {int(step): float(value) for step, value in
              re.findall(r"\[rl step (\d+)\] select/sampled_gold_reward=(-?[\d.]+)", err)}
    assert sorted(chosen) == list(range(11)), chosen  # before training, every step, the last policy
    best = max(chosen, key=lambda step: (chosen[step], -step))
    assert m["best/step"] == best and m["best/value"] == pytest.approx(chosen[best], abs=1e-4)


class StuckEngine:
    """An engine whose weight sync never ends on rank 1 and kills the process on rank 2."""

    def update_weights(self, weights):
        rank = int(os.environ["RANK"])
        if rank == 1:
            time.sleep(3600)
        if rank == 2:
            os._exit(1)
        return True


class Weights:
    def weights(self, checkpoint_format=False):
        return {"w": torch.ones(2)}


@pytest.mark.parametrize("engines,message", [(2, "rollout engine 1: weight sync failed.*no answer to update_weights"),
                                             (3, "rollout engine 2: weight sync failed.*died")])
def test_a_stuck_or_dead_engine_fails_the_sync_naming_it(cluster, engines, message):
    import ray

    from rlhf_core.distributed.resources import cluster_devices, create_pools, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rl.engines import EngineSyncError, RayEngines

    layout = plan_layout({"actor": 1, "rollout": engines}, [["actor", "rollout"]],
                         devices=cluster_devices(ray.cluster_resources()))  # the last case's pool may still be going
    pool = create_pools(layout, timeout_s=60)["actor+rollout"]
    share = layout.roles["actor"].share
    group = RoleGroup(StuckEngine, engines, pool, name="rollout", share=share, timeout_s=60)
    actor = RoleGroup(Weights, 1, pool, name="actor", share=share, timeout_s=60)
    try:
        t = time.monotonic()
        with pytest.raises(EngineSyncError, match=message):
            RayEngines(group, timeout_s=5).sync(actor)
        assert time.monotonic() - t < 30  # the deadline, or at once for a dead engine: never a hang
    finally:
        group.shutdown()
        actor.shutdown()
        pool.remove()
