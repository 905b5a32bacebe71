"""`rlhf train sft --multiturn` (OpenRLHF's): a model trained on whole conversations learns every
assistant turn, not only the last one."""

from __future__ import annotations

import json
import random

import torch

from rlhf_core.cli import main


def conversation(rng: random.Random) -> list[dict]:
    a, b = rng.randrange(10), rng.randrange(10)
    return [{"role": "user", "content": f"add {a}+{b}="}, {"role": "assistant", "content": str(a + b)},
            {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "done"}]


def turn_nll(model, tok, talk: list[dict]) -> list[float]:
    """Mean negative log-likelihood of each assistant turn's tokens (as the chat template writes them)."""
    from rlhf_core.config import SFTDataConfig
    from rlhf_core.data.examples import PromptFormatter

    seq = PromptFormatter(tok, SFTDataConfig(apply_chat_template=True, multiturn=True)).conversation(talk, "t", 1)
    ids = torch.tensor([seq.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    nll = -logp.gather(-1, ids[0, 1:, None])[:, 0]
    mask, turns, run = seq.loss_mask[1:], [], []
    for value, in_loss in zip(nll.tolist(), mask, strict=True):
        if in_loss:
            run.append(value)
        elif run:
            turns, run = [*turns, sum(run) / len(run)], []
    return turns + ([sum(run) / len(run)] if run else [])


def test_multiturn_sft_teaches_the_first_turn_and_the_last(prepared, tmp_path, capsys, one_torch_thread):
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.loading import load_tokenizer

    rng = random.Random(0)
    data = tmp_path / "talks.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(256)))
    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", str(data), "--input_key", "messages",
                 "--apply_chat_template", "--multiturn", "--max_len", "48", "--train_batch_size", "16",
                 "--micro_train_batch_size", "16", "--learning_rate", "3e-3", "--max_epochs", "2",
                 "--save_path", str(tmp_path / "out"), "--use_mlflow", "false", "--param_dtype", "fp32"])
    assert code == 0, capsys.readouterr().err[-3000:]

    tok = load_tokenizer(prepared["base"])
    rng = random.Random(1)
    held_out = [conversation(rng) for _ in range(8)]
    before = AutoModelForCausalLM.from_pretrained(prepared["base"]).eval()
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    def mean_turns(model) -> tuple[float, float]:
        per_talk = torch.tensor([turn_nll(model, tok, c) for c in held_out])  # (talks, 2 turns)
        return tuple(per_talk.mean(0).tolist())

    (first_before, last_before), (first_after, last_after) = mean_turns(before), mean_turns(after)
    # Both turns were in the loss: the last one ("done") is learnt outright, the first (a sum) much better
    assert last_after < 0.2 * last_before, (last_before, last_after)
    assert first_after < 0.4 * first_before, (first_before, first_after)
