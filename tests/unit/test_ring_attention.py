"""RingAttention over gloo (`models/ring.py`): two (or three) processes, each holding its share of
every row's columns, give the loss one process gives on the whole batch, and their parameter
gradients sum to its gradients: for packed samples, shared-prompt DPO pairs (a 4-D mask and predecessors) and
padded rows, with rows whose width the ring does not divide, grouped-query attention gathered one
key/value head at a time, a reward model's last-token score and a critic's values, and a model
with sliding-window attention (Mistral's) whose window is shorter than the rows."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rlhf_core.data.batching import pack_batch, pack_pairs, pad_batch
from rlhf_core.infra.network import rendezvous_port

VOCAB = 48


def _sequences(seed: int, lengths: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]  # a prompt, then a response
    return seqs, masks


def _batches():
    seqs, masks = _sequences(0, [7, 12, 5, 9])
    chosen, rejected = seqs[:2], [s[: len(s) // 2] + [4, 5, 6] for s in seqs[:2]]  # shared prompts
    cm, rm = masks[:2], [m[: len(m) // 2] + [1, 1, 1] for m in masks[:2]]
    return {"packed": pack_batch(seqs, masks, row_capacity=19),  # rows of 19 and 14 tokens: odd widths
            "pairs": pack_pairs(chosen, rejected, cm, rm, 24),
            "padded": pad_batch(seqs, masks, 0)}


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True, pad_token_id=0)


def _models(attention: str):
    from transformers import (
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        MistralConfig,
        MistralForCausalLM,
    )

    torch.manual_seed(0)
    lm = LlamaForCausalLM._from_config(_config(), attn_implementation=attention)
    torch.manual_seed(1)
    config = _config()
    config.num_labels = 1
    rm = LlamaForSequenceClassification._from_config(config, attn_implementation=attention)
    torch.manual_seed(2)
    windowed = MistralConfig(**{k: v for k, v in _config().to_dict().items() if k in MistralConfig().to_dict()})
    windowed.sliding_window = 4  # shorter than every row: tokens see only their last 4 positions
    return lm, rm, MistralForCausalLM._from_config(windowed, attn_implementation=attention)


def _objectives(lm, rm, windowed, batches) -> dict[str, torch.Tensor]:
    """Non-linear losses of whole-sample quantities, as DPO's, a reward model's and a critic's are."""
    from rlhf_core.models.forward import (
        loss_token_logprobs,
        per_sample_sum,
        response_index,
        response_values,
        reward_scores,
    )

    out = {}
    for name, batch in batches.items():
        logps = per_sample_sum(loss_token_logprobs(lm, batch), batch)
        out[f"{name}/logps"] = -torch.nn.functional.logsigmoid(logps[0] - logps[1]) + logps.square().mean() * 1e-2
    batch = batches["packed"]
    scores = reward_scores(rm, batch)
    values = response_values(rm, batch, response_index(batch)[0])
    out["scores"] = -torch.nn.functional.logsigmoid(scores[0] - scores[2]) + values.tanh().sum()
    for name in ("packed", "padded"):
        batch = batches[name]
        out[f"window/{name}"] = per_sample_sum(loss_token_logprobs(windowed, batch), batch).square().mean()
    return out


def _run(lm, rm, windowed, batches):
    """Each objective's value and the gradients it gives every parameter."""
    results = {}
    models = {"lm": lm, "rm": rm, "window": windowed}
    for name, loss in _objectives(lm, rm, windowed, batches).items():
        params = [p for model in models.values() for p in model.parameters()]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        named = [f"{m}.{k}" for m, model in models.items() for k, _ in model.named_parameters()]
        results[name] = (loss.item(), {k: g.numpy().copy() for k, g in zip(named, grads, strict=True)
                                       if g is not None})
    return results


def _ring_rank(rank: int, size: int, port: int, out):
    from rlhf_core.models import ring

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        assert ring.setup(size, head_stride=1).rank == rank
        out.put((rank, _run(*_models(ring.NAME), _batches())))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        out.put((rank, repr(e)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"ring{n}")
def ring_results(request):
    """Each rank's results, for a ring of 2 and one of 3 (where blocks pass through a rank that
    neither computed nor needs them, and no row's width divides by the ring)."""
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), rendezvous_port()
    procs = [ctx.Process(target=_ring_rank, args=(r, request.param, port, out)) for r in range(request.param)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            p.kill()
    for rank, result in results.items():
        assert not isinstance(result, str), f"rank {rank}: {result}"
    return results


def test_ring_ranks_give_one_ranks_losses_and_their_gradients_sum_to_its(ring_results):
    from rlhf_core.models.attention import register

    lm, rm, windowed = _models(register())
    whole = _run(lm, rm, windowed, _batches())
    # the window matters here: without it the same weights give another loss
    windowed.config.sliding_window = None
    assert abs(_run(lm, rm, windowed, _batches())["window/packed"][0] - whole["window/packed"][0]) > 1e-3
    assert sorted(ring_results[0]) == sorted(whole)
    for name, (loss, grads) in whole.items():
        ranks = sorted(ring_results)
        for rank in ranks:
            assert ring_results[rank][name][0] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, rank)
        shares = [ring_results[rank][name][1] for rank in ranks]
        assert all(set(share) == set(grads) for share in shares), name
        for key, grad in grads.items():
            summed = torch.from_numpy(sum(share[key] for share in shares))
            assert torch.allclose(summed, torch.from_numpy(grad), rtol=1e-4, atol=1e-6), (name, key)
        # Every rank did part of the work: none holds the whole gradient alone
        embed = {"scores": "rm", "window": "window"}.get(name.split("/")[0], "lm") + ".model.embed_tokens.weight"
        assert all(abs(share[embed]).sum() > 0 for share in shares), name


def test_rings_beside_tensor_parallel_groups_are_one_slice_of_each_position():
    """Ranks in blocks that take the same batches; in a block, AutoTP's groups are consecutive ranks
    (one per ring position) and a ring joins the ranks holding the same slice."""
    from rlhf_core.models.ring import ring_ranks

    assert ring_ranks(4, 2) == [[0, 1], [2, 3]]
    assert ring_ranks(4, 2, tensor_parallel=2) == [[0, 2], [1, 3]]
    assert ring_ranks(12, 3, tensor_parallel=2) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    with pytest.raises(ValueError, match="x --ds.tensor_parallel_size 2 must divide the ranks \\(6"):
        ring_ranks(6, 2, tensor_parallel=2)
