"""`prepare`, the tiny tokenizer and the tiny Llama: deterministic, loadable by plain transformers."""

import json
import string
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.data.synthetic import TASKS, build_splits
from rlhf_core.models.sizes import MODEL_SIZES
from rlhf_core.models.tiny import build_tiny_llama, train_tokenizer
from rlhf_core.stages.prep import prepare

SMALL = {"n_train": 300, "n_test": 40}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _task_texts(name: str, n: int = 300) -> list[str]:
    rows = build_splits(TASKS[name], seed=0, n_train=n, n_test=0)["sft"]["train"]
    return [text for row in rows for text in (row["prompt"], row["response"])]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    out = tmp_path_factory.mktemp("prep") / "run"
    return out, prepare(out, task="addition", seed=0, **SMALL)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(_task_texts("addition") + _task_texts("reverse"))


def test_prepare_writes_every_artifact(prepared):
    out, paths = prepared
    expected_keys = {"sft", "preference", "prompts", "tokenizer", "base"}
    expected_keys |= {f"{k}_{s}" for k in ("sft", "preference", "prompts") for s in ("train", "test")}
    assert set(paths) == expected_keys
    columns = {
        "sft": {"prompt", "response", "answer"},
        "preference": {"prompt", "chosen", "rejected"},
        "prompts": {"prompt", "answer"},
    }
    for kind, keys in columns.items():
        for split, n in (("train", SMALL["n_train"]), ("test", SMALL["n_test"])):
            rows = [json.loads(line) for line in Path(paths[f"{kind}_{split}"]).read_text().splitlines()]
            assert len(rows) == n and all(set(r) == keys for r in rows)
    assert (out / "base" / "model.safetensors").is_file()
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert not [p for p in out.rglob("*") if p.name.startswith(".")], "temporary files left behind"


def test_prepare_is_deterministic(prepared, tmp_path):
    out, _ = prepared
    same = tmp_path / "same"
    prepare(same, task="addition", seed=0, **SMALL)
    assert _files(same) == _files(out)
    prepare(same, task="addition", seed=0, **SMALL)  # rerun over existing output
    assert _files(same) == _files(out)

    other = tmp_path / "other"
    prepare(other, task="addition", seed=1, **SMALL)
    a, b = _files(out), _files(other)
    for name in ("data/sft/train.jsonl", "data/preference/test.jsonl", "base/model.safetensors"):
        assert a[name] != b[name]


