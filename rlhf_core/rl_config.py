"""`rlhf train ppo`: the configuration of the RL stage (PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO).

Sectioned like OpenRLHF's CLI: one model per section (`actor`, `critic`, `ref`, `reward`,
`rollout`, `vllm`, `algo`, `train`, `eval`, `logger`, `ds`, `data`, `ckpt`; the last four are the
supervised trainers' classes, `config.py`), and a field's flag is its dotted path
(`--actor.adam.lr`, `--algo.kl.init_coef`). OpenRLHF's flat flags (`--init_kl_coef`, ...) sit on
the fields; a few set two fields (`--adam_betas`, `--l2`, ... for the actor and the critic).
YAML may give a field nested (`actor: {adam: {lr: ...}}`), dotted (`actor.adam.lr: ...`) or flat
(`actor_learning_rate: ...`).

Precedence: defaults < `--config FILE.yaml` < flags. Unknown keys are errors; so is one field
given two different values in one place (`flags.py`). Derived defaults are resolved here, so the
controller reads plain values: the critic's and the reference's starting models,
`rollout.max_new_tokens`, `data.max_len`, `actor.eps_clip_low_high`.
"""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlhf_core.algos.names import (
    STEP_AGGREGATES,
    AdvantageEstimator,
    ISCorrectionType,
    KLEstimator,
    LossAggMode,
    PolicyLossType,
)
from rlhf_core.config import (
    NOT_BUILT_FLAGS,
    AdamConfig,
    CkptConfig,
    ConfigError,
    DSConfig,
    LoraConfig,
    Optimiser,
    RefModelConfig,
    RingAttention,
    RolloutBackend,
    Schedule,
    StrictModel,
    TensorParallel,
    TokenizingOptions,
    TrainingStageConfig,
    TrainLoopConfig,
    ValueHead,
    _deferred,
    check_aux_loss,
    check_input_template,
    check_probs,
    reward_token_list,
    spellings_of,
    template_or_none,
)
from rlhf_core.flags import flat
from rlhf_core.infra.manifests import NOT_SEMANTIC

# The roles DeepSpeed trains (`--ds.tensor_parallel_size` splits their layers; the frozen ones run whole)
TRAINED_ROLES = ("actor", "critic")


class Placement(StrictModel):
    """Where a role's ranks run."""

    num_nodes: int = Field(1, ge=1)
    num_gpus_per_node: int = Field(1, ge=1, description="Ranks per node (on CPU: worker processes)")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each rank's "
                                        "bundle takes, as JSON (e.g. '{\"node_a\": 1}'): the role runs only on "
                                        "nodes started with them (`ray start --resources`)",
                                        json_schema_extra=dict(NOT_SEMANTIC))

    @field_validator("resources", mode="before")
    @classmethod
    def _resources_from_json(cls, value):
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError as e:
                raise ValueError(f"not a JSON object of resource amounts ({e})") from None
        if isinstance(value, dict) and any(k in ("CPU", "GPU", "memory", "object_store_memory") for k in value):
            raise ValueError("CPUs and GPUs come from the role's placement; name only custom resources here")
        return value

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


class ActorAdam(AdamConfig):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (after warmup)")


class CriticAdam(AdamConfig):
    lr: float = Field(9e-6, gt=0, description="Peak learning rate (after warmup)")


class ActorConfig(Placement, Schedule, Optimiser):
    model_name_or_path: str | None = Field(None, description="Policy to start from (HF directory, s3:// URI or "
                                           "hub name; required)",
                                           json_schema_extra=flat("pretrain", **NOT_SEMANTIC))
    adam: ActorAdam = Field(default_factory=ActorAdam)
    gradient_checkpointing_enable: bool = Field(False, description="Gradient checkpointing (actor and critic)",
                                                json_schema_extra=flat("gradient_checkpointing"))
    gradient_checkpointing_reentrant: bool = Field(False, description="torch's reentrant checkpointing variant",
                                                   json_schema_extra=flat("gradient_checkpointing_use_reentrant"))
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range", json_schema_extra=flat("eps_clip"))
    eps_clip_low_high: tuple[float, float] | None = Field(None, description="Asymmetric clip range (low, high); "
                                                          "default: (eps_clip, eps_clip)",
                                                          json_schema_extra=flat("eps_clip_low_high"))
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 (off by default)",
                                    json_schema_extra=flat("dual_clip"))
    policy_loss_type: PolicyLossType = Field(PolicyLossType.PPO, description="The surrogate: ppo (a clipped ratio "
                                             "per token), gspo (one per sequence), cispo (REINFORCE weighted by "
                                             "the clipped, detached ratio), sapo (a soft gate on the ratio); "
                                             "docs/algorithms.md", json_schema_extra=flat("policy_loss_type"))
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO's gate temperature where the advantage is positive",
                                json_schema_extra=flat("sapo_tau_pos"))
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO's gate temperature where the advantage is not "
                                "positive", json_schema_extra=flat("sapo_tau_neg"))
    entropy_coef: float | None = Field(None, description="Entropy bonus coefficient (None: off; 0: logged only)",
                                       json_schema_extra=flat("entropy_loss_coef"))
    aux_loss_coef: float = Field(0.0, ge=0, description="Weight of a Mixture-of-Experts router's load-balancing "
                                 "loss in the actor's loss (and the critic's, when it is one too); 0: off",
                                 json_schema_extra=flat("aux_loss_coef"))

    @model_validator(mode="after")
    def _aux_loss_needs_gradients(self) -> ActorConfig:
        check_aux_loss(self)
        return self


class CriticConfig(Placement, Schedule, Optimiser):
    model_name_or_path: str | None = Field(None, description="Critic to start from (gae only); default: the "
                                           "first reward model, else the actor",
                                           json_schema_extra=flat("critic_pretrain", **NOT_SEMANTIC))
    adam: CriticAdam = Field(default_factory=CriticAdam)
    value_clip: float = Field(0.5, gt=0, description="Value clip range", json_schema_extra=flat("value_clip"))
    freezing_steps: int = Field(0, ge=-1, description="Freeze the actor for the first N steps while the critic "
                                "warms up (-1, OpenRLHF's default, is read as 0)",
                                json_schema_extra=flat("freezing_actor_steps"))
    save_value_network: bool = Field(False, description="Save the trained critic with the policy, as critic/ in the "
                                     "stage output",
                                     json_schema_extra=flat("save_value_network"))


