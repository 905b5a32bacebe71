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


@pytest.mark.parametrize("layout", sorted(batches()))
def test_a_widened_batch_gives_every_sample_the_same_logprobs_and_gradients(model, layout):
    """`Batch.widened` (few matmul shapes, models/shapes.py) adds padding slots only: each sample's
    log-probs and the gradients are the narrow batch's, on the lean path and transformers'."""
    batch = batches()[layout]
    width = batch.input_ids.shape[1]
    wide = batch.widened(width + 5, pad_id=0)  # a multiple that adds slots whatever the width
    assert wide.input_ids.shape == (batch.input_ids.shape[0], width + 5) and batch.widened(1) is batch
    assert torch.all(wide.seq_ids[:, width:] == -1) and torch.all(wide.loss_mask[:, width:] == 0)
    for logprobs in (loss_token_logprobs, token_logprobs):
        runs = []
        for b in (batch, wide):
            model.zero_grad()
            lp = logprobs(model, b)
            per_sample = per_sample_sum(lp, b)
            (per_sample * torch.linspace(0.5, 1.5, b.num_samples)).sum().backward()
            runs.append((per_sample.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
        (narrow_lp, narrow_grads), (wide_lp, wide_grads) = runs
        assert torch.allclose(narrow_lp, wide_lp, atol=1e-5, rtol=1e-5), logprobs.__name__
        for name, g in narrow_grads.items():
            assert (wide_grads[name] - g).abs().max() <= 1e-5 * g.abs().max().clamp(min=1e-6) + 1e-7, name


def test_the_lean_head_gathers_rows_in_multiples_only_where_matmuls_build_a_kernel_per_shape():
    from rlhf_core.infra.precision import Precision
    from rlhf_core.models.shapes import ROWS_MULTIPLE, gathered_rows, width_multiple

    index = torch.tensor([5, 9, 2])
    rows = gathered_rows(index, torch.bfloat16)
    assert len(rows) == ROWS_MULTIPLE and torch.equal(rows[:3], index) and torch.all(rows[3:] == 5)
    assert gathered_rows(index, torch.float32) is index and gathered_rows(index[:0], torch.bfloat16).numel() == 0
    assert width_multiple("cpu", Precision.BF16) == 16 and width_multiple("cpu", Precision.FP32) == 1
    assert width_multiple("cuda", Precision.BF16) == 1  # cuBLAS builds no kernel per shape


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


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_stage_batches_are_widened_where_matmuls_build_a_kernel_per_shape(precision, monkeypatch):
    """SFT's and DPO's batch builders round widths up on a CPU in half precision, not in fp32."""
    from types import SimpleNamespace

    from rlhf_core.config import STAGE_CONFIGS, build_config
    from rlhf_core.infra.precision import Precision
    from rlhf_core.trainers import common

    monkeypatch.setattr(common, "precision_of", lambda ds: Precision(precision))
    tokenizer = SimpleNamespace(pad_token_id=0)
    seqs, masks = examples()
    chosen, rejected, cmask, rmask = pairs()
    rows = [SimpleNamespace(input_ids=s, loss_mask=m) for s, m in zip(seqs, masks, strict=True)]
    built = {}
    for stage in ("sft", "dpo"):
        cfg = build_config(STAGE_CONFIGS[stage], None, {"pretrain": "/m", "dataset": "json@/d", "save_path": "/o",
                                                        "packing_samples": True, "max_len": 24})
        built[stage] = common.batch_builder(cfg, tokenizer, torch.device("cpu"))(rows)
    pair_cfg = build_config(STAGE_CONFIGS["dpo"], None, {"pretrain": "/m", "dataset": "json@/d", "save_path": "/o",
                                                         "packing_samples": True, "max_len": 20})
    built["pairs"] = common.pair_batch_builder(pair_cfg, tokenizer, torch.device("cpu"))(
        [SimpleNamespace(input_ids=s, loss_mask=m) for s, m in zip(chosen, cmask, strict=True)],
        [SimpleNamespace(input_ids=s, loss_mask=m) for s, m in zip(rejected, rmask, strict=True)])
    natural = {"sft": pack_batch(seqs, masks, 24, 0), "dpo": pack_batch(seqs, masks, 24, 0),
               "pairs": pack_pairs(chosen, rejected, cmask, rmask, 40)}
    for name, batch in built.items():
        width = natural[name].input_ids.shape[1]
        assert width % 16, name  # the data's own width is not a multiple already
        assert batch.input_ids.shape[1] == (width + -width % 16 if precision == "bf16" else width), name


def test_a_frozen_cpu_model_casts_its_weights_once_until_they_change(monkeypatch):
    """A DPO reference's forwards reuse its cast weights; an in-place update (a weight sync, the
    best policy restored) is seen at once; a trainable model builds them at every forward."""
    frozen = llama().requires_grad_(False)
    lean_model(frozen)  # the lean object the monkeypatched class builds for
    builds = []
    build = lean_module.LeanLlama._build
    monkeypatch.setattr(lean_module.LeanLlama, "_build", lambda self, mm: builds.append(mm) or build(self, mm))
    batch = batches()["pairs-shared-prompt"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = loss_token_logprobs(frozen, batch)
        assert torch.equal(loss_token_logprobs(frozen, batch), first) and len(builds) == 1
        frozen.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        changed = loss_token_logprobs(frozen, batch)
    assert len(builds) == 2 and not torch.allclose(changed, first, atol=1e-3)
    trainable = llama()
    lean_model(trainable)  # the same lean object for the model from here on
    for _ in range(2):
        with torch.no_grad():
            loss_token_logprobs(trainable, batch)
    assert len(builds) == 4
