"""OpenRLHF's two flag eras: the dotted names of its CLI since 2026-04 and the flat names before.

`rlhf train ppo` (rlhf_core/rl_config.py) takes both, as do the supervised trainers (aliases in
config.FLAG_ALIASES); each test builds one config from each era and compares them whole.
"""

import shlex

import pytest

from rlhf_core.cli import _parser
from rlhf_core.config import STAGE_CONFIGS, build_config

# --- the supervised trainers ------------------------------------------------------------------

SFT_FLAT = """
--pretrain Qwen/Qwen2.5-0.5B --save_path out/sft --ckpt_path out/ckpt --save_steps 100 --max_ckpt_num 2
--load_checkpoint --logging_steps 5 --eval_steps 50 --train_batch_size 64 --micro_train_batch_size 4
--gradient_checkpointing --seed 7 --zero_stage 3 --param_dtype bf16 --adam_offload --max_epochs 2
--learning_rate 2e-5 --adam_betas 0.9 0.98 --l2 0.01 --lr_warmup_ratio 0.05 --min_lr_ratio 0.2 --max_norm 0.5
--lora_rank 8 --lora_alpha 32 --lora_dropout 0.05 --target_modules q_proj,v_proj --packing_samples
--dataset data/train.jsonl --dataset_probs 1.0 --eval_dataset data/test.jsonl --dataset_split train
--eval_split test --max_samples 5000 --input_key question --output_key answer --apply_chat_template
--tokenizer_chat_template "{{ x }}" --max_len 1024 --pretrain_mode
"""
SFT_DOTTED = """
--model.model_name_or_path Qwen/Qwen2.5-0.5B --ckpt.output_dir out/sft --ckpt.path out/ckpt
--ckpt.save_steps 100 --ckpt.max_num 2 --ckpt.load_enable --logger.logging_steps 5 --eval.steps 50
--train.batch_size 64 --train.micro_batch_size 4 --model.gradient_checkpointing_enable --train.seed 7
--ds.zero_stage 3 --ds.param_dtype bf16 --ds.adam_offload --train.max_epochs 2 --adam.lr 2e-5
--adam.betas 0.9 0.98 --adam.weight_decay 0.01 --lr_warmup_ratio 0.05 --min_lr_ratio 0.2 --max_norm 0.5
--ds.lora.rank 8 --ds.lora.alpha 32 --ds.lora.dropout 0.05 --ds.lora.target_modules q_proj,v_proj
--ds.packing_samples --data.dataset data/train.jsonl --data.dataset_probs 1.0 --eval.dataset data/test.jsonl
--data.dataset_split train --eval.split test --data.max_samples 5000 --data.input_key question
--data.output_key answer --data.apply_chat_template --data.tokenizer_chat_template "{{ x }}"
--data.max_len 1024 --model.pretrain_mode_enable
"""
COMMON_FLAT = "--pretrain m --save_path o --dataset d.jsonl --learning_rate 1e-6 --train_batch_size 16 --zero_stage 0"
COMMON_DOTTED = ("--model.model_name_or_path m --ckpt.output_dir o --data.dataset d.jsonl --adam.lr 1e-6 "
                 "--train.batch_size 16 --ds.zero_stage 0")
STAGE_EXTRAS = {
    "rm": ("--loss logexp --value_head_prefix value_head --prompt_key q --chosen_key c --rejected_key r",
           "--model.loss_type logexp --ds.value_head_prefix value_head --data.prompt_key q --data.chosen_key c "
           "--data.rejected_key r"),
    "dpo": ("--ref_pretrain ref --beta 0.2 --label_smoothing 0.1 --nll_loss_coef 0.5",
            "--ref.model_name_or_path ref --model.beta 0.2 --model.label_smoothing 0.1 --model.nll_loss_coef 0.5"),
    "kto": ("--ref_pretrain ref --beta 0.2", "--ref.model_name_or_path ref --model.beta 0.2"),
}


def _supervised(stage: str, flags: str):
    args = vars(_parser().parse_args(["train", stage, *shlex.split(flags)]))
    values = {k: v for k, v in args.items() if k not in ("command", "stage", "config")}
    return build_config(STAGE_CONFIGS[stage], None, values)


def test_sft_dotted_flags_give_the_flat_config():
    flat, dotted = _supervised("sft", SFT_FLAT), _supervised("sft", SFT_DOTTED)
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.zero_stage == 3 and dotted.data.packing_samples and dotted.pretrain_mode and dotted.l2 == 0.01


@pytest.mark.parametrize("stage", ["rm", "dpo", "kto"])
def test_other_trainers_dotted_flags_give_the_flat_config(stage):
    flat_extra, dotted_extra = STAGE_EXTRAS[stage]
    flat = _supervised(stage, f"{COMMON_FLAT} {flat_extra}")
    dotted = _supervised(stage, f"{COMMON_DOTTED} {dotted_extra}")
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.pretrain == "m" and dotted.learning_rate == 1e-6


def test_supervised_yaml_takes_dotted_keys():
    cfg = build_config(STAGE_CONFIGS["dpo"], {"model.model_name_or_path": "m", "ckpt.output_dir": "o",
                                              "data.dataset": "d.jsonl", "data.max_len": 64, "model.beta": 0.3}, {})
    assert (cfg.pretrain, cfg.save_path, cfg.data.dataset, cfg.data.max_len, cfg.beta) == ("m", "o", "d.jsonl", 64, 0.3)
