"""OpenRLHF's two flag eras: the dotted names of its CLI since 2026-04 and the flat names before.

`rlhf train ppo` (rlhf_core/rl_config.py) takes both, as do the supervised trainers (aliases in
config.FLAG_ALIASES); each test builds one config from each era and compares them whole.
"""

import argparse
import shlex

import pytest
import yaml

from rlhf_core.cli import _parser, flag_values
from rlhf_core.config import STAGE_CONFIGS, build_config
from rlhf_core.infra.settings import ConfigError
from rlhf_core.rl_config import SPELLINGS, PPOConfig, add_ppo_flags, build_ppo_config

LEAVES = SPELLINGS.leaves

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
    return build_config(STAGE_CONFIGS[stage], None, flag_values(_parser().parse_args(["train", stage,
                                                                                      *shlex.split(flags)])))


def test_sft_dotted_flags_give_the_flat_config():
    flat, dotted = _supervised("sft", SFT_FLAT), _supervised("sft", SFT_DOTTED)
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.ds.zero_stage == 3 and dotted.ds.packing_samples and dotted.model.pretrain_mode_enable \
        and dotted.adam.weight_decay == 0.01


@pytest.mark.parametrize("stage", ["rm", "dpo", "kto"])
def test_other_trainers_dotted_flags_give_the_flat_config(stage):
    flat_extra, dotted_extra = STAGE_EXTRAS[stage]
    flat = _supervised(stage, f"{COMMON_FLAT} {flat_extra}")
    dotted = _supervised(stage, f"{COMMON_DOTTED} {dotted_extra}")
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.pretrain == "m" and dotted.adam.lr == 1e-6


def test_supervised_yaml_takes_dotted_keys():
    cfg = build_config(STAGE_CONFIGS["dpo"], {"model.model_name_or_path": "m", "ckpt.output_dir": "o",
                                              "data.dataset": "d.jsonl", "data.max_len": 64, "model.beta": 0.3}, {})
    assert (cfg.pretrain, cfg.save_path, cfg.data.dataset, cfg.data.max_len, cfg.model.beta) == ("m", "o", "d.jsonl", 64, 0.3)


# --- rlhf train ppo -----------------------------------------------------------------------------