class RefConfig(RefModelConfig, Placement):
    pass


class RewardConfig(Placement):
    model_name_or_path: str | None = Field(None, description="Reward model(s), comma-separated",
                                           json_schema_extra=flat("reward_pretrain", **NOT_SEMANTIC))
    offload: bool = Field(False, description="Keep the reward models' weights in CPU memory between uses (as "
                          "--ref.offload)", json_schema_extra={"gpu": "ZeRO-3 parameter offload on CUDA; on a CPU "
                                                               "the weights are in CPU memory already"})
    remote_url: str | None = Field(None, description="Reward server URL(s) (http/https, comma-separated) or a "
                                   "Python file defining reward_func",
                                   json_schema_extra=flat("remote_rm_url", **NOT_SEMANTIC))
    task: str | None = Field(None, description="Built-in task whose exact verifier scores responses",
                             json_schema_extra=flat("task"))
    normalize_enable: bool = Field(False, description="Normalise reward models' scores with their stored "
                                   "reward_mean/std (a reward file's, a server's or a task's are used as given)",
                                   json_schema_extra=flat("normalize_reward"))
    clip_range: tuple[float, float] = Field((-10.0, 10.0), json_schema_extra=flat("reward_clip_range"))
    overlong_buffer_len: float | None = Field(None, gt=0, description="DAPO soft overlong penalty over the last N "
                                            "tokens of the budget (off by default)",
                                            json_schema_extra=flat("overlong_buffer_len"))
    overlong_penalty_factor: float = Field(1.0, ge=0, json_schema_extra=flat("overlong_penalty_factor"))
    stop_properly_penalty_coef: float | None = Field(None, description="A response cut off without EOS: its reward "
                                                     "times this when >= 0, this value when < 0 (off by default)",
                                                     json_schema_extra=flat("stop_properly_penalty_coef"))
    placeholder_token: str | None = Field(None, description="The reward model is a process reward model (`rlhf "
                                          "train prm`) read at this token after each step (each line of a response; "
                                          "e.g. ки)", json_schema_extra=flat("placeholder_token"))
    reward_tokens: list[str] | None = Field(None, description="A process reward model's reward tokens, the first "
                                            "meaning a right step (e.g. + -)", json_schema_extra=flat("reward_tokens"))
    step_aggregate: str = Field("min", pattern="^(" + "|".join(STEP_AGGREGATES) + ")$", description="A process "
                                "reward model's score of a response from its steps' P(right): the weakest (min), "
                                "their product, the last, the mean", json_schema_extra=flat("step_aggregate"))
    process_enable: bool = Field(False, description="A process reward model's step scores as rewards, each at its "
                                 "step's last token (estimators gae, reinforce, group_norm, dr_grpo); off: the "
                                 "response's score (--reward.step_aggregate) at its last token",
                                 json_schema_extra=flat("process_reward"))

    @field_validator("reward_tokens", mode="before")
    @classmethod
    def _tokens(cls, value):
        return reward_token_list(value, at_least=2)

    @property
    def sources(self) -> list[str]:
        """The reward source kinds given: any of "model", "remote_url", "task"."""
        return [kind for kind, value in (("model", self.model_name_or_path), ("remote_url", self.remote_url),
                                         ("task", self.task)) if value]


class RolloutConfig(StrictModel):
    batch_size: int = Field(1024, gt=0, description="Prompts per rollout step",
                            json_schema_extra=flat("rollout_batch_size"))
    micro_batch_size: int | None = Field(None, gt=0, description="Samples per experience-pass batch on one rank "
                                         "(default: as many as rollout.max_tokens_per_gpu tokens hold)",
                                         json_schema_extra=flat("micro_rollout_batch_size"))
    n_samples_per_prompt: int = Field(1, ge=1, json_schema_extra=flat("n_samples_per_prompt"))
    max_new_tokens: int | None = Field(None, gt=0, description="Default: the task's longest answer + EOS with "
                                       "--reward.task, else data.max_len - data.prompt_max_len when max_len is "
                                       "given, else 1024",
                                       json_schema_extra=flat("generate_max_len", "max_new_tokens"))
    temperature: float = Field(1.0, gt=0, json_schema_extra=flat("temperature"))
    top_p: float = Field(1.0, gt=0, le=1, description="Sample from the smallest set of most likely tokens "
                         "holding this probability (1: off), after top_k", json_schema_extra=flat("top_p"))
    top_k: int = Field(-1, ge=-1, description="Sample from the k most likely tokens (-1 or 0: off)",
                       json_schema_extra=flat("top_k"))
    vllm_generate_batch_size: int | None = Field(None, gt=0, description="Prompts per call to the rollout engines "
                                                 "(default: a rollout step's all at once)",
                                                 json_schema_extra=flat("vllm_generate_batch_size"))
    max_tokens_per_gpu: int | None = Field(None, gt=0, description="Tokens per experience-pass chunk on one rank "
                                           "when chunks go by tokens (default: train.max_tokens_per_gpu)",
                                           json_schema_extra=flat("rollout_max_tokens_per_gpu"))
    backend: RolloutBackend = Field(RolloutBackend.AUTO, description="Generation engine when vllm.num_engines is 0: "
                                    "auto or transformers; vllm needs num_engines > 0",
                                    json_schema_extra=flat("rollout_backend"))


class VLLMConfig(StrictModel):
    num_engines: int = Field(0, ge=0, description="vLLM engines (0: no vLLM)",
                             json_schema_extra=flat("vllm_num_engines"))
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs of each vLLM engine (its tensor-parallel workers, "
                                      "on vLLM's Ray executor)",
                                      json_schema_extra=flat("vllm_tensor_parallel_size"))
    gpu_memory_utilization: float = Field(0.95, gt=0, le=1,
                                          json_schema_extra=flat("vllm_gpu_memory_utilization"))
    enable_sleep: bool = Field(False, description="Free the engines' GPU memory while training (colocate_all)",
                               json_schema_extra=flat("vllm_enable_sleep"))
    sync_backend: Literal["auto", "nccl", "gloo", "ipc", "object_store"] = Field(
        "auto", description="Weight sync, actor -> engines: auto (vLLM: CUDA IPC on the actor's GPUs, else NCCL; "
        "transformers engines: object store), nccl (CUDA IPC when colocated, as in OpenRLHF), gloo, ipc, object_store",
                                                                                 json_schema_extra=flat("vllm_sync_backend"))
    sync_bucket_mb: int = Field(512, gt=0, description="Bucket size of the broadcast and IPC weight sync (MiB)",
                                json_schema_extra=flat("vllm_sync_bucket_mb"))
    enforce_eager: bool = Field(False, description="Disable CUDA graphs in vLLM",
                                json_schema_extra=flat("enforce_eager"))
    enable_prefix_caching: bool = Field(False, description="vLLM's prefix caching on (not given: vLLM's default, "
                                        "on in its V1 engine)", json_schema_extra=flat("enable_prefix_caching"))
    sync_with_ray: bool = Field(False, description="Accepted for OpenRLHF's scripts: the weights go over NCCL to GPU "
                                "engines either way (--vllm.sync_backend); Ray's collective library is not used",
                                json_schema_extra=flat("vllm_sync_with_ray", noop="the transport is "
                                                       "--vllm.sync_backend's (NCCL to GPU engines)", **NOT_SEMANTIC))


