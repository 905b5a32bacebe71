"""flows/jobs.py: the stages' jobs: settings hashes, cache keys, inputs, checkpoints."""

from __future__ import annotations

import pytest

from tests.unit.flow_helpers import flow_ctx, outcome, perturbed, ppo_job_for

# ---------------------------------------------------------------------------------------------
# Settings hashes of the flow's own stages (prep, eval; pairs in test_flow_iterative.py): every params
# field counts unless it is excluded by name, with a reason, next to the hash.

def test_train_key_holds_the_precision_the_cluster_resolves_not_auto(tmp_path):
    from flows.jobs import train_job as _train_job
    from flows.params import PipelineDPOConfig, PipelineSettings, PipelineSFTConfig
    from rlhf_core.config import with_updates

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}

    def key(cfg, native_bf16):
        return _train_job(flow_ctx(tmp_path, native_bf16), PipelineSettings(), cfg, upstream.__getitem__).config_hash

    for cfg in (PipelineSFTConfig(), PipelineDPOConfig()):
        assert cfg.param_dtype.value == "auto"
        assert key(cfg, True) != key(cfg, False)  # bf16 on one cluster, fp32 on the other
        fp32 = with_updates(cfg, param_dtype="fp32")
        assert key(fp32, True) == key(fp32, False) == key(cfg, False)  # what runs is what counts
        bf16 = with_updates(cfg, bf16=True)
        assert key(bf16, True) == key(cfg, True) and key(bf16, False) == key(cfg, False)  # a request it falls back from

    ctx = flow_ctx(tmp_path)
    ctx.hardware = None  # fp32 is fp32 on every device: no need to ask the cluster
    _train_job(ctx, PipelineSettings(), PipelineSFTConfig(param_dtype="fp32"), upstream.__getitem__)
    assert ctx.hardware is None


def test_perturbed_changes_exactly_one_field():
    from flows.params import EvalParams, IterativeDPOParams, PrepParams

    for model in (PrepParams(), EvalParams(), IterativeDPOParams(), IterativeDPOParams(seed=3)):
        for name in type(model).model_fields:
            other = perturbed(model, name)
            changed = {k for k in type(model).model_fields if getattr(other, k) != getattr(model, k)}
            assert changed == {name}