# OpenRLHF's examples/scripts/train_ppo_ray_hybrid_engine.sh in each era (the flags it has that
# this stage does not implement left out), plus most other fields.
PPO_DOTTED = """
--ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
--critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
--actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k
--ckpt.output_dir final/llama3-8b-rlhf --ckpt.path ckpt/llama3-8b-rlhf --ckpt.save_steps 20 --ckpt.max_num 2
--ckpt.load_enable --train.batch_size 128 --train.micro_batch_size 2 --rollout.batch_size 1024
--rollout.micro_batch_size 4 --rollout.n_samples_per_prompt 1 --train.max_epochs 1 --train.num_episodes 2
--train.seed 1234 --data.max_len 2048 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16
--ds.adam_offload --ds.flash_attn --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --actor.adam.betas 0.9 0.98
--critic.adam.betas 0.9 0.98 --actor.adam.weight_decay 0.01 --critic.adam.weight_decay 0.01
--actor.lr_warmup_ratio 0.05 --critic.lr_warmup_ratio 0.05 --actor.max_norm 0.5 --critic.max_norm 0.5
--algo.kl.init_coef 0.01 --algo.kl.target 0.1 --algo.kl.horizon 5000 --algo.kl.estimator k1
--algo.advantage.gamma 0.99 --algo.advantage.lambd 0.95 --algo.advantage.no_std_norm --actor.eps_clip 0.2
--actor.eps_clip_low_high 0.2 0.28 --actor.dual_clip 3 --critic.value_clip 0.4 --actor.entropy_coef 0.001
--critic.freezing_steps 5 --critic.save_value_network
--data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.prompt_split train --data.input_key context_messages
--data.label_key answer --data.apply_chat_template --eval.dataset OpenRLHF/eval-set --eval.split test
--eval.steps 10 --eval.temperature 0.7 --eval.n_samples_per_prompt 2 --reward.normalize_enable
--reward.clip_range -5 5 --reward.overlong_buffer_len 256 --reward.overlong_penalty_factor 0.5
--actor.gradient_checkpointing_enable --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep
--vllm.enable_prefix_caching --rollout.temperature 0.9 --rollout.top_p 0.95 --rollout.max_new_tokens 1024
--logger.logging_steps 2 --ds.value_head_prefix score
"""
PPO_FLAT = """
--ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
--critic_num_nodes 1 --critic_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8
--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5
--pretrain OpenRLHF/Llama-3-8b-sft-mixture --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k
--save_path final/llama3-8b-rlhf --ckpt_path ckpt/llama3-8b-rlhf --save_steps 20 --max_ckpt_num 2
--load_checkpoint --train_batch_size 128 --micro_train_batch_size 2 --rollout_batch_size 1024
--micro_rollout_batch_size 4 --n_samples_per_prompt 1 --max_epochs 1 --num_episodes 2
--seed 1234 --prompt_max_len 1024 --generate_max_len 1024 --max_samples 100000 --zero_stage 3 --bf16
--adam_offload --flash_attn --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --adam_betas 0.9 0.98
--l2 0.01 --lr_warmup_ratio 0.05 --max_norm 0.5
--init_kl_coef 0.01 --kl_target 0.1 --kl_horizon 5000 --kl_estimator k1
--gamma 0.99 --lambd 0.95 --no_advantage_std_norm --eps_clip 0.2
--eps_clip_low_high 0.2 0.28 --dual_clip 3 --value_clip 0.4 --entropy_loss_coef 0.001
--freezing_actor_steps 5 --save_value_network
--prompt_data OpenRLHF/prompt-collection-v0.1 --prompt_split train --input_key context_messages
--label_key answer --apply_chat_template --eval_dataset OpenRLHF/eval-set --eval_split test
--eval_steps 10 --eval_temperature 0.7 --eval_n_samples_per_prompt 2 --normalize_reward
--reward_clip_range -5 5 --overlong_buffer_len 256 --overlong_penalty_factor 0.5
--gradient_checkpointing --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep
--enable_prefix_caching --temperature 0.9 --top_p 0.95
--logging_steps 2 --value_head_prefix score
"""
# examples/scripts/train_dapo_ray_hybrid_engine.sh-like GRPO with a reward function, both eras.
GRPO_DOTTED = """
--actor.model_name_or_path Qwen/Qwen3-4B --reward.remote_url examples/reward_func.py --algo.advantage.estimator
group_norm --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3 --rollout.n_samples_per_prompt 8
--rollout.batch_size 64 --train.batch_size 512 --train.micro_batch_size 4 --actor.num_gpus_per_node 4
--ref.num_gpus_per_node 4 --train.colocate_actor_ref --algo.dynamic_filtering_enable
--algo.dynamic_filtering_range 0.0 1.0 --algo.loss_agg_mode seq-mean-token-sum-norm --actor.eps_clip_low_high 0.2 0.28
--data.prompt_dataset json@data/math --data.input_key problem --data.label_key solution --ckpt.output_dir out
--rollout.backend transformers --train.max_steps 50 --critic.freezing_steps -1
"""
GRPO_FLAT = """
--pretrain Qwen/Qwen3-4B --remote_rm_url examples/reward_func.py --advantage_estimator group_norm
--init_kl_coef 0.001 --use_kl_loss --kl_estimator k3 --n_samples_per_prompt 8 --rollout_batch_size 64
--train_batch_size 512 --micro_train_batch_size 4 --actor_num_gpus_per_node 4 --ref_num_gpus_per_node 4
--colocate_actor_ref --dynamic_filtering --dynamic_filtering_reward_range 0.0 1.0 --loss_agg_mode
seq-mean-token-sum-norm --eps_clip_low_high 0.2 0.28 --prompt_data json@data/math --input_key problem
--label_key solution --save_path out --rollout_backend transformers --max_steps 50 --freezing_actor_steps -1
"""
TASK = {"actor.model_name_or_path": "m", "reward.task": "addition", "data.prompt_dataset": "json@d",
        "ckpt.output_dir": "o", "rollout.batch_size": 8, "train.batch_size": 8}


