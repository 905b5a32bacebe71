"""`--aux_loss_coef` changes how evenly a Mixture-of-Experts model uses its experts: the same SFT
of a Mixtral base (the built-in sort task, nano size, 4 experts, 2 per token) with and without the
load-balancing loss, then each output's routing on held-out rows; the loss is logged to MLflow
(`train/aux_loss`) only when it is on."""

import json
from pathlib import Path

import pytest
import torch

STEPS = "150"


def held_out_balance(model_dir: str, rows: list[dict], tokenizer_dir: str) -> float:
    """The load-balancing loss (2 = every expert picked equally often, up to 4) over held-out rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.data.batching import pad_batch
    from rlhf_core.models.forward import token_logprobs
    from rlhf_core.models.moe import RouterBalance

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    balance = RouterBalance(model, 1.0)
    seqs = [tokenizer(r["prompt"] + r["response"])["input_ids"] for r in rows]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # Mistral's: none
    batch = pad_batch(seqs, [[1] * len(s) for s in seqs], pad_id=pad)
    with balance.collecting():
        token_logprobs(model, batch)  # with gradients on, as a training forward (collects only those)
        return balance.loss().item()


@pytest.mark.timeout(900)
@pytest.mark.usefixtures("one_torch_thread")
def test_the_load_balancing_loss_spreads_the_tokens_over_the_experts(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    paths = prepare(tmp_path / "prep", task="sort", seed=0, model_family="mixtral", model_size="nano",
                    n_train=2000, n_test=64)
    rows = [json.loads(line) for line in Path(paths["sft_test"]).read_text().splitlines()]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    balance, logged = {}, {}
    for coef in ("0", "0.5"):
        out = tmp_path / f"sft-{coef}"
        assert main(["train", "sft", "--pretrain", paths["base"], "--dataset", f"json@{paths['sft']}",
                     "--save_path", str(out), "--max_steps", STEPS, "--max_len", "64", "--packing_samples",
                     "--param_dtype", "fp32", "--seed", "0", "--learning_rate", "2e-3",
                     "--train_batch_size", "32", "--micro_train_batch_size", "16", "--max_epochs", "50",
                     "--aux_loss_coef", coef]) == 0
        balance[coef] = held_out_balance(str(out), rows, paths["tokenizer"])
        run_id = json.loads((out / "stage.json").read_text())["mlflow_run_id"]
        logged[coef] = [m.value for m in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(
            run_id, "train/aux_loss")]
    base = held_out_balance(paths["base"], rows, paths["tokenizer"])
    print(f"held-out load-balancing loss: base {base:.4f}, after SFT {balance}")
    assert logged["0"] == [] and len(logged["0.5"]) >= 10 and 1.9 < min(logged["0.5"]) < 2.2, logged
    # Measured (AMD EPYC Zen 4 class, fp32): base 2.009; after SFT without the loss 2.162, with 0.5 2.000
    assert balance["0.5"] < balance["0"] - 0.08, (base, balance)
