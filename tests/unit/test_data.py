import json

import pytest

from rlhf_core.cli import main
from rlhf_core.config import DataConfig
from rlhf_core.data.examples import load_pairs, load_sft, load_unpaired
from rlhf_core.data.loading import DataError
from rlhf_core.models.loading import load_tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(prepared):
    return load_tokenizer(prepared["tokenizer"])


def test_json_at_dir_gives_train_and_test(prepared, tok):
    cfg = DataConfig(dataset=f"json@{prepared['sft']}", apply_chat_template=True, max_len=64)
    train, described = load_sft(cfg, tok, "train", 0)
    test, _ = load_sft(cfg, tok, "test", 0)
    assert len(train) == 1024 and len(test) == 128
    assert described[0]["digest"].startswith("sha256:") and described[0]["rows"] == 1024
    ex = train[0].seq
    # Loss only on the response (+ EOS), which is the tail of the sequence.
    assert ex.loss_mask[: ex.prompt_len] == [0] * ex.prompt_len and all(ex.loss_mask[ex.prompt_len :])
    assert ex.input_ids[-1] == tok.eos_token_id


def test_input_template_and_pretrain_mode(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"q": "add 1+2=", "a": "3"}])
    cfg = DataConfig(dataset=str(f), input_key="q", output_key="a", input_template="Q: {} A:")
    (ex,), _ = load_sft(cfg, tok, "train", 0)
    assert tok.decode(ex.seq.input_ids[: ex.seq.prompt_len], skip_special_tokens=True) == "Q: add 1+2= A:"
    (pre,), _ = load_sft(DataConfig(dataset=str(f), input_key="q"), tok, "train", 0, pretrain_mode=True)
    assert sum(pre.seq.loss_mask) == len(pre.seq.input_ids) - 1


def test_parquet_and_mixing_with_probs(tmp_path, tok):
    import datasets

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"add {i}+1=", "response": str(i + 1), "extra": 1} for i in range(50)])
    datasets.Dataset.from_list([{"prompt": f"add {i}+2=", "response": str(i + 2)} for i in range(50)]).to_parquet(
        str(tmp_path / "b.parquet"))
    cfg = DataConfig(dataset=f"{a},{tmp_path / 'b.parquet'}", dataset_probs="0.5,0.5", max_samples=60)
    mixed, described = load_sft(cfg, tok, "train", 0)
    assert len(mixed) == 60 and len(described) == 2
    texts = [tok.decode(e.seq.input_ids) for e in mixed]
    assert any("+1=" in t for t in texts) and any("+2=" in t for t in texts)


@pytest.mark.parametrize("rows,message", [
    ([{"prompt": "a", "response": "b"}, {"prompt": "a"}], "row 2: missing value for key 'response'"),
    ([{"prompt": "a", "response": "b"}, {"prompt": 3, "response": "b"}], "row 2: key 'prompt' must be a string, got int"),
    ([{"prompt": "a", "response": "  "}], "row 1: key 'response' is empty"),
    ([{"question": "a", "response": "b"}], "row 1: missing key 'prompt'"),
])
def test_bad_rows_name_file_row_and_key(tmp_path, tok, rows, message):
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_sft(DataConfig(dataset=str(f)), tok, "train", 0)
    assert message in str(err.value) and "bad.jsonl" in str(err.value)


def test_too_long_rows_fail_unless_truncating(tmp_path, tok):
    f = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "add 1+1=", "response": "2"},
                                               {"prompt": "add 1+1=", "response": "9" * 50}])
    with pytest.raises(DataError, match=r"long.jsonl: row 2: \d+ tokens, longer than --max_len 20"):
        load_sft(DataConfig(dataset=str(f), max_len=20), tok, "train", 0)
    examples, _ = load_sft(DataConfig(dataset=str(f), max_len=20, truncate=True), tok, "train", 0)
    assert max(len(e.seq.input_ids) for e in examples) == 20


def loss_spans(seq, tok) -> list[str]:
    """The decoded runs of loss tokens of a sequence."""
    spans, run = [], []
    for token, in_loss in zip(seq.input_ids, seq.loss_mask, strict=True):
        if in_loss:
            run.append(token)
        elif run:
            spans, run = [*spans, tok.decode(run)], []
    return spans + ([tok.decode(run)] if run else [])


