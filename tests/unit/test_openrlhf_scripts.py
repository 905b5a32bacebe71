"""OpenRLHF's own example scripts, as written, against `rlhf train <stage> --dry_run`.

The argv of every training command in OpenRLHF's `examples/scripts/` at v0.9.10 (flat flags),
v0.11.0 (dotted flags) and v0.9.0 (which also has `train_kto`, `train_kd` and `train_prm`) is test data
(`tests/data/openrlhf/scripts-<tag>.json`, extracted by `tools/openrlhf_inventory.py`; nothing is
fetched here), and so is each CLI's flag inventory (`flags-<tag>.json`). Every command is accepted,
except where it gives a flag of a feature not built yet (refused by name, exit 2) or a flag
OpenRLHF's own parser rejects at that tag; every flag of every inventory is accepted or refused by
name, never `unrecognized`."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from rlhf_core.cli import _parser, main

DATA = Path(__file__).resolve().parents[1] / "data" / "openrlhf"
TAGS = ("v0.9.10", "v0.11.0", "v0.9.0")
STAGES = {"train_sft": "sft", "train_rm": "rm", "train_dpo": "dpo", "train_kto": "kto", "train_ppo_ray": "ppo",
          "train_kd": "kd", "train_prm": "prm"}


def commands(tag: str) -> list[dict]:
    return json.loads((DATA / f"scripts-{tag}.json").read_text())["commands"]


def stage_parser(stage: str) -> argparse.ArgumentParser:
    def sub(parser, name):
        (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return action.choices[name]

    return sub(sub(_parser(), "train"), stage)


def deferred_flags(stage: str) -> set[str]:
    return {o for a in stage_parser(stage)._actions if type(a).__name__ == "_Deferred" for o in a.option_strings}


def run_dry(stage: str, argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(["train", stage, *argv, "--dry_run"])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out = capsys.readouterr()
    return code, out.err if code else out.out


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A dry run touches nothing; defaults made absolute (the checkpoint path) land under this folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.mark.parametrize("tag", TAGS)
def test_every_example_training_command_is_accepted_or_refused_by_name(tag, here, capsys):
    outcomes: dict[str, list[str]] = {"accepted": [], "deferred": [], "rejected by OpenRLHF too": []}
    for command in commands(tag):
        name = f"{command['script'].rsplit('/', 1)[-1]}#{command['index']}"
        stage = STAGES[command["cli"]]
        code, text = run_dry(stage, command["argv"], capsys)
        given = {a for a in command["argv"] if a.startswith("--")}
        if command["openrlhf_unrecognized"] or command["openrlhf_error"]:
            assert code == 2, (name, "OpenRLHF itself rejects this command")
            outcomes["rejected by OpenRLHF too"].append(name)
        elif given & deferred_flags(stage):
            assert code == 2 and "not built yet" in text and "unrecognized" not in text, (name, text[-500:])
            outcomes["deferred"].append(name)
        else:
            assert code == 0, (name, text[-800:])
            resolved = json.loads(text)
            assert resolved, name
            outcomes["accepted"].append(name)
    total = sum(map(len, outcomes.values()))
    print(f"\n{tag}: {total} training commands: " + "; ".join(f"{k} {len(v)}" for k, v in outcomes.items()))
    assert outcomes["accepted"], tag


@pytest.mark.parametrize("tag", TAGS)
def test_every_flag_of_every_cli_is_known_here(tag, here):
    """Each flag of OpenRLHF's training CLIs at `tag` is an option of its stage here: accepted, or
    refused by name (a feature not built yet); none is `unrecognized`."""
    inventory = json.loads((DATA / f"flags-{tag}.json").read_text())["clis"]
    missing = {}
    for cli, flags in inventory.items():
        parser = stage_parser(STAGES[cli])
        known = {o for a in parser._actions for o in a.option_strings}
        missing[cli] = [f["option_strings"][0] for f in flags if not set(f["option_strings"]) & known]
    assert {cli: names for cli, names in missing.items() if names} == {}, missing


# -- a representative command per stage, trained for a couple of steps on the tiny model ----------

OLD_ERA_REWARD = """
import torch

def reward_func(queries, prompts, labels):  # OpenRLHF <= 0.9's examples: no **kwargs, a bare tensor
    return torch.tensor([float(len(q) % 3) for q in queries])
