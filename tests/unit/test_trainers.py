"""Every trainer learns on the built-in task (one in-process rank; the Ray path is in integration/)."""

import json
from pathlib import Path

import pytest
import torch

from rlhf_core.config import STAGE_CONFIGS, build_config
from rlhf_core.distributed.cluster import prepare_environment
from rlhf_core.infra.precision import resolve_here
from rlhf_core.trainers import run_recipe
from rlhf_core.trainers.loop import TrainLoop

pytestmark = pytest.mark.slow



def train(stage, prepared, tmp_path, **overrides):
    prepare_environment()
    data = "sft" if stage == "sft" else "preference"
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared[data]}", "save_path": str(tmp_path / stage),
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 32, "micro_train_batch_size": 16,
              "learning_rate": 2e-3, "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "zero_stage": 2, "seed": 1,
              "max_eval_samples": 64, **overrides}
    return run_recipe(build_config(STAGE_CONFIGS[stage], None, values))


@pytest.fixture(scope="module")
def sft_model(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    # fp32 on every CPU kind: the preference tests below start from it, and their small effects
    # moved with the rounding of a bf16 SFT model (AMX) against an fp32 one (AVX2 only).
    manifest = train("sft", prepared, out, max_epochs=2, packing_samples=True)
    return manifest


def test_sft_loss_falls_and_output_contract(sft_model):
    m = sft_model["metrics"]
    assert m["eval/loss"] < 0.5 * m["eval_initial/loss"], m
    out = Path(sft_model["output_uri"])
    manifest = json.loads((out / "stage.json").read_text())
    assert manifest["stage"] == "sft" and manifest["config_hash"].startswith("sha256:")
    assert manifest["mlflow_run_id"] and manifest["inputs"]["datasets"][0]["digest"].startswith("sha256:")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)


