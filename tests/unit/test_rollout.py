"""Rollout engines: the transformers engine on CPU, and the backend factory's choices."""

import pytest
import torch

from rlhf_core.infra.settings import ConfigError
from rlhf_core.rollout import Completion, TransformersEngine, make_engine, prompt_formatter
from rlhf_core.rollout.hf import left_pad
from rlhf_core.rollout.prompts import load_prompt_set

MAX_NEW = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(prepared):
    return TransformersEngine.from_pretrained(prepared["base"], batch_size=8)


@pytest.fixture(scope="module")
def formatted(prepared, engine):
    prompts = load_prompt_set(prepared["prompts_test"], "train", max_samples=6, chat=True)
    fmt = prompt_formatter(engine.tokenizer, apply_chat_template=True)
    # Different lengths, so batches really are left-padded.
    return [fmt.prompt_text(p) for p in prompts.prompts] + [fmt.prompt_text("add 1+2=")]


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_greedy_matches_unbatched_hf_generate(engine, formatted):
    got = engine.generate(formatted, n=2, temperature=0.0, max_new_tokens=MAX_NEW, seed=0)
    assert len(got) == len(formatted) and all(len(g) == 2 and g[0] == g[1] for g in got)
    tok, model = engine.tokenizer, engine.model
    for text, (completion, _) in zip(formatted, got, strict=True):
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        expected = out[0, enc["input_ids"].shape[1] :].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id) + 1]
        assert list(completion.token_ids) == expected
        assert completion.text == tok.decode(expected, skip_special_tokens=True)


