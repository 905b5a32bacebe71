"""The Mixture-of-Experts load-balancing loss (`--aux_loss_coef`): the pure function against
transformers' own, the router hooks on a tiny Mixtral (padding left out, one number per micro-step,
nothing kept from no-grad passes), and the flag's errors. That the coefficient changes how evenly
the experts are used after training: tests/learning/test_moe_learning.py."""

import pytest
import torch

from rlhf_core.algos.losses import load_balancing_loss
from rlhf_core.data.batching import pack_batch, pad_batch
from rlhf_core.models.forward import sequence_logprobs, token_logprobs
from rlhf_core.models.moe import RouterBalance, router_balance, router_modules


def tiny_moe(family: str = "mixtral"):
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=64)
        return MixtralForCausalLM(config)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, max_position_embeddings=64, head_dim=16)
    return Qwen3MoeForCausalLM(config)


def test_the_loss_is_transformers_load_balancing_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    layers = [torch.randn(30, 8) for _ in range(3)]
    mask = torch.rand(2, 15) > 0.3
    ours = load_balancing_loss([layer[mask.reshape(-1)] for layer in layers], top_k=2)
    theirs = load_balancing_loss_func(tuple(layers), num_experts=8, top_k=2, attention_mask=mask.long())
    torch.testing.assert_close(ours, theirs.float())
    unmasked = load_balancing_loss_func(tuple(layers), num_experts=8, top_k=2)
    torch.testing.assert_close(load_balancing_loss(layers, top_k=2), unmasked.float())


def test_balanced_routing_costs_top_k_and_one_expert_for_all_costs_more():
    even = torch.zeros(40, 4)  # every expert equally likely: P_e = 1/4, so E * sum_e f_e / 4 = top_k whatever is picked
    assert load_balancing_loss([even], top_k=1).item() == pytest.approx(1.0)
    spread = torch.eye(4).repeat(10, 1) * 5.0  # each row prefers another expert, in turn: f_e = P_e = 1/4
    assert load_balancing_loss([spread], top_k=1).item() == pytest.approx(1.0)
    skewed = torch.zeros(40, 4)
    skewed[:, 0] = 8.0  # everything on expert 0
    assert load_balancing_loss([skewed], top_k=1).item() > 3.9
    assert load_balancing_loss([], top_k=2).item() == 0.0


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_every_moe_layer_router_is_found(family):
    model = tiny_moe(family)
    assert len(router_modules(model)) == model.config.num_hidden_layers


def test_a_dense_model_has_no_router():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert router_modules(model) == []
    with pytest.raises(ValueError, match="no Mixture-of-Experts router"):
        RouterBalance(model, 0.01)


def test_a_micro_step_loss_covers_the_real_tokens_of_its_forwards_as_transformers_counts_them():
    """A padded batch: the hooked routers give transformers' aux loss of the same forward with its
    attention mask (padding left out); without collecting, or without gradients, nothing is kept."""
    model = tiny_moe()
    balance = RouterBalance(model, 0.02)
    assert router_balance(model) is balance
    batch = pad_batch([[1, 5, 7, 9, 11], [2, 4, 6]], [[0, 1, 1, 1, 1], [0, 1, 1]], pad_id=0)
    with balance.collecting():
        token_logprobs(model, batch)
        ours = balance.loss()
    assert ours.requires_grad
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True)
    torch.testing.assert_close(ours, out.aux_loss.float())
    with balance.collecting():
        with torch.no_grad():  # a frozen reference or an evaluation: not the trained forward
            token_logprobs(model, batch)
        assert balance.loss().item() == 0.0
    token_logprobs(model, batch)  # outside a micro-step: nothing kept
    with balance.collecting():
        assert balance.loss().item() == 0.0