def test_prep_key_moves_with_every_prep_field(tmp_path):
    from flows.jobs import prep_job as _prep_job
    from flows.params import PrepParams

    ctx = flow_ctx(tmp_path)
    key = _prep_job(ctx, PrepParams()).config_hash
    assert _prep_job(ctx, PrepParams()).config_hash == key
    assert _prep_job(flow_ctx(tmp_path / "elsewhere"), PrepParams()).config_hash == key  # not the output place
    for name in PrepParams.model_fields:
        assert _prep_job(ctx, perturbed(PrepParams(), name)).config_hash != key, name

    class Later(PrepParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert _prep_job(ctx, Later()).config_hash != _prep_job(ctx, Later(new_knob=1)).config_hash


def test_eval_key_moves_with_every_eval_field_and_the_task(tmp_path):
    from flows.jobs import EVAL_NOT_IN_KEY, eval_job
    from flows.params import EvalParams, PrepParams

    assert EVAL_NOT_IN_KEY == {"promote_metric"}  # widening this needs a reason next to it

    def key(prep=PrepParams(), params=EvalParams(), ctx=None):  # noqa: B008
        prep_o, dpo, sft, rm = [outcome(n, tmp_path) for n in ("prep", "dpo", "sft", "rm")]
        return eval_job(ctx or flow_ctx(tmp_path), prep, params, prep_o, {"dpo": dpo}, sft, rm, name="eval").config_hash

    base = key()
    assert key() == base and key(ctx=flow_ctx(tmp_path / "elsewhere")) == base
    for name in EvalParams.model_fields:
        moved = key(params=perturbed(EvalParams(), name)) != base
        assert moved == (name not in EVAL_NOT_IN_KEY), name
    assert key(prep=perturbed(PrepParams(), "task")) != base

    class Later(EvalParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert key(params=Later()) != key(params=Later(new_knob=1))


# ---------------------------------------------------------------------------------------------
# Training stages: a model named in the config rather than made upstream is an input by URI.

def dpo_job(tmp_path, cfg=None, **values):
    """The pipeline's DPO job (cache key, lineage tags) for `cfg` or `PipelineDPOConfig(**values)`."""
    from flows.jobs import train_job as _train_job
    from flows.params import PipelineDPOConfig, PipelineSettings
    from orchestration.stages import _tags, stage_cache_key

    data = tmp_path / "prep" / "data" / "preference"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}
    ctx = flow_ctx(tmp_path)
    job = _train_job(ctx, PipelineSettings(), cfg or PipelineDPOConfig(**values), upstream.__getitem__)
    key = stage_cache_key(job)
    return key, _tags(ctx, job, key), job


def test_an_explicit_reference_model_enters_the_cache_key_and_the_tags(tmp_path):
    import yaml

    base_key, base_tags, base = dpo_job(tmp_path)
    assert "rlhf.input.reference" not in base_tags  # filled from the SFT model, already upstream
    assert yaml.safe_load(base.config_yaml)["ref"]["model_name_or_path"] == str(tmp_path / "sft")
    key_a, tags_a, job_a = dpo_job(tmp_path, ref_pretrain="org/ref-a")
    key_b, _, _ = dpo_job(tmp_path, ref_pretrain="org/ref-b")
    assert len({base_key, key_a, key_b}) == 3
    assert tags_a["rlhf.input.reference"] == "org/ref-a" and job_a.config_hash == base.config_hash
    assert yaml.safe_load(job_a.config_yaml)["ref"]["model_name_or_path"] == "org/ref-a"

    # With an explicit pretrain, a reference equal to it, given or derived, adds nothing.
    from flows.params import PipelineDPOConfig
    from rlhf_core.config import with_updates

    own_key, own_tags, _ = dpo_job(tmp_path, pretrain="org/base")
    assert "rlhf.input.reference" not in own_tags and own_tags["rlhf.input.model"] == "org/base"
    revalidated = PipelineDPOConfig.model_validate(PipelineDPOConfig(pretrain="org/base").model_dump())
    assert "model_name_or_path" in revalidated.ref.model_fields_set  # derived, yet now indistinguishable by the field
    for same in (dict(cfg=revalidated), dict(cfg=with_updates(PipelineDPOConfig(pretrain="org/base"), beta=0.1)),
                 dict(pretrain="org/base", ref_pretrain="org/base")):
        assert dpo_job(tmp_path, **same)[0] == own_key, same
    other_key, other_tags, _ = dpo_job(tmp_path, pretrain="org/base", ref_pretrain="org/other")
    assert other_key != own_key and other_tags["rlhf.input.reference"] == "org/other"


def test_given_reference_tells_a_named_reference_from_a_derived_one():
    from flows.jobs import given_reference
    from rlhf_core.config import DPOConfig, KTOConfig, SFTConfig

    for cls in (DPOConfig, KTOConfig):
        assert given_reference(cls()) is None
        assert given_reference(cls(pretrain="a")) is None  # filled from pretrain by the validator
        assert given_reference(cls(ref_pretrain="r")) == "r"
        assert given_reference(cls(pretrain="a", ref_pretrain="r")) == "r"
    assert given_reference(SFTConfig(pretrain="a")) is None


# ---------------------------------------------------------------------------------------------
# The PPO stage: inputs from SFT and the reward model, its cache key, resumable checkpoints.

def test_ppo_takes_actor_and_reference_from_sft_reward_and_critic_from_the_reward_model(tmp_path):
    from rlhf_core.rl_config import PPOConfig

    job, _, tags, cfg = ppo_job_for(tmp_path)
    assert job.args == ["train", "ppo", "--config", "{config}"] and job.stage == "ppo"
    sft, rm, prep = (str(tmp_path / n) for n in ("sft", "rm", "prep"))
    assert cfg["actor"]["model_name_or_path"] == sft and cfg["ref"]["model_name_or_path"] == sft
    assert cfg["reward"]["model_name_or_path"] == rm and cfg["reward"]["normalize_enable"]
    assert cfg["critic"]["model_name_or_path"] == rm  # OpenRLHF's critic init: the reward model
    assert cfg["data"]["prompt_dataset"] == cfg["eval"]["dataset"] == f"json@{prep}/data/prompts"
    assert cfg["eval"]["task"] == "sort" and cfg["rollout"]["max_new_tokens"] == 16  # derived from the task
    assert cfg["ckpt"]["output_dir"] == str(tmp_path / "run" / "ppo")
    for role, name in (("model", "sft"), ("reference", "sft"), ("reward", "rm"), ("critic", "rm"), ("data", "prep")):
        assert tags[f"rlhf.upstream.{role}.run_id"] == f"run-{name}", role
    PPOConfig.model_validate(cfg).check_complete()  # what the job reads is a complete `rlhf train ppo` config

    # The verifier as the reward: no reward model upstream, the critic starts from SFT.
    _, _, tags, cfg = ppo_job_for(tmp_path, {"reward.task": "sort"})
    assert cfg["reward"]["model_name_or_path"] is None and cfg["critic"]["model_name_or_path"] == sft
    assert "rlhf.upstream.reward.run_id" not in tags and tags["rlhf.upstream.critic.run_id"] == "run-sft"
    # A reward file: an input whose bytes are in the key.
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def reward_func(**kw): pass\n")
    job_a, key_a, tags, cfg = ppo_job_for(tmp_path, {"reward.remote_url": str(reward_file),
                                                     "algo.advantage.estimator": "group_norm"})
    assert tags["rlhf.input.reward"] == str(reward_file) and cfg["critic"]["model_name_or_path"] is None
    reward_file.write_text("def reward_func(**kw): return None\n")
    assert ppo_job_for(tmp_path, {"reward.remote_url": str(reward_file), "algo.advantage.estimator": "group_norm"}
                       )[1] != key_a


def test_ppo_key_moves_with_settings_upstream_and_precision_not_with_places(tmp_path):
    from rlhf_core.infra.manifests import not_semantic_paths
    from rlhf_core.rl_config import PPOConfig

    # What the fields' NOT_SEMANTIC marker leaves out of the key: places, cadence, tracking and
    # dashboards, and the flags accepted for OpenRLHF's scripts that nothing reads (no-ops by design).
    assert not_semantic_paths(PPOConfig) == {
        "actor.model_name_or_path", "critic.model_name_or_path", "ref.model_name_or_path", "reward.model_name_or_path",
        "reward.remote_url", "data.prompt_dataset", "eval.dataset", "ckpt.output_dir", "ckpt.path", "ckpt.save_steps",
        "ckpt.max_num", "ckpt.load_enable", "ckpt.save_hf", "ckpt.disable_ds", "ckpt.max_mem", "logger.logging_steps",
        "mlflow_experiment",
        "mlflow_run_name", "mlflow_parent_run_id", "use_mlflow", "actor.resources", "critic.resources", "ref.resources",
        "reward.resources", "logger.tensorboard_dir", "logger.wandb.group", "logger.wandb.key", "logger.wandb.mode",
        "logger.wandb.org", "logger.wandb.project", "logger.wandb.run_name", "local_rank", "data.dataloader_num_workers",
        "train.actor_init_on_gpu", "train.perf", "train.ptx_coef", "vllm.sync_with_ray", "ckpt.best_metric_key",
        "use_ms", "eval.reward_model_name_or_path"}
    job, key, _, _ = ppo_job_for(tmp_path)
    assert ppo_job_for(tmp_path, ctx=flow_ctx(tmp_path / "elsewhere"))[1] == key  # not the output place
    for values in ({"train.max_steps": 81}, {"actor.adam.lr": 1e-4}, {"algo.kl.init_coef": 0.02},
                   {"rollout.n_samples_per_prompt": 2}):
        assert ppo_job_for(tmp_path, values)[1] != key, values
    # `auto` enters as what the ranks train in: bf16 on a native-bf16 cluster, fp32 here
    assert ppo_job_for(tmp_path, ctx=flow_ctx(tmp_path, native_bf16=True))[1] != key
    assert ppo_job_for(tmp_path, {"ds.param_dtype": "fp32"})[1] == key
    for values in ({"logger.logging_steps": 5}, {"ckpt.max_num": 1}, {"actor.resources": {"node_a": 1}}):
        assert ppo_job_for(tmp_path, values)[1] == key, values
    named, named_key, tags, _ = ppo_job_for(tmp_path, {"pretrain": "org/actor"})
    assert named_key != key and tags["rlhf.input.model"] == "org/actor" and "rlhf.upstream.model.run_id" not in tags
    # a gold reward model checking held-out responses: an input by URI (lineage, the key, what prune keeps)
    _, gold_key, tags, cfg = ppo_job_for(tmp_path, {"eval.reward_model_name_or_path": "org/gold"})
    assert gold_key != key and tags["rlhf.input.gold_reward"] == "org/gold"
    assert cfg["eval"]["reward_model_name_or_path"] == "org/gold"
    assert ppo_job_for(tmp_path, {"eval.reward_model_name_or_path": "org/gold-2"})[1] != gold_key


def test_ppo_gets_a_checkpoint_folder_it_resumes_from_only_under_its_own_key(tmp_path):
    from flows.params import PipelineSettings
    from orchestration.resume import MARKER, CheckpointMismatch, claim

    job, key, _, cfg = ppo_job_for(tmp_path)
    folder = str(tmp_path / "run" / "checkpoints" / "ppo")
    assert job.checkpoint_uri == cfg["ckpt"]["path"] == folder
    assert cfg["ckpt"]["save_steps"] == PipelineSettings().checkpoint_steps and cfg["ckpt"]["load_enable"]
    assert ppo_job_for(tmp_path, settings=PipelineSettings(checkpoint_steps=0))[0].checkpoint_uri is None

    assert claim(folder, key, "ppo") is False  # the first attempt starts from step 0
    (tmp_path / "run" / "checkpoints" / "ppo" / "latest").write_text("global_step20")
    assert claim(folder, key, "ppo") is True  # a retry of the same config resumes
    other = ppo_job_for(tmp_path, {"train.max_steps": 81})[1]
    with pytest.raises(CheckpointMismatch, match=r"(?s)another configuration.*Remove the folder"):
        claim(folder, other, "ppo")
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "latest").write_text("global_step5")
    with pytest.raises(CheckpointMismatch, match=MARKER):
        claim(str(stray), key, "ppo")