"""
NEW_ERA_REWARD = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    rewards = torch.tensor([float(len(q) % 3) for q in queries])
    return {"rewards": rewards, "scores": rewards / 2, "extra_logs": {"length": torch.tensor([float(len(q))
                                                                                           for q in queries])}}
"""


def replaced(argv: list[str], values: dict[str, str | None]) -> list[str]:
    """`argv` with each flag of `values` given that value (None: a switch) in place, or added."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if flag in values:
            out += [flag] + ([] if values[flag] is None else [values[flag]])
            i += 2 if takes else 1
            continue
        out.append(flag)
        i += 1
    return out + [x for f, v in values.items() if f not in argv for x in ([f] if v is None else [f, v])]


def command(tag: str, script: str) -> dict:
    (found,) = [c for c in commands(tag) if c["script"].endswith("/" + script)]
    return found


def scaled_down(tag, script, prepared, tmp_path, data_kind, dotted: bool) -> tuple[str, list[str]]:
    """The script's argv with its model, data and output replaced by the tiny local ones and its
    scale (batches, lengths, samples, ranks, engines) by a CPU's; every other flag as written."""
    found = command(tag, script)
    names = {  # flat spelling -> dotted spelling
        "--pretrain": "--model.model_name_or_path", "--dataset": "--data.dataset", "--save_path": "--ckpt.output_dir",
        "--input_key": "--data.input_key", "--output_key": "--data.output_key", "--max_len": "--data.max_len",
        "--max_samples": "--data.max_samples", "--train_batch_size": "--train.batch_size",
        "--micro_train_batch_size": "--train.micro_batch_size", "--prompt_data": "--data.prompt_dataset",
        "--remote_rm_url": "--reward.remote_url", "--rollout_batch_size": "--rollout.batch_size",
        "--micro_rollout_batch_size": "--rollout.micro_batch_size", "--zero_stage": "--ds.zero_stage",
        "--max_steps": "--train.max_steps", "--generate_max_len": "--rollout.max_new_tokens",
        "--n_samples_per_prompt": "--rollout.n_samples_per_prompt", "--vllm_num_engines": "--vllm.num_engines",
        "--vllm_tensor_parallel_size": "--vllm.tensor_parallel_size",
        "--use_mlflow": "--use_mlflow", "--prompt_max_len": "--data.prompt_max_len",
        **{f"--{role}_num_gpus_per_node": f"--{role}.num_gpus_per_node" for role in ("actor", "critic", "ref")},
    }
    stage = STAGES[found["cli"]]
    values = {"--save_path": str(tmp_path / "out"), "--max_len": "64", "--max_samples": "32", "--zero_stage": "2",
              "--use_mlflow": "false"}
    if stage == "ppo":
        values.update({"--pretrain": prepared["base"], "--prompt_data": f"json@{prepared['prompts']}",
                       "--input_key": "prompt", "--rollout_batch_size": "4", "--micro_rollout_batch_size": "4",
                       "--train_batch_size": "8", "--micro_train_batch_size": "4", "--max_steps": "2",
                       "--generate_max_len": "6", "--prompt_max_len": "32", "--n_samples_per_prompt": "2",
                       "--vllm_num_engines": "0", "--vllm_tensor_parallel_size": "1", "--remote_rm_url": str(tmp_path / "reward_func.py"),
                       **{f"--{role}_num_gpus_per_node": "1" for role in ("actor", "critic", "ref")}})
        if dotted:
            values["--pretrain"] = values.pop("--pretrain")
            names["--pretrain"] = "--actor.model_name_or_path"
    elif data_kind == "unpaired":  # KTO's script names its columns instruction/response/score: rows in those
        rows = [json.loads(line) for line in (Path(prepared["preference"]) / "train.jsonl").read_text().splitlines()]
        with open(tmp_path / "unpaired.jsonl", "w") as f:
            for row in rows[:32]:
                for key, label in (("chosen", True), ("rejected", False)):
                    f.write(json.dumps({"instruction": row["prompt"], "response": row[key], "score": label}) + "\n")
        values.update({"--pretrain": prepared["base"], "--dataset": str(tmp_path / "unpaired.jsonl"),
                       "--train_batch_size": "8", "--micro_train_batch_size": "4", "--max_steps": "2"})
    else:
        values.update({"--pretrain": prepared["base"], "--dataset": f"json@{prepared[data_kind]}",
                       "--input_key": "prompt", "--train_batch_size": "8", "--micro_train_batch_size": "4",
                       "--max_steps": "2"})
        if data_kind == "sft":
            values["--output_key"] = "response"
        if stage == "kd":  # the student distils the same tiny model (a teacher shares its tokenizer)
            values["--teacher_model"] = prepared["base"]
    if dotted:
        values = {names[k]: v for k, v in values.items()}
    return stage, replaced(found["argv"], values)