def test_packed_rows_count_only_their_samples_tokens():
    """Packing pads row ends with restarted positions: only `seq_ids` tells them apart, so the
    packed and the padded layouts of the same samples give the same loss."""
    model = tiny_moe()
    balance = RouterBalance(model, 0.02)
    seqs, masks = [[1, 5, 7, 9, 11], [2, 4, 6], [3, 3, 8, 8]], [[0, 1, 1, 1, 1], [0, 1, 1], [0, 0, 1, 1]]
    losses = []
    for batch in (pad_batch(seqs, masks, pad_id=0), pack_batch(seqs, masks, row_capacity=8, pad_id=0)):
        with balance.collecting():
            sequence_logprobs(model, batch)
            losses.append(balance.loss())
    torch.testing.assert_close(losses[0], losses[1])


def test_a_forward_that_does_not_say_its_tokens_is_an_error():
    model = tiny_moe()
    balance = RouterBalance(model, 0.02)
    with balance.collecting():
        model(input_ids=torch.tensor([[1, 2, 3]]))
        with pytest.raises(RuntimeError, match="did not say which of its tokens are real"):
            balance.loss()


def test_the_coefficient_on_a_dense_model_is_a_config_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.config import SFTConfig
    from rlhf_core.distributed.engine import EngineSettings, initialize
    from rlhf_core.infra.settings import ConfigError

    cfg = SFTConfig.model_validate({"pretrain": "unused", "dataset": "unused", "save_path": str(tmp_path),
                                    "aux_loss_coef": 0.01})
    assert cfg.model.aux_loss_coef == 0.01
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match="--aux_loss_coef 0.01: LlamaForCausalLM is not a Mixture-of-Experts"):
        initialize(model, EngineSettings.of(cfg), total_steps=1)


REWARD = """
import torch

def reward_func(queries, prompts, labels, responses):
    return torch.tensor([(len(r) % 5) / 5 for r in responses])
"""


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_an_moe_actor_and_critic_train_with_the_loss_and_report_it(tmp_path):
    """The RL stage: the actor and, with GAE, its critic (a Mixtral too) add the load-balancing loss and
    report it per step (`train/aux_loss`, `train/value_aux_loss`: between top_k 2 and E 4)."""
    import json

    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    paths = prepare(tmp_path / "prep", task="addition", seed=0, model_family="mixtral", model_size="nano",
                    n_train=64, n_test=8)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    out = tmp_path / "ppo"
    assert main(["train", "ppo", "--pretrain", paths["base"], "--prompt_data", f"json@{paths['prompts']}",
                 "--remote_rm_url", str(reward), "--advantage_estimator", "gae", "--n_samples_per_prompt", "2",
                 "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
                 "--generate_max_len", "4", "--max_steps", "1", "--aux_loss_coef", "0.01", "--use_mlflow", "false",
                 "--param_dtype", "fp32", "--save_path", str(out)]) == 0
    metrics = json.loads((out / "stage.json").read_text())["metrics"]
    assert 2.0 <= metrics["train/aux_loss"] <= 4.0 and 2.0 <= metrics["train/value_aux_loss"] <= 4.0, metrics


def test_reentrant_checkpointing_with_the_loss_is_refused_naming_the_flag(tmp_path):
    """Reentrant checkpointing runs the layers without gradients: the hooks would keep nothing and the
    loss would silently be 0."""
    from pydantic import ValidationError

    from rlhf_core.config import SFTConfig
    from rlhf_core.rl_config import PPOConfig

    flags = {"aux_loss_coef": 0.01, "gradient_checkpointing": True, "gradient_checkpointing_use_reentrant": True}
    with pytest.raises(ValidationError, match="drop --gradient_checkpointing_use_reentrant"):
        SFTConfig.model_validate({"pretrain": "unused", "dataset": "unused", "save_path": str(tmp_path), **flags})
    with pytest.raises(ValidationError, match="drop --gradient_checkpointing_use_reentrant"):
        PPOConfig.model_validate({"pretrain": "unused", "prompt_data": "unused", "save_path": str(tmp_path), **flags})
    SFTConfig.model_validate({"pretrain": "unused", "dataset": "unused", "save_path": str(tmp_path),
                              **flags, "gradient_checkpointing_use_reentrant": False})
