"""The lean Llama forward (`models/lean.py`) computes what transformers' `LlamaForCausalLM` computes:
logits and gradients on every batch layout the RL passes build, in fp32 and under bf16 autocast,
and the sampler on it draws the same tokens with the same log-probs as on transformers' forward."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf_core.models import lean as lean_module
from rlhf_core.models.attention import batch_mask, register
from rlhf_core.models.forward import response_index, response_logits
from rlhf_core.models.lean import lean_model, supported
from rlhf_core.rl.experience import RolloutSample, collate
from rlhf_core.rollout.hf import left_pad
from rlhf_core.rollout.sampling import sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")
VOCAB = 64


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
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


def rollout(groups: int = 4, n: int = 3, seed: int = 0) -> list[RolloutSample]:
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 10))]
        for _ in range(n):
            response = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 8))]
            samples.append(RolloutSample(prompt, response, g, torch.zeros(len(response)), True))
    return samples


LAYOUTS = {  # (samples of a prompt, packing): the batches RL passes build
    "shared-prefix": (3, True),  # packed, each prompt once, 4-D mask
    "packed": (1, True),  # packed rows, samples told apart by restarted positions
    "padded": (3, False),  # right-padded rows, 2-D mask
}


def transformers_logits(model, batch, index):
    """`response_logits` on transformers' forward (the lean one switched off)."""
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids, use_cache=False).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    from rlhf_core.models.forward import predicting_index

    return model.lm_head(hidden[predicting_index(batch, index)])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_logits_and_gradients_are_transformers(model, layout, bf16):
    n, packing = LAYOUTS[layout]
    batch, index, mask = collate(rollout(n=n), 0, packing, row_capacity=64)
    assert lean_model(model) is not None
    tol = dict(atol=3e-2, rtol=3e-2) if bf16 else dict(atol=1e-5, rtol=1e-5)
    grads = []
    for lean_on in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = response_logits(model, batch, index) if lean_on else transformers_logits(model, batch, index)
        assert logits.dtype == (torch.bfloat16 if bf16 else torch.float32)
        (logits.float().pow(2) * mask.unsqueeze(-1)).sum().backward()
        grads.append((logits.detach().float(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (ours, our_grads), (theirs, their_grads) = grads
    valid = mask.bool()
    assert torch.allclose(ours[valid], theirs[valid], **tol)
    for name, g in their_grads.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert (our_grads[name] - g).abs().max() / scale < (2e-2 if bf16 else 1e-4), name


def test_a_no_grad_pass_with_reused_weights_gives_exactly_the_training_pass_log_probs(model):
    """PPO's first ratio is exp(new - old) = 1 exactly: the experience pass (no grad, weights
    prepared once) and the training forward (differentiable) must compute the same numbers."""
    batch, index, _ = collate(rollout(), 0, True, row_capacity=64)
    lean = lean_model(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = response_logits(model, batch, index)
        with torch.no_grad(), lean.reusing_weights():
            old = response_logits(model, batch, index)
    assert torch.equal(trained.detach(), old)


def test_reused_weights_are_prepared_once_per_pass_and_see_updates_between_passes(monkeypatch):
    model = llama()
    lean = lean_model(model)
    built = []
    build = lean._build
    monkeypatch.setattr(lean, "_build", lambda mm: built.append(mm) or build(mm))
    batch, index, _ = collate(rollout(), 0, True, row_capacity=64)
    with torch.no_grad(), lean.reusing_weights():
        first = response_logits(model, batch, index)
        again = response_logits(model, batch, index)
    assert len(built) == 1 and torch.equal(first, again)
    with torch.no_grad():  # an optimizer step that does not bump the version counters (fused AdamW)
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        with lean.reusing_weights():
            after = response_logits(model, batch, index)
    assert len(built) == 2 and not torch.allclose(first, after)
    response_logits(model, batch, index)  # outside a pass: built at every call (and differentiable)
    assert len(built) == 3  # the head alone is cast by itself


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_weights_are_a_cast_of_the_concatenation_with_its_gradients(dtype):
    weights = [torch.randn(rows, 8, requires_grad=True) for rows in (8, 4, 4)]
    fused = lean_module._CastCat.apply(dtype, *weights)
    reference = torch.cat(weights).to(dtype)
    assert fused.dtype == dtype and torch.equal(fused, reference)
    upstream = torch.randn_like(reference)
    mine = torch.autograd.grad(fused, weights, upstream)
    theirs = torch.autograd.grad(reference, weights, upstream)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))


def test_batch_masks_are_the_layouts_masks():
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    packed = batch_mask(None, positions)[0, 0]
    assert packed[4].tolist() == [False, False, False, True, True]  # the second sample sees itself only
    assert packed[2].tolist() == [True, True, True, False, False]
    plain = batch_mask(None, torch.arange(4).unsqueeze(0))
    assert torch.equal(plain[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    padded = batch_mask(torch.tensor([[1, 1, 0]]), torch.tensor([[0, 1, 2]]))[0, 0]
    assert padded.tolist() == [[True, False, False], [True, True, False], [True, True, False]]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_sampler_draws_what_it_draws_on_transformers_forward(model, monkeypatch, temperature):
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(6)]
    input_ids, mask = left_pad(prompts, 0)
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv(lean_module.ENV, flag)
        runs.append(sample(model, input_ids, mask, 12, temperature, [2, 5], 0, torch.Generator().manual_seed(7),
                           repeats=3))
    (tokens, logprobs, lengths), (tokens_hf, logprobs_hf, lengths_hf) = runs
    assert torch.equal(tokens, tokens_hf) and torch.equal(lengths, lengths_hf)
    assert torch.allclose(logprobs, logprobs_hf, atol=1e-5)
    if temperature:
        assert lengths.min() < lengths.max()  # rows ended at different steps (and left the batch)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_engine_s_log_probs_are_the_training_forward_s(model, bf16):
    """The engine's log-probs (lean decode with a cache; under the trainer's autocast when it
    trains in bf16) against the trainer's (lean forward over the packed prompt + response): the
    rollout/trainer mismatch metric starts at rounding."""
    from rlhf_core.rollout.hf import TransformersEngine

    class Tokenizer:
        eos_token_id, pad_token_id = 2, 0

    engine = TransformersEngine(model, Tokenizer(), autocast_dtype=torch.bfloat16 if bf16 else None)
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(4)]
    groups = engine.generate_ids(prompts, n=2, temperature=1.0, max_new_tokens=8, seed=1)
    samples = [RolloutSample(prompts[i], list(s.token_ids), i, torch.tensor(s.logprobs), s.finished)
               for i, group in enumerate(groups) for s in group]
    batch, index, resp_mask = collate(samples, 0, True, row_capacity=64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        trained = torch.log_softmax(response_logits(model, batch, index).float(), -1)
    trained = trained.gather(-1, batch.input_ids.reshape(-1)[index].unsqueeze(-1)).squeeze(-1)
    gap = max((trained[i, : s.response_len] - s.rollout_logprobs).abs().max().item() for i, s in enumerate(samples))
    assert gap < (2e-2 if bf16 else 1e-5)
    assert torch.equal(response_index(batch)[0], index)


def test_what_the_lean_forward_does_not_cover_runs_on_transformers(monkeypatch):
    assert supported(llama(attention_bias=True)) is not None
    assert supported(llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})) is not None
    checkpointed = llama()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert lean_model(checkpointed) is None
    plain = llama()
    assert lean_model(plain) is not None
    monkeypatch.setenv(lean_module.ENV, "0")
    assert lean_model(plain) is None


def test_bf16_weights_without_autocast_are_transformers_bf16_forward():
    """Weights held in bf16 (DeepSpeed's bf16 mode on a GPU, a bf16 engine): every op in bf16 as
    transformers runs it, norms computed in fp32 and cast back before the weight."""
    model = llama().to(torch.bfloat16)
    batch, index, mask = collate(rollout(), 0, True, row_capacity=64)
    with torch.no_grad():
        ours = response_logits(model, batch, index)
        theirs = transformers_logits(model, batch, index)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    valid = mask.bool()
    assert torch.allclose(ours[valid].float(), theirs[valid].float(), atol=6e-2, rtol=6e-2)