def test_supervised_stages_get_a_checkpoint_folder_outside_their_cache_key(tmp_path):
    import yaml

    from flows.jobs import train_job
    from flows.params import PipelineRMConfig, PipelineSettings, PipelineSFTConfig

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}
    for cfg in (PipelineSFTConfig(), PipelineRMConfig()):
        job = train_job(flow_ctx(tmp_path), PipelineSettings(), cfg, upstream.__getitem__)
        written = yaml.safe_load(job.config_yaml)
        assert job.checkpoint_uri == written["ckpt"]["path"] == str(tmp_path / "run" / "checkpoints" / cfg.stage)
        assert written["ckpt"]["save_steps"] == PipelineSettings().supervised_checkpoint_steps
        assert written["ckpt"]["load_enable"]
        off = train_job(flow_ctx(tmp_path), PipelineSettings(supervised_checkpoint_steps=0), cfg, upstream.__getitem__)
        assert off.checkpoint_uri is None and yaml.safe_load(off.config_yaml)["ckpt"]["path"] is None
        assert off.config_hash == job.config_hash  # where and how often it saves is not what it trains


def test_an_s3_output_root_gets_checkpoint_folders_on_s3_too(tmp_path):
    """Retry-resume with an s3:// output root: every resumable stage checkpoints under the run's
    output area on S3 (no node keeps a local folder another node would need)."""
    import dataclasses

    import yaml

    from flows.jobs import train_job
    from flows.params import PipelineSettings, PipelineSFTConfig

    ctx = dataclasses.replace(flow_ctx(tmp_path), run_root="s3://bucket/pipelines/run")
    sft = train_job(ctx, PipelineSettings(), PipelineSFTConfig(), {n: outcome(n, tmp_path) for n in ("prep",)}.__getitem__)
    written = yaml.safe_load(sft.config_yaml)
    assert sft.checkpoint_uri == written["ckpt"]["path"] == "s3://bucket/pipelines/run/checkpoints/sft"
    assert written["ckpt"]["load_enable"] and written["ckpt"]["output_dir"] == "s3://bucket/pipelines/run/sft"
    ppo, _, _, cfg = ppo_job_for(tmp_path, ctx=ctx)
    assert ppo.checkpoint_uri == cfg["ckpt"]["path"] == "s3://bucket/pipelines/run/checkpoints/ppo"
    assert cfg["ckpt"]["load_enable"]


