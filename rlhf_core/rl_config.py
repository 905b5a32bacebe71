"""`rlhf train ppo`: the configuration of the RL stage (PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO).

Sectioned like OpenRLHF's CLI: one model per section (`actor`, `critic`, `ref`, `reward`,
`rollout`, `vllm`, `algo`, `train`, `eval`, `logger`, `ds`, `data`, `ckpt`), and a field's flag
is its dotted path (`--actor.adam.lr`, `--algo.kl.init_coef`). OpenRLHF's flat flags
(`--pretrain`, `--actor_learning_rate`, `--init_kl_coef`, ...) are aliases (`ALIASES`); a few set
two fields (`--adam_betas`, `--l2`, ... for the actor and the critic). YAML may give a field
nested (`actor: {adam: {lr: ...}}`), dotted (`actor.adam.lr: ...`) or flat (`actor_learning_rate: ...`).

Precedence: defaults < `--config FILE.yaml` < flags. Unknown keys are errors; so is one field
given two different values in one place (`flags.py`). Derived defaults are resolved here, so the
controller reads plain values: the critic's and the reference's starting models,
`rollout.max_new_tokens`, `data.max_len`, `actor.eps_clip_low_high`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.algos.names import AdvantageEstimator, KLEstimator, LossAggMode
from rlhf_core.config import ConfigError, RolloutBackend, StrictModel, check_input_template
from rlhf_core.flags import Spellings
from rlhf_core.infra.manifests import NOT_SEMANTIC
from rlhf_core.infra.precision import Precision


class Placement(StrictModel):
    """Where a role's ranks run."""

    num_nodes: int = Field(1, ge=1)
    num_gpus_per_node: int = Field(1, ge=1, description="Ranks per node (on CPU: worker processes)")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


class ActorAdam(StrictModel):
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)


class CriticAdam(ActorAdam):
    lr: float = Field(9e-6, gt=0)


class ActorConfig(Placement):
    model_name_or_path: str | None = Field(None, description="Policy to start from (HF directory, s3:// URI or "
                                           "hub name; required)", json_schema_extra=NOT_SEMANTIC)
    adam: ActorAdam = Field(default_factory=ActorAdam)
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_norm: float = Field(1.0, gt=0)
    gradient_checkpointing_enable: bool = Field(False, description="Gradient checkpointing (actor and critic)")
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range")
    eps_clip_low_high: tuple[float, float] | None = Field(None, description="Asymmetric clip range (low, high); "
                                                          "default: (eps_clip, eps_clip)")
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 (off by default)")
    entropy_coef: float | None = Field(None, description="Entropy bonus coefficient (None: off; 0: logged only)")


class CriticConfig(Placement):
    model_name_or_path: str | None = Field(None, description="Critic to start from (gae only); default: the "
                                           "first reward model, else the actor",
                                           json_schema_extra=NOT_SEMANTIC)
    adam: CriticAdam = Field(default_factory=CriticAdam)
    lr_warmup_ratio: float = Field(0.03, ge=0, le=1)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    max_norm: float = Field(1.0, gt=0)
    value_clip: float = Field(0.5, gt=0, description="Value clip range")
    freezing_steps: int = Field(0, ge=-1, description="Freeze the actor for the first N steps while the critic "
                                "warms up (-1, OpenRLHF's default, is read as 0)")
    save_value_network: bool = Field(False, description="Save the critic next to the policy")


class RefConfig(Placement):
    model_name_or_path: str | None = Field(None, description="Reference model (default: the actor's)",
                                           json_schema_extra=NOT_SEMANTIC)


class RewardConfig(Placement):
    model_name_or_path: str | None = Field(None, description="Reward model(s), comma-separated",
                                           json_schema_extra=NOT_SEMANTIC)
    remote_url: str | None = Field(None, description="Reward server URL(s) (http/https, comma-separated) or a "
                                   "Python file defining reward_func", json_schema_extra=NOT_SEMANTIC)
    task: str | None = Field(None, description="Built-in task whose exact verifier scores responses")
    normalize_enable: bool = Field(False, description="Normalise scores with the RM's stored reward_mean/std")
    clip_range: tuple[float, float] = (-10.0, 10.0)
    overlong_buffer_len: int | None = Field(None, gt=0, description="DAPO soft overlong penalty over the last N "
                                            "tokens of the budget (off by default)")
    overlong_penalty_factor: float = Field(1.0, ge=0)

    @property
    def sources(self) -> list[str]:
        """The reward source kinds given: any of "model", "remote_url", "task"."""
        return [kind for kind, value in (("model", self.model_name_or_path), ("remote_url", self.remote_url),
                                         ("task", self.task)) if value]


