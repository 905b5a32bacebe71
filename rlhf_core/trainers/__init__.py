"""One recipe per stage, each `setup -> train -> save`, run on every rank of a worker group."""

from __future__ import annotations

import importlib

RECIPES = {
    "sft": "rlhf_core.trainers.sft:SFTRecipe",
    "rm": "rlhf_core.trainers.rm:RewardModelRecipe",
    "dpo": "rlhf_core.trainers.dpo:DPORecipe",
    "kto": "rlhf_core.trainers.kto:KTORecipe",
}


def recipe_class(stage: str):
    module, name = RECIPES[stage].split(":")
    return getattr(importlib.import_module(module), name)


def run_recipe(cfg) -> dict | None:
    """Run one stage on this rank; returns the stage manifest on rank 0, None elsewhere."""
    recipe = recipe_class(cfg.stage)(cfg)
    recipe.setup()
    try:
        recipe.train()
        manifest = recipe.save()
    except BaseException:
        recipe.ctx.tracker.finish("FAILED")
        raise
    recipe.ctx.tracker.finish("FINISHED")
    return manifest


def check_data(cfg) -> dict[str, int]:
    """Load and check a stage's data on the driver, so bad input fails before any rank starts.

    Raises DataError (file, row, key) or ValueError (too little data); returns example counts.
    """
    from rlhf_core.data.examples import load_pairs, load_sft, load_unpaired
    from rlhf_core.trainers.common import load_stage_tokenizer

    tokenizer = load_stage_tokenizer(cfg)
    loaders = {
        "sft": lambda split: load_sft(cfg.data, tokenizer, split, cfg.seed, cfg.pretrain_mode),
        "rm": lambda split: load_pairs(cfg.data, tokenizer, split, cfg.seed),
        "dpo": lambda split: load_pairs(cfg.data, tokenizer, split, cfg.seed),
        "kto": lambda split: load_unpaired(cfg.data, tokenizer, split, cfg.seed),
    }
    train, _ = loaders[cfg.stage](cfg.data.dataset_split)
    evaluation, _ = loaders[cfg.stage](cfg.data.eval_split)
    if len(train) < cfg.train_batch_size:
        raise ValueError(f"--dataset {cfg.data.dataset}: {len(train)} training examples, fewer than one global "
                         f"batch (--train_batch_size {cfg.train_batch_size})")
    return {"train": len(train), "eval": len(evaluation or [])}
