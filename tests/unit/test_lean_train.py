"""The supervised passes' lean forward (`loss_token_logprobs`, `models/lean_train.py`) gives
transformers' token log-probs and gradients at every loss token, on every batch layout the
SFT/DPO/KTO trainers build, and falls back to transformers' forward where it does not apply."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.data.batching import pack_batch, pack_pairs, pad_batch
from rlhf_core.models import forward
from rlhf_core.models import lean as lean_module
from rlhf_core.models.attention import register
from rlhf_core.models.forward import loss_token_logprobs, per_sample_sum, token_logprobs
from rlhf_core.models.lean import lean_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 64


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation=register()))
        for p in model.parameters():  # livelier than the default init: logits that differ by token
            p.data.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def model():
    return llama()


def examples(n: int = 6, seed: int = 0):
    """Prompt + response sequences with a loss mask on the response (SFT rows)."""
    rng = random.Random(seed)
    seqs, masks = [], []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 10))]
        response = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))]
        seqs.append(prompt + response)
        masks.append([0] * len(prompt) + [1] * len(response))
    return seqs, masks


def pairs(n: int = 5, seed: int = 1):
    rng = random.Random(seed)
    chosen, rejected, cmask, rmask = [], [], [], []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 10))]
        a = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 8))]
        b = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 8))]
        chosen.append(prompt + a)
        rejected.append(prompt + b)
        cmask.append([0] * len(prompt) + [1] * len(a))
        rmask.append([0] * len(prompt) + [1] * len(b))
    return chosen, rejected, cmask, rmask


def batches():
    seqs, masks = examples()
    chosen, rejected, cmask, rmask = pairs()
    return {
        "padded": pad_batch(seqs, masks, 0),
        "packed-rows": pack_batch(seqs, masks, row_capacity=24, pad_id=0),
        "packed-one-row": pack_batch(seqs, masks),
        "pairs-shared-prompt": pack_pairs(chosen, rejected, cmask, rmask, row_capacity=40),
        "pretrain-mode": pack_batch(seqs, [[0] + [1] * (len(s) - 1) for s in seqs], row_capacity=24, pad_id=0),
    }


@pytest.mark.parametrize("layout", sorted(batches()))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_loss_token_logprobs_and_gradients_are_transformers(model, layout, bf16, monkeypatch):
    batch = batches()[layout]
    assert lean_model(model) is not None
    called = []
    selected = forward.selected_hidden
    monkeypatch.setattr(forward, "selected_hidden", lambda *a: called.append(1) or selected(*a))
    weights = torch.linspace(0.5, 1.5, batch.num_samples)
    runs = []
    for lean_on in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            lp = loss_token_logprobs(model, batch) if lean_on else token_logprobs(model, batch)
        assert lp.dtype == torch.float32 and lp.shape == batch.input_ids.shape
        (per_sample_sum(lp, batch) * weights).sum().backward()
        runs.append((lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert called == [1]  # the lean path ran (once: the second run is transformers')
    (ours, our_grads), (theirs, their_grads) = runs
    keep = (batch.loss_mask != 0) & (batch.seq_ids >= 0)
    assert torch.all(ours[~keep] == 0)  # nothing outside the loss tokens
    tol = dict(atol=5e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)
    assert torch.allclose(ours[keep], theirs[keep], **tol)
    for name, g in their_grads.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert (our_grads[name] - g).abs().max() / scale < (3e-2 if bf16 else 1e-4), name


def test_rejected_responses_read_their_first_token_from_the_shared_prompt(model):
    """Without `predecessors`, a rejected response's first token is predicted by the chosen
    response's last position: the lean path must follow the re-pointing too."""
    chosen, rejected, cmask, rmask = pairs()
    batch = pack_pairs(chosen, rejected, cmask, rmask, row_capacity=40)
    with torch.no_grad():
        right = loss_token_logprobs(model, batch)
        batch.predecessors = None
        wrong = loss_token_logprobs(model, batch)
    assert not torch.allclose(right, wrong, atol=1e-3)


def test_unsupported_models_run_transformers_forward_masked_alike(monkeypatch):
    seqs, masks = examples()
    batch = pack_batch(seqs, masks, row_capacity=24, pad_id=0)
    monkeypatch.setattr(forward, "selected_hidden", lambda *a: pytest.fail("the lean path ran"))
    checkpointed = llama()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    biased = llama(attention_bias=True)
    for unsupported in (checkpointed, biased):
        with torch.no_grad():
            lp = loss_token_logprobs(unsupported, batch)
            expected = token_logprobs(unsupported, batch) * batch.loss_mask
        assert torch.equal(lp, expected)
    monkeypatch.setenv(lean_module.ENV, "0")
    with torch.no_grad():
        assert torch.equal(loss_token_logprobs(llama(), batch), token_logprobs(llama(), batch) * batch.loss_mask)


def test_lora_models_run_transformers_forward():
    from rlhf_core.models.loading import apply_lora

    seqs, masks = examples()
    batch = pack_batch(seqs, masks, row_capacity=24, pad_id=0)
    lora = apply_lora(llama(), 4, 8, 0.0, "q_proj,v_proj", False)
    assert lean_model(lora) is None
    with torch.no_grad():
        assert torch.equal(loss_token_logprobs(lora, batch), token_logprobs(lora, batch) * batch.loss_mask)
