"""``rlhf prep``: everything a demo needs, built locally from a seed, with no network.

Writes under ``out_dir``::

    data/sft/{train,test}.jsonl         {"prompt", "response"}
    data/preference/{train,test}.jsonl  {"prompt", "chosen", "rejected"}
    data/prompts/{train,test}.jsonl     {"prompt", "answer"}
    tokenizer/                          byte-level BPE trained on the train split's text
    base/                               random tiny Llama + its tokenizer (safetensors)

Choices:
- Deterministic: the same arguments give byte-identical jsonl files and identical weights, so
  the pipeline's cache keys (config hash + dataset digests) hit on a rerun.
- Every file and folder is written under a temporary name in its final directory and moved into
  place with ``os.replace``: a crash leaves a stray temp entry, never a half-written file under a
  real name that a later stage, or a cache check, would take for finished output.
- The tokenizer learns only from the train split: the test split is held out everywhere.
- Defaults (4000 train / 200 test) are sized so each demo stage trains in a minute or two on
  CPU; the test split stays at a size where greedy decoding for evaluation is a few seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from rlhf_core.data.synthetic import build_splits, get_task
from rlhf_core.models.tiny import DEFAULT_VOCAB_SIZE, build_tiny_llama, train_tokenizer

DEFAULT_N_TRAIN = 4000
DEFAULT_N_TEST = 200
DATA_KINDS = ("sft", "preference", "prompts")


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_dir_atomic(path: Path, *savables) -> None:
    """``save_pretrained`` every object into a temp folder, then swap it in for ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        for obj in savables:
            obj.save_pretrained(tmp)
        # A folder can't be os.replace'd onto a non-empty one: move the old one aside first.
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare(
    out_dir: str | os.PathLike,
    task: str = "addition",
    seed: int = 0,
    model_size: str = "tiny",
    n_train: int = DEFAULT_N_TRAIN,
    n_test: int = DEFAULT_N_TEST,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> dict[str, str]:
    """Build the demo's data, tokenizer and base model under ``out_dir``; return their paths.

    Keys: ``sft``, ``preference``, ``prompts`` (data folders), ``<kind>_<split>`` for each jsonl
    file (e.g. ``sft_train``), ``tokenizer`` and ``base`` (model folders).
    """
    out = Path(out_dir)
    synthetic_task = get_task(task)
    splits = build_splits(synthetic_task, seed=seed, n_train=n_train, n_test=n_test)

    paths: dict[str, str] = {}
    for kind in DATA_KINDS:
        kind_dir = out / "data" / kind
        paths[kind] = str(kind_dir)
        for split, rows in splits[kind].items():
            file = kind_dir / f"{split}.jsonl"
            _write_jsonl_atomic(file, rows)
            paths[f"{kind}_{split}"] = str(file)

    train_texts = [text for row in splits["sft"]["train"] for text in (row["prompt"], row["response"])]
    tokenizer = train_tokenizer(train_texts, vocab_size=vocab_size)
    model = build_tiny_llama(tokenizer, size=model_size, seed=seed)

    _save_dir_atomic(out / "tokenizer", tokenizer)
    _save_dir_atomic(out / "base", model, tokenizer)
    paths["tokenizer"] = str(out / "tokenizer")
    paths["base"] = str(out / "base")
    return paths