def test_sampling_is_seeded_and_diverse(engine, formatted):
    a = engine.generate(formatted, n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
    b = engine.generate(formatted, n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=7)
    c = engine.generate(formatted, n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=8)
    assert a == b and a != c
    assert all(len(g) == 4 and all(isinstance(x, Completion) for x in g) for g in a)
    assert any(len({x.token_ids for x in g}) > 1 for g in a), "temperature 1 gave identical samples everywhere"
    eos = engine.tokenizer.eos_token_id
    for g in a:
        for x in g:
            assert 1 <= len(x.token_ids) <= MAX_NEW and eos not in x.token_ids[:-1]


def test_sampling_leaves_the_callers_rng_alone(engine, formatted):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    engine.generate(formatted[:2], n=2, temperature=1.0, max_new_tokens=3, seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_factory_picks_transformers_on_cpu_and_refuses_vllm_where_it_is_missing(prepared, monkeypatch):
    import rlhf_core.rollout as rollout

    assert isinstance(make_engine(prepared["base"], "transformers"), TransformersEngine)
    if not torch.cuda.is_available():  # vLLM's CPU build is installed here, and still not the default
        assert rollout.vllm_available() and isinstance(make_engine(prepared["base"], "auto"), TransformersEngine)
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    with pytest.raises(ConfigError, match="--rollout_backend vllm: vLLM is not installed for this machine"):
        make_engine(prepared["base"], "vllm")
    with pytest.raises(ConfigError, match="--rollout_backend 'tpu'"):
        make_engine(prepared["base"], "tpu")


def test_bad_requests_are_refused(engine):
    with pytest.raises(ValueError, match="n must be"):
        engine.generate(["x"], n=0, temperature=1.0, max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(["x"], n=1, temperature=-1.0, max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate_ids([[1, 2]], n=1, temperature=1.0, max_new_tokens=2, seed=0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be"):
        engine.generate_ids([[1, 2]], n=1, temperature=1.0, max_new_tokens=2, seed=0, top_k=-2)


def _token_prompts(engine, formatted):
    return [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in formatted]


def rows_counted(model):
    """`model` as the sampler calls it, and the list of how many rows each of its forwards took."""
    rows = []

    class Counting:
        config = model.config

        def __call__(self, **kw):
            rows.append(kw["input_ids"].shape[0])
            return model(**kw)

    return Counting(), rows


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_the_policys_at_the_temperature(engine, formatted, temperature):
    """Each recorded log-prob equals an exact forward pass over prompt + response at logits / T,
    and a prompt sampled in a left-padded batch gets the same tokens as the same prompt alone."""
    from rlhf_core.data.batching import pad_batch
    from rlhf_core.models.forward import response_index, response_logprobs

    prompts = _token_prompts(engine, formatted)
    groups = engine.generate_ids(prompts, n=3, temperature=temperature, max_new_tokens=MAX_NEW, seed=5)
    flat = [(p, s) for p, g in zip(prompts, groups, strict=True) for s in g]
    assert all(len(s.token_ids) == len(s.logprobs) >= 1 for _, s in flat)
    assert all(s.finished == (s.token_ids[-1] in engine.eos_ids) for _, s in flat)
    batch = pad_batch([p + list(s.token_ids) for p, s in flat],
                      [[0] * len(p) + [1] * len(s.token_ids) for p, s in flat], engine.pad_id)
    index, mask = response_index(batch)
    with torch.no_grad():
        recomputed = response_logprobs(engine.model, batch, index, temperature)
    for i, (_, s) in enumerate(flat):
        assert torch.allclose(recomputed[i, : len(s.logprobs)], torch.tensor(s.logprobs), atol=1e-4)
    again = engine.generate_ids(prompts, n=3, temperature=temperature, max_new_tokens=MAX_NEW, seed=5)
    assert again == groups  # a seed fixes the samples
    assert engine.generate_ids(prompts, n=3, temperature=temperature, max_new_tokens=MAX_NEW, seed=6) != groups


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (3, 1.0), (-1, 0.6), (5, 0.8)])
def test_top_k_and_top_p_draw_from_and_report_the_filtered_distribution(engine, formatted, top_k, top_p):
    """Every draw lies in the filtered set of the policy's logits at that step, and its recorded
    log-prob is the filtered, renormalised distribution's (what vLLM's `processed_logprobs` report);
    top-k 1 is greedy."""
    from rlhf_core.algos.nucleus import filter_logits

    prompts = _token_prompts(engine, formatted)
    groups = engine.generate_ids(prompts, n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=5, top_k=top_k,
                                 top_p=top_p)
    gaps = []
    for prompt, group in zip(prompts, groups, strict=True):
        for s in group:
            ids = torch.tensor([prompt + list(s.token_ids)])
            with torch.no_grad():
                logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float()
            filtered = torch.log_softmax(filter_logits(logits, top_k, top_p), -1)
            drawn = ids[0, len(prompt):, None]
            assert filtered.gather(-1, drawn).isfinite().all(), "a token outside the filtered set was drawn"
            assert torch.allclose(filtered.gather(-1, drawn)[:, 0], torch.tensor(s.logprobs), atol=1e-4)
            gaps.append((torch.log_softmax(logits, -1).gather(-1, drawn)[:, 0] - torch.tensor(s.logprobs)).abs().max())
    assert max(gaps) > 1e-3, "the filter changed nothing"
    if top_k == 1:
        greedy = engine.generate_ids(prompts, n=1, temperature=0.0, max_new_tokens=MAX_NEW, seed=5)
        assert [[s.token_ids for s in g] for g in groups] == [[g[0].token_ids] * 3 for g in greedy]


def test_update_weights_changes_what_the_engine_samples(prepared, formatted):
    from rlhf_core.models.tiny import build_tiny_llama

    engine = TransformersEngine.from_pretrained(prepared["base"], batch_size=8)
    prompts = _token_prompts(engine, formatted)
    before = engine.generate_ids(prompts, 1, 0.0, MAX_NEW, 0)
    other = build_tiny_llama(engine.tokenizer, seed=7)
    engine.update_weights(other.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(engine.model.parameters(), other.parameters(), strict=True))
    assert engine.generate_ids(prompts, 1, 0.0, MAX_NEW, 0) != before
    with pytest.raises(ValueError, match="do not match"):
        engine.update_weights({"not.a.weight": torch.zeros(1)})


def test_one_prefill_per_prompt_draws_what_repeated_prompts_draw(engine, formatted):
    from rlhf_core.rollout.sampling import sample

    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in formatted]
    input_ids, mask = left_pad(ids, engine.pad_id)
    model, rows = rows_counted(engine.model)
    args = (MAX_NEW, 1.0, engine.eos_ids, engine.pad_id)
    once = sample(model, input_ids, mask, *args, torch.Generator().manual_seed(5), repeats=4)
    assert rows[0] == len(ids)  # the prefill ran on each prompt once
    repeated = sample(engine.model, input_ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0), *args,
                      torch.Generator().manual_seed(5))
    assert torch.equal(once[0], repeated[0]) and torch.equal(once[2], repeated[2])
    assert torch.allclose(once[1], repeated[1], atol=1e-5)
    assert len({tuple(r) for r in once[0].tolist()}) > len(ids)  # the samples of a prompt differ


def test_the_preallocated_kv_cache_samples_what_transformers_cache_samples(engine, formatted, monkeypatch):
    from transformers import DynamicCache

    from rlhf_core.models.lean import ENV
    from rlhf_core.rollout import sampling

    monkeypatch.setenv(ENV, "0")  # transformers' forward, which the cache serves (Llamas run models/lean.py)
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in formatted]
    input_ids, mask = left_pad(ids, engine.pad_id)
    args = (MAX_NEW, 1.0, engine.eos_ids, engine.pad_id)
    ours = sampling.sample(engine.model, input_ids, mask, *args, torch.Generator().manual_seed(3), repeats=3)
    assert isinstance(sampling.kv_cache(engine.model, 8).layers[0], sampling._PreallocatedLayer)
    monkeypatch.setattr(sampling, "kv_cache", lambda model, capacity: DynamicCache(config=model.config))
    theirs = sampling.sample(engine.model, input_ids, mask, *args, torch.Generator().manual_seed(3), repeats=3)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
    assert torch.allclose(ours[1], theirs[1], atol=1e-5)