def test_sft_mlflow_run_has_params_metrics_and_inputs(sft_model):
    import mlflow

    from rlhf_core.infra.settings import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    run = mlflow.get_run(sft_model["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["adam.lr"] == "0.002" and run.data.params["data.max_len"] == "48"
    assert "train/loss" in run.data.metrics and "eval/loss" in run.data.metrics
    assert run.data.tags["rlhf.output_uri"] == sft_model["output_uri"]
    assert len(run.inputs.dataset_inputs) == 2
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")
    assert len(history) == sft_model["metrics"]["train/steps"]


def test_reward_model_learns_and_loads_with_plain_transformers(prepared, sft_model, tmp_path):
    manifest = train("rm", {**prepared, "base": sft_model["output_uri"]}, tmp_path, learning_rate=1e-3,
                     max_steps=48, max_epochs=2, packing_samples=True)
    m = manifest["metrics"]
    assert m["eval/accuracy"] > max(0.6, m["eval_initial/accuracy"] + 0.1), m
    assert m["eval/loss"] < m["eval_initial/loss"]
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = manifest["output_uri"]
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert abs(model.config.reward_mean - m["reward_mean"]) < 1e-9 and model.config.reward_std > 0
    prompt = tok.apply_chat_template([{"role": "user", "content": "add 12+30="}], tokenize=False,
                                     add_generation_prompt=True)
    texts = [prompt + "42" + tok.eos_token, prompt + "52" + tok.eos_token]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        scores = model(**enc).logits.squeeze(-1)
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_reward_model_of_a_tokenizer_padding_with_eos_scores_the_same_in_plain_transformers(prepared, tmp_path):
    """Hub tokenizers without a pad token pad with EOS; the saved RM must still be read at EOS."""
    import shutil

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_core.rewards.reward_model import RewardModelReward

    base = tmp_path / "eos-pad-base"
    shutil.copytree(prepared["base"], base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": config["eos_token"]}))
    assert AutoTokenizer.from_pretrained(base).pad_token_id == AutoTokenizer.from_pretrained(base).eos_token_id

    manifest = train("rm", {**prepared, "base": str(base)}, tmp_path, max_steps=2, use_mlflow=False)
    path = manifest["output_uri"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    assert tok.pad_token_id not in (None, tok.eos_token_id) and model.config.pad_token_id == tok.pad_token_id

    prompts, responses = ["add 12+30=", "add 7+5="], ["42", "12"]
    ours = RewardModelReward(path, dtype=torch.float32).score(prompts, responses)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             + r + tok.eos_token for p, r in zip(prompts, responses, strict=True)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert enc["input_ids"].shape[1] > enc["attention_mask"].sum(-1).min()  # the batch really is padded
    with torch.no_grad():
        plain = model(**enc).logits.squeeze(-1).tolist()
    assert plain == pytest.approx(ours, abs=1e-5)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "hinge"])
def test_dpo_learns_the_preference_on_held_out_pairs(prepared, sft_model, tmp_path, loss):
    # Two epochs of 1024 pairs from a weak SFT model: the effects are small but their signs are the
    # proof. At lr 5e-4 IPO's and hinge's held-out losses rose (the spread of the margins grew faster
    # than their mean), so all three take gentler steps. Hinge takes the gentlest: at 2e-4 its held-out
    # loss ended just above the start (1.005-1.009) when the rounding of the gradient clipping changed.
    manifest = train("dpo", {**prepared, "base": sft_model["output_uri"]}, tmp_path,
                     learning_rate=1e-4 if loss == "hinge" else 2e-4,
                     max_steps=48, max_epochs=2, max_eval_samples=128, loss_type=loss,
                     beta=0.5 if loss == "ipo" else 0.1, nll_loss_coef=0.1 if loss == "sigmoid" else 0.0,
                     packing_samples=loss == "ipo")
    m = manifest["metrics"]
    assert m["eval/loss"] < m["eval_initial/loss"], m
    assert m["eval/reward_margin"] > 0 and m["eval/chosen_reward"] > m["eval/rejected_reward"], m
    # Held-out implicit-reward accuracy over 128 pairs: a no-op (policy = reference) scores 0 (ties),
    # a policy moved at random about 0.5 (± 0.044); measured 0.625-0.64 (fp32, Xeon with AMX).
    assert m["eval_initial/reward_accuracy"] == 0.0 and m["eval/reward_accuracy"] >= 0.58, m
    assert m["eval/logp_margin"] > m["eval_initial/logp_margin"] + 0.1, m
    assert manifest["inputs"]["ref_pretrain"] == sft_model["output_uri"]


def test_kto_moves_desirable_above_undesirable(prepared, sft_model, tmp_path):
    # Unpaired near misses are a weak signal for a weak SFT model: three gentle epochs (at lr 5e-4 the
    # held-out signed reward landed anywhere between -0.05 and +0.05 with the SFT fixture's rounding).
    manifest = train("kto", {**prepared, "base": sft_model["output_uri"]}, tmp_path, learning_rate=2e-4,
                     max_steps=96, max_epochs=3, max_eval_samples=128)
    m = manifest["metrics"]
    assert m["eval/loss"] < m["eval_initial/loss"] and m["eval/signed_reward"] > 0, m
    # KTO's own held-out accuracy can sit at 0.5 when it raises every completion: the outcome that
    # matters is the preference. On the 128 held-out pairs, the policy's implicit reward must rank
    # chosen above rejected: a no-op ties every pair (0), a policy moved at random about 0.5
    # (± 0.044); measured 0.633 (fp32, Xeon with AMX).
    assert held_out_pair_accuracy(manifest["output_uri"], sft_model["output_uri"], prepared) >= 0.58, m


def held_out_pair_accuracy(policy: str, reference: str, prepared, n: int = 128) -> float:
    """Fraction of held-out preference pairs whose implicit reward logπ − logπ_ref is higher for
    the chosen response than for the rejected one (ties count as wrong), computed outside the trainer."""
    from rlhf_core.models.loading import load_causal_lm, load_tokenizer
    from rlhf_core.stages.evaluation import response_logprobs

    tok = load_tokenizer(reference)
    rows = [json.loads(line) for line in (Path(prepared["preference"]) / "test.jsonl").read_text().splitlines()][:n]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in rows]
    chosen = [tok(r["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"] for r in rows]
    rejected = [tok(r["rejected"] + tok.eos_token, add_special_tokens=False)["input_ids"] for r in rows]
    margin = torch.zeros(len(rows))
    for path, sign in ((policy, 1.0), (reference, -1.0)):
        model = load_causal_lm(path).eval()
        margin += sign * (response_logprobs(model, prompts, chosen, tok.pad_token_id)
                          - response_logprobs(model, prompts, rejected, tok.pad_token_id))
    return (margin > 0).float().mean().item()


def test_lora_is_merged_on_save(prepared, tmp_path):
    manifest = train("sft", prepared, tmp_path, lora_rank=8, lora_alpha=16, max_steps=4, learning_rate=1e-2,
                     gradient_checkpointing=True)
    from safetensors.torch import load_file

    saved = load_file(str(Path(manifest["output_uri"]) / "model.safetensors"))
    base = load_file(str(Path(prepared["base"]) / "model.safetensors"))
    assert not any("lora" in k for k in saved) and set(saved) == set(base)
    changed = [k for k in base if not torch.equal(base[k], saved[k])]
    assert any("q_proj" in k for k in changed)
    assert not any("embed_tokens" in k for k in changed)  # LoRA leaves non-target weights alone


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def test_gradient_accumulation_matches_one_big_batch(prepared, tmp_path):
    a = train("sft", prepared, tmp_path / "a", micro_train_batch_size=32, max_steps=2, use_mlflow=False)
    b = train("sft", prepared, tmp_path / "b", micro_train_batch_size=8, max_steps=2, use_mlflow=False)
    assert abs(a["metrics"]["train/final_loss"] - b["metrics"]["train/final_loss"]) < 1e-5
    wa, wb = _weights(a["output_uri"]), _weights(b["output_uri"])
    # Summation order differs between the splits; Adam turns tiny gradient differences into ~lr-scaled ones.
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4


@pytest.mark.parametrize(("stage", "packing"), [("sft", True), ("dpo", False)])
def test_micro_batches_by_a_token_budget_give_the_updates_of_fixed_ones(prepared, tmp_path, monkeypatch, stage,
                                                                        packing):
    """No micro-batch size given (the default): micro-batches by `--train_max_tokens_per_gpu` token
    slots, any number a step, with the loss and weights of fixed micro-batches of the same data."""
    from rlhf_core.trainers import loop

    counts, step = [], loop.optimizer_step
    monkeypatch.setattr(loop, "optimizer_step", lambda engine, micro, *a, **k: counts.append(len(micro)) or
                        step(engine, micro, *a, **k))
    common = dict(max_steps=2, use_mlflow=False, packing_samples=packing, max_eval_samples=16)
    runs = {}
    for name, flags in (("fixed", {"micro_train_batch_size": 8}),
                        ("budget", {"micro_train_batch_size": None, "train_max_tokens_per_gpu": 200}),
                        ("default", {"micro_train_batch_size": None})):
        counts.clear()
        runs[name] = (train(stage, prepared, tmp_path / name, **common, **flags), list(counts))
    assert runs["fixed"][1] == [4, 4] and runs["default"][1] == [1, 1]  # 32 short rows fit 16192 slots
    assert all(c > 1 for c in runs["budget"][1]) and runs["budget"][1] != [4, 4], runs["budget"][1]
    reference = _weights(runs["fixed"][0]["output_uri"])
    moved = max((reference[k] - w).abs().max().item() for k, w in _weights(prepared["base"]).items())
    for name in ("budget", "default"):
        manifest = runs[name][0]
        assert manifest["metrics"]["train/final_loss"] == pytest.approx(runs["fixed"][0]["metrics"]["train/final_loss"],
                                                                        abs=1e-5)
        weights = _weights(manifest["output_uri"])
        # Only the summation order differs (fp32); Adam turns the smallest gradients' rounding into
        # updates of up to the learning rate (1.6e-4 seen on one thread), far below the steps' own.
        gap = max((weights[k] - reference[k]).abs().max().item() for k in reference)
        print(f"\n{stage} {name}: weights {gap:.2e} from fixed micro-batches, moved {moved:.2e}")
        assert gap < 0.1 * moved, (name, gap, moved)


@pytest.mark.parametrize("stage", ["sft", "kto"])
def test_one_cpu_rank_at_stage_0_trains_like_zero_2(prepared, tmp_path, monkeypatch, stage):
    """`effective_zero_stage` runs one CPU rank's ZeRO-2 as stage 0: the weights must not notice."""
    if torch.cuda.is_available():
        pytest.skip("GPU ranks keep the ZeRO stage they are given")
    from rlhf_core.distributed import engine

    ran, config = [], engine.deepspeed_config
    monkeypatch.setattr(engine, "deepspeed_config",
                        lambda *a, **k: ran.append(config(*a, **k)["zero_optimization"]["stage"]) or config(*a, **k))
    # The machine's own precision (bf16 where native), as the CLI trains by default.
    common = dict(max_steps=3, use_mlflow=False, param_dtype="auto", packing_samples=True, micro_train_batch_size=16,
                  max_samples=256)
    fast = train(stage, prepared, tmp_path / "stage0", **common)
    monkeypatch.setattr(engine, "effective_zero_stage", lambda stage, *args: stage)
    zero2 = train(stage, prepared, tmp_path / "zero2", **common)
    assert ran == [0, 2]  # the two runs really took the two paths (KTO's reference is not a DeepSpeed engine)
    wa, wb = _weights(fast["output_uri"]), _weights(zero2["output_uri"])
    moved = max((wb[k] - w).abs().max().item() for k, w in _weights(prepared["base"]).items())
    assert moved > 1e-3  # the steps did train
    # bf16 autocast rounds the two gradient paths differently: far below one step's update. In fp32
    # only the summation order differs.
    bf16 = fast["precision"] == "bf16"
    assert fast["precision"] == zero2["precision"] == resolve_here("auto").value
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < (0.1 if bf16 else 1e-3) * moved
    assert fast["metrics"]["train/final_loss"] == pytest.approx(zero2["metrics"]["train/final_loss"],
                                                               rel=1e-3 if bf16 else 1e-5)


def test_adam_offload_trains_like_adamw(prepared, tmp_path, monkeypatch):
    """--adam_offload keeps ZeRO-2 and steps with DeepSpeed's compiled CPU Adam: same math as AdamW."""
    from rlhf_core.distributed import engine

    built, build = [], engine.build_optimizer
    monkeypatch.setattr(engine, "build_optimizer", lambda *a: built.append(build(*a)) or built[-1])
    common = dict(max_steps=3, use_mlflow=False, micro_train_batch_size=16, max_samples=256)
    plain = train("sft", prepared, tmp_path / "plain", **common)
    offload = train("sft", prepared, tmp_path / "offload", adam_offload=True, **common)
    assert [type(o).__name__ for o in built] == ["AdamW", "DeepSpeedCPUAdam"]
    wa, wb = _weights(plain["output_uri"]), _weights(offload["output_uri"])
    moved = max((wb[k] - w).abs().max().item() for k, w in _weights(prepared["base"]).items())
    assert moved > 1e-3
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 0.01 * moved
    assert offload["metrics"]["train/final_loss"] == pytest.approx(plain["metrics"]["train/final_loss"], rel=1e-4)


def test_resume_after_crash_matches_uninterrupted_run(prepared, tmp_path, monkeypatch):
    common = dict(max_steps=6, use_mlflow=False, lr_warmup_ratio=0.2)
    full = train("sft", prepared, tmp_path / "full", **common)
    ckpt = tmp_path / "ckpt"
    original = TrainLoop.train_step

    def crash_at_step_5(self):
        if self.step == 4:
            raise RuntimeError("simulated crash")
        return original(self)

    monkeypatch.setattr(TrainLoop, "train_step", crash_at_step_5)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train("sft", prepared, tmp_path / "resumed", save_steps=3, ckpt_path=str(ckpt), max_ckpt_num=1, **common)
    assert not (tmp_path / "resumed" / "sft").exists()  # nothing half-written looks finished
    assert [p.name for p in ckpt.glob("global_step*")] == ["global_step3"]
    monkeypatch.setattr(TrainLoop, "train_step", original)
    resumed = train("sft", prepared, tmp_path / "resumed", save_steps=3, ckpt_path=str(ckpt), load_checkpoint=True,
                    **common)
    # It resumed (a restart from step 0 would run 6 steps) and ended exactly where the full run did;
    # kill -9 mid-step, dropout, epochs and every stage: tests/unit/test_resume.py.
    assert resumed["metrics"]["train/start_step"] == 3 and resumed["metrics"]["train/steps_run"] == 3
    wf, wr = _weights(full["output_uri"]), _weights(resumed["output_uri"])
    assert all(torch.equal(wf[k], wr[k]) for k in wf)


def test_one_local_rank_trains_in_the_cli_process_without_ray(prepared, tmp_path, monkeypatch):
    """`rlhf train` with one rank and no cluster trains where it runs: no local Ray for one actor."""
    from rlhf_core.stages import launch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launch, "ensure_ray", lambda: pytest.fail("a one-rank local stage started Ray"))
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(tmp_path / "sft"),
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 32, "micro_train_batch_size": 32,
              "max_steps": 2, "use_mlflow": False, "param_dtype": "fp32"}
    manifest = launch.run_stage(build_config(STAGE_CONFIGS["sft"], None, values))
    assert manifest["metrics"]["train/steps"] == 2 and (tmp_path / "sft" / "stage.json").exists()
    assert not launch.trains_in_process(build_config(STAGE_CONFIGS["sft"], None, {**values, "num_gpus_per_node": 2,
                                                                           "micro_train_batch_size": 16}))
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # inside a Ray job (every pipeline stage): a worker group
    assert not launch.trains_in_process(build_config(STAGE_CONFIGS["sft"], None, values))
