"""``rlhf prep``: the built-in task's data, tokenizer and base model, built locally from a seed, with no network.

Writes under ``out_dir``::

    data/sft/{train,test}.jsonl         {"prompt", "response"}
    data/preference/{train,test}.jsonl  {"prompt", "chosen", "rejected"}
    data/prompts/{train,test}.jsonl     {"prompt", "answer"}
    data/prm/{train,test}.jsonl         a task of steps only: {"input", "label"} for `rlhf train prm`
                                        (steps marked by `ки`, labels "+"/"-"; half the rows err)
    tokenizer/                          byte-level BPE trained on the train split's text
    base/                               random tiny Llama (or a `--model_family` model) + its tokenizer
    student/                            with `student_size`: the same at that (smaller) size, from
                                        another seed: a distilled student's start (stage `distill`)

With ``model_family`` (`models/families.py`: qwen2, qwen3, llama, mistral, gemma, phi3, mixtral, qwen3_moe) the
tokenizer carries that family's special tokens and chat template and the base model is built from
the family's own transformers config, at the same dimensions.

- Deterministic: the same arguments give byte-identical jsonl files and weights, so the
  pipeline's cache keys (config hash + dataset digests) hit on a rerun.
- Every file and folder is written under a temporary name and ``os.replace``d into place: a crash
  never leaves a half-written file under a real name.
- The tokenizer learns only from the train split.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from rlhf_core.data import steps
from rlhf_core.data.steps import PLACEHOLDER
from rlhf_core.data.synthetic import build_splits, get_task
from rlhf_core.infra import storage
from rlhf_core.models.families import build_family_model, get_family, train_family_tokenizer
from rlhf_core.models.sizes import MODEL_SIZES
from rlhf_core.models.tiny import DEFAULT_VOCAB_SIZE, SPECIAL_TOKENS, build_tiny_llama, train_tokenizer

DEFAULT_N_TRAIN = 4000
DEFAULT_N_TEST = 200
DATA_KINDS = ("sft", "preference", "prompts")
# What a local prep rewrites under its folder; anything else there (e.g. models saved under
# `work/models`) is left alone, so rerunning prep over its own output is allowed with it present.
REWRITTEN = ("data", "tokenizer", "base", "student")


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
    demo_error_rate: float = 0.0,
    model_family: str | None = None,
    student_size: str | None = None,
) -> dict[str, str]:
    """Build the data, tokenizer and base model under ``out_dir``; return their paths.

    Keys: ``sft``, ``preference``, ``prompts`` (data folders), ``<kind>_<split>`` for each jsonl
    file (e.g. ``sft_train``), ``tokenizer`` and ``base`` (model folders), and ``student`` with
    ``student_size``.
    """
    out = Path(out_dir)
    synthetic_task = get_task(task)
    splits = build_splits(synthetic_task, seed=seed, n_train=n_train, n_test=n_test, demo_error_rate=demo_error_rate)

    paths: dict[str, str] = {}
    for kind in DATA_KINDS:
        kind_dir = out / "data" / kind
        paths[kind] = str(kind_dir)
        for split, rows in splits[kind].items():
            file = kind_dir / f"{split}.jsonl"
            storage.write_text_atomic(file, storage.jsonl_text(rows))
            paths[f"{kind}_{split}"] = str(file)

    if synthetic_task.step_labels is not None:  # a task of steps: PRM rows too
        kind_dir = out / "data" / "prm"
        paths["prm"] = str(kind_dir)
        for split, rows in prm_rows(synthetic_task, splits["prompts"], seed).items():
            file = kind_dir / f"{split}.jsonl"
            storage.write_text_atomic(file, storage.jsonl_text(rows))
            paths[f"prm_{split}"] = str(file)

    train_texts = [text for row in splits["sft"]["train"]
                   for text in (row["prompt"], row["response"], *(m["content"] for m in row.get("messages", ())))]
    # A task of steps marks them with the PRM's placeholder: one token wherever it stands.
    extra = [PLACEHOLDER] if synthetic_task.step_labels is not None else []
    if model_family is None:
        tokenizer = train_tokenizer(train_texts, vocab_size=vocab_size, specials=[*SPECIAL_TOKENS, *extra])

        def build(size: str, seed: int):
            return build_tiny_llama(tokenizer, size=size, seed=seed)
    else:
        family = get_family(model_family)
        tokenizer = train_family_tokenizer(family, train_texts, vocab_size, extra)

        def build(size: str, seed: int):
            return build_family_model(family, tokenizer, size=size, seed=seed)

    _save_dir_atomic(out / "tokenizer", tokenizer)
    _save_dir_atomic(out / "base", build(model_size, seed), tokenizer)
    paths["tokenizer"] = str(out / "tokenizer")
    paths["base"] = str(out / "base")
    if student_size is not None:
        _save_dir_atomic(out / "student", build(student_size, seed + 1), tokenizer)
        paths["student"] = str(out / "student")
    return paths


def prm_rows(task, prompts: dict[str, list[dict]], seed: int) -> dict[str, list[dict]]:
    """Per split, a process-reward row per prompt: the right solution or (half the time, its own
    random stream) one with a wrong carry, its steps marked by the placeholder and labelled as
    OpenRLHF's `train_prm` reads them (`input`, `label`); the prompt and response alongside."""
    rng = random.Random(f"{seed}-prm")
    out = {}
    for split, rows in prompts.items():
        out[split] = []
        for row in rows:
            response = row["answer"] if rng.random() < 0.5 else task.near_miss(row["answer"], rng)
            out[split].append({"input": steps.prm_text(row["prompt"], response),
                               "label": task.step_labels(row["prompt"], response),
                               "prompt": row["prompt"], "response": response})
    return out


