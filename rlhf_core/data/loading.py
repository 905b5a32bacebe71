"""Read training data through the `datasets` library and check it row by row.

Sources, comma-separated in `--dataset`: a `.jsonl`/`.json`/`.parquet` file, `json@DIR`
(DIR/train.jsonl, DIR/test.jsonl), a directory of such files, the same on `s3://` (downloaded once
into `storage.local_copy`'s cache), or a hub dataset name; several are mixed by `--dataset_probs`.

Every row is checked before training: a missing key, wrong type or empty text is a `DataError`
naming the source, the 1-based row and the key (the CLI exits 2 with it).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where data is read: `datasets` costs ~0.6 s of every process that names DataError
    import datasets

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """Bad input data; the message names the source, the row and the key."""


@dataclass(frozen=True)
class Source:
    """One dataset spec resolved to something `datasets.load_dataset` understands."""

    spec: str
    builder: str
    data_files: dict[str, str] | None
    single_file: bool = False  # one file given as the dataset: its rows are its 'train' split

    def describe(self, split: str) -> str:
        if self.data_files and split in self.data_files:
            return self.data_files[split]
        return f"{self.spec}[{split}]"


def _local(location: str) -> Path:
    """A local path for `location`; object-store files and folders (s3://...) are downloaded once into
    the cache (a file under its own name, so its extension still names its format)."""
    if "://" not in location or location.startswith("file://"):
        return Path(location.removeprefix("file://")).expanduser()
    from rlhf_core.infra import storage
    from rlhf_core.infra.settings import state_dir

    try:
        return Path(storage.local_copy(location, state_dir() / "cache"))
    except FileNotFoundError as e:
        raise DataError(f"{location}: not found") from e


def resolve_source(spec: str) -> Source:
    """Local files and folders, `json@DIR`, the same on s3:// (files and folders), or a hub dataset name."""
    spec = spec.strip()
    if spec.startswith("json@"):
        directory = _local(spec[len("json@") :])
        if not directory.is_dir():
            raise DataError(f"{spec}: {directory} is not a directory")
        files = {s: str(directory / f"{s}.jsonl") for s in ("train", "test") if (directory / f"{s}.jsonl").exists()}
        if not files:
            raise DataError(f"{spec}: neither train.jsonl nor test.jsonl in {directory}")
        return Source(spec, "json", files)
    path = _local(spec) if "://" in spec else Path(spec).expanduser()
    if path.is_file():
        builder = FILE_FORMATS.get(path.suffix)
        if builder is None:
            raise DataError(f"{spec}: unsupported file type {path.suffix!r} (use .jsonl, .json or .parquet)")
        return Source(spec, builder, {"train": str(path)}, single_file=True)
    if path.is_dir():
        for suffix, builder in FILE_FORMATS.items():
            files = {s: str(path / f"{s}{suffix}") for s in ("train", "test") if (path / f"{s}{suffix}").exists()}
            if files:
                return Source(spec, builder, files)
        raise DataError(f"{spec}: directory without train/test .jsonl, .json or .parquet files")
    if spec.startswith((".", "/", "~")) or (os.sep in spec and not _looks_like_hub_name(spec)):
        raise DataError(f"{spec}: no such file or directory")
    return Source(spec, spec, None)


def _looks_like_hub_name(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not Path(parts[0]).exists()


def has_split(source: Source, split: str) -> bool:
    return source.data_files is None or split in source.data_files


def load_split(source: Source, split: str) -> datasets.Dataset:
    """Load one split of one source as a `datasets.Dataset` (DataError naming the file when it cannot
    be read, with the line and key at fault for a local JSON file, or when it has no rows)."""
    if source.data_files is not None and split not in source.data_files:
        raise DataError(f"{source.spec}: no {split!r} split (have {sorted(source.data_files)})")
    import datasets

    where = source.describe(split)
    try:
        with _quiet_reader():
            if source.data_files is None:
                ds = datasets.load_dataset(source.builder, split=split)
            else:
                ds = datasets.load_dataset(source.builder, data_files={split: source.data_files[split]}, split=split)
    except Exception as e:  # datasets wraps parse errors in many types: find the line at fault ourselves
        diagnose = {"json": diagnose_json_file, "parquet": diagnose_parquet_file}.get(source.builder)
        problem = diagnose(where) if diagnose is not None and os.path.isfile(where) else None
        raise DataError(f"{where}: {problem or f'cannot be read as {source.builder}: {_root_cause(e)}'}") from e
    if len(ds) == 0:
        raise DataError(f"{where}: no rows (the {split!r} split is empty)")
    return ds


@contextmanager
def _quiet_reader():
    """The readers log their own ERROR line for a file they cannot parse; the DataError raised here
    says it once, naming the line, so theirs is held back while a file is read."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}[type(value)]


def diagnose_json_file(path: str) -> str | None:
    """Why a local JSON/JSON-lines file cannot be read as one table: the first line that is not
    UTF-8, not JSON or not an object, or no rows; None if none. Only on the error path."""
    import json

    with open(path, "rb") as f:
        first = f.read(4096).lstrip()
    if path.endswith(".json") and first.startswith(b"["):  # one JSON document: a list of objects
        with open(path, "rb") as f:
            raw = f.read()
        try:
            rows = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            return f"line {line}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r})"
        except json.JSONDecodeError as e:
            return f"line {e.lineno}: not valid JSON (column {e.colno}: {e.msg})"
        numbered = list(enumerate(rows, start=1)) if isinstance(rows, list) else []
        label = "row"
    else:
        numbered, label = [], "line"
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"line {lineno}: not valid UTF-8 (byte {e.start + 1} is {line[e.start:e.start + 1]!r})"
                try:
                    numbered.append((lineno, json.loads(text)))
                except json.JSONDecodeError as e:
                    return f"line {lineno}: not valid JSON (column {e.colno}: {e.msg})"
    if not numbered:
        return "no rows (the file is empty or holds only blank lines)"
    for n, row in numbered:
        if not isinstance(row, dict):
            return f"{label} {n}: expected a JSON object of key: value, got {_json_kind(row)}"
    return None


def diagnose_parquet_file(path: str) -> str | None:
    """Why a local parquet file cannot be read: not parquet at all, or a table without rows."""
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
        return f"not a parquet file ({_root_cause(e)})"
    return "no rows (a table of 0 rows)" if rows == 0 else None


def file_digest(path: str) -> str:
    """sha256 of a file's bytes: the dataset digest recorded in stage manifests and MLflow."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


def check_rows(ds: datasets.Dataset, where: str, text_keys: list[str], other_keys: dict[str, tuple] | None = None,
               chat_keys: set[str] | frozenset = frozenset()) -> None:
    """Raise DataError for the first bad row: missing key, wrong type or empty text.

    `chat_keys` may also hold a list of {"role", "content"} messages instead of a string.
    """
    other_keys = other_keys or {}
    for key in [*text_keys, *other_keys]:
        if key not in ds.column_names:
            raise DataError(f"{where}: row 1: missing key {key!r} (columns: {ds.column_names})")
    for i, row in _rows(ds.select_columns([*text_keys, *other_keys]), where):
        for key in text_keys:
            value = row[key]
            if key in chat_keys and isinstance(value, list):
                if not value or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
                    raise DataError(f"{where}: row {i}: key {key!r} must be a non-empty list of {{role, content}} messages")
                continue
            if value is None:
                raise DataError(f"{where}: row {i}: missing value for key {key!r}")
            if not isinstance(value, str):
                raise DataError(f"{where}: row {i}: key {key!r} must be a string, got {type(value).__name__}")
            if not value.strip():
                raise DataError(f"{where}: row {i}: key {key!r} is empty")
        for key, types in other_keys.items():
            if not isinstance(row[key], types) or isinstance(row[key], bool) and bool not in types:
                names = "/".join(t.__name__ for t in types)
                raise DataError(f"{where}: row {i}: key {key!r} must be {names}, got {type(row[key]).__name__}")


def _rows(ds: datasets.Dataset, where: str):
    """(1-based row number, row); the reader keeps a JSON string's bytes as they are, so text that is
    not UTF-8 shows only when a row is decoded: a DataError naming the row (and the line, for a file)."""
    rows = iter(ds)
    for i in range(1, len(ds) + 1):
        try:
            row = next(rows)
        except UnicodeDecodeError:
            problem = diagnose_json_file(where) if os.path.isfile(where) and not where.endswith(".parquet") else None
            raise DataError(f"{where}: {problem or f'row {i}: text that is not valid UTF-8'}") from None
        yield i, row


def load_mixture(specs: str, split: str, probs: list[float] | None, max_samples: int, seed: int,
                 keys: list[str], check, optional: bool = False,
                 split_flag: str | None = None) -> tuple[datasets.Dataset | None, list[dict]]:
    """Load, check and mix the datasets named in `specs`.

    `check(ds, where)` validates one source; `keys` are the columns kept (so sources with extra
    columns still mix). Returns the mixed dataset and one descriptor per source (spec, split,
    rows, fingerprint) for lineage. A source without `split` is a DataError naming `split_flag`,
    unless `optional` (a default held-out split): then the result is (None, []).
    """
    sources = [resolve_source(s) for s in specs.split(",") if s.strip()]
    if not sources:
        raise DataError(f"--dataset {specs!r}: names no dataset")
    if not all(has_split(s, split) for s in sources):
        if optional:
            return None, []
        missing = [s for s in sources if not has_split(s, split)]
        have = sorted({k for s in missing for k in s.data_files})
        flag = f"{split_flag} {split}; " if split_flag else ""
        raise DataError(f"{', '.join(s.spec for s in missing)}: no {split!r} split ({flag}splits there: "
                        f"{', '.join(have)})")
    parts, described = [], []
    for source in sources:
        ds = load_split(source, split)
        where = source.describe(split)
        check(ds, where)
        ds = ds.select_columns([k for k in keys if k in ds.column_names])
        parts.append(ds)
        described.append({"spec": source.spec, "split": split, "rows": len(ds), "path": where,
                          "digest": file_digest(where) if os.path.isfile(where) else ds._fingerprint})
    if len(parts) == 1:
        mixed = parts[0]
    else:
        import datasets

        mixed = datasets.interleave_datasets(parts, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    if len(mixed) > max_samples:
        mixed = mixed.select(range(max_samples))
    return mixed, described
