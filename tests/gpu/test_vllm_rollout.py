"""The vLLM rollout engine against the transformers one, on a GPU with vllm installed.

Skipped without CUDA (conftest) or without the `gpu` extra (`pip install 'rlhf-lifecycle[gpu]'`).
"""

import json

import pytest
import torch

pytestmark = pytest.mark.gpu

MAX_NEW = 5


@pytest.fixture(scope="module")
def vllm_engine(prepared):
    pytest.importorskip("vllm")
    from rlhf_core.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(prepared["base"], gpu_memory_utilization=0.3, enforce_eager=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def formatted(prepared):
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout import load_prompt_set, prompt_formatter

    prompts = load_prompt_set(prepared["prompts_test"], "train", max_samples=16, chat=True)
    fmt = prompt_formatter(load_tokenizer(prepared["base"]), apply_chat_template=True)
    return [fmt.prompt_text(p) for p in prompts.prompts]


def test_auto_picks_vllm_on_a_gpu_and_transformers_when_asked(prepared, monkeypatch):
    pytest.importorskip("vllm")
    import rlhf_core.rollout.vllm_engine as vllm_engine
    from rlhf_core.rollout import TransformersEngine, make_engine

    built = []

    class Recorded(vllm_engine.VLLMEngine):  # records the choice without a second engine on the GPU
        def __init__(self, model_path, **kwargs):
            built.append((model_path, kwargs))

    monkeypatch.setattr(vllm_engine, "VLLMEngine", Recorded)
    engine = make_engine(prepared["base"], "auto", add_special_tokens=True)
    assert isinstance(engine, Recorded)
    assert built == [(prepared["base"], {"add_special_tokens": True, "dtype": "bfloat16"})]
    assert isinstance(make_engine(prepared["base"], "transformers"), TransformersEngine) and len(built) == 1


def test_greedy_agrees_with_transformers(prepared, vllm_engine, formatted):
    from rlhf_core.rollout import TransformersEngine

    hf = TransformersEngine.from_pretrained(prepared["base"], dtype=torch.float32)
    expected = hf.generate(formatted, 1, 0.0, MAX_NEW, 0)
    got = vllm_engine.generate(formatted, 2, 0.0, MAX_NEW, 0)
    assert all(len(g) == 2 and g[0] == g[1] for g in got)
    # Different kernels and precision: a random model's near-ties may flip, but rarely.
    same = sum(e[0].token_ids == g[0].token_ids for e, g in zip(expected, got, strict=True))
    assert same >= 0.75 * len(formatted), same


def test_sampling_shape_determinism_and_eos(vllm_engine, formatted):
    a = vllm_engine.generate(formatted, 4, 1.0, MAX_NEW, 7)
    b = vllm_engine.generate(formatted, 4, 1.0, MAX_NEW, 7)
    assert len(a) == len(formatted) and all(len(g) == 4 for g in a)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert any(len({c.token_ids for c in g}) > 1 for g in a)
    tok, eos = vllm_engine.tokenizer, vllm_engine.tokenizer.eos_token_id
    for g in a:
        for c in g:
            assert 1 <= len(c.token_ids) <= MAX_NEW and eos not in c.token_ids[:-1]
            assert c.text == tok.decode(list(c.token_ids), skip_special_tokens=True)


def test_eval_on_vllm_agrees_with_the_transformers_engine(rl_setting, tmp_path, capsys):
    """`rlhf eval` of the RL setting's SFT policy against its random base model, once on vLLM and once
    on the transformers engine: the SFT policy answers most held-out prompts right greedily and the
    base none, far apart in KL, and both engines say so alike (sampling differs, greedy decoding
    only at near-ties)."""
    pytest.importorskip("vllm")
    from pathlib import Path

    from rlhf_core.cli import main

    prep = Path(rl_setting["root"]) / "prep"

    def evaluate(backend: str) -> dict:
        code = main(["eval", "--pretrain", rl_setting["sft"], "--ref_pretrain", str(prep / "base"), "--dataset",
                     str(prep / "data" / "prompts" / "test.jsonl"), "--task", "sort", "--max_samples", "64",
                     "--rollout_backend", backend, "--save_path", str(tmp_path / backend), "--use_mlflow", "false"])
        captured = capsys.readouterr()
        assert code == 0, captured.err[-3000:]
        return json.loads(captured.out)["metrics"]

    on_vllm, on_hf = evaluate("vllm"), evaluate("transformers")
    assert on_vllm["eval/policy/greedy_accuracy"] > 0.8 and on_vllm["eval/reference/greedy_accuracy"] < 0.1
    assert abs(on_vllm["eval/policy/greedy_accuracy"] - on_hf["eval/policy/greedy_accuracy"]) <= 0.05
    assert on_vllm["eval/policy/kl"] > 1.0 and abs(on_vllm["eval/policy/kl"] / on_hf["eval/policy/kl"] - 1) < 0.25