class AdvantageConfig(StrictModel):
    estimator: AdvantageEstimator = Field(AdvantageEstimator.GAE, description="gae (PPO), reinforce (REINFORCE++), rloo, "
                                          "reinforce_baseline, group_norm (GRPO), dr_grpo",
                                          json_schema_extra=flat("advantage_estimator"))
    gamma: float = Field(1.0, gt=0, le=1, json_schema_extra=flat("gamma"))
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda", json_schema_extra=flat("lambd"))
    no_std_norm: bool = Field(False, description="Whiten advantages without dividing by the std",
                              json_schema_extra=flat("no_advantage_std_norm"))
    is_correction_enable: bool = Field(False, description="Weight the policy loss by the trainer's over the "
                                       "engine's probability of each sampled token (importance sampling across the "
                                       "engine/trainer mismatch; GSPO: its sequence ratio against the engine's "
                                       "log-probs); docs/algorithms.md", json_schema_extra=flat("enable_vllm_is_correction"))
    is_correction_threshold: tuple[float, float] = Field((0.5, 5.0), description="The weights' low and high bounds",
                                                         json_schema_extra=flat("vllm_is_truncated_threshold"))
    is_correction_type: ISCorrectionType = Field(ISCorrectionType.TIS, description="tis (clamp each weight), icepop "
                                                 "(drop tokens whose weight is out of bounds), seq-mask-tis (drop "
                                                 "sequences whose mean weight is)",
                                                 json_schema_extra=flat("vllm_is_correction_type"))


class KLConfig(StrictModel):
    init_coef: float = Field(0.01, ge=0, description="KL coefficient (0: no reference model)",
                             json_schema_extra=flat("init_kl_coef"))
    target: float | None = Field(None, gt=0, description="Adaptive KL target (None: fixed coefficient)",
                                 json_schema_extra=flat("kl_target"))
    horizon: int = Field(10000, gt=0, json_schema_extra=flat("kl_horizon"))
    estimator: KLEstimator = Field(KLEstimator.K1, json_schema_extra=flat("kl_estimator"))
    use_loss: bool = Field(False, description="KL as a policy-loss term (GRPO) instead of a reward penalty",
                           json_schema_extra=flat("use_kl_loss"))


class AlgoConfig(StrictModel):
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    loss_agg_mode: LossAggMode = Field(LossAggMode.TOKEN_MEAN, description="How per-token losses reduce to one "
                                       "(docs/algorithms.md, Aggregation)",
                                       json_schema_extra=flat("loss_agg_mode"))
    dynamic_filtering_enable: bool = Field(False, description="Keep only prompt groups whose mean score lies "
                                           "strictly inside dynamic_filtering_range",
                                           json_schema_extra=flat("dynamic_filtering"))
    dynamic_filtering_range: tuple[float, float] = Field((0.0, 1.0),
                                                         json_schema_extra=flat("dynamic_filtering_reward_range"))