def _ppo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf train ppo", argument_default=argparse.SUPPRESS)
    add_ppo_flags(parser)
    return parser


def _flags(flags: str) -> dict:
    values = vars(_ppo_parser().parse_args(shlex.split(flags)))
    values.pop("config", None)
    return values


def _ppo(flags: str = "", yaml_values: dict | None = None, complete: bool = True) -> PPOConfig:
    return build_ppo_config(yaml_values, _flags(flags), complete=complete)


def test_every_spelling_names_a_field_and_no_two_fields_share_a_flag():
    assert not set(SPELLINGS.aliases) & set(LEAVES)
    assert all(target in LEAVES for targets in SPELLINGS.aliases.values() for target in targets)
    assert "actor.adam.lr" in LEAVES and "algo.kl.init_coef" in LEAVES and "actor" in SPELLINGS.sections
    _ppo_parser()  # argparse refuses a flag registered twice


def test_ppo_command_lines_of_both_openrlhf_eras_give_one_config():
    dotted, flat = _ppo(PPO_DOTTED), _ppo(PPO_FLAT)
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.actor.adam.lr == 5e-7 and dotted.critic.adam.betas == (0.9, 0.98)
    assert dotted.ds.param_dtype.value == "bf16" and dotted.data.max_len == 2048
    assert dotted.rollout.max_new_tokens == 1024 and dotted.critic.freezing_steps == 5
    assert dotted.critic.model_name_or_path == "OpenRLHF/Llama-3-8b-rm-700k"  # gae: the reward model's body


def test_grpo_command_lines_of_both_eras_give_one_config():
    dotted, flat = _ppo(GRPO_DOTTED), _ppo(GRPO_FLAT)
    assert dotted.model_dump() == flat.model_dump()
    assert dotted.critic.model_name_or_path is None and dotted.ref.model_name_or_path == "Qwen/Qwen3-4B"
    assert dotted.critic.freezing_steps == 0 and dotted.actor.eps_clip_low_high == (0.2, 0.28)
    assert dotted.uses_ref and not dotted.uses_critic


def test_ring_attention_puts_every_model_role_in_rings_of_ranks_that_share_samples():
    """`--ring_attn_size 2` (`--ds.ring_attn_size`): each model role the run starts (actor, critic,
    reference, reward model) gets a ring of ranks where its ranks are not given, must have a multiple
    of it where they are, and the batches count data-parallel ranks (ranks / ring)."""
    from rlhf_core.distributed.engine import deepspeed_config
    from rlhf_core.rl.roles import engine_settings

    base = "--pretrain m --prompt_data p --save_path o --reward_pretrain r --advantage_estimator gae"
    cfg = _ppo(f"{base} --ring_attn_size 2 --ring_head_stride 2 --train_batch_size 8 --micro_train_batch_size 4")
    assert (cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride) == (2, 2)
    assert [getattr(cfg, r).world_size for r in ("actor", "critic", "ref", "reward")] == [2, 2, 2, 2]
    assert _ppo(f"{base} --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2").ds.model_dump() == \
        _ppo(f"{base} --ring_attn_size 2 --ring_head_stride 2").ds.model_dump()
    settings = engine_settings(cfg, cfg.actor, 2)
    assert settings.data_parallel_size == 1 and settings.accumulation_steps == 2
    assert deepspeed_config(settings)["train_batch_size"] == 16  # DeepSpeed counts both ranks of the ring
    four = _ppo(f"{base} --ring_attn_size 2 --actor_num_gpus_per_node 4 --train_batch_size 8 "
                "--micro_train_batch_size 4")
    assert four.actor.world_size == 4 and engine_settings(four, four.actor, 4).accumulation_steps == 1
    grpo = _ppo("--pretrain m --prompt_data p --save_path o --advantage_estimator group_norm --remote_rm_url r.py "
                "--init_kl_coef 0 --n_samples_per_prompt 2 --ring_attn_size 2")
    assert (grpo.actor.world_size, grpo.ref.world_size, grpo.critic.world_size) == (2, 1, 1)  # no ref, no critic
    for flags, says in [("--ring_attn_size 2 --critic_num_gpus_per_node 3",
                         r"--ring_attn_size\) 2 must divide the critic ranks \(3"),
                        ("--ring_attn_size 2 --aux_loss_coef 0.01", "router statistics"),
                        ("--ring_attn_size 2 --actor_num_gpus_per_node 4 --train_batch_size 8 "
                         "--micro_train_batch_size 8", "--train.micro_batch_size x actor ranks / --ds.ring_attn_size 2 "
                         r"\(8 x 2")]:
        with pytest.raises(ConfigError, match=says):
            _ppo(f"{base} {flags}")