def test_base_model_loads_with_plain_transformers_and_generates(prepared):
    out, paths = prepared
    model = AutoModelForCausalLM.from_pretrained(paths["base"])
    tok = AutoTokenizer.from_pretrained(paths["base"])
    assert AutoTokenizer.from_pretrained(paths["tokenizer"]).get_vocab() == tok.get_vocab()
    assert model.config.vocab_size == len(tok)
    assert model.config.tie_word_embeddings
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (
        tok.pad_token_id,
        tok.bos_token_id,
        tok.eos_token_id,
    )
    assert tok.padding_side == "right"

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "add 12+34="}], tokenize=False, add_generation_prompt=True
    )
    inputs = tok(prompt, return_tensors="pt", add_special_tokens=False)
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    n = inputs["input_ids"].shape[1]
    assert torch.equal(generated[0, :n], inputs["input_ids"][0])  # the prompt, then the continuation
    # Greedy decoding by hand (argmax of a full forward per token, stopping after EOS) gives the same
    # tokens: generate() reads this model's config (EOS, pad) and its KV cache agrees with a plain forward.
    ids, by_hand = inputs["input_ids"], []
    with torch.no_grad():
        for _ in range(4):
            nxt = model(ids).logits[0, -1].argmax().item()
            by_hand.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            if nxt == tok.eos_token_id:
                break
    assert generated[0, n:].tolist() == by_hand
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tokenizer_round_trips_exactly(tokenizer, name):
    for text in _task_texts(name) + ["  two  spaces ", "tab\tand\nnewline", "add 1 + 2 = 3", "ünïcode ✓"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_payload_characters_are_single_tokens(tokenizer):
    for char in string.digits + string.ascii_uppercase:
        assert len(tokenizer(char, add_special_tokens=False)["input_ids"]) == 1, char
    for name in TASKS:
        for prompt in _task_texts(name)[::2][:100]:
            tokens = tokenizer.convert_ids_to_tokens(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            payload = [c for c in prompt if c.isdigit() or c.isupper()]
            assert [t for t in tokens if t in payload] == payload  # each payload char is its own token
    # The template words are allowed to merge: BPE learned something beyond single bytes.
    assert len(tokenizer("reverse: ", add_special_tokens=False)["input_ids"]) < len("reverse: ")


def test_special_tokens(tokenizer):
    for token in ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == (
        "<|pad|>",
        "<|bos|>",
        "<|eos|>",
    )
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_chat_template_prompt_is_a_prefix_of_the_conversation(tokenizer):
    for prompt, response in [("add 47+385=", "432"), ("reverse: KQZM", "MZQK"), ("", "")]:
        user = [{"role": "user", "content": prompt}]
        head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            user + [{"role": "assistant", "content": response}], tokenize=False
        )
        assert full == head + response + tokenizer.eos_token
        assert head.startswith(tokenizer.bos_token) and prompt in head
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        assert full_ids[: len(head_ids)] == head_ids and full_ids[-1] == tokenizer.eos_token_id


def test_chat_template_rejects_unknown_roles(tokenizer):
    with pytest.raises(Exception, match="user and assistant"):
        tokenizer.apply_chat_template([{"role": "system", "content": "hi"}], tokenize=False)


def test_build_tiny_llama_sizes_and_seeding(tokenizer):
    assert set(MODEL_SIZES) == {"nano", "tiny", "small", "100m", "500m"}
    nano = build_tiny_llama(tokenizer, size="nano")
    assert sum(p.numel() for p in nano.model.layers.parameters()) < 200_000  # a student smaller than tiny
    with pytest.raises(ValueError, match="tiny"):
        build_tiny_llama(tokenizer, size="huge")
    torch.manual_seed(7)
    expected = torch.rand(1)
    torch.manual_seed(7)
    a = build_tiny_llama(tokenizer, size="tiny", seed=3)
    assert torch.equal(torch.rand(1), expected), "building a model must not consume the caller's RNG"
    b = build_tiny_llama(tokenizer, size="tiny", seed=3)
    c = build_tiny_llama(tokenizer, size="tiny", seed=4)
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)
    assert a.config.hidden_size == 128 and a.config.num_hidden_layers == 4
    assert a.config.num_key_value_heads == a.config.num_attention_heads == 4  # the Llama: one per head
    assert a.config.max_position_embeddings == 256
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight


def test_500m_is_qwen2_5_0_5b_shaped(tokenizer):
    """`--model_family qwen2 --model_size 500m`: Qwen2.5-0.5B's shape (its own 2 key/value heads, not
    the family's grouping), the GPU benchmarks' model; other sizes keep the family's grouping."""
    from rlhf_core.models.families import family_config, get_family

    config = family_config(get_family("qwen2"), tokenizer, "500m")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size) == (896, 24, 14, 2, 4864)
    assert family_config(get_family("qwen2"), tokenizer, "tiny").num_key_value_heads == 2  # 4 heads, pairs
    assert family_config(get_family("phi3"), tokenizer, "tiny").num_key_value_heads == 4  # full multi-head