class RolloutConfig(StrictModel):
    batch_size: int = Field(1024, gt=0, description="Prompts per rollout step")
    micro_batch_size: int = Field(1, gt=0, description="Samples per generation / experience batch on one rank")
    n_samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int | None = Field(None, gt=0, description="Default: the task's longest answer + EOS with "
                                       "--reward.task, else data.max_len - data.prompt_max_len when max_len is "
                                       "given, else 1024")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    backend: RolloutBackend = Field(RolloutBackend.AUTO, description="Generation engine when vllm.num_engines is 0: "
                                    "auto or transformers; vllm needs num_engines > 0")


class VLLMConfig(StrictModel):
    num_engines: int = Field(0, ge=0, description="vLLM engines (0: no vLLM)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs of each vLLM engine (its tensor-parallel workers, "
                                      "on vLLM's Ray executor)")
    gpu_memory_utilization: float = Field(0.95, gt=0, le=1)
    enable_sleep: bool = Field(False, description="Free the engines' GPU memory while training (colocate_all)")
    sync_backend: Literal["auto", "nccl", "gloo", "ipc", "object_store"] = Field(
        "auto", description="Weight sync, actor -> engines: auto (vLLM: CUDA IPC on the actor's GPUs, else NCCL; "
        "transformers engines: object store), nccl (CUDA IPC when colocated, as in OpenRLHF), gloo, ipc, object_store")
    sync_bucket_mb: int = Field(512, gt=0, description="Bucket size of the broadcast and IPC weight sync (MiB)")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs in vLLM")
    enable_prefix_caching: bool = False


class AdvantageConfig(StrictModel):
    estimator: AdvantageEstimator = Field(AdvantageEstimator.GAE, description="gae (PPO), reinforce (REINFORCE++), rloo, "
                                          "reinforce_baseline, group_norm (GRPO), dr_grpo")
    gamma: float = Field(1.0, gt=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    no_std_norm: bool = Field(False, description="Whiten advantages without dividing by the std")


class KLConfig(StrictModel):
    init_coef: float = Field(0.01, ge=0, description="KL coefficient (0: no reference model)")
    target: float | None = Field(None, gt=0, description="Adaptive KL target (None: fixed coefficient)")
    horizon: int = Field(10000, gt=0)
    estimator: KLEstimator = KLEstimator.K1
    use_loss: bool = Field(False, description="KL as a policy-loss term (GRPO) instead of a reward penalty")


class AlgoConfig(StrictModel):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    loss_agg_mode: LossAggMode = Field(LossAggMode.TOKEN_MEAN, description="How per-token losses reduce to one "
                                       "(docs/algorithms.md, Aggregation)")
    dynamic_filtering_enable: bool = Field(False, description="Keep only prompt groups whose mean score lies "
                                           "strictly inside dynamic_filtering_range")
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)


class TrainSection(StrictModel):
    batch_size: int = Field(128, gt=0, description="Samples per optimizer step (all ranks)")
    micro_batch_size: int = Field(1, gt=0, description="Samples per forward/backward on one rank")
    max_epochs: int = Field(1, ge=1, description="PPO epochs over each rollout")
    num_episodes: int = Field(1, ge=1, description="Passes over the prompts")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many rollout steps")
    seed: int = 42
    colocate_all: bool = Field(False, description="All models and the vLLM engines share the actor's GPUs")
    colocate_actor_ref: bool = False
    colocate_critic_reward: bool = False


