import pytest
import yaml

from rlhf_core.algos.names import DPOLossType
from rlhf_core.cli import main
from rlhf_core.config import DPOConfig, SFTConfig, build_config
from rlhf_core.infra.settings import ConfigError

BASE = {"pretrain": "m", "save_path": "out", "dataset": "d.jsonl"}


def test_flat_fields_nest_into_data_and_flags_override_yaml():
    cfg = build_config(SFTConfig, {**BASE, "max_len": 128, "learning_rate": 1e-4}, {"max_len": 256})
    assert cfg.data.max_len == 256
    assert cfg.adam.lr == 1e-4
    assert cfg.data.dataset == "d.jsonl"


def test_batch_arithmetic_and_accumulation():
    cfg = build_config(SFTConfig, BASE, {"train_batch_size": 64, "micro_train_batch_size": 8, "num_gpus_per_node": 2})
    assert cfg.world_size == 2 and cfg.accumulation_steps == 4
    with pytest.raises(ConfigError, match="train_batch_size"):
        build_config(SFTConfig, BASE, {"train_batch_size": 60, "micro_train_batch_size": 8})
    # no micro-batch size: micro-batches by tokens, any number a step; DeepSpeed is told one
    cfg = build_config(SFTConfig, BASE, {"train_batch_size": 60, "num_gpus_per_node": 2})
    assert cfg.train.micro_batch_size is None and cfg.per_rank_batch == 30 and cfg.accumulation_steps == 1
    assert cfg.train.max_tokens_per_gpu == 16192
    with pytest.raises(ConfigError, match="multiple of the data-parallel ranks"):
        build_config(SFTConfig, BASE, {"train_batch_size": 61, "num_gpus_per_node": 2})


def test_tensor_parallel_ranks_share_batches_and_what_autotp_cannot_combine_with_is_refused():
    """`--ds_tensor_parallel_size`: a group's ranks see the same batches, so the accumulation counts
    data-parallel ranks; DeepSpeed is told every rank's batch and AutoTP's size; alone, it asks for
    one group of ranks (OpenRLHF's launcher starts a rank per GPU)."""
    from rlhf_core.distributed.engine import EngineSettings, deepspeed_config

    cfg = build_config(SFTConfig, BASE, {"train_batch_size": 64, "micro_train_batch_size": 8, "num_gpus_per_node": 4,
                                         "ds_tensor_parallel_size": 2})
    assert (cfg.world_size, cfg.data_parallel_size, cfg.accumulation_steps) == (4, 2, 4)
    ds = deepspeed_config(EngineSettings.of(cfg))
    assert ds["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    assert "tensor_parallel" not in deepspeed_config(EngineSettings.of(build_config(SFTConfig, BASE, {})))
    assert build_config(SFTConfig, BASE, {"ds.tensor_parallel_size": 2}).world_size == 2
    from rlhf_core.config import KTOConfig, PRMConfig, RMConfig

    for config, extra in ((RMConfig, {}), (KTOConfig, {}), (PRMConfig, {"placeholder_token": "ки"})):
        assert build_config(config, BASE, {"ds_tensor_parallel_size": 2, **extra}).data_parallel_size == 1
    for flags, says in [({"num_gpus_per_node": 3, "ds_tensor_parallel_size": 2}, "2 must divide the ranks"),
                        ({"ds_tensor_parallel_size": 2, "zero_stage": 3}, "does not shard its layers under ZeRO-3"),
                        ({"ds_tensor_parallel_size": 2, "lora_rank": 8}, "train without --lora_rank"),
                        ({"ds_tensor_parallel_size": 2, "micro_train_batch_size": 8, "train_batch_size": 12},
                         r"x data-parallel ranks \(8 x 1\)")]:
        with pytest.raises(ConfigError, match=says):
            build_config(SFTConfig, BASE, flags)


def test_ring_ranks_share_batches_and_what_ring_attention_is_not_built_for_is_refused():
    """`--ring_attn_size` (v0.9) / `--ds.ring_attn_size` (v0.11): a ring's ranks see the same batches
    (the accumulation counts data-parallel ranks), DeepSpeed is told every rank's batch; alone, it
    asks for one ring of ranks. Where it is not built, it is refused by name."""
    from rlhf_core.config import KDConfig, KTOConfig, PRMConfig, RMConfig
    from rlhf_core.distributed.engine import EngineSettings, deepspeed_config

    cfg = build_config(SFTConfig, BASE, {"train_batch_size": 64, "micro_train_batch_size": 8, "num_gpus_per_node": 4,
                                         "ring_attn_size": 2, "ring_head_stride": 2})
    assert (cfg.world_size, cfg.data_parallel_size, cfg.accumulation_steps) == (4, 2, 4)
    assert (cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride, cfg.ds.duplicates) == (2, 2, 2)
    ds = deepspeed_config(EngineSettings.of(cfg))
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    dotted = build_config(DPOConfig, BASE, {"ds.ring_attn_size": 2, "ds.ring_attn_head_stride": 4})
    assert (dotted.world_size, dotted.ds.ring_attn_head_stride) == (2, 4)
    assert build_config(RMConfig, BASE, {"ring_attn_size": 2}).data_parallel_size == 1
    both = build_config(SFTConfig, BASE, {"ring_attn_size": 2, "ds_tensor_parallel_size": 2})  # a ring of TP groups
    assert (both.world_size, both.data_parallel_size, both.ds.duplicates) == (4, 1, 4)
    for config in (KTOConfig, KDConfig, PRMConfig):
        with pytest.raises(ConfigError, match=r"--ring_attn_size\) 2: not built for `rlhf train"):
            build_config(config, {**BASE, "teacher_model": "t"} if config is KDConfig else BASE, {"ring_attn_size": 2})
    for flags, says in [({"num_gpus_per_node": 3, "ring_attn_size": 2}, r"--ring_attn_size\) 2 must divide the ranks"),
                        ({"ring_attn_size": 2, "ds_tensor_parallel_size": 2, "num_gpus_per_node": 6},
                         r"--ds_tensor_parallel_size\) 2 x --ds.ring_attn_size \(--ring_attn_size\) 2 must divide"),
                        ({"ring_attn_size": 2, "aux_loss_coef": 0.01}, "router statistics")]:
        with pytest.raises(ConfigError, match=says):
            build_config(SFTConfig, BASE, flags)


def test_invalid_value_names_the_field():
    with pytest.raises(ConfigError, match="--zero_stage"):
        build_config(SFTConfig, BASE, {"zero_stage": 4})
    with pytest.raises(ConfigError, match="--bogus: unknown field"):
        build_config(SFTConfig, {**BASE, "bogus": 1}, {})
    with pytest.raises(ConfigError, match="--model.model_name_or_path \\(--pretrain\\): required"):
        build_config(SFTConfig, {"save_path": "x", "dataset": "d"}, {})


def test_dpo_variants_resolve():
    cfg = build_config(DPOConfig, BASE, {"ipo": True})
    assert cfg.model.loss_type == DPOLossType.IPO and cfg.ref_pretrain == "m" and cfg.ref.model_name_or_path == "m"
    with pytest.raises(ConfigError, match="label_smoothing"):
        build_config(DPOConfig, BASE, {"loss_type": "hinge", "label_smoothing": 0.1})


def test_cli_unknown_flag_exits_2_and_names_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "sft", "--pretrain", "m", "--save_path", "o", "--dataset", "d", "--no_such_flag", "1"])
    assert exc.value.code == 2
    assert "--no_such_flag" in capsys.readouterr().err