@pytest.mark.parametrize("tag, script, data_kind, dotted, reward", [
    ("v0.11.0", "train_sft.sh", "sft", True, None),
    ("v0.9.10", "train_rm.sh", "preference", False, None),
    ("v0.9.10", "train_dpo_llama.sh", "preference", False, None),
    ("v0.9.0", "train_kto_llama.sh", "unpaired", False, None),
    ("v0.9.0", "train_knowledge_distillation.sh", "sft", False, None),
    ("v0.9.10", "train_ppo_with_reward_fn.sh", None, False, OLD_ERA_REWARD),
    ("v0.11.0", "train_ppo_with_reward_fn.sh", None, True, NEW_ERA_REWARD),
])
def test_a_representative_script_trains_on_the_cpu_as_written(tag, script, data_kind, dotted, reward, prepared,
                                                              tmp_path, monkeypatch, capsys, one_torch_thread):
    """OpenRLHF's own command with its model, data and output swapped for the tiny local ones and
    its scale cut to a CPU's (every other flag as the script gives it: precision, packing, gradient
    checkpointing, flash attention, offloads, W&B...): it trains, and its output loads."""
    from transformers import AutoConfig

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")  # the scripts' `--use_wandb {wandb_token}`
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if reward:
        (tmp_path / "reward_func.py").write_text(reward)
    stage, argv = scaled_down(tag, script, prepared, tmp_path, data_kind, dotted)
    code = main(["train", stage, *argv])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    manifest = json.loads(out.out[out.out.index("{"):])
    assert manifest["metrics"]["train/steps"] == 2, manifest["metrics"]
    assert AutoConfig.from_pretrained(tmp_path / "out").model_type == "llama"