class EvalSection(StrictModel):
    dataset: str | None = Field(None, description="Held-out prompts (evaluated every eval.steps)",
                                json_schema_extra=NOT_SEMANTIC)
    split: str | None = Field(None, description="Default: 'test' where eval.dataset has one, else 'train'")
    steps: int = Field(-1, description="Evaluate every N steps (-1: at the end only)")
    temperature: float = Field(0.6, gt=0)
    n_samples_per_prompt: int = Field(4, ge=1)
    task: str | None = Field(None, description="Built-in task whose exact verifier measures held-out accuracy "
                             "(default: --reward.task); the training reward may come from a reward model")


class LoggerSection(StrictModel):
    logging_steps: int = Field(1, gt=0, json_schema_extra=NOT_SEMANTIC)


class DSConfig(StrictModel):
    zero_stage: int = Field(2, ge=0, le=3)
    param_dtype: Precision = Field(Precision.AUTO, description="Training precision: auto (bf16 where the device "
                                   "computes it natively, else fp32), bf16, fp16 (GPU) or fp32")
    adam_offload: bool = False
    flash_attn: bool = False
    value_head_prefix: str = Field("score", description="Name of the value head in reward/critic weights")


class PromptDataConfig(StrictModel):
    prompt_dataset: str | None = Field(None, description="Prompts: jsonl/json/parquet files, json@DIR or hub "
                                       "names, comma-separated (required)", json_schema_extra=NOT_SEMANTIC)
    prompt_split: str = "train"
    input_key: str = "prompt"
    label_key: str = Field("answer", description="Reference answer column (verifiers and reward functions)")
    prompt_max_len: int = Field(1024, gt=0, description="Longer prompts are truncated (left)")
    max_len: int | None = Field(None, gt=1, description="Prompt + response tokens; default: prompt_max_len + "
                                "rollout.max_new_tokens")
    max_samples: int = Field(100_000_000, gt=0)
    apply_chat_template: bool = True
    input_template: str | None = Field(None, description="Python format string with one {} for the prompt")
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template that replaces the tokenizer's")


class CkptConfig(StrictModel):
    output_dir: str | None = Field(None, description="Stage output (the trained policy): local directory or "
                                   "s3:// URI (required)", json_schema_extra=NOT_SEMANTIC)
    path: str | None = Field(None, description="Training-state checkpoints (for save_steps, load_enable)",
                             json_schema_extra=NOT_SEMANTIC)
    save_steps: int = Field(-1, description="Checkpoint every N steps (-1: never)",
                            json_schema_extra=NOT_SEMANTIC)
    max_num: int = Field(3, gt=0, json_schema_extra=NOT_SEMANTIC)
    load_enable: bool = Field(False, description="Resume from the latest checkpoint under ckpt.path",
                              json_schema_extra=NOT_SEMANTIC)