def test_cli_invalid_value_exits_2(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**BASE, "learning_rate": -1}))
    assert main(["train", "sft", "--config", str(config)]) == 2
    assert "--learning_rate" in capsys.readouterr().err


def test_cli_bad_choice_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "rm", "--pretrain", "m", "--save_path", "o", "--dataset", "d", "--loss", "hinge"])
    assert exc.value.code == 2
    assert "--loss" in capsys.readouterr().err


def test_every_stage_reads_its_spellings_by_one_rule():
    """The trainers, eval and pairs read flags and YAML as `rlhf train ppo` does (`flags.Spellings`):
    flat, dotted or nested spellings give one config; two spellings that disagree are an error
    naming both; one flag twice keeps the last."""
    import argparse
    import shlex

    from rlhf_core.config import EvalConfig, add_config_flags

    def parse(cls, line):
        parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS, exit_on_error=False)
        add_config_flags(parser, cls)
        values = vars(parser.parse_args(shlex.split(line)))
        values.pop("config", None)
        return values

    flat = build_config(SFTConfig, None, parse(SFTConfig, "--pretrain m --save_path o --dataset d --learning_rate 1e-3 "
                                                          "--max_len 96 --train_batch_size 16"))
    dotted = build_config(SFTConfig, None, parse(SFTConfig, "--model.model_name_or_path m --ckpt.output_dir o "
                                                            "--data.dataset d --adam.lr 1e-3 --data.max_len 96 "
                                                            "--train.batch_size 16"))
    nested = build_config(SFTConfig, yaml.safe_load("""
model: {model_name_or_path: m}
ckpt: {output_dir: o}
data: {dataset: d, max_len: 96}
adam: {lr: 1.0e-3}
train: {batch_size: 16}
"""), {})
    assert flat.model_dump() == dotted.model_dump() == nested.model_dump()
    assert flat.adam.lr == 1e-3 and flat.data.max_len == 96

    with pytest.raises(argparse.ArgumentError, match="--learning_rate already set --adam.lr to 0.001; give one "
                                                     "of its spellings \\(--adam.lr, --learning_rate\\)"):
        parse(SFTConfig, "--learning_rate 1e-3 --adam.lr 2e-3")
    assert parse(SFTConfig, "--max_len 64 --max_len 12")["data.max_len"] == 12  # the same flag again: the last
    assert parse(SFTConfig, "--max_len 64 --data.max_len 64")["data.max_len"] == 64  # equal values agree
    with pytest.raises(ConfigError, match="--max_len \\(64\\) and --data.max_len \\(12\\) set --data.max_len"):
        build_config(SFTConfig, {**BASE, "max_len": 64, "data.max_len": 12}, {})
    with pytest.raises(ConfigError, match="--data.max_len \\(--max_len\\): Input should be greater than 1"):
        build_config(SFTConfig, BASE, {"max_len": 1})

    cfg = build_config(EvalConfig, {"pretrain": "p", "dataset": "d", "save_path": "o", "task": "sort"},
                       parse(EvalConfig, "--temperature 0.5"))
    assert cfg.temperature == 0.5
    with pytest.raises(ConfigError, match="--bogus: unknown field"):
        build_config(EvalConfig, {"bogus": 1}, {})