def test_one_eval_job_compares_every_policy_stage(tmp_path):
    """The flow side of `rlhf eval`'s multi-policy contract: `--pretrain A,B --policy_names dpo,ppo`."""
    from flows.jobs import eval_job
    from flows.params import EvalParams, PrepParams

    prep_o, dpo, ppo, sft, rm = (outcome(n, tmp_path) for n in ("prep", "dpo", "ppo", "sft", "rm"))
    job = eval_job(flow_ctx(tmp_path), PrepParams(), EvalParams(), prep_o, {"dpo": dpo, "ppo": ppo}, sft, rm, "eval")
    args = dict(zip(job.args[1::2], job.args[2::2], strict=False))
    assert job.args[0] == "eval"
    assert args["--pretrain"] == f"{dpo.output_uri},{ppo.output_uri}" and args["--policy_names"] == "dpo,ppo"
    assert args["--ref_pretrain"] == sft.output_uri and args["--reward_pretrain"] == rm.output_uri
    assert args["--n_samples_per_prompt"] == "4" and args["--task"] == "sort"
    assert {"policy-dpo", "policy-ppo", "reference", "reward", "data"} == set(job.upstream)
    one = eval_job(flow_ctx(tmp_path), PrepParams(), EvalParams(), prep_o, {"ppo": ppo}, sft, rm, "eval")
    assert one.config_hash != job.config_hash