# OpenRLHF's example environment (examples/python/agent_func.py) in the shape of each tag: v0.9.10
# declares AgentInstance.__init__ async (which OpenRLHF itself cannot construct; rlhf awaits it),
# v0.11.0 a plain one. The rewards vary within a prompt's group, so dynamic filtering keeps some.
AGENT_FILE = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    {init}
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states: dict, **kwargs):
        done = self.step_idx >= 1 or len(states["action_text"]) % 2 == 0
        reward = torch.tensor([float(len(states["action_text"]) % 3)]) if done else torch.tensor(0)
        self.step_idx += 1
        return {{"rewards": reward, "scores": reward, "environment_feedback": "" if done else " again: ",
                 "done": done, "sampling_params": states.get("sampling_params", None),
                 "extra_logs": {{"dummy_scores": reward}}}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.mark.parametrize("tag, dotted, init", [
    ("v0.9.10", False, "async def __init__(self, *args, **kwargs):"),
    ("v0.11.0", True, "def __init__(self, *args, **kwargs):"),
])
def test_the_async_agent_script_with_partial_rollouts_and_is_correction_trains_on_the_cpu(
        tag, dotted, init, prepared, tmp_path, monkeypatch, capsys, one_torch_thread):
    """train_reinforce_baseline_ray_agent_async.sh (agent file, --async_train, --partial_rollout,
    icepop correction, dynamic filtering, colocate_all, ZeRO-3) scaled down like the others; its
    ring of 2 ranks becomes one rank and its DAPO-math labels the task's answers."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    agent = tmp_path / "agent_func.py"
    agent.write_text(AGENT_FILE.format(init=init))
    stage, argv = scaled_down(tag, "train_reinforce_baseline_ray_agent_async.sh", prepared, tmp_path, None, dotted)

    def flag(dotted_name: str, flat_name: str) -> str:
        return dotted_name if dotted else flat_name

    argv = replaced(argv, {flag("--train.agent_func_path", "--agent_func_path"): str(agent),
                           flag("--ds.ring_attn_size", "--ring_attn_size"): "1",
                           flag("--data.label_key", "--label_key"): "answer",
                           flag("--rollout.max_new_tokens", "--max_new_tokens"): "12",
                           flag("--data.max_len", "--max_len"): "48"})
    dropped = {"--generate_max_len", "--remote_rm_url", "--reward.remote_url"}  # the script has no reward source
    argv = [a for i, a in enumerate(argv) if not (a in dropped or (i and argv[i - 1] in dropped))]
    code = main(["train", stage, *argv])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    metrics = json.loads(out.out[out.out.index("{"):])["metrics"]
    assert metrics["train/steps"] == 2 and metrics["rollout/agent_failed_frac"] == 0.0
    assert "rollout/staleness_max" in metrics and "rollout/agent/dummy_scores" in metrics


# The other RL scripts of both eras that use the engine/trainer correction or an agent file: each
# scaled down like the others (its hub models, data, reward file, checkpoint and log folders swapped
# for local ones; rings of 2 ranks one rank), every other flag as written.
IS_AND_AGENT_SCRIPTS = ("train_dapo_ray_hybrid_engine.sh", "train_ppo_ray_hybrid_engine.sh",
                        "train_prorlv2_math_hybrid_engine.sh", "train_reinforce_baseline_hybrid_engine.sh")


# (v0.9.10's DAPO script passes `--vllm_enable_is_correction`, which OpenRLHF's parser rejects at that tag)
SCRIPT_RUNS = [(tag, dotted, script) for tag, dotted in (("v0.9.10", False), ("v0.11.0", True))
               for script in IS_AND_AGENT_SCRIPTS
               if not (command(tag, script)["openrlhf_unrecognized"] or command(tag, script)["openrlhf_error"])]


@pytest.mark.parametrize("tag, dotted, script", SCRIPT_RUNS)
def test_each_is_correction_and_agent_script_trains_on_the_cpu(tag, dotted, script, prepared, tmp_path, monkeypatch,
                                                               capsys, one_torch_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "reward_func.py").write_text(NEW_ERA_REWARD if dotted else OLD_ERA_REWARD)
    agent = tmp_path / "agent_func.py"
    agent.write_text(AGENT_FILE.format(init="def __init__(self, *args, **kwargs):"))
    stage, argv = scaled_down(tag, script, prepared, tmp_path, None, dotted)

    def flag(dotted_name: str, flat_name: str) -> str:
        return dotted_name if dotted else flat_name

    given = set(argv)
    reward_model = tmp_path / "rm"  # the tiny base as `rlhf train rm` saves a reward model: with its score statistics
    shutil.copytree(prepared["base"], reward_model)
    config = json.loads((reward_model / "config.json").read_text())
    (reward_model / "config.json").write_text(json.dumps({**config, "reward_mean": 0.0, "reward_std": 1.0}))
    swaps = {flag("--ckpt.path", "--ckpt_path"): str(tmp_path / "ckpt"),
             flag("--data.label_key", "--label_key"): "answer",
             flag("--rollout.max_new_tokens", "--max_new_tokens"): "6",
             flag("--train.agent_func_path", "--agent_func_path"): str(agent),
             flag("--ds.ring_attn_size", "--ring_attn_size"): "1",
             flag("--eval.dataset", "--eval_dataset"): f"json@{prepared['prompts']}",
             flag("--logger.tensorboard_dir", "--use_tensorboard"): str(tmp_path / "runs"),
             flag("--reward.model_name_or_path", "--reward_pretrain"): str(reward_model),
             flag("--reward.num_gpus_per_node", "--reward_num_gpus_per_node"): "1"}
    argv = replaced(argv, {k: v for k, v in swaps.items() if k in given})
    if flag("--reward.model_name_or_path", "--reward_pretrain") in given or flag(
            "--train.agent_func_path", "--agent_func_path") in given:  # the script has no reward file
        dropped = {"--remote_rm_url", "--reward.remote_url"}
        argv = [a for i, a in enumerate(argv) if not (a in dropped or (i and argv[i - 1] in dropped))]
    code = main(["train", stage, *argv])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    metrics = json.loads(out.out[out.out.index("{"):])["metrics"]
    assert metrics["train/steps"] == 2, metrics
    if flag("--train.agent_func_path", "--agent_func_path") in given:
        assert metrics["rollout/agent_failed_frac"] == 0.0 and "rollout/agent/dummy_scores" in metrics, metrics
