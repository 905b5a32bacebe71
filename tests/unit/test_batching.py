import torch

from rlhf_core.algos.losses import sft_loss
from rlhf_core.data.batching import BatchPlan, pack_batch, pack_pairs, pad_batch, shared_prefix_len
from rlhf_core.models.forward import per_sample_sum, reward_scores, token_logprobs
from rlhf_core.models.loading import load_causal_lm, load_reward_model, load_tokenizer


def _sequences(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs, masks = [], []
    for i in range(n):
        length = int(torch.randint(4, 20, (1,), generator=g))
        ids = torch.randint(10, 100, (length,), generator=g).tolist()
        prompt = 1 + i % 3
        seqs.append(ids)
        masks.append([0] * prompt + [1] * (length - prompt))
    return seqs, masks


def test_packed_and_padded_give_same_per_sample_logprobs_and_loss(prepared):
    model = load_causal_lm(prepared["base"]).eval()
    seqs, masks = _sequences()
    padded, packed = pad_batch(seqs, masks, pad_id=0), pack_batch(seqs, masks)
    rows = pack_batch(seqs, masks, row_capacity=24)
    assert packed.input_ids.shape == (1, sum(map(len, seqs)))
    assert rows.input_ids.shape[0] > 1 and rows.input_ids.shape[1] <= 24
    with torch.no_grad():
        lp_pad = token_logprobs(model, padded)
        per_pad = per_sample_sum(lp_pad, padded)
        for batch in (packed, rows):
            lp = token_logprobs(model, batch)
            assert torch.allclose(per_pad, per_sample_sum(lp, batch), atol=1e-5, rtol=0)
            assert torch.allclose(sft_loss(lp_pad, padded.loss_mask), sft_loss(lp, batch.loss_mask), atol=1e-5)
    # With positions that do not restart, samples would attend to each other: the check can fail.
    leaky = pack_batch(seqs, masks)
    leaky.position_ids = torch.arange(leaky.input_ids.shape[1])[None]
    with torch.no_grad():
        assert not torch.allclose(per_sample_sum(token_logprobs(model, leaky), leaky), per_pad, atol=1e-3)


def test_reward_scores_match_plain_transformers_and_packing(prepared):
    tok = load_tokenizer(prepared["tokenizer"])
    ours = load_reward_model(prepared["base"], tok.pad_token_id).eval()
    seqs, masks = _sequences(4, seed=1)
    with torch.no_grad():
        padded = reward_scores(ours, pad_batch(seqs, masks, tok.pad_token_id))
        packed = reward_scores(ours, pack_batch(seqs, masks))
        rows = reward_scores(ours, pack_batch(seqs, masks, row_capacity=20, pad_id=tok.pad_token_id))
        plain = ours(**{k: v for k, v in zip(("input_ids", "attention_mask"),
                                               (pad_batch(seqs, masks, tok.pad_token_id).input_ids,
                                                pad_batch(seqs, masks, tok.pad_token_id).attention_mask),
                                               strict=True)}).logits.squeeze(-1)
    assert torch.allclose(padded, packed, atol=1e-5) and torch.allclose(padded, rows, atol=1e-5)
    assert torch.allclose(padded, plain, atol=1e-5)


def test_batch_plan_partitions_each_global_batch_across_ranks():
    n, global_batch = 100, 16
    one = BatchPlan(n, global_batch, 4, 0, 1, seed=3)
    two = [BatchPlan(n, global_batch, 4, r, 2, seed=3) for r in range(2)]
    assert one.steps_per_epoch == 6
    for step in range(one.steps_per_epoch):
        whole = sorted(i for mb in one.micro_batches(0, step) for i in mb)
        split = sorted(i for p in two for mb in p.micro_batches(0, step) for i in mb)
        assert whole == split and len(set(whole)) == global_batch
        assert all(len(mb) == 4 for mb in two[0].micro_batches(0, step))
    assert one.micro_batches(0, 0) != one.micro_batches(1, 0)  # reshuffled per epoch
    assert one.micro_batches(1, 2) == BatchPlan(n, global_batch, 4, 0, 1, seed=3).micro_batches(1, 2)


def test_a_batch_plan_by_tokens_partitions_each_step_alike_on_every_rank():
    """No micro-batch size: each rank cuts its share by the token budget into as many micro-batches
    as the rank that needs most; the step's data is the fixed-size plan's."""
    n, global_batch = 64, 16
    lengths = tuple((5 + (7 * i) % 40,) for i in range(n))
    fixed = BatchPlan(n, global_batch, 4, 0, 1, seed=3)
    ranks = [BatchPlan(n, global_batch, None, r, 2, seed=3, lengths=lengths, token_budget=60) for r in range(2)]
    for step in range(fixed.steps_per_epoch):
        split = [p.micro_batches(0, step) for p in ranks]
        assert len(split[0]) == len(split[1]) > 1
        assert sorted(i for mbs in split for mb in mbs for i in mb) == sorted(i for mb in fixed.micro_batches(0, step)
                                                                              for i in mb)
    one = BatchPlan(n, global_batch, None, 0, 1, seed=3, lengths=lengths, token_budget=16192)
    assert len(one.micro_batches(0, 0)) == 1  # the whole step fits one


def test_packed_rows_take_the_width_that_wastes_least():
    from rlhf_core.data.batching import first_fit_rows, least_padded_rows

    def slots(lengths, width):
        rows = first_fit_rows(lengths, width)
        return len(rows) * max(sum(lengths[i] for i in members) for members in rows)

    g = torch.Generator().manual_seed(0)
    fixed, chosen = [], []
    for _ in range(50):
        lengths = torch.randint(16, 36, (32,), generator=g).tolist()
        rows = least_padded_rows(lengths, 64)
        width = max(sum(lengths[i] for i in members) for members in rows)
        assert max(lengths) <= width <= 64 and sorted(i for r in rows for i in r) == list(range(32))
        batch = pack_batch([[5] * n for n in lengths], [[1] * n for n in lengths], row_capacity=64)
        assert batch.input_ids.numel() == slots(lengths, width) <= slots(lengths, 64)
        assert int((batch.seq_ids >= 0).sum()) == sum(lengths)
        fixed.append(slots(lengths, 64) / sum(lengths))
        chosen.append(batch.input_ids.numel() / sum(lengths))
    # Rows of exactly 64 waste ~10% on these lengths (the last row runs mostly empty); the chosen width ~4%.
    assert sum(fixed) / 50 > 1.08 and sum(chosen) / 50 < 1.05
    assert least_padded_rows([70, 3], 64) == [[0], [1]]  # a sample longer than the rows: max_len checks fail it


def _pairs(n=6, seed=1):
    """Chosen/rejected sequences with a common prompt (no loss) and different responses."""
    g = torch.Generator().manual_seed(seed)
    chosen, rejected, cmask, rmask = [], [], [], []
    for _ in range(n):
        prompt = torch.randint(10, 100, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        a = torch.randint(10, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        b = a[:1] + torch.randint(10, 100, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        chosen.append(prompt + a)
        rejected.append(prompt + b)  # same first response token: it carries loss, so it is not shared
        cmask.append([0] * len(prompt) + [1] * len(a))
        rmask.append([0] * len(prompt) + [1] * len(b))
    return chosen, rejected, cmask, rmask


def test_shared_prefix_stops_where_either_sequence_carries_loss():
    assert shared_prefix_len([1, 2, 3, 4], [1, 2, 3, 5], [0, 0, 1, 1], [0, 0, 1, 1]) == 2
    assert shared_prefix_len([1, 2, 3], [1, 9, 3], [0, 0, 0], [0, 0, 0]) == 1
    assert shared_prefix_len([1, 2], [1, 2, 3], [0, 0], [0, 1, 1]) == 1


def test_pairs_with_a_shared_prompt_give_the_logprobs_scores_and_gradients_of_separate_sequences(prepared):
    chosen, rejected, cmask, rmask = _pairs()
    n = len(chosen)
    shared = pack_pairs(chosen, rejected, cmask, rmask, row_capacity=48)
    apart = pack_batch(chosen + rejected, cmask + rmask, row_capacity=24)
    assert shared.num_samples == apart.num_samples == 2 * n and len(shared.predecessors) == n
    tokens = sum(map(len, chosen + rejected))
    assert int((shared.seq_ids >= 0).sum()) < tokens  # the prompts really are computed once

    model = load_causal_lm(prepared["base"]).train()
    per = []
    for batch in (shared, apart):
        model.zero_grad()
        lp = per_sample_sum(token_logprobs(model, batch), batch)
        (lp * torch.linspace(0.5, 1.5, 2 * n)).sum().backward()
        per.append((lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    for other in per[1:]:
        assert torch.allclose(per[0][0], other[0], atol=1e-4, rtol=0)
        assert max((per[0][1][k] - other[1][k]).abs().max().item() for k in per[0][1]) < 1e-4
    # Without the re-pointed predecessors, each rejected response's first token would be read
    # from the chosen response's last logits: the check can fail.
    broken = pack_pairs(chosen, rejected, cmask, rmask, row_capacity=48)
    broken.predecessors = None
    with torch.no_grad():
        assert not torch.allclose(per_sample_sum(token_logprobs(model, broken), broken)[n:], per[1][0][n:], atol=1e-3)

    tok = load_tokenizer(prepared["base"])
    rm = load_reward_model(prepared["base"], tok.pad_token_id).eval()
    with torch.no_grad():
        assert torch.allclose(reward_scores(rm, shared), reward_scores(rm, apart), atol=1e-4, rtol=0)


def test_an_rl_micro_batch_computes_each_prompt_once_with_the_logprobs_values_and_gradients_of_padding(prepared):
    from rlhf_core.models.forward import response_logprobs, response_values
    from rlhf_core.rl.experience import RolloutSample, collate

    g = torch.Generator().manual_seed(3)
    samples = []
    for p in range(4):  # 4 prompts x 3 samples, interleaved as a permuted rollout would leave them
        prompt = torch.randint(10, 100, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(3):
            response = torch.randint(10, 100, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            samples.append(RolloutSample(prompt, response, p, torch.zeros(len(response)), True))
    samples = samples[::2] + samples[1::2]
    shared, index, mask = collate(samples, 0, packing=True, row_capacity=64)
    apart, index_apart, mask_apart = collate(samples, 0, packing=False, row_capacity=64)
    assert int((shared.seq_ids >= 0).sum()) < sum(len(s.prompt_ids) + s.response_len for s in samples)
    assert len(shared.predecessors) > 0 and torch.equal(mask, mask_apart)
    # rounded up to a width of few matmul shapes (models/shapes.py): the same samples, more padding
    wide, index_wide, mask_wide = collate(samples, 0, packing=True, row_capacity=64, width_multiple=16)
    assert shared.input_ids.shape[1] % 16 and wide.input_ids.shape[1] % 16 == 0 and torch.equal(mask, mask_wide)

    model = load_causal_lm(prepared["base"]).train()
    per = []
    for batch, idx in ((shared, index), (apart, index_apart), (wide, index_wide)):
        model.zero_grad()
        lp = response_logprobs(model, batch, idx, temperature=0.7)
        (lp * mask * torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)).sum().backward()
        per.append((lp.detach() * mask, {k: p.grad.clone() for k, p in model.named_parameters()}))
    for other in per[1:]:
        assert torch.allclose(per[0][0], other[0], atol=1e-4, rtol=0)
        assert max((per[0][1][k] - other[1][k]).abs().max().item() for k in per[0][1]) < 1e-4

    critic = load_reward_model(prepared["base"], 0).eval()
    with torch.no_grad():
        assert torch.allclose(response_values(critic, shared, index) * mask,
                              response_values(critic, apart, index_apart) * mask, atol=1e-4, rtol=0)
        # Without the re-pointed predecessors a later sibling's first token would be read from the
        # previous sibling's last position: the comparison above can fail.
        shared.predecessors = None
        assert not torch.allclose(response_logprobs(model, shared, index) * mask,
                                  response_logprobs(model, apart, index_apart) * mask, atol=1e-3)