def test_the_prep_job_builds_the_chosen_model_family(tmp_path):
    """`prep.model_family` reaches `rlhf prep --model_family`; unset, the job's command is as before."""
    from flows.jobs import prep_job as _prep_job
    from flows.params import PrepParams
    from rlhf_core.cli import _parser

    args = _prep_job(flow_ctx(tmp_path), PrepParams(model_family="qwen3")).args
    assert _parser().parse_args(args).model_family == "qwen3"
    assert "--model_family" not in _prep_job(flow_ctx(tmp_path), PrepParams()).args
    with pytest.raises(ValueError, match="model_family"):
        PrepParams(model_family="gpt5")


def test_the_prep_job_builds_a_student_only_for_a_run_that_distills(tmp_path):
    """With `distill` among the stages, prep also builds a student base a size below the policy's
    (or `prep.student_size`); without, its command and key are what they were before students."""
    from flows.jobs import prep_job as _prep_job
    from flows.params import PrepParams
    from rlhf_core.cli import _parser
    from rlhf_core.infra.manifests import params_hash

    ctx = flow_ctx(tmp_path)
    plain = _prep_job(ctx, PrepParams())
    assert "--student_size" not in plain.args
    assert plain.config_hash == params_hash(PrepParams(), exclude=frozenset({"student_size"}))
    # the key the default prep had before students existed (computed at 4e81f2c): outputs stay cached
    assert plain.config_hash == "sha256:9a1a8e28caac23eab73a54d9cc68a5dc0777c56437813f6ed9a5bca464c4b64d"
    distilling = _prep_job(ctx, PrepParams(), distills=True)
    assert _parser().parse_args(distilling.args).student_size == "nano"  # tiny's next size down
    assert distilling.config_hash != plain.config_hash
    small = _prep_job(ctx, PrepParams(model_size="small"), distills=True)
    assert _parser().parse_args(small.args).student_size == "tiny"
    chosen = _prep_job(ctx, PrepParams(student_size="nano", model_size="small"))
    assert _parser().parse_args(chosen.args).student_size == "nano"
    from flows.jobs import PipelineError

    with pytest.raises(PipelineError, match="no size is smaller than prep.model_size 'nano'"):
        _prep_job(ctx, PrepParams(model_size="nano"), distills=True)  # before anything trains
    assert "--student_size" not in _prep_job(ctx, PrepParams(model_size="nano")).args


def test_the_distill_job_starts_prep_s_student_and_learns_from_the_teacher_it_is_given(tmp_path):
    import yaml

    from flows.jobs import PipelineError, train_job
    from flows.params import PipelineKDConfig, PipelineSettings
    from orchestration.stages import StageOutcome, _tags, stage_cache_key

    rows = tmp_path / "prep" / "data" / "sft"
    rows.mkdir(parents=True)
    (rows / "train.jsonl").write_text('{"prompt": "cba", "response": "abc"}\n')
    prep = StageOutcome("prep", "prep", str(tmp_path / "prep"), "run-prep", "key-prep", False, {},
                        {"outputs": {"base": "b", "student": "s"}})
    upstream = {"prep": prep, "sft": outcome("sft", tmp_path)}
    ctx = flow_ctx(tmp_path)

    def job(teacher, cfg=None, prep_outcome=prep):
        return train_job(ctx, PipelineSettings(), cfg or PipelineKDConfig(), {**upstream, "prep": prep_outcome}.__getitem__,
                         name="distill", teacher_from=teacher)

    ppo = outcome("ppo", tmp_path)
    distill = job(ppo)
    config = yaml.safe_load(distill.config_yaml)
    assert (distill.stage, distill.name, distill.args[:2]) == ("kd", "distill", ["train", "kd"])
    assert config["model"]["model_name_or_path"] == f"{prep.output_uri}/student"
    assert config["teacher"]["model_name_or_path"] == ppo.output_uri
    assert config["data"]["dataset"] == f"json@{prep.output_uri}/data/sft"
    assert config["model"]["kd_coef"] == 0.5  # the pipeline's tuned default
    tags = _tags(ctx, distill, stage_cache_key(distill))
    assert tags["rlhf.upstream.teacher.model_uri"] == ppo.output_uri
    # Another teacher is another student: the teacher's key is in the student's.
    assert stage_cache_key(job(outcome("dpo", tmp_path))) != stage_cache_key(distill)
    named = job(None, PipelineKDConfig.model_validate({"teacher_model": "/models/teacher"}))
    assert stage_cache_key(named) != stage_cache_key(distill)
    no_student = StageOutcome("prep", "prep", prep.output_uri, "run-prep", "key-prep", False, {},
                              {"outputs": {"base": "b"}})
    with pytest.raises(PipelineError, match="no student base"):
        job(ppo, prep_outcome=no_student)
    with pytest.raises(PipelineError, match="needs a teacher"):
        job(None)