def test_inverse_cdf_draws_follow_the_distribution_and_never_pick_an_impossible_token():
    from rlhf_core.rollout.sampling import inverse_cdf_draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).repeat(20000, 1)
    draws = inverse_cdf_draw(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs[0], atol=0.015)
    again = inverse_cdf_draw(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)


def test_rows_that_ended_leave_the_batch_without_changing_what_the_others_generate(engine, formatted):
    from rlhf_core.rollout.sampling import sample

    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in formatted]
    input_ids, mask = left_pad(ids, engine.pad_id)
    free, _, _ = sample(engine.model, input_ids, mask, MAX_NEW, 0.0, [-1], engine.pad_id)  # no row ever ends
    stop = sorted({int(free[0, 1]), int(free[1, 1])})  # rows 0 and 1 end by step 2 at the latest
    counting, rows_per_forward = rows_counted(engine.model)
    tokens, logprobs, lengths = sample(counting, input_ids, mask, MAX_NEW, 0.0, stop, engine.pad_id)
    assert min(rows_per_forward) < len(ids) and (lengths == MAX_NEW).any()  # rows left, others went on
    for i in range(len(ids)):
        start = int(mask[i].argmax())
        alone = sample(engine.model, input_ids[i : i + 1, start:], mask[i : i + 1, start:], MAX_NEW, 0.0, stop,
                       engine.pad_id)
        n = int(lengths[i])
        assert n == int(alone[2][0]) and tokens[i, :n].tolist() == alone[0][0, :n].tolist()
        assert torch.allclose(logprobs[i, :n], alone[1][0, :n], atol=1e-4)
        assert tokens[i, n:].eq(engine.pad_id).all() and logprobs[i, n:].eq(0).all()


def test_each_prompt_may_have_its_own_budget(engine, formatted):
    """`max_new_tokens` per prompt (an agent's episodes each have their own room left): each response
    stops at its own budget, as the prefix of what the largest budget samples (greedy), and the rows
    that reached theirs leave the batch; a list of the wrong length is refused."""
    from rlhf_core.rollout.sampling import sample

    ids = _token_prompts(engine, formatted)
    budgets = [1, MAX_NEW, 2, 1, 3, 1, 1][: len(ids)]
    full = engine.generate_ids(ids, 1, 0.0, MAX_NEW, seed=0)
    own = engine.generate_ids(ids, 1, 0.0, budgets, seed=0)
    for (f,), (o,), budget in zip(full, own, budgets, strict=True):
        assert len(o.token_ids) <= budget and o.token_ids == f.token_ids[:budget]
        assert o.logprobs == pytest.approx(f.logprobs[:budget], abs=1e-5)
        assert o.finished == (f.finished and len(f.token_ids) <= budget)
    assert sum(len(f.token_ids) > b for (f,), b in zip(full, budgets, strict=True)) >= 4  # the budgets bind
    # sampled, several per prompt, in chunks of two prompts: each row within its prompt's budget
    small = TransformersEngine(engine.model, engine.tokenizer, batch_size=4)
    for group, budget in zip(small.generate_ids(ids, 2, 1.0, budgets, seed=3), budgets, strict=True):
        assert len(group) == 2 and all(1 <= len(s.token_ids) <= budget for s in group)
    counting, rows_per_forward = rows_counted(engine.model)
    input_ids, mask = left_pad(ids, engine.pad_id)
    sample(counting, input_ids, mask, budgets, 0.0, [-1], engine.pad_id)  # no row ends by EOS
    assert rows_per_forward[-1] < len(ids)
    with pytest.raises(ValueError, match="2 budgets for"):
        engine.generate_ids(ids, 1, 0.0, [2, 3], seed=0)
