"""Stage jobs of the `rlhf` flow: what each stage runs, on whose outputs, under which cache key.

Pure builders: stage parameters and upstream `StageOutcome`s -> a `StageJob` (CLI arguments, the
config, the settings hash, the upstream roles that become lineage tags and cache-key inputs).
Nothing here submits or waits (`orchestration.stages.run_job_stage` does).

Inputs a config names itself win over upstream and enter the cache key by URI; inputs left empty
are filled from upstream and enter it by the upstream's cache key.
"""

from __future__ import annotations

from flows.params import EvalParams, PipelineSettings, PrepParams
from orchestration.stages import PipelineContext, StageJob, StageOutcome
from rlhf_core.config import TrainConfig, with_updates
from rlhf_core.infra.manifests import config_hash, params_hash, semantic_values, values_hash
from rlhf_core.infra.settings import ConfigError
from rlhf_core.rl_config import PPOConfig


class PipelineError(ConfigError):
    """A pipeline-level configuration problem (missing upstream, bad from_run, a metric not there):
    the CLI exits 2 with its message, and the flow run's log shows it without a traceback."""


def prep_job(ctx: PipelineContext, prep: PrepParams, distills: bool = False) -> StageJob:
    """`rlhf prep`; with `distills` (the run trains a distilled student) it also builds a student
    base, of `prep.student_size` or the size below the policy's. A run without a student keeps the
    key it had before students existed."""
    from rlhf_core.models.sizes import smaller_size

    out = ctx.output("prep")
    student = prep.student_size or (smaller_size(prep.model_size) if distills else None)
    if distills and student is None:
        raise PipelineError(f"stage 'distill': no size is smaller than prep.model_size {prep.model_size!r} to build "
                            "its student at; set prep.student_size, or distill.pretrain to a student model")
    args = ["prep", "--out", out, "--task", prep.task, "--seed", str(prep.seed), "--model_size", prep.model_size,
            "--n_train", str(prep.n_train), "--n_test", str(prep.n_test),
            "--demo_error_rate", str(prep.demo_error_rate)]
    if prep.model_family:
        args += ["--model_family", prep.model_family]
    if student:
        args += ["--student_size", student]
    resolved = prep.model_copy(update={"student_size": student})
    return StageJob("prep", "prep", args, out,
                    params_hash(resolved, exclude=frozenset() if student else frozenset({"student_size"})))


def prep_made(earlier: StageOutcome, given: PrepParams) -> PrepParams:
    """The prep section of a run that takes prep's output from `from_run`: the settings that output
    was made with (its manifest's config: task, n_train, ...), which the stages reading its data
    (verifier, prompt windows, token budgets) must use rather than this run's defaults. A field this
    run sets to another value is refused: it would describe data that is not there. A field given at
    its default counts as not given: the Prefect UI's custom-run form submits every field's default."""
    recorded = {k: v for k, v in (earlier.manifest.get("config") or {}).items() if k in PrepParams.model_fields}
    chosen = {k for k in given.model_fields_set & recorded.keys()
              if getattr(given, k) != PrepParams.model_fields[k].get_default(call_default_factory=True)}
    clash = [f"prep.{k} {getattr(given, k)!r} (its prep made {recorded[k]!r})"
             for k in sorted(chosen) if getattr(given, k) != recorded[k]]
    if clash:
        raise PipelineError(f"prep is taken from from_run ({earlier.output_uri}), not run here, yet this run gives "
                            f"{'; '.join(clash)}: drop those or add prep to settings.stages")
    return given.model_copy(update=recorded)


def prep_paths(prep_outcome: StageOutcome) -> dict[str, str]:
    root = prep_outcome.output_uri.rstrip("/")  # a local path or an s3:// URI: join as strings
    return {"base": f"{root}/base", "student": f"{root}/student", "sft": f"json@{root}/data/sft",
            "preference": f"json@{root}/data/preference", "prompts": f"json@{root}/data/prompts",
            "prm": f"json@{root}/data/prm"}