def test_tensor_parallelism_splits_the_trained_roles_and_runs_the_frozen_ones_whole():
    """`--ds_tensor_parallel_size 2` (`--ds.tensor_parallel_size`, OpenRLHF v0.9's PPO flag): the
    actor's and critic's ranks in groups of 2 that take the same samples (DeepSpeed's AutoTP splits
    what it trains); the reference and reward model get as many ranks, each running the model whole
    on its own samples; the batches count data-parallel ranks; what AutoTP cannot do is refused."""
    from rlhf_core.distributed.engine import deepspeed_config
    from rlhf_core.rl.roles import engine_settings

    base = "--pretrain m --prompt_data p --save_path o --reward_pretrain r --advantage_estimator gae"
    cfg = _ppo(f"{base} --ds_tensor_parallel_size 2 --train_batch_size 8 --micro_train_batch_size 4")
    assert cfg.ds.tensor_parallel_size == 2 and _ppo(f"{base} --ds.tensor_parallel_size 2").ds.tensor_parallel_size == 2
    assert [getattr(cfg, r).world_size for r in ("actor", "critic", "ref", "reward")] == [2, 2, 2, 2]
    assert [cfg.duplicates(r) for r in ("actor", "critic", "ref", "reward")] == [2, 2, 1, 1]
    settings = engine_settings(cfg, cfg.actor, 2)
    assert settings.data_parallel_size == 1 and settings.accumulation_steps == 2
    ds = deepspeed_config(settings)
    assert ds["tensor_parallel"]["autotp_size"] == 2 and ds["train_batch_size"] == 16
    frozen = engine_settings(cfg, cfg.actor, 2, role="ref")  # the reference: two data-parallel ranks
    assert frozen.data_parallel_size == 2 and "tensor_parallel" not in deepspeed_config(frozen, train=False)
    for flags, says in [("--ds_tensor_parallel_size 2 --actor_num_gpus_per_node 3",
                         r"--ds_tensor_parallel_size\) 2 must divide the actor ranks \(3"),
                        ("--ds_tensor_parallel_size 2 --zero_stage 3", "does not shard its layers under ZeRO-3"),
                        ("--ds_tensor_parallel_size 2 --lora_rank 4", "AutoTP replaces the linear layers LoRA adapts"),
                        ("--ds_tensor_parallel_size 2 --ring_attn_size 2 --actor_num_gpus_per_node 6",
                         r"--ds_tensor_parallel_size\) 2 x --ds.ring_attn_size \(--ring_attn_size\) 2 must divide "
                         r"the actor ranks \(6"),
                        ("--ds_tensor_parallel_size 2 --actor_num_gpus_per_node 4 --critic_num_gpus_per_node 4 "
                         "--train_batch_size 8 --micro_train_batch_size 8",
                         r"--train.micro_batch_size x actor ranks / --ds.tensor_parallel_size 2 \(8 x 2")]:
        with pytest.raises(ConfigError, match=says):
            _ppo(f"{base} {flags}")