def test_one_field_on_a_shared_section_is_a_flag_of_every_stage_and_reaches_the_optimizer():
    """`AdamConfig.eps` is one line: `--adam.eps` of every trainer and `--actor.adam.eps` /
    `--critic.adam.eps` of PPO, each in the optimizer it configures."""
    import torch

    from rlhf_core.config import STAGE_CONFIGS, spellings_of
    from rlhf_core.distributed.engine import EngineSettings, build_optimizer
    from rlhf_core.rl.roles import engine_settings
    from rlhf_core.rl_config import SPELLINGS, build_ppo_config

    assert all("adam.eps" in spellings_of(cls).leaves for cls in STAGE_CONFIGS.values())
    assert {"actor.adam.eps", "critic.adam.eps"} <= set(SPELLINGS.leaves)

    def eps_of(settings: EngineSettings) -> float:
        return build_optimizer([torch.nn.Parameter(torch.zeros(2))], settings.adam, offload=False).defaults["eps"]

    assert eps_of(EngineSettings.of(build_config(SFTConfig, BASE, {}))) == 1e-8  # AdamW's default
    assert eps_of(EngineSettings.of(build_config(DPOConfig, BASE, {"adam.eps": 1e-6}))) == 1e-6
    ppo = build_ppo_config({"pretrain": "m", "prompt_data": "p", "save_path": "o", "task": "sort"},
                           {"actor.adam.eps": 1e-5, "critic.adam.eps": 1e-4})
    assert eps_of(engine_settings(ppo, ppo.actor, 1)) == 1e-5 and eps_of(engine_settings(ppo, ppo.critic, 1)) == 1e-4


def test_flat_names_sit_on_fields_and_a_shared_class_s_name_sets_every_section_it_is_in():
    from pydantic import BaseModel, Field

    from rlhf_core.flags import Spellings, flat

    class Opt(BaseModel):
        lr: float = 1.0
        decay: float = Field(0.0, json_schema_extra=flat("l2"))

    class Config(BaseModel):
        actor: Opt = Field(default_factory=Opt)
        critic: Opt = Field(default_factory=Opt)
        seed: int = Field(0, json_schema_extra=flat("seed", "random_seed"))  # its own path is not an alias

    spellings = Spellings(Config, {"actor_lr": ("actor.lr",)})
    assert spellings.aliases == {"l2": ("actor.decay", "critic.decay"), "random_seed": ("seed",),
                                 "actor_lr": ("actor.lr",)}
    assert spellings.to_paths({"l2": 0.1, "actor_lr": 2.0, "random_seed": 3}, "test") == {
        "actor.decay": 0.1, "critic.decay": 0.1, "actor.lr": 2.0, "seed": 3}
    with pytest.raises(ValueError, match="both on a field and in the table \\['l2'\\]"):
        Spellings(Config, {"l2": ("actor.decay",)})


def test_yaml_and_pipeline_sections_written_before_the_sections_still_validate():
    """A trainer config validates from any spelling: flat, dotted, nested, and the keys that moved."""
    from flows.params import PipelineDPOConfig

    old = {"pretrain": "m", "learning_rate": 1e-4, "beta": 0.2, "train_batch_size": 64,
           "data": {"max_len": 96, "packing_samples": True, "eval_dataset": "held.jsonl", "eval_split": "dev"}}
    cfg = PipelineDPOConfig.model_validate(old)
    assert (cfg.adam.lr, cfg.model.beta, cfg.train.batch_size, cfg.data.max_len) == (1e-4, 0.2, 64, 96)
    assert cfg.ds.packing_samples and (cfg.eval.dataset, cfg.eval.split) == ("held.jsonl", "dev")
    assert cfg.model.nll_loss_coef == 1.0  # the pipeline's tuned default under what was given
    assert PipelineDPOConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # a dump reads back
    with pytest.raises(ValueError, match="--data.bogus: unknown field"):
        PipelineDPOConfig.model_validate({"data": {"bogus": 1}})