class TrainSection(TrainLoopConfig):
    batch_size: int = Field(128, gt=0, description="Samples per optimizer step (all ranks)",
                            json_schema_extra=flat("train_batch_size"))
    max_epochs: int = Field(1, ge=1, description="PPO epochs over each rollout",
                            json_schema_extra=flat("max_epochs"))
    num_episodes: int = Field(1, ge=1, description="Passes over the prompts",
                              json_schema_extra=flat("num_episodes"))
    max_steps: int | None = Field(None, gt=0, description="Stop after this many rollout steps",
                                  json_schema_extra=flat("max_steps"))
    colocate_all: bool = Field(False, description="All models and the vLLM engines share the actor's GPUs",
                               json_schema_extra=flat("colocate_all_models"))
    colocate_actor_ref: bool = Field(False, json_schema_extra=flat("colocate_actor_ref"))
    colocate_critic_reward: bool = Field(False, json_schema_extra=flat("colocate_critic_reward"))
    perf: bool = Field(False, description="Accepted for OpenRLHF 0.9's scripts: the perf/ and time/ metrics are "
                       "always logged", json_schema_extra=flat("perf", noop="perf/ and time/ metrics are always logged",
                                                               **NOT_SEMANTIC))
    enable_ema: bool = Field(False, description="The output is an exponential moving average of the policy's "
                             "weights (updated after every optimizer step; the engines sample the policy itself)",
                             json_schema_extra=flat("enable_ema"))
    ema_beta: float = Field(0.992, ge=0, le=1, description="The moving average's decay: ema = beta x ema + (1 - beta) x "
                            "weights", json_schema_extra=flat("ema_beta"))
    ptx_coef: float = Field(0.05, description="Accepted for OpenRLHF 0.9's scripts: its PPO-ptx loss needs "
                            "pretraining data, which OpenRLHF 0.9 no longer takes either",
                            json_schema_extra=flat("ptx_coef", noop="no pretraining data to mix in (OpenRLHF 0.9 "
                                                   "dropped --pretrain_data too)", **NOT_SEMANTIC))
    actor_init_on_gpu: bool = Field(False, description="Accepted for OpenRLHF 0.9's scripts: each rank builds its "
                                    "models where it trains them", json_schema_extra=flat(
                                        "actor_init_on_gpu", noop="each rank builds its models on its own device",
                                        **NOT_SEMANTIC))
    async_enable: bool = Field(False, description="Sample the next rollout batches while the actor trains on the "
                               "current one: each batch is sampled by the policy train.async_queue_size updates "
                               "before the one that trains on it (docs/flags.md)", json_schema_extra=flat("async_train"))
    async_queue_size: int = Field(1, ge=1, description="With train.async_enable: the rollout batches sampled ahead "
                                  "of training, and so the policy updates between a batch's sampling and its "
                                  "training", json_schema_extra=flat("async_queue_size"))
    partial_rollout_enable: bool = Field(False, description="With train.async_enable: a weight sync does not wait "
                                         "for the batches sampled ahead; their unfinished responses go on with "
                                         "the new weights from the end of the current generation segment "
                                         "(each token's policy version is kept and its staleness logged)",
                                         json_schema_extra=flat("partial_rollout"))
    agent_func_path: str | None = Field(None, description="An OpenRLHF agent file (AgentInstance with async "
                                        "reset/step, AgentExecutor(MultiTurnAgentExecutor)): multi-turn episodes "
                                        "against its environment, which gives the rewards (docs/flags.md)",
                                        json_schema_extra=flat("agent_func_path"))
    agent_max_turns: int = Field(0, ge=0, description="With train.agent_func_path: actions per episode at most (0: "
                                 "until the environment is done or data.max_len tokens are spent)",
                                 json_schema_extra=flat("agent_max_turns"))
    agent_timeout_s: float = Field(60.0, gt=0, description="With train.agent_func_path: seconds each environment "
                                   "call (reset, step) may take; one that misses it, or raises, ends its episode",
                                   json_schema_extra=flat("agent_timeout_s"))
    agent_turn_rewards: bool = Field(False, description="With train.agent_func_path: each turn's reward at the turn's "
                                     "last action token, as step rewards (estimators gae, reinforce, group_norm, "
                                     "dr_grpo); off: their sum at the episode's last action token, as OpenRLHF",
                                     json_schema_extra=flat("agent_turn_rewards"))
    agent_tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3",
                                    "deepseek_v31", "kimi_k2", "granite", "glm45", "minimax_m2", "seed_oss", "step3",
                                    "xlam", "phi4_mini_json", "internlm2", "jamba", "hunyuan_a13b", "longcat",
                                    "olmo3", "ernie45", "openai", "granite4", "lfm2", "apertus",
                                    "cohere_command3", "cohere_command4", "glm47", "deepseek_v32", "deepseek_v4",
                                    "kimi_k3", "gemma4", "qwen3_xml", "llama4_pythonic", "minimax",
                                    "qwen2_5_coder", "step3p5", "hy_v3", "hy_v4", "functiongemma", "mimo",
                                    "dots", "gigachat3", "internlm", "llama4_json", "qwen3_json",
                                    "granite-20b-fc", "deepseek_v41", "plamo3", "ling3", "minimax_m3",
                                    "minicpm5", "k2_horizon", "inkling", "muse_glimmer", "poolside_v1", "hf"] = Field(
        "auto", description="With an agent file's OpenAIAgentExecutor: the format of the tool calls the policy "
        "writes, returned by its endpoint as OpenAI tool_calls (vLLM's --tool-call-parser names); auto: the one "
        "the chat template teaches, else the tokenizer's response_template (hf) where it has one with tool calls, "
        "hermes otherwise (docs/flags.md)")
    dynamic_batch_enable: bool = Field(False, description="Micro-batches by a token budget (train.max_tokens_per_gpu; "
                                       "the experience passes: rollout.max_tokens_per_gpu) even where micro-batch sizes "
                                       "are given (without them it is the default): the same loss, fewer and fuller "
                                       "passes", json_schema_extra=flat("use_dynamic_batch"))


class EvalSection(StrictModel):
    dataset: str | None = Field(None, description="Held-out prompts (evaluated every eval.steps)",
                                json_schema_extra=flat("eval_dataset", **NOT_SEMANTIC))
    split: str | None = Field(None, description="Default: 'test' where eval.dataset has one, else 'train'",
                              json_schema_extra=flat("eval_split"))
    steps: int = Field(-1, description="Evaluate every N steps (-1: at the end only, or, where a held-out check "
                       "is watched (eval.task, with the guard or eval.publish_best on), every tenth of the run)",
                       json_schema_extra=flat("eval_steps"))
    temperature: float = Field(0.6, gt=0, json_schema_extra=flat("eval_temperature"))
    n_samples_per_prompt: int = Field(4, ge=1, json_schema_extra=flat("eval_n_samples_per_prompt"))
    task: str | None = Field(None, description="Built-in task whose exact verifier measures held-out accuracy "
                             "(default: --reward.task); the training reward may come from a reward model")
    reward_model_name_or_path: str | None = Field(None, description="A gold reward model scoring the held-out "
                                                  "responses (eval/sampled_gold_reward, its spread in _std): a "
                                                  "held-out check for the guard and the best policy, one the "
                                                  "training never optimises (a larger reward model, or one "
                                                  "trained on other data; not one of --reward.model_name_or_path)",
                                                  json_schema_extra=NOT_SEMANTIC)  # in a pipeline: an input by URI
    hacking_guard_enable: bool = Field(True, description="Warn (log, MLflow tag and metric) when the training "
                                       "reward rises while the held-out check (--ckpt.best_metric_key's metric "
                                       "where it is one, else the verifier's sampled accuracy, else the gold "
                                       "reward model's sampled reward) falls over the last eval.hacking_window "
                                       "evaluations; needs a held-out check (eval.task or "
                                       "eval.reward_model_name_or_path) and evaluations during training")
    hacking_window: int = Field(3, ge=1, description="Evaluations the reward-hacking guard looks back over")
    hacking_min_drop: float = Field(0.02, ge=0, description="How far (absolute) the held-out check must fall over "
                                    "the window for the guard to fire; an accuracy must also fall by more than the "
                                    "noise of two evaluations on that many responses (twice the standard error of "
                                    "their difference)")
    stop_on_hacking: bool = Field(False, description="Stop training when the reward-hacking guard fires (the "
                                  "last evaluation and the save still run)")
    selection_fraction: float = Field(0.25, ge=0, lt=1, description="With evaluations during training: the share of "
                                      "the held-out prompts they (the guard, the best policy) are measured on; the "
                                      "evaluations before and after training, the reported ones, take the rest (0: "
                                      "every evaluation on all of them, and no best policy is published)")
    publish_best: bool = Field(True, description="Publish the policy of the best evaluation during training "
                               "(--ckpt.best_metric_key, on the selection prompts) as the stage's output, where it "
                               "is not the last one; needs eval.selection_fraction > 0")