def test_yaml_nested_dotted_and_flat_give_one_config():
    nested = yaml.safe_load("""
actor: {model_name_or_path: m, adam: {lr: 5.0e-7, betas: [0.9, 0.98]}}
critic: {adam.lr: 1.0e-5}
reward: {task: addition}
rollout: {batch_size: 8, n_samples_per_prompt: 4}
algo: {advantage: {estimator: rloo}, kl: {use_loss: true, estimator: k3}}
train: {batch_size: 16, micro_batch_size: 2}
data: {prompt_dataset: json@d}
ckpt: {output_dir: o}
""")
    dotted = yaml.safe_load("""
actor.model_name_or_path: m
actor.adam.lr: 5.0e-7
actor.adam.betas: [0.9, 0.98]
critic.adam.lr: 1.0e-5
reward.task: addition
rollout.batch_size: 8
rollout.n_samples_per_prompt: 4
algo.advantage.estimator: rloo
algo.kl.use_loss: true
algo.kl.estimator: k3
train.batch_size: 16
train.micro_batch_size: 2
data.prompt_dataset: json@d
ckpt.output_dir: o
""")
    flat = yaml.safe_load("""
pretrain: m
actor_learning_rate: 5.0e-7
critic_learning_rate: 1.0e-5
actor.adam.betas: [0.9, 0.98]
task: addition
rollout_batch_size: 8
n_samples_per_prompt: 4
advantage_estimator: rloo
use_kl_loss: true
kl_estimator: k3
train_batch_size: 16
micro_train_batch_size: 2
prompt_data: json@d
save_path: o
stage: ppo
""")
    configs = [build_ppo_config(values, {}) for values in (nested, dotted, flat)]
    assert configs[0].model_dump() == configs[1].model_dump() == configs[2].model_dump()
    assert configs[0].critic.adam.lr == 1e-5 and configs[0].rollout.max_new_tokens > 0  # the task's budget


def test_flags_override_yaml_whatever_the_spellings():
    cfg = build_ppo_config({**TASK, "actor_learning_rate": 1e-6, "seed": 1}, _flags("--actor.adam.lr 2e-6"))
    assert cfg.actor.adam.lr == 2e-6 and cfg.train.seed == 1


def test_two_spellings_with_different_values_in_one_place_are_an_error():
    with pytest.raises(ConfigError, match=r"--actor\.adam\.lr .* --actor_learning_rate .*different values"):
        build_ppo_config({**TASK, "actor.adam.lr": 1e-6, "actor_learning_rate": 2e-6}, {})
    with pytest.raises(ConfigError, match="--l2 .*--critic.adam.weight_decay"):
        build_ppo_config({**TASK, "l2": 0.1, "critic": {"adam": {"weight_decay": 0.2}}}, {})
    with pytest.raises(ConfigError, match="--bf16 .*--ds.param_dtype"):
        build_ppo_config({**TASK, "bf16": True, "param_dtype": "fp16"}, {})
    # The same value twice is no conflict (YAML reads 1e-6 as a string, 1.0e-6 as a number).
    cfg = build_ppo_config({**TASK, "actor.adam.lr": "1e-6", "actor_learning_rate": 1.0e-6, "bf16": True,
                            "ds.param_dtype": "bf16"}, {})
    assert cfg.actor.adam.lr == 1e-6 and cfg.ds.param_dtype.value == "bf16"