# Per supervised stage: the upstream stage its model starts from (`prep`: prep's base, or its
# student base for a distilled student) and prep's data kind it trains on.
UPSTREAM = {"sft": ("prep", "sft"), "rm": ("sft", "preference"), "dpo": ("sft", "preference"), "kd": ("prep", "sft"),
            "prm": ("sft", "prm")}


def train_job(ctx: PipelineContext, settings: PipelineSettings, cfg: TrainConfig, need,
              name: str | None = None, model_from: StageOutcome | None = None,
              data_from: tuple[StageOutcome, str] | None = None, eval_dataset: str | None = None,
              teacher_from: StageOutcome | None = None) -> StageJob:
    """A supervised training stage whose missing inputs come from upstream outcomes (prep data, SFT
    model; a distilled student's teacher from `teacher_from`)."""
    import yaml

    stage = cfg.stage
    name = name or stage
    model_role, data_kind = UPSTREAM[stage]
    upstream: dict[str, StageOutcome] = {}
    external: dict[str, str] = {}
    updates: dict = {"mlflow_experiment": ctx.experiment, "mlflow_parent_run_id": ctx.parent_run_id,
                     "mlflow_run_name": name}
    if cfg.pretrain is None:
        source = model_from or need(model_role)
        upstream["model"] = source
        updates["pretrain"] = (prep_paths(source)["student" if stage == "kd" else "base"] if source.stage == "prep"
                               else source.output_uri)
        if stage == "kd" and source.stage == "prep" and "student" not in source.manifest.get("outputs", {}):
            raise PipelineError(f"stage {name!r}: the prep output {source.output_uri} has no student base (prep "
                                "builds one when the run's stages include distill, or with prep.student_size); "
                                "run prep in this run, or set distill.pretrain to a student model")
    else:
        external["model"] = cfg.pretrain
    if stage == "kd":
        if cfg.teacher_pretrain is None:
            source = teacher_from
            if source is None:
                raise PipelineError(f"stage {name!r} needs a teacher: a policy stage or SFT in this run or from_run, "
                                    "or distill.teacher.model_name_or_path")
            upstream["teacher"] = source
            updates["teacher.model_name_or_path"] = source.output_uri
        else:
            external["teacher"] = cfg.teacher_pretrain
    reference = given_reference(cfg)
    if reference is not None:
        external["reference"] = reference
    if data_from is not None:
        upstream["data"], updates["dataset"] = data_from
    elif cfg.data.dataset is None:
        prep_outcome = need("prep")
        if data_kind == "prm" and "prm" not in prep_outcome.manifest.get("outputs", {}):
            raise PipelineError(f"stage {name!r}: the prep output {prep_outcome.output_uri} has no step-labelled rows "
                                "(a task of steps writes them: prep.task addition_steps); or give prm.dataset")
        upstream.setdefault("data", prep_outcome)
        updates["dataset"] = prep_paths(prep_outcome)[data_kind]
    if eval_dataset is not None:
        updates["eval_dataset"] = eval_dataset
    if cfg.save_path is None:
        updates["save_path"] = ctx.output(name)
    if cfg.ckpt_path is None and settings.supervised_checkpoint_steps:
        # As for RL (ppo_job): a retried attempt resumes from its newest checkpoint, under the same key only.
        updates.update(ckpt_path=ctx.output(f"checkpoints/{name}"), save_steps=settings.supervised_checkpoint_steps,
                       load_checkpoint=True)
    filled = with_updates(cfg, **updates)
    filled.check_complete()
    datasets = ",".join(d for d in (filled.data.dataset, filled.eval.dataset) if d)
    # The key holds the precision the ranks will train in, never `auto`; the job gets the config as asked.
    hashed = with_updates(filled, param_dtype=ctx.precision(filled.param_dtype))
    return StageJob(stage, name, ["train", stage, "--config", "{config}"], filled.save_path, config_hash(hashed),
                    yaml.safe_dump(filled.model_dump(mode="json"), sort_keys=True), datasets, upstream, external,
                    checkpoint_uri=filled.ckpt_path if filled.ckpt.load_enable else None)