def prep_config(**params) -> dict:
    """Every parameter of `prepare` but the output folder, defaults filled in: what prep's output depends on.

    Unknown names raise TypeError, as `prepare` would. `model_family` and `student_size` are left
    out when None (the built-in tiny Llama, no student), so outputs prepared before those flags
    existed keep their config hash.
    """
    import inspect

    bound = inspect.signature(prepare).bind(None, **params)
    bound.apply_defaults()
    return {k: v for k, v in bound.arguments.items()
            if k != "out_dir" and not (k in ("model_family", "student_size") and v is None)}


def check_prep_params(params: dict) -> None:
    """ConfigError naming the flag of the first of `prep_config`'s parameters that `prepare` cannot build
    from: `rlhf prep` checks them before anything is written."""
    from rlhf_core.infra.settings import ConfigError

    try:
        get_task(params["task"])
    except ValueError as e:
        raise ConfigError(f"--task: {e}") from None
    for name in ("n_train", "n_test"):
        if isinstance(params[name], bool) or not isinstance(params[name], int) or params[name] < 1:
            raise ConfigError(f"--{name}: must be a whole number of examples >= 1, got {params[name]!r}")
    for flag in ("model_size", "student_size"):
        if flag in params and params[flag] not in MODEL_SIZES:
            raise ConfigError(f"--{flag}: must be one of {', '.join(MODEL_SIZES)}, got {params[flag]!r}")
    if params.get("model_family") is not None:
        try:
            get_family(params["model_family"])
        except ValueError as e:
            raise ConfigError(f"--model_family: {e}") from None
    if not 0 <= params["demo_error_rate"] < 1:
        raise ConfigError(f"--demo_error_rate: must be in [0, 1), got {params['demo_error_rate']}")


def run_prep(out_dir: str | os.PathLike, **params) -> dict:
    """`rlhf prep`: `prepare`, then `stage.json` last (its presence means the output is complete),
    logged to the orchestrator's MLflow run. The manifest holds every parameter (defaults included),
    their hash and each data file's sha256. `out_dir` must be new, empty or an earlier prep output
    (`storage.check_destination`, checked before anything is built).
    """
    params = prep_config(**params)
    out = storage.normalize_uri(str(out_dir))
    remote = storage.is_remote(out)
    storage.check_destination(out, "prep", flag="--out", replaces=None if remote else REWRITTEN)
    if remote:  # build locally, then upload with the manifest last
        with tempfile.TemporaryDirectory(prefix="rlhf-prep-") as tmp:
            manifest, tracker = _prep_and_record(Path(tmp), out, params)
            tracker.await_store(f"nothing was published at {out}")
            storage.publish_dir(tmp, out, manifest, flag="--out")
    else:  # in place, marked as being written, so a rerun after a crash may take it over
        local = Path(out)
        with storage.saving("--out", out, "prep output", "it stays marked unfinished (no stage.json), and prep "
                            "run again there takes it over"):
            storage.mark_writing(out, "prep")
            (local / storage.MANIFEST).unlink(missing_ok=True)
            manifest, tracker = _prep_and_record(local, out, params)
            tracker.await_store(f"{out} stays marked unfinished")
            storage.write_manifest(local, manifest)
        storage.clear_writing(out)
    tracker.published(out, "prep")
    tracker.finish()
    return manifest


def _prep_and_record(build_dir: Path, out: str, params: dict):
    """Run `prepare` in `build_dir` and log it to MLflow; returns the manifest (files named by their
    final location) and the still-open tracker, finished once the manifest is in place."""
    import time

    from rlhf_core.data.loading import file_digest
    from rlhf_core.infra.manifests import code_version, values_hash

    built = prepare(build_dir, **params)
    digests = {key: file_digest(path) for key, path in built.items() if path.endswith(".jsonl")}
    paths = {key: out.rstrip("/") + "/" + Path(path).relative_to(build_dir).as_posix() for key, path in built.items()}
    run_id = os.environ.get("MLFLOW_RUN_ID")
    manifest = {
        "stage": "prep",
        "config": params,
        "config_hash": values_hash(params),
        "outputs": paths,
        "dataset_digests": digests,
        "metrics": {},
        "mlflow_run_id": run_id,
        "code_version": code_version(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "output_uri": out,
    }
    from rlhf_core.infra.tracking import Tracker

    tracker = Tracker(bool(run_id), os.environ.get("MLFLOW_EXPERIMENT_NAME", "rlhf"), "prep", None)
    tracker.log_params(params)
    tracker.log_datasets([{"path": p, "spec": k, "split": k.rsplit("_", 1)[-1], "digest": digests[k]}
                          for k, p in built.items() if k in digests], "output")
    tracker.set_tags({"rlhf.output_uri": out, "rlhf.config_hash": manifest["config_hash"]})
    return manifest, tracker