@pytest.mark.parametrize("flags, named", [
    ("--actor.adam.lr 1e-6 --actor_learning_rate 2e-6", "--actor_learning_rate"),
    ("--bf16 --ds.param_dtype fp16", "--ds.param_dtype"),
    ("--adam_betas 0.9 0.99 --critic.adam.betas 0.8 0.9", "--critic.adam.betas"),
    ("--advantage_estimator ppo", "--advantage_estimator"),
    ("--actor.adam.lr fast", "--actor.adam.lr"),
    ("--actor.bogus 1", "--actor.bogus"),
])
def test_flag_errors_exit_2_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        _ppo_parser().parse_args(shlex.split(flags))
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("values, named", [
    ({"advantage_estimator": "group_norm"}, "--rollout.n_samples_per_prompt > 1"),
    ({"advantage_estimator": "rloo", "n_samples_per_prompt": 2, "gamma": 0.99}, "--algo.advantage.gamma must be 1"),
    ({"dynamic_filtering": True}, "--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt"),
    ({"train.batch_size": 3}, "must be a multiple of --train.batch_size (3)"),
    ({"train.micro_batch_size": 3}, "--train.micro_batch_size x actor ranks (3 x 1"),
    ({"critic.num_gpus_per_node": 3}, "must be a multiple of the critic ranks (3"),
    ({"critic.num_gpus_per_node": 3, "micro_train_batch_size": 1}, "--train.micro_batch_size x critic ranks (1 x 3"),
    ({"reward_pretrain": "rm"}, "give one reward source"),
    ({"reward.task": None, "remote_rm_url": "ftp://x"}, "--reward.remote_url: 'ftp://x'"),
    ({"reward.task": "no_such_task"}, "--reward.task"),
    ({"advantage_estimator": "reinforce", "critic_pretrain": "c"}, "--critic.model_name_or_path: only"),
    ({"actor_learning_rate": -1}, "--actor.adam.lr (--actor_learning_rate): Input should be greater than 0"),
    ({"dual_clip": 0.5}, "--actor.dual_clip (--dual_clip)"),
    ({"reward_clip_range": [1, 2, 3]}, "--reward.clip_range (--reward_clip_range)"),
    ({"kl_estimator": "k4"}, "--algo.kl.estimator (--kl_estimator)"),
    ({"ckpt_path": "ftp://host/ckpt", "save_steps": 10}, "--ckpt.path (--ckpt_path) ftp://host/ckpt: checkpoints go"),
    ({"colocate_all_models": True, "vllm_num_engines": 2}, "--train.colocate_all: actor ranks (1)"),
    ({"colocate_actor_ref": True, "ref_num_gpus_per_node": 2, "train.batch_size": 2, "rollout.batch_size": 2},
     "--actor.num_nodes/num_gpus_per_node and --ref.num_nodes"),
    ({"rollout.backend": "vllm"}, "--rollout.backend vllm needs --vllm.num_engines > 0"),
    ({"rollout.backend": "transformers", "vllm.num_engines": 1}, "--rollout.backend transformers contradicts"),
    ({"reward.task": None, "reward_pretrain": "rm", "max_len": 512, "prompt_max_len": 512}, "--data.max_len (512)"),
    ({"input_template": "no {slot}"}, "--data.input_template must contain '{}'"),
    ({"reward.task": None, "reward_pretrain": "prm", "placeholder_token": "ки"}, "a process reward model needs both"),
    ({"process_reward": True}, "--reward.process_enable: step rewards come from a process reward model"),
    ({"placeholder_token": "ки", "reward_tokens": ["+", "-"]}, "--reward.placeholder_token: the process reward model is"),
    ({"reward.task": None, "reward_pretrain": "prm", "placeholder_token": "ки", "reward_tokens": ["+", "-"],
      "normalize_reward": True}, "--reward.normalize_enable: a process reward model's scores"),
    ({"reward.task": None, "reward_pretrain": "prm", "placeholder_token": "ки", "reward_tokens": ["+", "-"],
      "process_reward": True, "advantage_estimator": "rloo", "n_samples_per_prompt": 2},
     "--reward.process_enable: --algo.advantage.estimator rloo takes one reward per sample"),
    ({"reward.task": None, "reward_pretrain": "prm", "placeholder_token": "ки", "reward_tokens": ["+"]},
     "at least 2"),
    ({"actor": {"bogus": 1}}, "--actor.bogus: unknown field"),
    ({"no_such_flag": 1}, "--no_such_flag: unknown field"),
    ({"policy_loss_type": "gspo", "loss_agg_mode": "token-mean"}, "must be seq-mean-token-mean, got token-mean"),
    ({"policy_loss_type": "gspo", "ring_attn_size": 2}, "--actor.policy_loss_type gspo with --ds.ring_attn_size"),
    ({"policy_loss_type": "sapo", "dual_clip": 3.0}, "--actor.policy_loss_type sapo has none"),
    ({"policy_loss_type": "cispo", "dual_clip": 3.0}, "--actor.policy_loss_type cispo has none"),
    ({"policy_loss_type": "grpo"}, "--actor.policy_loss_type (--policy_loss_type)"),
    ({"sapo_tau_neg": 0}, "--actor.sapo_tau_neg (--sapo_tau_neg)"),
    ({"enable_vllm_is_correction": True, "vllm_is_truncated_threshold": [2, 1]}, "give 0 <= low <= high"),
    ({"enable_vllm_is_correction": True, "vllm_is_correction_type": "seq-mask-tis", "ring_attn_size": 2},
     "seq-mask-tis with --ds.ring_attn_size"),
    ({"vllm_is_correction_type": "mis"}, "--algo.advantage.is_correction_type (--vllm_is_correction_type)"),
    ({"async_train": True, "vllm_enable_sleep": True}, "--train.async_enable (--async_train) with --vllm.enable_sleep"),
    ({"async_train": True, "async_queue_size": 0}, "--train.async_queue_size (--async_queue_size)"),
])
def test_invalid_configs_name_the_flag(values, named):
    with pytest.raises(ConfigError) as exc:
        build_ppo_config({**TASK, **values}, {})
    assert named in str(exc.value)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto", "ppo"])