class RLDSConfig(DSConfig, ValueHead, RingAttention, TensorParallel):
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on the actor and the critic "
                             "(the critic's value head trained whole); merged into the weights the engines get and "
                             "the output")
    enable_sleep: bool = Field(False, description="Move the actor's and critic's DeepSpeed states off the GPU while "
                               "the rollout engines generate (ZeRO-3 on CUDA; elsewhere not applied, said in one log "
                               "line)", json_schema_extra=flat("deepspeed_enable_sleep", gpu="DeepSpeed's offload_states "
                                                               "(ZeRO-3, CUDA)"))
    packing_samples: bool = Field(True, description="Accepted for OpenRLHF's scripts: every RL pass packs its samples "
                                  "(padding-free, the same numbers as padded batches), given or not",
                                  json_schema_extra=flat("packing_samples", noop="the RL passes always pack"))

    def problems(self) -> list[str]:
        return super().problems() + self.tensor_parallel_problems()


class PromptDataConfig(TokenizingOptions):
    prompt_dataset: str | None = Field(None, description="Prompts: jsonl/json/parquet files, json@DIR or hub "
                                       "names, comma-separated (required)",
                                       json_schema_extra=flat("prompt_data", **NOT_SEMANTIC))
    prompt_split: str = Field("train", json_schema_extra=flat("prompt_split"))
    input_key: str = Field("prompt", json_schema_extra=flat("input_key"))
    label_key: str = Field("answer", description="Reference answer column (verifiers and reward functions)",
                           json_schema_extra=flat("label_key"))
    prompt_max_len: int = Field(1024, gt=0, description="Longer prompts are truncated (left)",
                                json_schema_extra=flat("prompt_max_len"))
    max_len: int | None = Field(None, gt=1, description="Prompt + response tokens; default: prompt_max_len + "
                                "rollout.max_new_tokens", json_schema_extra=flat("max_len"))
    max_samples: int = Field(100_000_000, gt=0, json_schema_extra=flat("max_samples"))
    apply_chat_template: bool = Field(True, json_schema_extra=flat("apply_chat_template"))
    input_template: str | None = Field(None, description="Python format string with one {} for the prompt",
                                       json_schema_extra=flat("input_template"))

    prompt_probs: str | None = Field(None, description="Sampling weights of the prompt datasets, comma-separated",
                                     json_schema_extra=flat("prompt_data_probs"))

    @model_validator(mode="after")
    def _check_prompt_probs(self) -> PromptDataConfig:
        check_probs(self.prompt_probs, self.prompt_dataset, "--data.prompt_probs (--prompt_data_probs)")
        return self

    @field_validator("input_template")
    @classmethod
    def _braceless_template_is_none(cls, template: str | None) -> str | None:
        return template_or_none(template)
    tokenizer_chat_template: str | None = Field(None, description="Jinja chat template that replaces the tokenizer's",
                                                json_schema_extra=flat("tokenizer_chat_template"))


# The held-out metrics of the RL stage's evaluation (`rl/controller.py`), for --ckpt.best_metric_key
EVAL_METRICS = ("sampled_accuracy", "greedy_accuracy", "sampled_reward", "greedy_reward", "sampled_gold_reward",
                "greedy_gold_reward")
# Those that are held-out checks: a verifier's, a gold reward model's (the others are the training reward's own)
CHECK_METRICS = tuple(m for m in EVAL_METRICS if m.endswith(("_accuracy", "_gold_reward")))


class RLCkptConfig(CkptConfig):
    best_metric_key: str = Field("", description="Keep the checkpoint of the best held-out evaluation as "
                                 "best_global_step<N> under --ckpt.path (the previous best removed, never rotated): "
                                 "'' the sampled accuracy where a verifier scores the evaluation (OpenRLHF's first "
                                 "pass@1 metric), else the sampled gold reward where --eval.reward_model_name_or_path "
                                 f"scores it, else none; one of {', '.join(EVAL_METRICS)} (with or without eval/; "
                                 "OpenRLHF's <source>_pass1 is sampled_accuracy); 'none': off",
                                 json_schema_extra=flat("best_metric_key", **NOT_SEMANTIC))

    @field_validator("best_metric_key")
    @classmethod
    def _a_metric_of_the_evaluation(cls, key: str) -> str:
        """The metric's full name (`eval/greedy_accuracy`), '' (automatic) or 'none'."""
        if key in ("", "none"):
            return key
        name = "sampled_accuracy" if key.endswith("_pass1") else key.removeprefix("eval/")
        if name not in EVAL_METRICS:
            raise ValueError(f"{key!r} is not a metric of the evaluation; give one of {', '.join(EVAL_METRICS)}, "
                             "'' (automatic) or 'none'")
        return f"eval/{name}"


# The estimators that take a reward at each step: those whose returns sum the rewards after a token
# (gae, reinforce), and the group ones that normalise every step reward of a prompt's samples
# together (DeepSeekMath's process supervision). RLOO's and REINFORCE-baseline's leave-one-out or
# mean baselines are of one scalar per sample.
PROCESS_ESTIMATORS = ("gae", "reinforce", "group_norm", "dr_grpo")


def process_reward_problems(reward: RewardConfig, estimator: AdvantageEstimator) -> list[str]:
    """What is wrong with a process reward model's flags (none given: nothing)."""
    problems = []
    # With no reward named yet, a pipeline fills in its process reward model and the tokens it trained with.
    named = bool(reward.sources)
    if named and (reward.placeholder_token is None) != (not reward.reward_tokens):
        problems.append("--reward.placeholder_token and --reward.reward_tokens: a process reward model needs both")
    if named and reward.process_enable and reward.placeholder_token is None:
        problems.append("--reward.process_enable: step rewards come from a process reward model "
                        "(--reward.placeholder_token, --reward.reward_tokens)")
    if reward.placeholder_token is None:
        return problems
    models = [m for m in (reward.model_name_or_path or "").split(",") if m.strip()]
    if reward.remote_url is not None or reward.task is not None or len(models) > 1:
        problems.append("--reward.placeholder_token: the process reward model is the one reward model "
                        "(--reward.model_name_or_path), with no other reward source")
    if reward.normalize_enable:
        problems.append("--reward.normalize_enable: a process reward model's scores are probabilities, used as given")
    if reward.process_enable and estimator.value not in PROCESS_ESTIMATORS:
        problems.append(f"--reward.process_enable: --algo.advantage.estimator {estimator.value} takes one reward per "
                        f"sample; step rewards go to {', '.join(PROCESS_ESTIMATORS)}")
    return problems