def test_multiturn_sft_learns_every_assistant_turn_as_the_chat_template_writes_it(tmp_path, tok):
    """OpenRLHF's `--multiturn`: the whole conversation in the input column (the output column's
    reply appended where a row has one); loss on each assistant turn, context elsewhere; the
    sequence is the rendered conversation; bad rows name the file, row and key."""
    from rlhf_core.config import SFTDataConfig

    talk = [{"role": "user", "content": "add 1+2="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "add 3+4="}, {"role": "assistant", "content": "7"}]
    f = write_jsonl(tmp_path / "talk.jsonl", [
        {"messages": talk},
        {"messages": talk[:3], "answer": "7"},  # the last reply in the output column
        {"messages": [*talk, {"role": "user", "content": "thanks"}]},  # a trailing user turn: context only
    ])
    cfg = SFTDataConfig(dataset=str(f), input_key="messages", output_key="answer", apply_chat_template=True,
                        multiturn=True, max_len=64)
    examples, _ = load_sft(cfg, tok, "train", 0)
    eos = tok.eos_token
    for ex in examples[:2]:
        assert loss_spans(ex.seq, tok) == [f"3{eos}", f"7{eos}"]
        assert tok.decode(ex.seq.input_ids) == tok.apply_chat_template(talk, tokenize=False)
    assert loss_spans(examples[2].seq, tok) == [f"3{eos}", f"7{eos}"]
    # single-turn SFT of the same first exchange: the loss covers the answer only
    single, _ = load_sft(SFTDataConfig(dataset=str(write_jsonl(tmp_path / "one.jsonl", [
        {"prompt": "add 1+2=", "response": "3"}])), apply_chat_template=True), tok, "train", 0)
    assert loss_spans(single[0].seq, tok) == [f"3{eos}"]

    for rows, message in [([{"messages": "add 1+2="}], "row 1: --multiturn: key 'messages' must be a list"),
                          ([{"messages": talk[:1]}], "row 1: --multiturn: the conversation has no assistant"),
                          ([{"messages": talk}, {"messages": talk[:1], "answer": 7}], "row 2: --multiturn: key "
                           "'answer' must be text")]:
        with pytest.raises(DataError, match=message) as err:
            load_sft(cfg.model_copy(update={"dataset": str(write_jsonl(tmp_path / "bad.jsonl", rows))}), tok,
                     "train", 0)
        assert "bad.jsonl" in str(err.value)


def test_missing_file_and_bad_json(tmp_path, tok):
    with pytest.raises(DataError, match="no such file"):
        load_sft(DataConfig(dataset=str(tmp_path / "nope.jsonl")), tok, "train", 0)
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"broken.jsonl: line 2: not valid JSON"):
        load_sft(DataConfig(dataset=str(bad)), tok, "train", 0)


def test_pairs_margin_and_kto_unpairing(prepared, tmp_path, tok):
    cfg = DataConfig(dataset=f"json@{prepared['preference']}", apply_chat_template=True, max_len=64)
    pairs, _ = load_pairs(cfg, tok, "train", 0)
    assert pairs[0].chosen.prompt_len == pairs[0].rejected.prompt_len
    unpaired, _ = load_unpaired(cfg, tok, "train", 0)
    assert len(unpaired) == 2 * len(pairs) and sum(e.desirable for e in unpaired) == len(pairs)
    f = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "add 1+1=", "response": "2", "label": True},
                                              {"prompt": "add 1+1=", "response": "3", "label": "no"}])
    with pytest.raises(DataError, match="row 2: key 'label' must be bool"):
        load_unpaired(DataConfig(dataset=str(f)), tok, "train", 0)
    m = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 0.5}])
    (pair,), _ = load_pairs(DataConfig(dataset=str(m), margin_key="margin"), tok, "train", 0)
    assert pair.margin == 0.5


def test_cli_bad_data_exits_2_before_training(tmp_path, prepared, capsys):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}] * 3 + [{"prompt": "a"}])
    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", str(f), "--save_path",
                 str(tmp_path / "out"), "--train_batch_size", "2", "--micro_train_batch_size", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl: row 4: missing value for key 'response'" in err
    assert not (tmp_path / "out").exists()