def given_reference(cfg: TrainConfig) -> str | None:
    """The reference model a DPO/KTO config names apart from its start model; None when derived.

    Validators fill `ref_pretrain` from `pretrain`, and any dump-and-validate makes that a set
    field, so the field alone cannot say who chose it. Only a reference other than `pretrain` is
    a further cache-key input.
    """
    reference = getattr(cfg, "ref_pretrain", None)
    return reference if reference is not None and reference != cfg.pretrain else None



def ppo_config_hash(cfg: PPOConfig, precision: str, reward_file_digest: str | None = None) -> str:
    """The settings part of a PPO stage's cache key: every semantic field, the precision the ranks
    train in (never `auto`), and the content of a local reward file."""
    values = semantic_values(cfg)  # models and datasets enter the key as upstream keys, URIs or digests
    values["ds"]["param_dtype"] = precision
    return values_hash({"ppo": values, "reward_file": reward_file_digest})


def _file_digest(path: str) -> str:
    import hashlib

    from rlhf_core.infra import storage

    if storage.is_remote(path):
        import fsspec

        with fsspec.open(path, "rb") as f:
            data = f.read()
    else:
        from pathlib import Path

        data = Path(path).read_bytes()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def prm_tokens(prm: StageOutcome, reward) -> dict:
    """The placeholder and reward tokens a PPO stage reads the run's process reward model at: the
    ones its stage trained with (PipelineError if the PPO section names others, or none recorded)."""
    data = ((prm.manifest or {}).get("config") or {}).get("data") or {}
    trained = {"placeholder_token": data.get("placeholder_token"), "reward_tokens": data.get("reward_tokens")}
    if not trained["placeholder_token"] or not trained["reward_tokens"]:
        raise PipelineError(f"stage {prm.name!r} records no placeholder and reward tokens: it is not a process "
                            "reward model the PPO stage can read")
    for name, value in trained.items():
        given = getattr(reward, name)
        if given is not None and (list(given) if isinstance(given, (list, tuple)) else given) != value:
            raise PipelineError(f"ppo reward.{name} {given!r}: the run's process reward model was trained with "
                                f"{value!r}")
    return trained