class PPOConfig(StrictModel):
    """`rlhf train ppo`: every section of the RL stage."""

    stage: Literal["ppo"] = "ppo"
    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    logger: LoggerSection = Field(default_factory=LoggerSection)
    ds: DSConfig = Field(default_factory=DSConfig)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)

    mlflow_experiment: str = Field("rlhf", json_schema_extra=NOT_SEMANTIC)
    mlflow_run_name: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    mlflow_parent_run_id: str | None = Field(None, json_schema_extra=NOT_SEMANTIC)
    use_mlflow: bool = Field(True, json_schema_extra=NOT_SEMANTIC)

    # The names every stage config answers to (storage's destination checks, manifests, pipelines).
    @property
    def save_path(self) -> str | None:
        return self.ckpt.output_dir

    @property
    def pretrain(self) -> str | None:
        return self.actor.model_name_or_path

    @property
    def ref_pretrain(self) -> str | None:
        return self.ref.model_name_or_path

    @property
    def reward_pretrain(self) -> str | None:
        return self.reward.model_name_or_path

    @property
    def critic_pretrain(self) -> str | None:
        return self.critic.model_name_or_path if self.uses_critic else None

    @property
    def ckpt_path(self) -> str | None:
        return self.ckpt.path

    @property
    def param_dtype(self) -> Precision:
        return self.ds.param_dtype

    @property
    def uses_critic(self) -> bool:
        return self.algo.advantage.estimator.needs_critic

    @property
    def uses_ref(self) -> bool:
        return self.algo.kl.init_coef > 0 or self.algo.kl.use_loss

    @model_validator(mode="after")
    def _resolve_and_check(self) -> PPOConfig:
        problems: list[str] = []
        set_ = object.__setattr__  # resolved defaults, without re-running validation
        actor, critic, reward, rollout, algo, train = (self.actor, self.critic, self.reward, self.rollout,
                                                       self.algo, self.train)
        adv = algo.advantage

        if critic.freezing_steps < 0:
            set_(critic, "freezing_steps", 0)
        if actor.eps_clip_low_high is None:
            set_(actor, "eps_clip_low_high", (actor.eps_clip, actor.eps_clip))

        # Advantage estimator and the models it needs.
        if adv.estimator.is_group:
            if rollout.n_samples_per_prompt < 2:
                problems.append(f"--algo.advantage.estimator {adv.estimator} needs --rollout.n_samples_per_prompt "
                                f"> 1 (a baseline from the prompt's other samples; got {rollout.n_samples_per_prompt})")
            if adv.gamma != 1.0:
                problems.append(f"--algo.advantage.gamma must be 1 with --algo.advantage.estimator {adv.estimator} "
                                f"(got {adv.gamma})")
        if self.uses_critic:
            if critic.model_name_or_path is None:
                reward_models = [m.strip() for m in (reward.model_name_or_path or "").split(",") if m.strip()]
                set_(critic, "model_name_or_path", reward_models[0] if reward_models else actor.model_name_or_path)
        elif critic.model_name_or_path is not None:
            problems.append(f"--critic.model_name_or_path: only --algo.advantage.estimator gae trains a critic "
                            f"(got {adv.estimator})")
        if self.ref.model_name_or_path is None:
            set_(self.ref, "model_name_or_path", actor.model_name_or_path)

        # Rewards: one kind of source.
        if len(reward.sources) > 1:
            problems.append("give one reward source: --reward.model_name_or_path, --reward.remote_url or "
                            f"--reward.task (got {', '.join(reward.sources)})")
        if reward.remote_url is not None:
            for url in reward.remote_url.split(","):
                url = url.strip()
                if not (url.startswith(("http://", "https://")) or url.endswith(".py")):
                    problems.append(f"--reward.remote_url: {url!r} is neither an http(s) URL nor a .py file")
        if reward.normalize_enable and not reward.model_name_or_path:
            problems.append("--reward.normalize_enable needs --reward.model_name_or_path")
        if reward.clip_range[0] >= reward.clip_range[1]:
            problems.append(f"--reward.clip_range: low must be below high (got {reward.clip_range})")
        if algo.dynamic_filtering_enable:
            low, high = algo.dynamic_filtering_range
            if low >= high:
                problems.append(f"--algo.dynamic_filtering_range: low must be below high (got {(low, high)})")
            if rollout.n_samples_per_prompt < 2:
                problems.append("--algo.dynamic_filtering_enable needs --rollout.n_samples_per_prompt > 1")

        # Generation budget.
        task_budget = None
        if reward.task is not None:
            from rlhf_core.data.synthetic import get_task

            try:
                task_budget = get_task(reward.task).max_answer_len + 1  # the longest answer and EOS
            except ValueError as e:
                problems.append(f"--reward.task: {e}")
        if self.eval.task is None and reward.task is not None:
            set_(self.eval, "task", reward.task)
        elif self.eval.task is not None and self.eval.task != reward.task:
            from rlhf_core.data.synthetic import get_task

            try:
                budget = get_task(self.eval.task).max_answer_len + 1
                task_budget = budget if task_budget is None else max(task_budget, budget)
            except ValueError as e:
                problems.append(f"--eval.task: {e}")
        if rollout.max_new_tokens is None:
            if task_budget is not None:
                set_(rollout, "max_new_tokens", task_budget)
            elif self.data.max_len is None:
                set_(rollout, "max_new_tokens", 1024)
            elif self.data.max_len > self.data.prompt_max_len:
                set_(rollout, "max_new_tokens", self.data.max_len - self.data.prompt_max_len)
            else:
                problems.append(f"--data.max_len ({self.data.max_len}) leaves no room to generate after "
                                f"--data.prompt_max_len ({self.data.prompt_max_len}): give --rollout.max_new_tokens")
        try:
            check_input_template(self.data.input_template, "--data.input_template")
        except ValueError as e:
            problems.append(str(e))
        if self.data.max_len is None and rollout.max_new_tokens is not None:
            set_(self.data, "max_len", self.data.prompt_max_len + rollout.max_new_tokens)

        # Batches: a rollout step is whole optimizer steps; an optimizer step is whole micro-batches.
        samples = rollout.batch_size * rollout.n_samples_per_prompt
        if samples % train.batch_size:
            problems.append(f"--rollout.batch_size x --rollout.n_samples_per_prompt ({rollout.batch_size} x "
                            f"{rollout.n_samples_per_prompt} = {samples}) must be a multiple of --train.batch_size "
                            f"({train.batch_size})")
        trained = [("actor", actor)] + ([("critic", critic)] if self.uses_critic else [])
        for role, placement in trained:
            per_step = train.micro_batch_size * placement.world_size
            if train.batch_size % per_step:
                problems.append(f"--train.batch_size ({train.batch_size}) must be a multiple of "
                                f"--train.micro_batch_size x {role} ranks ({train.micro_batch_size} x "
                                f"{placement.world_size}: --{role}.num_nodes x --{role}.num_gpus_per_node)")

        # Placement.
        if (train.colocate_actor_ref or train.colocate_all) and self.uses_ref and \
                (actor.num_nodes, actor.num_gpus_per_node) != (self.ref.num_nodes, self.ref.num_gpus_per_node):
            problems.append("colocating actor and reference (--train.colocate_actor_ref or --train.colocate_all) "
                            "needs the same --actor.num_nodes/num_gpus_per_node and --ref.num_nodes/num_gpus_per_node")
        if (train.colocate_critic_reward or train.colocate_all) and self.uses_critic and reward.model_name_or_path \
                and (critic.num_nodes, critic.num_gpus_per_node) != (reward.num_nodes, reward.num_gpus_per_node):
            problems.append("colocating critic and reward model (--train.colocate_critic_reward or "
                            "--train.colocate_all) needs the same --critic.num_nodes/num_gpus_per_node and "
                            "--reward.num_nodes/num_gpus_per_node")
        vllm = self.vllm
        tp = vllm.tensor_parallel_size
        if tp > 1 and not vllm.num_engines:
            problems.append(f"--vllm.tensor_parallel_size {tp} needs --vllm.num_engines > 0 (it sets the GPUs of each "
                            "vLLM engine; the transformers engine has no tensor parallelism)")
        if train.colocate_all and vllm.num_engines and actor.world_size != vllm.num_engines * tp:
            problems.append(f"--train.colocate_all: actor ranks ({actor.world_size}) must equal --vllm.num_engines x "
                            f"--vllm.tensor_parallel_size ({vllm.num_engines} x {tp})")
        elif train.colocate_all and vllm.num_engines and actor.num_gpus_per_node % tp:
            problems.append(f"--train.colocate_all: --actor.num_gpus_per_node ({actor.num_gpus_per_node}) must be a "
                            f"multiple of --vllm.tensor_parallel_size ({tp}), so that each engine's GPUs are on one node")
        if rollout.backend == RolloutBackend.VLLM and not vllm.num_engines:
            problems.append("--rollout.backend vllm needs --vllm.num_engines > 0")
        if rollout.backend == RolloutBackend.TRANSFORMERS and vllm.num_engines:
            problems.append(f"--rollout.backend transformers contradicts --vllm.num_engines {vllm.num_engines}: "
                            "give one of them")

        # Checkpoints.
        if self.ckpt.save_steps > 0 and not self.ckpt.path:
            problems.append("--ckpt.save_steps needs --ckpt.path")
        if self.ckpt.load_enable and not self.ckpt.path:
            problems.append("--ckpt.load_enable needs --ckpt.path")

        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def check_complete(self) -> None:
        """Raise ConfigError naming every input/output a run still needs: the actor, the prompts, the
        output directory and a reward source (a pipeline fills them in from upstream stages)."""
        missing = [f"--{path} (--{_flat_spelling(path)}): required"
                   for path, value in (("actor.model_name_or_path", self.actor.model_name_or_path),
                                       ("data.prompt_dataset", self.data.prompt_dataset),
                                       ("ckpt.output_dir", self.ckpt.output_dir)) if not value]
        if not self.reward.sources:
            missing.append("a reward source is required: --reward.model_name_or_path (--reward_pretrain), "
                           "--reward.remote_url (--remote_rm_url) or --reward.task (--task)")
        if missing:
            raise ConfigError(f"{self.stage}: " + "; ".join(missing))