def test_prep_manifest_hashes_every_parameter_of_prepare_with_defaults_filled_in(tmp_path, monkeypatch):
    """`stage.json`'s config and config hash cover all of `prepare`'s parameters, given or not, so a
    parameter added to `prepare` counts at once and an explicit default hashes like an omitted one."""
    import functools
    import inspect

    from rlhf_core.infra.manifests import values_hash
    from rlhf_core.stages import prep as prep_module

    def fake_prepare(out_dir, **params):  # the manifest, not the artifacts, is under test here
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        return {}

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(prep_module, "prepare", functools.wraps(prepare)(fake_prepare))
    full = prep_module.prep_config(task="sort")
    # model_family None (the built-in tiny Llama) and student_size None (no student) are left out:
    # outputs prepared before they existed keep their hash
    assert set(full) == set(inspect.signature(prepare).parameters) - {"out_dir", "model_family", "student_size"}
    manifest = prep_module.run_prep(tmp_path / "a", task="sort")
    assert manifest["config"] == full and manifest["config_hash"] == values_hash(full)
    assert prep_module.run_prep(tmp_path / "b", task="sort", **{k: full[k] for k in ("n_train", "vocab_size")}) \
        ["config_hash"] == manifest["config_hash"]
    for name, value in full.items():
        other = value + "_x" if isinstance(value, str) else value + 1
        assert prep_module.run_prep(tmp_path / name, **{**full, name: other})["config_hash"] != \
            manifest["config_hash"], name
    family = prep_module.run_prep(tmp_path / "qwen3", **full, model_family="qwen3")
    assert family["config"]["model_family"] == "qwen3" and family["config_hash"] != manifest["config_hash"]
    with pytest.raises(TypeError):
        prep_module.prep_config(not_a_parameter=1)


def test_prep_writes_only_where_it_may_and_a_rerun_takes_over_a_crashed_prep(tmp_path, monkeypatch):
    """Only a new or empty folder or an earlier prep output; a crash leaves a marker a rerun accepts,
    and models saved under an earlier prep output (outside what prep rewrites) stay where they are."""
    import functools

    from rlhf_core.infra import storage
    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.stages import prep as prep_module

    def fake_prepare(out_dir, crash=False, **params):
        (Path(out_dir) / "data" / "sft").mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "data" / "sft" / "train.jsonl").write_text("{}\n")
        if crash:
            raise RuntimeError("killed")
        return {}

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setattr(prep_module, "prepare", functools.wraps(prepare)(fake_prepare))
    work = tmp_path / "work"
    monkeypatch.setattr(prep_module, "prep_config", lambda **params: params)
    with pytest.raises(RuntimeError, match="killed"):
        prep_module.run_prep(work, crash=True)
    assert storage.read_manifest(str(work)) is None and (work / storage.WRITING).exists()
    with pytest.raises(ConfigError, match="is being written by stage prep"):
        storage.check_destination(str(work), "sft")
    prep_module.run_prep(work)
    assert storage.read_manifest(str(work))["stage"] == "prep" and not (work / storage.WRITING).exists()

    sft = work / "models" / "sft"  # README layout: models saved under the prep folder
    sft.mkdir(parents=True)
    (sft / "stage.json").write_text('{"stage": "sft"}')
    prep_module.run_prep(work)
    assert (sft / "stage.json").read_text() == '{"stage": "sft"}'
    (work / "base").mkdir()
    (work / "base" / "eval").mkdir()
    (work / "base" / "eval" / "stage.json").write_text('{"stage": "eval"}')  # inside what prep rewrites
    with pytest.raises(ConfigError, match=r"holds other outputs inside it \(base/eval/stage.json"):
        prep_module.run_prep(work)
    (tmp_path / "notes.md").write_text("keep")
    with pytest.raises(ConfigError, match="folder with other content"):
        prep_module.run_prep(tmp_path)
    assert (tmp_path / "notes.md").read_text() == "keep" and not (tmp_path / "data").exists()