def ppo_job(ctx: PipelineContext, settings: PipelineSettings, prep: PrepParams, cfg: PPOConfig, need,
            name: str = "ppo", actor_from: StageOutcome | None = None, prompts_from: StageOutcome | None = None,
            prompt_dataset: str | None = None, reference_from: StageOutcome | None = None,
            stop_on_hacking: bool = False) -> StageJob:
    """`rlhf train ppo`: actor and reference from SFT (or `actor_from`), the reward from the run's
    reward model unless the config names a verifier task, a reward file or another model, or asks
    for a process reward (`reward.placeholder_token` or `reward.process_enable` with no model: the
    run's process reward model, its tokens from its stage), the critic from the reward model (else
    the actor), prompts and held-out prompts from prep.

    Upstream roles (lineage tags and cache-key inputs): `model` (the actor), `reference`,
    `reward`, `critic` (its initialisation) and `data` (prep). A model the config names is an
    input by URI (`rlhf.input.<role>`) instead, and so is a gold reward model checking held-out
    responses (`gold_reward`). `stop_on_hacking`: training stops where the
    reward-hacking guard fires (where the guard is on; the held-out check is prep's, filled here).
    """
    import yaml

    values = cfg.model_dump(mode="json")
    upstream: dict[str, StageOutcome] = {}
    external: dict[str, str] = {}
    values.update(mlflow_experiment=ctx.experiment, mlflow_parent_run_id=ctx.parent_run_id, mlflow_run_name=name)

    actor = cfg.actor.model_name_or_path
    if actor is None:
        source = actor_from or need("sft")
        upstream["model"] = source
        actor = values["actor"]["model_name_or_path"] = source.output_uri
    else:
        external["model"] = actor
    if cfg.uses_ref:
        if cfg.ref.model_name_or_path is None:
            reference = reference_from or upstream.get("model")
            if reference is not None:
                upstream["reference"] = reference
                values["ref"]["model_name_or_path"] = reference.output_uri
        elif cfg.ref.model_name_or_path != actor:
            external["reference"] = cfg.ref.model_name_or_path

    reward_outcome = None
    reward_file_digest = None
    if not cfg.reward.sources and (cfg.reward.placeholder_token is not None or cfg.reward.process_enable):
        prm = need("prm")  # the run's process reward model, read at its own placeholder and reward tokens
        upstream["reward"] = prm
        values["reward"].update(model_name_or_path=prm.output_uri, **prm_tokens(prm, cfg.reward))
    elif not cfg.reward.sources:  # nothing named: the run's reward model, normalised by its stored mean/std
        reward_outcome = need("rm")
        upstream["reward"] = reward_outcome
        values["reward"]["model_name_or_path"] = reward_outcome.output_uri
        values["reward"]["normalize_enable"] = True
    elif cfg.reward.model_name_or_path:
        external["reward"] = cfg.reward.model_name_or_path
    elif cfg.reward.remote_url:
        external["reward"] = cfg.reward.remote_url
        if cfg.reward.remote_url.endswith(".py"):
            reward_file_digest = _file_digest(cfg.reward.remote_url)

    if cfg.eval.reward_model_name_or_path:  # the held-out check's model: an input of the run's lineage
        external["gold_reward"] = cfg.eval.reward_model_name_or_path

    if cfg.uses_critic:
        if cfg.critic.model_name_or_path is None:  # a process reward model has no value head: the actor then
            critic = reward_outcome or (upstream.get("model") if "reward" not in external else None)
            if critic is not None:  # else the validator derives it from the named reward model or actor
                upstream["critic"] = critic
                values["critic"]["model_name_or_path"] = critic.output_uri
        elif cfg.critic.model_name_or_path != actor:
            external["critic"] = cfg.critic.model_name_or_path

    if cfg.data.prompt_dataset is None or cfg.eval.dataset is None:
        prep_outcome = prompts_from or need("prep")
        upstream["data"] = prep_outcome
        prompts = prep_paths(prep_outcome)["prompts"]
        if cfg.data.prompt_dataset is None:
            values["data"]["prompt_dataset"] = prompt_dataset or prompts
        if cfg.eval.dataset is None:
            values["eval"]["dataset"] = prompts
    elif prompt_dataset is not None:
        values["data"]["prompt_dataset"] = prompt_dataset
    if cfg.eval.task is None and cfg.reward.task is None:
        values["eval"]["task"] = prep.task  # held-out accuracy by the prep task's verifier
    if stop_on_hacking and cfg.eval.hacking_guard_enable:
        values["eval"]["stop_on_hacking"] = True
    if cfg.ckpt.output_dir is None:
        values["ckpt"]["output_dir"] = ctx.output(name)
    if cfg.ckpt.path is None and settings.checkpoint_steps:
        # A retried attempt of this stage (same flow run, same folder: local, or on S3 with an s3://
        # output root) resumes from its newest checkpoint; `orchestration.stages` refuses a folder
        # written under another cache key.
        values["ckpt"].update(path=ctx.output(f"checkpoints/{name}"), save_steps=settings.checkpoint_steps,
                              load_enable=True)
    for section, leaf in (p.split(".") for p in ("critic.model_name_or_path", "ref.model_name_or_path",
                                                 "rollout.max_new_tokens", "data.max_len")):
        if values[section].get(leaf) is None:
            values[section].pop(leaf, None)  # derived again from the filled inputs

    filled = PPOConfig.model_validate(values)
    filled.check_complete()
    datasets = ",".join(dict.fromkeys(d for d in (filled.data.prompt_dataset, filled.eval.dataset) if d))
    key = ppo_config_hash(filled, ctx.precision(filled.param_dtype), reward_file_digest)
    return StageJob("ppo", name, ["train", "ppo", "--config", "{config}"], filled.ckpt.output_dir, key,
                    yaml.safe_dump(filled.model_dump(mode="json"), sort_keys=True), datasets, upstream, external,
                    checkpoint_uri=filled.ckpt.path if filled.ckpt.load_enable else None)