@pytest.mark.parametrize("flag", ["save_steps", "load_checkpoint"])
def test_checkpoints_without_a_path_go_where_openrlhf_puts_them(stage, flag, tmp_path, monkeypatch):
    """OpenRLHF's --ckpt_path defaults to ./ckpt/checkpoints_<cli> (ppo_ray for RL); an input
    template with no braces at all is dropped, as OpenRLHF drops it (one warning line)."""
    from rlhf_core.cli import _parser, train_config

    monkeypatch.chdir(tmp_path)
    inputs = (["--prompt_data", "p", "--remote_rm_url", "r.py"] if stage == "ppo" else ["--dataset", "d"])
    value = ["10"] if flag == "save_steps" else []
    cfg = train_config(_parser().parse_args(["train", stage, "--pretrain", "m", "--save_path", "o", *inputs,
                                             f"--{flag}", *value, "--input_template", '""']))
    assert cfg.ckpt.path == str(tmp_path / "ckpt" / f"checkpoints_{'ppo_ray' if stage == 'ppo' else stage}")
    assert cfg.data.input_template is None


def test_check_complete_names_every_missing_input():
    with pytest.raises(ConfigError) as exc:
        build_ppo_config({}, {})
    message = str(exc.value)
    for named in ("--actor.model_name_or_path (--pretrain): required", "--data.prompt_dataset (--prompt_data)",
                  "--ckpt.output_dir (--save_path)", "a reward source is required"):
        assert named in message
    cfg = build_ppo_config({}, {}, complete=False)  # a pipeline fills them in later
    assert cfg.actor.model_name_or_path is None and cfg.critic.model_name_or_path is None


def test_derived_defaults():
    cfg = build_ppo_config({**TASK, "reward.task": None, "remote_rm_url": "http://127.0.0.1:5000/get_reward"}, {})
    assert cfg.critic.model_name_or_path == "m"  # gae without a reward model: the actor's body
    assert cfg.rollout.max_new_tokens == 1024 and cfg.data.max_len == 1024 + 1024
    assert cfg.actor.eps_clip_low_high == (0.2, 0.2)
    cfg = build_ppo_config({**TASK, "reward.task": None, "reward_pretrain": "rm1,rm2", "ref_pretrain": "r",
                            "max_len": 1536}, {})
    assert (cfg.critic.model_name_or_path, cfg.ref.model_name_or_path) == ("rm1", "r")
    assert cfg.rollout.max_new_tokens == 512


def test_policy_loss_type_in_both_eras_and_gspo_reduces_per_sequence():
    """OpenRLHF's `--policy_loss_type` (0.9) / `--actor.policy_loss_type` (0.11): `ppo` by default; `gspo`
    takes the sequence-mean reduction OpenRLHF forces for it; `cispo` and `sapo` (verl's and TRL's) keep
    the configured one."""
    assert build_ppo_config(TASK, {}).actor.policy_loss_type == "ppo"
    flat, dotted = (_ppo(f"{PPO_FLAT} --policy_loss_type gspo"), _ppo(f"{PPO_DOTTED} --actor.policy_loss_type gspo"))
    assert flat.model_dump() == dotted.model_dump()
    assert dotted.actor.policy_loss_type == "gspo" and dotted.algo.loss_agg_mode == "seq-mean-token-mean"
    for kind in ("cispo", "sapo"):
        cfg = build_ppo_config({**TASK, "policy_loss_type": kind, "sapo_tau_pos": 2.0}, {})
        assert cfg.actor.policy_loss_type == kind and cfg.algo.loss_agg_mode == "token-mean"
        assert cfg.actor.sapo_tau_pos == 2.0 and cfg.actor.sapo_tau_neg == 1.05
    dumped = dotted.model_dump(mode="json")
    assert PPOConfig.model_validate(dumped).model_dump(mode="json") == dumped