FAMILY_FORMATS = {  # what the family's own chat format puts before a user's prompt, and after it
    "llama": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
              "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen2": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "mistral": ("<s>[INST] ", " [/INST]"),
    "gemma": ("<bos><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
    "phi3": ("<|user|>\n", "<|end|>\n<|assistant|>\n"),
    "mixtral": ("<s>[INST] ", " [/INST]"),
    "qwen3_moe": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
}
FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM", "gemma": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_model_family_base_is_that_family_with_its_tokens_and_chat_format(tmp_path, family):
    """`prepare(model_family=...)`: plain transformers loads a model of the family's class and a
    tokenizer that renders the family's chat format, whose special tokens are single tokens and whose
    EOS ends an assistant turn; the architecture's traits are there."""
    from rlhf_core.models.families import FAMILIES

    paths = prepare(tmp_path, task="sort", seed=0, model_family=family, n_train=64, n_test=8)
    tok = AutoTokenizer.from_pretrained(paths["base"])
    model = AutoModelForCausalLM.from_pretrained(paths["base"])
    assert type(model).__name__ == FAMILY_CLASSES[family]
    before, after = FAMILY_FORMATS[family]
    text = tok.apply_chat_template([{"role": "user", "content": "sort: QWE"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == before + "sort: QWE" + after
    for special in FAMILIES[family].specials:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    assert tok.eos_token == FAMILIES[family].eos and model.config.eos_token_id == tok.eos_token_id
    cfg = model.config
    traits = {"qwen2": lambda: model.model.layers[0].self_attn.q_proj.bias is not None,
              "qwen3": lambda: hasattr(model.model.layers[0].self_attn, "q_norm") and not cfg.tie_word_embeddings,
              "gemma": lambda: cfg.attn_logit_softcapping == 50.0 and cfg.final_logit_softcapping == 30.0,
              "phi3": lambda: hasattr(model.model.layers[0].self_attn, "qkv_proj"),
              "mixtral": lambda: cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 2,
              "qwen3_moe": lambda: cfg.num_experts == 4 and cfg.num_experts_per_tok == 2 and cfg.norm_topk_prob
              and hasattr(model.model.layers[0].self_attn, "q_norm") and not cfg.tie_word_embeddings,
              "llama": lambda: cfg.num_key_value_heads < cfg.num_attention_heads and tok.pad_token is None,
              "mistral": lambda: cfg.sliding_window is None and tok.pad_token is None}
    assert traits[family](), family
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    assert out.shape[1] > ids.shape[1]


def test_unknown_model_family_is_a_config_error_naming_the_flag(tmp_path, capsys):
    from rlhf_core.cli import main

    assert main(["prep", "--out", str(tmp_path / "p"), "--model_family", "gpt5"]) == 2
    err = capsys.readouterr().err
    assert "--model_family" in err and "gpt5" in err and "qwen3" in err
    assert not (tmp_path / "p").exists()


def test_a_student_base_is_the_same_family_and_tokenizer_at_the_smaller_size(tmp_path):
    """`rlhf prep --student_size nano`: student/ beside base/, a fresh model of the student's
    size over the same vocabulary (what distillation needs), loadable by plain transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.cli import main
    from rlhf_core.models.sizes import MODEL_SIZES, smaller_size

    assert [smaller_size(s) for s in ("nano", "tiny", "small")] == [None, "nano", "tiny"]
    assert main(["prep", "--out", str(tmp_path / "p"), "--task", "sort", "--n_train", "64", "--n_test", "8",
                 "--student_size", "nano"]) == 0
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "p" / "base")
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "p" / "student")
    assert student.config.hidden_size == MODEL_SIZES["nano"]["hidden_size"] < base.config.hidden_size
    assert student.config.vocab_size == base.config.vocab_size
    tok = AutoTokenizer.from_pretrained(tmp_path / "p" / "student")
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(tmp_path / "p" / "base").get_vocab()
    manifest = json.loads((tmp_path / "p" / "stage.json").read_text())
    assert manifest["config"]["student_size"] == "nano" and manifest["outputs"]["student"].endswith("/student")
    with pytest.raises(SystemExit) as refused:  # argparse's choices: exit 2 naming the flag
        main(["prep", "--out", str(tmp_path / "q"), "--student_size", "huge"])
    assert refused.value.code == 2 and not (tmp_path / "q").exists()