def eval_job(ctx: PipelineContext, prep: PrepParams, params: EvalParams, prep_outcome: StageOutcome,
             policies: dict[str, StageOutcome], reference: StageOutcome, reward: StageOutcome | None,
             name: str) -> StageJob:
    """One `rlhf eval` of every policy in `policies` (name -> outcome) against `reference`, on
    prep's held-out prompts: metrics `eval/<name>/<metric>` and `eval/reference/<metric>`."""
    if not policies:
        raise ValueError("eval_job needs at least one policy")
    out = ctx.output(name)
    prompts = prep_paths(prep_outcome)["prompts"]
    args = ["eval", "--pretrain", ",".join(o.output_uri for o in policies.values()),
            "--policy_names", ",".join(policies), "--ref_pretrain", reference.output_uri, "--dataset", prompts,
            "--task", prep.task, "--max_samples", str(params.max_samples),
            "--n_samples_per_prompt", str(params.n_samples_per_prompt),
            "--save_path", out, "--mlflow_experiment", ctx.experiment, "--mlflow_run_name", name]
    upstream = {f"policy-{n}": o for n, o in policies.items()}
    upstream.update({"reference": reference, "data": prep_outcome})
    if reward is not None:
        args += ["--reward_pretrain", reward.output_uri]
        upstream["reward"] = reward
    settings = values_hash({"settings": eval_settings_hash(prep, params), "policy_names": list(policies)})
    return StageJob("eval", name, args, out, settings, None, prompts, upstream, num_gpus=ctx.rollout_gpus)


# EvalParams fields that never reach the eval job: `promote_metric` only decides, after the job,
# what its metrics promote. Every other field, present or future, is in the eval cache key.
EVAL_NOT_IN_KEY = frozenset({"promote_metric"})


def eval_settings_hash(prep: PrepParams, params: EvalParams) -> str:
    """The settings part of an eval stage's cache key (models and prompts enter as upstream keys)."""
    return params_hash(params, exclude=EVAL_NOT_IN_KEY, task=prep.task)


def policy_metric(metrics: dict, policy: str, metric: str) -> float:
    """`eval/<policy>/<metric>` from an eval job's metrics, or a PipelineError naming what there is."""
    key = f"eval/{policy}/{metric}"
    if key not in metrics:
        raise PipelineError(f"evaluation.promote_metric {metric!r}: {key!r} is not among the evaluation metrics "
                            f"{sorted(k for k in metrics if k.startswith(f'eval/{policy}/'))}")
    return float(metrics[key])


def driver_gpus(ctx: PipelineContext, num_engines: int) -> float:
    """GPUs a sampling job's driver reserves: `rollout_gpus` when it generates in-process; none when
    its engines are Ray actors of their own, which take theirs from the cluster."""
    return ctx.rollout_gpus if num_engines == 1 else 0


def starting_policy(start_from: str, sft: StageOutcome) -> StageOutcome:
    """Where a scheduled policy stage starts: the registered champion's run (`start_from: champion`,
    when there is one whose output still exists), else the SFT model."""
    from orchestration import lineage

    if start_from == "champion":
        version = lineage.alias_version(lineage.POLICY_MODEL, lineage.CHAMPION)
        if version is not None:
            outcome = StageOutcome.from_run(lineage.get_run(version.run_id), "champion")
            if outcome is not None:
                return outcome
    return sft