class PPOConfig(TrainingStageConfig):
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
    ds: RLDSConfig = Field(default_factory=RLDSConfig)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    ckpt: RLCkptConfig = Field(default_factory=RLCkptConfig)

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
    def uses_critic(self) -> bool:
        return self.algo.advantage.estimator.needs_critic

    @property
    def uses_ref(self) -> bool:
        return self.algo.kl.init_coef > 0 or self.algo.kl.use_loss

    @property
    def reward_models(self) -> list[str]:
        """The reward models trained against (`--reward.model_name_or_path`, comma-separated)."""
        return [m.strip() for m in (self.reward.model_name_or_path or "").split(",") if m.strip()]

    @property
    def gold_reward_models(self) -> list[str]:
        """The gold reward model checking held-out responses (`--eval.reward_model_name_or_path`), or none."""
        gold = (self.eval.reward_model_name_or_path or "").strip()
        return [gold] if gold else []

    @property
    def uses_reward_role(self) -> bool:
        """Whether the reward role starts: reward models to train against, or a gold one to check with
        (placed by `--reward.*` either way)."""
        return bool(self.reward_models or self.gold_reward_models)

    @property
    def has_held_out_check(self) -> bool:
        """A check of held-out responses the training reward is not: a verifier or a gold reward model."""
        return self.eval.task is not None or self.eval.reward_model_name_or_path is not None

    def ring_of(self, world_size: int) -> int:
        """The ranks of a ring of a role of `world_size` ranks (`--ds.ring_attn_size`; one rank: none)."""
        return self.ds.ring_attn_size if world_size > 1 else 1

    def tensor_parallel_of(self, role: str, world_size: int) -> int:
        """The ranks of a tensor-parallel group of `role` ("actor", "critic", "ref", "reward") on
        `world_size` ranks: AutoTP splits only what DeepSpeed trains (TRAINED_ROLES); one rank: none."""
        return self.ds.tensor_parallel_size if role in TRAINED_ROLES and world_size > 1 else 1

    def duplicates(self, role: str, world_size: int | None = None) -> int:
        """How many of `role`'s ranks take the same samples: a ring's, times a tensor-parallel
        group's; `world_size`: the role's ranks (default: its placement's)."""
        if world_size is None:
            world_size = {"actor": self.actor, "critic": self.critic, "ref": self.ref, "reward": self.reward}[role].world_size
        return self.ring_of(world_size) * self.tensor_parallel_of(role, world_size)

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
        loss_type = actor.policy_loss_type
        if loss_type.per_sequence:  # one ratio per sequence: its loss is the sequence's mean (OpenRLHF, verl)
            if "loss_agg_mode" not in algo.model_fields_set:
                set_(algo, "loss_agg_mode", LossAggMode.SEQ_MEAN_TOKEN_MEAN)
            elif algo.loss_agg_mode is not LossAggMode.SEQ_MEAN_TOKEN_MEAN:
                problems.append(f"--actor.policy_loss_type {loss_type} reduces per sequence: --algo.loss_agg_mode "
                                f"(--loss_agg_mode) must be seq-mean-token-mean, got {algo.loss_agg_mode}")
            if self.ds.ring_attn_size > 1:
                problems.append(f"--actor.policy_loss_type {loss_type} with --ds.ring_attn_size (--ring_attn_size): "
                                "a ring splits each sequence's tokens over its ranks, and the sequence's ratio "
                                "needs them all; not built")
        low, high = adv.is_correction_threshold
        if adv.is_correction_enable and not 0 <= low <= high:
            problems.append(f"--algo.advantage.is_correction_threshold (--vllm_is_truncated_threshold) {low} {high}: "
                            "give 0 <= low <= high")
        if adv.is_correction_enable and adv.is_correction_type.per_sequence and self.ds.ring_attn_size > 1:
            problems.append("--algo.advantage.is_correction_type seq-mask-tis with --ds.ring_attn_size: a ring splits "
                            "each sequence's tokens over its ranks, and the sequence's mean weight needs them all; "
                            "not built")
        if train.partial_rollout_enable and not train.async_enable:  # as OpenRLHF refuses it
            problems.append("--train.partial_rollout_enable (--partial_rollout) needs --train.async_enable "
                            "(--async_train): only batches sampled ahead overlap a weight sync")
        if train.async_enable and self.vllm.enable_sleep:  # as OpenRLHF refuses it
            problems.append("--train.async_enable (--async_train) with --vllm.enable_sleep (--vllm_enable_sleep): the "
                            "engines sample while the actor trains, so they never sleep")
        if actor.dual_clip is not None and loss_type in (PolicyLossType.CISPO, PolicyLossType.SAPO):
            problems.append(f"--actor.dual_clip (--dual_clip) bounds PPO's and GSPO's clipped surrogate; "
                            f"--actor.policy_loss_type {loss_type} has none")

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
                reward_models = self.reward_models
                set_(critic, "model_name_or_path", reward_models[0] if reward_models else actor.model_name_or_path)
        elif critic.model_name_or_path is not None:
            problems.append(f"--critic.model_name_or_path: only --algo.advantage.estimator gae trains a critic "
                            f"(got {adv.estimator})")
        if self.ref.model_name_or_path is None:
            set_(self.ref, "model_name_or_path", actor.model_name_or_path)

        # Rewards: one kind of source (an agent's environment gives its own).
        if train.agent_func_path and reward.sources:
            problems.append(f"--train.agent_func_path (--agent_func_path): the environment's step() gives the "
                            f"rewards; drop {', '.join('--reward.' + k for k in reward.sources)} (a held-out "
                            "verifier is --eval.task)")
        elif len(reward.sources) > 1:
            problems.append("give one reward source: --reward.model_name_or_path, --reward.remote_url or "
                            f"--reward.task (got {', '.join(reward.sources)})")
        if reward.remote_url is not None:
            for url in reward.remote_url.split(","):
                url = url.strip()
                if not (url.startswith(("http://", "https://")) or url.endswith(".py")):
                    problems.append(f"--reward.remote_url: {url!r} is neither an http(s) URL nor a .py file")
        problems += process_reward_problems(reward, adv.estimator)
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
                task_budget = get_task(reward.task).new_tokens
            except ValueError as e:
                problems.append(f"--reward.task: {e}")
        if self.eval.task is None and reward.task is not None:
            set_(self.eval, "task", reward.task)
        elif self.eval.task is not None and self.eval.task != reward.task:
            from rlhf_core.data.synthetic import get_task

            try:
                budget = get_task(self.eval.task).new_tokens
                task_budget = budget if task_budget is None else max(task_budget, budget)
            except ValueError as e:
                problems.append(f"--eval.task: {e}")
        if train.agent_turn_rewards and not train.agent_func_path:
            problems.append("--train.agent_turn_rewards places an agent's per-turn rewards: give "
                            "--train.agent_func_path")
        elif train.agent_turn_rewards and adv.estimator.value not in PROCESS_ESTIMATORS:
            problems.append(f"--train.agent_turn_rewards: --algo.advantage.estimator {adv.estimator.value} takes one "
                            f"reward per sample; per-turn rewards go to {', '.join(PROCESS_ESTIMATORS)}")
        if rollout.max_new_tokens is None and train.agent_func_path and task_budget is not None:
            problems.append("--train.agent_func_path (--agent_func_path): give --rollout.max_new_tokens "
                            "(--generate_max_len) or --data.max_len: an episode's budget holds every action and the "
                            f"environment's answers, which the task's answer length ({task_budget} tokens) does not")
        elif rollout.max_new_tokens is None:
            if task_budget is not None:
                set_(rollout, "max_new_tokens", task_budget)
            elif self.data.max_len is None:
                set_(rollout, "max_new_tokens", 1024)
            elif self.data.max_len > self.data.prompt_max_len:
                set_(rollout, "max_new_tokens", self.data.max_len - self.data.prompt_max_len)
            else:
                problems.append(f"--data.max_len ({self.data.max_len}) leaves no room to generate after "
                                f"--data.prompt_max_len ({self.data.prompt_max_len}): give --rollout.max_new_tokens")
        guard = self.eval
        gold = guard.reward_model_name_or_path
        if gold is not None and ("," in gold or os.path.normpath(gold.strip()) in map(os.path.normpath,
                                                                                    self.reward_models)):
            problems.append(f"--eval.reward_model_name_or_path {gold}: give one reward model, not one trained against "
                            "(--reward.model_name_or_path): a check the policy is optimised for cannot see it game it")
        if self.ckpt.best_metric_key.endswith("_gold_reward") and gold is None:
            problems.append(f"--ckpt.best_metric_key {self.ckpt.best_metric_key} is a gold reward model's score: give "
                            "--eval.reward_model_name_or_path")
        if guard.stop_on_hacking:
            needs = [what for what, missing in (
                ("the guard on (--eval.hacking_guard_enable)", not guard.hacking_guard_enable),
                ("held-out prompts (--eval.dataset)", guard.dataset is None),
                ("a held-out check (--eval.task, a verifier, or --eval.reward_model_name_or_path)",
                 not self.has_held_out_check)) if missing]
            if needs:
                problems.append(f"--eval.stop_on_hacking needs {' and '.join(needs)}")
        try:
            check_input_template(self.data.input_template, "--data.input_template")
        except ValueError as e:
            problems.append(str(e))
        if self.data.max_len is None and rollout.max_new_tokens is not None:
            set_(self.data, "max_len", self.data.prompt_max_len + rollout.max_new_tokens)

        # Ring attention: every model role's ranks in rings; tensor parallelism: the trained roles'
        # ranks in groups that split each linear layer (the frozen ones run whole, data-parallel, on
        # as many ranks). Given alone, a ring's or a group's ranks per role.
        ring, tp = self.ds.ring_attn_size, self.ds.tensor_parallel_size
        models = {"actor": actor, "critic": critic if self.uses_critic else None,
                  "ref": self.ref if self.uses_ref else None, "reward": reward if self.uses_reward_role else None}
        for role, placement in models.items():
            if placement is None or ring * tp == 1:
                continue
            if placement.world_size == 1 and "num_gpus_per_node" not in placement.model_fields_set:
                set_(placement, "num_gpus_per_node", ring * tp)
            layout = self.ds.layout_problem(placement.world_size, f"{role} ranks ({placement.world_size}: "
                                            f"--{role}.num_nodes x --{role}.num_gpus_per_node)",
                                            tensor_parallel=role in TRAINED_ROLES)
            if layout:
                problems.append(layout)
        if ring > 1 and actor.aux_loss_coef > 0:
            problems.append("--ds.ring_attn_size (--ring_attn_size) with --actor.aux_loss_coef (--aux_loss_coef): "
                            "each rank of a ring sees part of every row, so its router statistics are not the "
                            "batch's; not built")

        # Batches: a rollout step is whole optimizer steps; an optimizer step is whole micro-batches.
        samples = rollout.batch_size * rollout.n_samples_per_prompt
        if samples % train.batch_size:
            problems.append(f"--rollout.batch_size x --rollout.n_samples_per_prompt ({rollout.batch_size} x "
                            f"{rollout.n_samples_per_prompt} = {samples}) must be a multiple of --train.batch_size "
                            f"({train.batch_size})")
        trained = [("actor", actor)] + ([("critic", critic)] if self.uses_critic else [])
        for role, placement in trained:
            # a ring's ranks, and a tensor-parallel group's, take the same samples
            data_parallel = max(1, placement.world_size // (ring * tp))
            per_step = (train.micro_batch_size or 1) * data_parallel
            ranks = f"{role} ranks" + (f" / --ds.ring_attn_size {ring}" if ring > 1 else "") + \
                (f" / --ds.tensor_parallel_size {tp}" if tp > 1 else "")
            if train.batch_size % per_step and train.micro_batch_size is None:
                problems.append(f"--train.batch_size ({train.batch_size}) must be a multiple of the {ranks} "
                                f"({data_parallel}: --{role}.num_nodes x --{role}.num_gpus_per_node)")
            elif train.batch_size % per_step:
                problems.append(f"--train.batch_size ({train.batch_size}) must be a multiple of "
                                f"--train.micro_batch_size x {ranks} ({train.micro_batch_size} x "
                                f"{data_parallel}: --{role}.num_nodes x --{role}.num_gpus_per_node)")

        if self.ds.lora.rank > 0 and self.ds.zero_stage == 3:
            problems.append("--ds.lora.rank (--lora_rank) with --ds.zero_stage 3 is not built yet in train ppo (the "
                            "engines get merged weights, gathered without ZeRO-3): use --ds.zero_stage 2")

        # Placement.
        if (train.colocate_actor_ref or train.colocate_all) and self.uses_ref and \
                (actor.num_nodes, actor.num_gpus_per_node) != (self.ref.num_nodes, self.ref.num_gpus_per_node):
            problems.append("colocating actor and reference (--train.colocate_actor_ref or --train.colocate_all) "
                            "needs the same --actor.num_nodes/num_gpus_per_node and --ref.num_nodes/num_gpus_per_node")
        if (train.colocate_critic_reward or train.colocate_all) and self.uses_critic and self.uses_reward_role \
                and (critic.num_nodes, critic.num_gpus_per_node) != (reward.num_nodes, reward.num_gpus_per_node):
            problems.append("colocating critic and reward model (--train.colocate_critic_reward or "
                            "--train.colocate_all) needs the same --critic.num_nodes/num_gpus_per_node and "
                            "--reward.num_nodes/num_gpus_per_node")
        started = {"critic": self.uses_critic, "ref": self.uses_ref, "reward": self.uses_reward_role}
        for role, used in started.items():
            if getattr(self, role).resources and not used:
                problems.append(f"--{role}.resources: this run starts no {role} role (its estimator, KL or reward "
                                "source does not use one), so there is nothing to place")
        vllm = self.vllm
        tp = vllm.tensor_parallel_size
        if tp > 1 and not vllm.num_engines:
            problems.append(f"--vllm.tensor_parallel_size {tp} needs --vllm.num_engines > 0 (it sets the GPUs of each "
                            "vLLM engine; the transformers engine has no tensor parallelism)")
        engines_colocated = train.colocate_all and not train.async_enable  # async: the DeepSpeed models only
        if engines_colocated and vllm.num_engines and actor.world_size != vllm.num_engines * tp:
            problems.append(f"--train.colocate_all: actor ranks ({actor.world_size}) must equal --vllm.num_engines x "
                            f"--vllm.tensor_parallel_size ({vllm.num_engines} x {tp})")
        elif engines_colocated and vllm.num_engines and actor.num_gpus_per_node % tp:
            problems.append(f"--train.colocate_all: --actor.num_gpus_per_node ({actor.num_gpus_per_node}) must be a "
                            f"multiple of --vllm.tensor_parallel_size ({tp}), so that each engine's GPUs are on one node")
        if rollout.backend == RolloutBackend.VLLM and not vllm.num_engines:
            problems.append("--rollout.backend vllm needs --vllm.num_engines > 0")
        if rollout.backend == RolloutBackend.TRANSFORMERS and vllm.num_engines:
            problems.append(f"--rollout.backend transformers contradicts --vllm.num_engines {vllm.num_engines}: "
                            "give one of them")

        problems += self.ckpt.problems() + self.ds.problems()

        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def check_complete(self) -> None:
        """Raise ConfigError naming every input/output a run still needs: the actor, the prompts, the
        output directory, a reward source and, for a gold reward model, held-out prompts (a pipeline
        fills them in from upstream stages)."""
        missing = [f"{spellings_of(type(self)).flag_name((path,))}: required"
                   for path, value in (("actor.model_name_or_path", self.actor.model_name_or_path),
                                       ("data.prompt_dataset", self.data.prompt_dataset),
                                       ("ckpt.output_dir", self.ckpt.output_dir)) if not value]
        if not self.reward.sources and not self.train.agent_func_path:
            missing.append("a reward source is required: --reward.model_name_or_path (--reward_pretrain), "
                           "--reward.remote_url (--remote_rm_url), --reward.task (--task) or an agent "
                           "(--train.agent_func_path)")
        if self.eval.reward_model_name_or_path and not self.eval.dataset:
            missing.append("--eval.reward_model_name_or_path scores held-out responses: --eval.dataset "
                           "(--eval_dataset) is required")
        if missing:
            raise ConfigError(f"{self.stage}: " + "; ".join(missing))


# ---------------------------------------------------------------------------------------------
# Spellings. A field's dotted path is its flag and YAML key; OpenRLHF's flat flags (and ours:
# --task, --rollout_backend, ...) sit on the fields (`flat`). This table names the spellings a
# field of a shared section class cannot carry: the per-role names of `Placement` and `AdamConfig`.
PPOConfig.ALIASES = {
    "actor_learning_rate": ("actor.adam.lr",),
    "actor_num_nodes": ("actor.num_nodes",),
    "actor_num_gpus_per_node": ("actor.num_gpus_per_node",),
    "critic_learning_rate": ("critic.adam.lr",),
    "critic_num_nodes": ("critic.num_nodes",),
    "critic_num_gpus_per_node": ("critic.num_gpus_per_node",),
    "actor.freezing_steps": ("critic.freezing_steps",),
    "ref_num_nodes": ("ref.num_nodes",),
    "ref_num_gpus_per_node": ("ref.num_gpus_per_node",),
    "reward_num_nodes": ("reward.num_nodes",),
    "reward_num_gpus_per_node": ("reward.num_gpus_per_node",),
    "disable_fast_tokenizer": ("data.disable_fast_tokenizer",),
    "dataloader_num_workers": ("data.dataloader_num_workers",),
    "ref_reward_offload": ("ref.offload", "reward.offload"),  # OpenRLHF 0.9's one flag for both
}
PPOConfig.DEFERRED = {
    **NOT_BUILT_FLAGS,
    **_deferred("vision-language RL is not planned yet", "data.image_key", "data.max_images_per_prompt",
                "actor.freeze_visual_encoder"),
}
SPELLINGS = spellings_of(PPOConfig)


def add_ppo_flags(parser) -> None:
    """`--config` and every field's flags (`flags.Spellings.add_flags`)."""
    SPELLINGS.add_flags(parser)


def build_ppo_config(yaml_values: dict | None, flag_values: dict, complete: bool = True) -> PPOConfig:
    """Merge YAML (lower precedence) and flags into a validated PPOConfig, or raise ConfigError.

    Both may use any spelling: nested sections, dotted paths, flat names. `complete=False` allows
    leaving out the actor, the prompts, the output and the reward source (a pipeline fills them in).
    """
    return SPELLINGS.build(yaml_values, flag_values, complete)