def test_rejection_sampling_jobs_and_what_their_keys_hold():
    from flows.params import PrepParams, RejectionSamplingParams
    from flows.rejection import job_names, sampling_key, scoring_key
    from tests.unit.flow_helpers import perturbed

    assert job_names(2) == ["rejection_sampling-generate-round1", "rejection_sampling-score-round1",
                            "rejection_sampling-sft-round1", "rejection_sampling-generate-round2",
                            "rejection_sampling-score-round2", "rejection_sampling"]
    prep, params = PrepParams(), RejectionSamplingParams()
    key = sampling_key(prep, params, 7, 1)
    assert sampling_key(prep, params, 8, 1) != key and sampling_key(prep, params, 7, 2) != key
    for name in ("n_prompts", "best_of_n", "temperature", "num_engines"):  # engines draw with seeds of their own
        assert sampling_key(prep, perturbed(params, name), 7, 1) != key, name
    for name in ("rounds", "start_from", "learning_rate", "max_epochs", "seed", "reward"):  # raising rounds keeps round 1
        assert sampling_key(prep, perturbed(params, name), 7, 1) == key, name
    assert scoring_key(prep, perturbed(params, "reward")) != scoring_key(prep, params)
    for name in ("best_of_n", "num_engines"):  # the samples are the scoring job's upstream
        assert scoring_key(prep, perturbed(params, name)) == scoring_key(prep, params), name


def test_rejection_sampling_generates_on_its_engines_and_its_driver_holds_a_gpu_only_when_it_generates(tmp_path):
    """`rejection_sampling.num_engines` reaches the generating `rlhf batch_inference`; with engines as
    Ray actors its driver reserves no GPU of `settings.rollout_gpus`; the scoring job keeps its own."""
    from flows.params import PipelineSettings, PipelineSFTConfig, PrepParams, RejectionSamplingParams
    from flows.rejection import run_rejection_sampling

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
    for engines, driver_gpus in ((1, 1.0), (2, 0)):
        jobs = []

        def run(job, jobs=jobs):
            jobs.append(job)
            return outcome(job.name, tmp_path)

        ctx = flow_ctx(tmp_path)
        ctx.rollout_gpus = 1.0
        run_rejection_sampling(ctx, PipelineSettings(), PrepParams(), PipelineSFTConfig(),
                               RejectionSamplingParams(num_engines=engines, n_prompts=16), upstream.__getitem__, run, {})
        generate, score = jobs[0], jobs[1]
        assert generate.args[generate.args.index("--num_engines") + 1] == str(engines)
        assert (generate.num_gpus, score.num_gpus) == (driver_gpus, 1.0), engines
        assert "--num_engines" not in score.args


