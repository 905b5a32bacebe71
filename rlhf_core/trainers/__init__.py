"""One recipe per stage, each `setup -> train -> save`, run on every rank of a worker group."""

from __future__ import annotations

import importlib

from rlhf_core.infra.hubs import use_modelscope

RECIPES = {
    "sft": "rlhf_core.trainers.sft:SFTRecipe",
    "rm": "rlhf_core.trainers.rm:RewardModelRecipe",
    "dpo": "rlhf_core.trainers.dpo:DPORecipe",
    "kto": "rlhf_core.trainers.kto:KTORecipe",
    "kd": "rlhf_core.trainers.kd:KDRecipe",
    "prm": "rlhf_core.trainers.prm:PRMRecipe",
}


def recipe_class(stage: str):
    module, name = RECIPES[stage].split(":")
    return getattr(importlib.import_module(module), name)


def run_recipe(cfg, data=None) -> dict | None:
    """Run one stage on this rank; returns the stage manifest on rank 0, None elsewhere.

    `data`: the stage's StageData as `check_data` loaded it; None loads it here."""
    use_modelscope(cfg.use_ms)  # a rank's own process loads the models by name
    recipe = recipe_class(cfg.stage)(cfg)
    try:
        recipe.setup(data)
        recipe.train()
        manifest = recipe.save()
    except BaseException:
        ctx = getattr(recipe, "ctx", None)  # set once setup has started the stage's run
        if ctx is not None:
            ctx.tracker.finish("FAILED")
        raise
    recipe.ctx.tracker.finish("FINISHED")
    return manifest


def check_data(cfg):
    """Load and check a stage's data on the driver, so bad input fails before any rank starts.

    Raises DataError (file, row, key; or too little data); returns the StageData,
    which the ranks then train on as it is (tokenized once, here).
    """
    from rlhf_core.data.loading import DataError

    data = importlib.import_module(RECIPES[cfg.stage].split(":")[0]).load_data(cfg)
    if len(data.train) < cfg.train.batch_size:
        raise DataError(f"--dataset {cfg.data.dataset}: {len(data.train)} training examples, fewer than one global "
                         f"batch (--train.batch_size {cfg.train.batch_size})")
    return data
