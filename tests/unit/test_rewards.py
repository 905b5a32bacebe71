"""Reward sources: the task verifier, and a saved reward model scored exactly as the trainer scores it."""

import pytest
import torch

from rlhf_core.config import DataConfig
from rlhf_core.data.batching import pack_batch, pad_batch
from rlhf_core.data.examples import load_pairs
from rlhf_core.models.forward import reward_scores
from rlhf_core.models.loading import load_reward_model, load_tokenizer
from rlhf_core.rewards import RewardModelReward, VerifierReward

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reward_model_dir(prepared, tmp_path_factory):
    """A reward model as `rlhf train rm` saves one (random head), with reward statistics in its config."""
    tok = load_tokenizer(prepared["base"])
    torch.manual_seed(0)
    model = load_reward_model(prepared["base"], tok.pad_token_id)
    model.config.reward_mean, model.config.reward_std = 0.25, 2.0
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_verifier_scores_exact_answers():
    v = VerifierReward("addition")
    assert v.score(["add 1+2="] * 3, ["3", " 3 ", "4"], ["3", "3", "3"]) == [1.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="reference answer"):
        v.score(["p"], ["3"], [None])
    with pytest.raises(ValueError, match="unknown synthetic task"):
        VerifierReward("nope")


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_reward_model_matches_the_trainers_reward_scores(prepared, reward_model_dir, apply_chat_template):
    cfg = DataConfig(dataset=f"json@{prepared['preference']}", apply_chat_template=apply_chat_template,
                     max_len=64, max_samples=12)
    tok = load_tokenizer(reward_model_dir)
    examples, _ = load_pairs(cfg, tok, "train", 0)
    rows = [(r["prompt"], r["chosen"], r["rejected"]) for r in _rows(prepared["preference_train"], 12)]
    trainer_model = load_reward_model(reward_model_dir, tok.pad_token_id).eval()
    seqs = [e.chosen for e in examples] + [e.rejected for e in examples]
    with torch.no_grad():
        padded = pad_batch([s.input_ids for s in seqs], [s.loss_mask for s in seqs], tok.pad_token_id)
        packed = pack_batch([s.input_ids for s in seqs], [s.loss_mask for s in seqs], 64, tok.pad_token_id)
        expected = reward_scores(trainer_model, padded)
        expected_packed = reward_scores(trainer_model, packed)

    rm = RewardModelReward(reward_model_dir, apply_chat_template=apply_chat_template, batch_size=5)
    prompts = [p for p, _, _ in rows] * 2
    responses = [c for _, c, _ in rows] + [r for _, _, r in rows]
    assert rm.sequences(prompts, responses) == [s.input_ids for s in seqs]  # the trainer's exact tokens
    got = torch.tensor(rm.score(prompts, responses, [None] * len(prompts)))
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    assert torch.allclose(got, expected_packed, atol=1e-5, rtol=0)
    assert got.std() > 0

    normalized = RewardModelReward(reward_model_dir, apply_chat_template, normalize=True).score(prompts, responses)
    assert torch.allclose(torch.tensor(normalized), (got - 0.25) / 2.0, atol=1e-5)


def test_normalize_needs_reward_statistics(prepared):
    with pytest.raises(ValueError, match="reward_mean/reward_std"):
        RewardModelReward(prepared["base"], normalize=True)


def _rows(path, n):
    import json
    from pathlib import Path

    return [json.loads(line) for line in Path(path).read_text().splitlines()[:n]]