def test_conditional_sft_scores_the_sft_rows_then_trains_the_base_asking_for_the_chosen_percentile(tmp_path):
    """Two jobs: the reward model scores prep's SFT rows into csft rows; SFT of prep's base on them,
    whose saved chat template appends the score the scoring job reported at `condition_percentile`."""
    import yaml

    from flows.conditional import SCORE, STAGE, run_conditional_sft
    from flows.jobs import PipelineError
    from flows.params import ConditionalSFTParams, PipelineSettings, PipelineSFTConfig, PrepParams
    from orchestration.stages import stage_cache_key
    from rlhf_core.stages.batch_inference import conditioned_chat_template

    base = tmp_path / "prep" / "base"
    base.mkdir(parents=True)
    (base / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    for folder in (tmp_path / "prep" / "data" / "sft", tmp_path / SCORE):
        folder.mkdir(parents=True)
        (folder / "train.jsonl").write_text('{"prompt": "cba", "response": "abc"}\n')
    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
    metrics = {f"batch_inference/written_reward_p{q}": q / 100 for q in (10, 25, 50, 75, 90, 95, 99)}
    metrics.update({"batch_inference/written_reward_min": -12.5, "batch_inference/written_reward_max": 1.5})

    def flow(params=ConditionalSFTParams(), sft=PipelineSFTConfig(), force=()):
        jobs, outcomes = [], {}
        ctx = flow_ctx(tmp_path)
        ctx.force = list(force)

        def run(job):
            jobs.append(job)
            return outcome(job.name, tmp_path, metrics if job.name == SCORE else None)

        run_conditional_sft(ctx, PipelineSettings(), PrepParams(), sft, params, upstream.__getitem__, run, outcomes)
        return jobs, ctx

    (score, train), ctx = flow()
    assert (score.name, train.name) == (SCORE, STAGE)
    args = score.args
    assert args[:3] == ["batch_inference", "--eval_task", "rm"]
    assert args[args.index("--pretrain") + 1] == upstream["rm"].output_uri
    assert args[args.index("--dataset") + 1] == f"json@{upstream['prep'].output_uri}/data/sft"
    assert args[args.index("--post_processor") + 1] == "csft" and "--normalize_reward" in args
    assert set(score.upstream) == {"data", "reward"}
    config = yaml.safe_load(train.config_yaml)
    assert config["model"]["model_name_or_path"] == f"{upstream['prep'].output_uri}/base"  # the base, as OpenRLHF
    assert config["data"]["dataset"] == f"json@{tmp_path / SCORE}"
    assert (config["data"]["input_key"], config["data"]["output_key"], config["data"]["apply_chat_template"]) == \
        ("input", "output", False)
    assert config["data"]["tokenizer_chat_template"] == conditioned_chat_template(
        "{{ bos_token }}{{ messages[0]['content'] }}", " <rm_score>: 0.90 ")
    # every row fits: the longest score written (-12.50) bounds what a row grows by
    assert config["data"]["max_len"] == PipelineSFTConfig().data.max_len + len(" <rm_score>: -12.50 ")
    assert config["adam"]["lr"] == PipelineSFTConfig().adam.lr  # the sft section's recipe

    # Another percentile asks for another score: another model, the same scoring.
    (score2, train2), _ = flow(ConditionalSFTParams(condition_percentile=50, learning_rate=1e-4))
    assert stage_cache_key(score2) == stage_cache_key(score) and stage_cache_key(train2) != stage_cache_key(train)
    assert " <rm_score>: 0.50 " in yaml.safe_load(train2.config_yaml)["data"]["tokenizer_chat_template"]
    assert yaml.safe_load(train2.config_yaml)["adam"]["lr"] == 1e-4
    (score3, _), _ = flow(ConditionalSFTParams(normalize_reward=False))
    assert stage_cache_key(score3) != stage_cache_key(score) and "--normalize_reward" not in score3.args
    _, forced = flow(force=[STAGE])
    assert SCORE in forced.force  # forcing the stage rescores too
    (score4, _), _ = flow(sft=PipelineSFTConfig.model_validate({"max_samples": 1000}))
    assert stage_cache_key(score4) != stage_cache_key(score)  # other rows scored: scored again
    # The task's verifier scores instead (each row's response against its answer): no reward model needed
    rm = upstream.pop("rm")
    (score5, train5), _ = flow(ConditionalSFTParams(reward="verifier"))
    upstream["rm"] = rm
    assert set(score5.upstream) == {"data"}  # the base's tokenizer writes the prompts:
    assert score5.args[score5.args.index("--pretrain") + 1] == f"{upstream['prep'].output_uri}/base"
    assert score5.args[score5.args.index("--task") + 1] == PrepParams().task
    assert score5.args[score5.args.index("--label_key") + 1] == "answer"
    assert stage_cache_key(score5) != stage_cache_key(score)
    assert yaml.safe_load(train5.config_yaml)["data"]["dataset"] == f"json@{tmp_path / SCORE}"

    with pytest.raises(PipelineError, match="applies no chat template"):
        flow(sft=PipelineSFTConfig.model_validate({"apply_chat_template": False}))
    (base / "chat_template.jinja").unlink()
    with pytest.raises(PipelineError, match="stores no chat template"):
        flow()
    with pytest.raises(ValueError, match="before {input}"):
        ConditionalSFTParams(reward_template="{reward}: {input}")
    with pytest.raises(ValueError, match="one of 10, 25"):
        ConditionalSFTParams(condition_percentile=80)


def test_a_prm_stage_trains_the_sft_model_on_prep_s_step_rows_and_rejection_sampling_can_pick_with_it(tmp_path):
    import yaml

    from flows.jobs import PipelineError, train_job
    from flows.params import PipelinePRMConfig, PipelineSettings, PrepParams, RejectionSamplingParams
    from flows.rejection import scorer_args
    from orchestration.stages import StageOutcome

    rows = tmp_path / "prep" / "data" / "prm"
    rows.mkdir(parents=True)
    (rows / "train.jsonl").write_text('{"input": "add 1+2=\\n1+2+0=3 ки\\n=3 ки", "label": ["+", "+"]}\n')
    prep = StageOutcome("prep", "prep", str(tmp_path / "prep"), "run-prep", "key-prep", False, {},
                        {"outputs": {"prm": str(rows)}})
    upstream = {"prep": prep, "sft": outcome("sft", tmp_path)}
    job = train_job(flow_ctx(tmp_path), PipelineSettings(), PipelinePRMConfig(), upstream.__getitem__)
    config = yaml.safe_load(job.config_yaml)
    assert (job.stage, job.name, job.args[:2]) == ("prm", "prm", ["train", "prm"])
    assert config["model"]["model_name_or_path"] == upstream["sft"].output_uri  # from the SFT model
    assert config["data"]["dataset"] == f"json@{prep.output_uri}/data/prm"
    assert (config["data"]["placeholder_token"], config["data"]["reward_tokens"]) == ("ки", ["+", "-"])
    without = StageOutcome("prep", "prep", prep.output_uri, "run-prep", "key-prep", False, {}, {"outputs": {}})
    with pytest.raises(PipelineError, match="no step-labelled rows"):
        train_job(flow_ctx(tmp_path), PipelineSettings(), PipelinePRMConfig(), {**upstream, "prep": without}.__getitem__)

    trained = StageOutcome("prm", "prm", "/m/prm", "run-prm", "key-prm", False, {},
                           {"config": {"data": {"placeholder_token": "ки", "reward_tokens": ["+", "-"]}}})
    args = scorer_args(RejectionSamplingParams(reward="prm"), trained, PrepParams())
    assert args == ["--pretrain", "/m/prm", "--input_key", "prompt", "--placeholder_token", "ки", "--reward_tokens",
                    "+", "-"]
    assert scorer_args(RejectionSamplingParams(reward="verifier"), None, PrepParams()) == ["--task", "sort",
                                                                                          "--min_reward", "1"]
    with pytest.raises(PipelineError, match="records no placeholder"):
        scorer_args(RejectionSamplingParams(reward="prm"), outcome("prm", tmp_path), PrepParams())


def test_ppo_rewarded_by_the_run_s_process_reward_model(tmp_path):
    """A PPO section that asks for a process reward without naming a model (`reward.process_enable`,
    or `reward.placeholder_token`) gets the run's PRM stage, read at the tokens that stage trained
    with; the critic starts from SFT (a PRM has no value head); the PRM is the reward's lineage."""
    import yaml

    from flows.jobs import PipelineError, ppo_job
    from flows.params import PipelinePPOConfig, PipelineSettings, PrepParams
    from orchestration.stages import StageOutcome, _tags, stage_cache_key
    from rlhf_core.rl_config import PPOConfig

    ppo_job_for(tmp_path)  # writes prep's prompts
    prm = StageOutcome("prm", "prm", str(tmp_path / "prm"), "run-prm", "key-prm", False, {},
                       {"config": {"data": {"placeholder_token": "ки", "reward_tokens": ["+", "-"]}}})
    upstream = {"prm": prm, **{n: outcome(n, tmp_path) for n in ("prep", "sft")}}

    def job_for(values, stages=upstream):
        def need(name):  # as the flow's: a stage not in the run is named
            if name not in stages:
                raise PipelineError(f"stage {name!r} is needed but not run here")
            return stages[name]

        ctx = flow_ctx(tmp_path)
        job = ppo_job(ctx, PipelineSettings(), PrepParams(task="addition_steps"),
                      PipelinePPOConfig.model_validate(values), need)
        return yaml.safe_load(job.config_yaml), _tags(ctx, job, stage_cache_key(job))

    cfg, tags = job_for({"reward.process_enable": True})
    assert cfg["reward"]["model_name_or_path"] == prm.output_uri and not cfg["reward"]["normalize_enable"]
    assert (cfg["reward"]["placeholder_token"], cfg["reward"]["reward_tokens"]) == ("ки", ["+", "-"])
    assert cfg["reward"]["process_enable"] and cfg["critic"]["model_name_or_path"] == str(tmp_path / "sft")
    assert tags["rlhf.upstream.reward.run_id"] == "run-prm" and tags["rlhf.upstream.critic.run_id"] == "run-sft"
    PPOConfig.model_validate(cfg).check_complete()
    cfg, _ = job_for({"reward.placeholder_token": "ки"})  # the response's weakest step as its one reward
    assert cfg["reward"]["model_name_or_path"] == prm.output_uri and not cfg["reward"]["process_enable"]
    with pytest.raises(PipelineError, match="trained with"):
        job_for({"reward.placeholder_token": "<s>"})
    with pytest.raises(PipelineError, match="stage 'prm' is needed"):
        job_for({"reward.process_enable": True}, {k: v for k, v in upstream.items() if k != "prm"})
    bare = StageOutcome("prm", "prm", prm.output_uri, "run-prm", "key-prm", False, {}, {})
    with pytest.raises(PipelineError, match="records no placeholder"):
        job_for({"reward.process_enable": True}, {**upstream, "prm": bare})