def test_the_engine_mismatch_correction_in_both_eras():
    flat = _ppo(f"{PPO_FLAT} --enable_vllm_is_correction --vllm_is_truncated_threshold 0.8 2 "
                "--vllm_is_correction_type icepop")
    dotted = _ppo(f"{PPO_DOTTED} --algo.advantage.is_correction_enable --algo.advantage.is_correction_threshold 0.8 2 "
                  "--algo.advantage.is_correction_type icepop")
    assert flat.model_dump() == dotted.model_dump()
    adv = dotted.algo.advantage
    assert adv.is_correction_enable and adv.is_correction_threshold == (0.8, 2.0) and adv.is_correction_type == "icepop"
    default = build_ppo_config(TASK, {}).algo.advantage  # OpenRLHF's defaults
    assert not default.is_correction_enable and default.is_correction_threshold == (0.5, 5.0)
    assert default.is_correction_type == "tis"


def test_a_resolved_config_validates_again_unchanged():
    for cfg in (_ppo(PPO_DOTTED), _ppo(GRPO_DOTTED)):
        dumped = cfg.model_dump(mode="json")  # what a pipeline stores as parameters
        assert PPOConfig.model_validate(dumped).model_dump(mode="json") == dumped


def test_the_configs_choices_are_the_maths_enums_and_need_no_torch():
    """The configs name estimators, KL estimators and aggregation modes with the enums the math is
    registered under (`algos/names.py`), not copies; those parse from their spelling, print as it,
    and load without torch (the CLI parser and `flows/` import the configs)."""
    import subprocess
    import sys

    from rlhf_core.algos import advantages, losses
    from rlhf_core.algos.names import AdvantageEstimator, KLEstimator, LossAggMode
    from rlhf_core.rl_config import AdvantageConfig, AlgoConfig, KLConfig

    assert AdvantageConfig.model_fields["estimator"].annotation is AdvantageEstimator
    assert KLConfig.model_fields["estimator"].annotation is KLEstimator
    assert AlgoConfig.model_fields["loss_agg_mode"].annotation is LossAggMode
    assert set(losses.KL_ESTIMATORS) == set(KLEstimator)
    assert {e for e in AdvantageEstimator if e.is_group} == set(advantages._GROUP_SHAPERS)

    cfg = AlgoConfig.model_validate({"advantage": {"estimator": "rloo"}, "loss_agg_mode": "seq-mean-token-sum"})
    assert cfg.advantage.estimator is AdvantageEstimator.RLOO and cfg.advantage.estimator.is_group
    assert f"{cfg.advantage.estimator}|{cfg.loss_agg_mode}|{AlgoConfig().kl.estimator}" == "rloo|seq-mean-token-sum|k1"
    assert AlgoConfig().advantage.estimator is AdvantageEstimator.GAE  # defaults are members, not bare strings

    code = "import sys, rlhf_core.rl_config, rlhf_core.config, flows.params; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_readmes_dotted_and_flat_grpo_commands_are_the_same_run():
    import re
    import shlex
    from pathlib import Path

    from rlhf_core.cli import _parser
    from rlhf_core.rl_config import build_ppo_config

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    commands = [re.sub(r"\s*\\\n\s*", " ", c) for c in re.findall(r"^rlhf train ppo (?:.*\\\n)*.*$", readme, re.M)]
    assert len(commands) >= 2
    configs = []
    for command in commands[:2]:
        args = _parser().parse_args(shlex.split(command.split("#")[0])[1:])
        configs.append(build_ppo_config(None, flag_values(args)).model_dump())
    assert configs[0] == configs[1]