# ---------------------------------------------------------------------------------------------
# Spellings. Every leaf field's dotted path is its flag and YAML key; the names below are other
# spellings of the same fields: OpenRLHF's flat flags (and ours: --task, --rollout_backend,
# --max_steps, ...). A name with two targets sets both.

ALIASES: dict[str, tuple[str, ...]] = {
    # actor
    "pretrain": ("actor.model_name_or_path",),
    "actor_learning_rate": ("actor.adam.lr",),
    "actor_num_nodes": ("actor.num_nodes",),
    "actor_num_gpus_per_node": ("actor.num_gpus_per_node",),
    "gradient_checkpointing": ("actor.gradient_checkpointing_enable",),
    "eps_clip": ("actor.eps_clip",),
    "eps_clip_low_high": ("actor.eps_clip_low_high",),
    "dual_clip": ("actor.dual_clip",),
    "entropy_loss_coef": ("actor.entropy_coef",),
    # actor and critic (one flat flag set both optimisers)
    "adam_betas": ("actor.adam.betas", "critic.adam.betas"),
    "l2": ("actor.adam.weight_decay", "critic.adam.weight_decay"),
    "lr_warmup_ratio": ("actor.lr_warmup_ratio", "critic.lr_warmup_ratio"),
    "min_lr_ratio": ("actor.min_lr_ratio", "critic.min_lr_ratio"),
    "max_norm": ("actor.max_norm", "critic.max_norm"),
    # critic
    "critic_pretrain": ("critic.model_name_or_path",),
    "critic_learning_rate": ("critic.adam.lr",),
    "critic_num_nodes": ("critic.num_nodes",),
    "critic_num_gpus_per_node": ("critic.num_gpus_per_node",),
    "value_clip": ("critic.value_clip",),
    "freezing_actor_steps": ("critic.freezing_steps",),
    "actor.freezing_steps": ("critic.freezing_steps",),
    "save_value_network": ("critic.save_value_network",),
    # ref
    "ref_pretrain": ("ref.model_name_or_path",),
    "ref_num_nodes": ("ref.num_nodes",),
    "ref_num_gpus_per_node": ("ref.num_gpus_per_node",),
    # reward
    "reward_pretrain": ("reward.model_name_or_path",),
    "remote_rm_url": ("reward.remote_url",),
    "task": ("reward.task",),
    "normalize_reward": ("reward.normalize_enable",),
    "reward_clip_range": ("reward.clip_range",),
    "overlong_buffer_len": ("reward.overlong_buffer_len",),
    "overlong_penalty_factor": ("reward.overlong_penalty_factor",),
    "reward_num_nodes": ("reward.num_nodes",),
    "reward_num_gpus_per_node": ("reward.num_gpus_per_node",),
    # rollout
    "rollout_batch_size": ("rollout.batch_size",),
    "micro_rollout_batch_size": ("rollout.micro_batch_size",),
    "n_samples_per_prompt": ("rollout.n_samples_per_prompt",),
    "generate_max_len": ("rollout.max_new_tokens",),
    "max_new_tokens": ("rollout.max_new_tokens",),
    "temperature": ("rollout.temperature",),
    "top_p": ("rollout.top_p",),
    "rollout_backend": ("rollout.backend",),
    # vllm
    "vllm_num_engines": ("vllm.num_engines",),
    "vllm_tensor_parallel_size": ("vllm.tensor_parallel_size",),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization",),
    "vllm_enable_sleep": ("vllm.enable_sleep",),
    "vllm_sync_backend": ("vllm.sync_backend",),
    "vllm_sync_bucket_mb": ("vllm.sync_bucket_mb",),
    "enforce_eager": ("vllm.enforce_eager",),
    "enable_prefix_caching": ("vllm.enable_prefix_caching",),
    # algo
    "advantage_estimator": ("algo.advantage.estimator",),
    "gamma": ("algo.advantage.gamma",),
    "lambd": ("algo.advantage.lambd",),
    "no_advantage_std_norm": ("algo.advantage.no_std_norm",),
    "init_kl_coef": ("algo.kl.init_coef",),
    "kl_target": ("algo.kl.target",),
    "kl_horizon": ("algo.kl.horizon",),
    "kl_estimator": ("algo.kl.estimator",),
    "use_kl_loss": ("algo.kl.use_loss",),
    "loss_agg_mode": ("algo.loss_agg_mode",),
    "dynamic_filtering": ("algo.dynamic_filtering_enable",),
    "dynamic_filtering_reward_range": ("algo.dynamic_filtering_range",),
    # train
    "train_batch_size": ("train.batch_size",),
    "micro_train_batch_size": ("train.micro_batch_size",),
    "max_epochs": ("train.max_epochs",),
    "num_episodes": ("train.num_episodes",),
    "max_steps": ("train.max_steps",),
    "seed": ("train.seed",),
    "colocate_all_models": ("train.colocate_all",),
    "colocate_actor_ref": ("train.colocate_actor_ref",),
    "colocate_critic_reward": ("train.colocate_critic_reward",),
    # eval, logger
    "eval_dataset": ("eval.dataset",),
    "eval_split": ("eval.split",),
    "eval_steps": ("eval.steps",),
    "eval_temperature": ("eval.temperature",),
    "eval_n_samples_per_prompt": ("eval.n_samples_per_prompt",),
    "logging_steps": ("logger.logging_steps",),
    # ds
    "zero_stage": ("ds.zero_stage",),
    "param_dtype": ("ds.param_dtype",),
    "adam_offload": ("ds.adam_offload",),
    "flash_attn": ("ds.flash_attn",),
    "value_head_prefix": ("ds.value_head_prefix",),
    # data
    "prompt_data": ("data.prompt_dataset",),
    "prompt_split": ("data.prompt_split",),
    "input_key": ("data.input_key",),
    "label_key": ("data.label_key",),
    "prompt_max_len": ("data.prompt_max_len",),
    "max_len": ("data.max_len",),
    "max_samples": ("data.max_samples",),
    "apply_chat_template": ("data.apply_chat_template",),
    "input_template": ("data.input_template",),
    "tokenizer_chat_template": ("data.tokenizer_chat_template",),
    # ckpt
    "save_path": ("ckpt.output_dir",),
    "ckpt_path": ("ckpt.path",),
    "save_steps": ("ckpt.save_steps",),
    "max_ckpt_num": ("ckpt.max_num",),
    "load_checkpoint": ("ckpt.load_enable",),
}
# `--bf16` is `--ds.param_dtype bf16`; `--bf16 false` says nothing.
SPELLINGS = Spellings(PPOConfig, ALIASES, transforms={
    "bf16": (("ds.param_dtype",), lambda on: Precision.BF16.value if on else None,
             "Older spelling of --ds.param_dtype bf16")})
LEAVES = SPELLINGS.leaves  # dotted path -> field, e.g. "actor.adam.lr"


def _flat_spelling(path: str) -> str | None:
    return next((name for name, targets in ALIASES.items() if path in targets and "." not in name), None)


def add_ppo_flags(parser) -> None:
    """`--config` and every field's flags (`flags.Spellings.add_flags`)."""
    SPELLINGS.add_flags(parser)


def build_ppo_config(yaml_values: dict | None, flag_values: dict, complete: bool = True) -> PPOConfig:
    """Merge YAML (lower precedence) and flags into a validated PPOConfig, or raise ConfigError.

    Both may use any spelling: nested sections, dotted paths, flat names. `complete=False` allows
    leaving out the actor, the prompts, the output and the reward source (a pipeline fills them in).
    """
    return SPELLINGS.build(yaml_values, flag_values, complete)
