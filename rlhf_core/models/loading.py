"""Load policies and reward models in Hugging Face format, apply LoRA, export for saving.

Reward models are plain one-label `*ForSequenceClassification`, so a saved one scores the same
in plain transformers (the architecture's `score` head, read at the last non-pad token, as our
trainer reads it). `value_head_prefix` maps a head stored under another name (OpenRLHF's
`value_head.*`). Attention (`--ds.attn_implementation`): `sdpa` (default) is `rlhf_sdpa`
(models/attention.py); `eager` and `flex_attention` go to transformers as asked; flash-attention 2 or
3 where a GPU and its package are there, elsewhere `rlhf_sdpa`, said in one line
(`infra/not_applied.py`). MoE experts (`--ds.experts_implementation`) likewise.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from rlhf_core.infra.not_applied import not_applied
from rlhf_core.models.lean import partitioned, unwrap

log = logging.getLogger(__name__)


FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
GPU_EXPERTS = ("grouped_mm", "deepgemm")


def attention_implementation(requested: str | bool = "sdpa") -> str:
    """What to give transformers' `attn_implementation` for `requested` (`DSConfig.attention`; True
    and False: `--flash_attn`'s) on this machine. In a ring (`--ds.ring_attn_size`), ring attention
    (`models/ring.py`), whatever was requested."""
    from rlhf_core.models import ring

    if ring.current() is not None:
        return ring.register()
    requested = {True: "flash_attention_2", False: "sdpa", None: "sdpa"}.get(requested, requested)
    package = FLASH_PACKAGES.get(requested)
    if package is not None:
        if torch.cuda.is_available() and importlib.util.find_spec(package) is not None:
            return requested
        needs = f"a CUDA device and the {package} package"
        not_applied("ds.attn_implementation", requested, needs, "attention runs PyTorch SDPA")
    elif requested != "sdpa":
        return requested
    from rlhf_core.models.attention import register

    return register()


def apply_liger_kernel(model) -> bool:
    """Liger's fused kernels into `model` (`--ds.use_liger_kernel`) where a CUDA device and the
    liger-kernel package are there; elsewhere one `not applied here:` line. The lean forward would
    bypass the patched modules, so a patched model runs its own forward (`models/lean.supported`)."""
    if torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        model._rlhf_liger = True
        return True
    not_applied("ds.use_liger_kernel", True, "a CUDA device and the liger-kernel package", "the model's own kernels run")
    return False


def model_options(ds) -> dict:
    """`load_causal_lm` / `load_reward_model` keywords from a stage's `ds` section."""
    return {"attention": ds.attention, "experts": ds.experts_implementation,
            "quantization": four_bit_config(ds.param_dtype) if getattr(ds, "load_in_4bit", False) else None}


def four_bit_config(param_dtype: str):
    """QLoRA's weights (`--ds.load_in_4bit`): NF4 with double quantisation, as OpenRLHF loads them,
    computing in the training precision resolved on this device (bf16 where it is native, else fp32)."""
    from rlhf_core.infra.precision import Precision, resolve_here
    from rlhf_core.infra.settings import ConfigError

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("--ds.load_in_4bit (--load_in_4bit) needs bitsandbytes: pip install "
                          "'rlhf-lifecycle[qlora]'")
    from transformers import BitsAndBytesConfig

    # bitsandbytes' CPU backend warns at import that its optional bf16 inference kernel (the `kernels`
    # package) is missing: that kernel is kept off here anyway (`_trainable_4bit`), so the line is noise
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    finally:
        cpu_ops.setLevel(level)
    compute = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(
        resolve_here(Precision(param_dtype).value), torch.float32)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute)


def _quantized(quantization) -> dict:
    """`from_pretrained` keywords for 4-bit weights (on this rank's GPU, where there is one)."""
    if quantization is None:
        return {}
    device = {"": torch.cuda.current_device()} if torch.cuda.is_available() else None
    return {"quantization_config": quantization, **({"device_map": device} if device else {})}


def strict_load(module) -> bool:
    """Whether a DeepSpeed checkpoint of `module` loads strictly: not with 4-bit weights, whose saved
    state also holds bitsandbytes' quantisation entries (absmax, quant_map, ...), which are not
    parameters (the frozen 4-bit weights themselves load as saved)."""
    return not is_quantized(unwrap(module))


def is_quantized(model) -> bool:
    """Whether `model` (or the model under a PEFT wrapper) holds 4-bit bitsandbytes weights."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return bool(getattr(base, "is_loaded_in_4bit", False))


def experts_implementation(requested: str | None) -> dict:
    """`from_pretrained`'s keyword for `--ds.experts_implementation` on this machine ({}: its default)."""
    if requested is None:
        return {}
    if requested in GPU_EXPERTS and not torch.cuda.is_available():
        not_applied("ds.experts_implementation", requested, "a CUDA device", "experts run transformers' default")
        return {}
    return {"experts_implementation": requested}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def check_pretrained(location: str, flag: str, tokenizer: bool = False) -> None:
    """ConfigError naming `flag` unless `location` can be loaded as a model (and, with `tokenizer`,
    holds a tokenizer): run before anything is loaded, so a bad path fails at once in one line.
    s3:// models are checked when they are downloaded."""
    from pathlib import Path

    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.infra.storage import is_remote

    if not location or is_remote(location):
        return
    path = Path(location.removeprefix("file://")).expanduser()
    if not path.exists():
        parts = location.split("/")
        if location.startswith((".", "/", "~", "file://")) or len(parts) > 2 or not all(parts) or \
                Path(parts[0]).exists():
            raise ConfigError(f"{flag} {location}: no such model directory")
        _check_hub_model(location, flag)
        return
    if not path.is_dir():
        raise ConfigError(f"{flag} {location}: not a directory (a model is a folder holding config.json and weights)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {location}: no config.json there: not a Hugging Face model folder")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{flag} {location}: config.json does not describe a model ({_first_line(e)})") from None
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{flag} {location}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")


def _check_hub_model(name: str, flag: str) -> None:
    from transformers import AutoConfig

    from rlhf_core.infra.settings import ConfigError

    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{flag} {name}: not a local folder, and the Hugging Face hub did not provide it "
                          f"({_first_line(e)})") from None


def load_tokenizer(path: str, use_fast: bool = True):
    """`use_fast=False` (`--data.disable_fast_tokenizer`): transformers' Python tokenizer where the
    model has one (as OpenRLHF asks for it); transformers 5 gives the Rust one to models that have no other."""
    from transformers import AutoTokenizer

    from rlhf_core.infra.settings import ConfigError

    try:
        tok = AutoTokenizer.from_pretrained(path, use_fast=use_fast)
    except (OSError, ValueError) as e:  # no such folder or hub name, no tokenizer files, or none it can convert
        raise ConfigError(f"{path}: no tokenizer can be loaded from it ({_first_line(e)})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


REWARD_PAD_TOKEN = "<|reward_pad|>"


def give_reward_model_its_own_pad(model, tokenizer) -> bool:
    """Add a pad token to a reward model whose tokenizer pads with EOS; True when it did.

    A `*ForSequenceClassification` reads its score at the last token that is not
    `config.pad_token_id`; with EOS as pad (Llama 3, Mistral, ...) plain transformers would read the
    token before EOS while the trainer reads EOS. A pad token of its own (a new embedding row
    unless there are spare rows) makes both read the same token.
    """
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return False
    tokenizer.add_special_tokens({"pad_token": REWARD_PAD_TOKEN})
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    return True


def load_causal_lm(path: str, attention: str | bool = "sdpa", dtype: torch.dtype = torch.float32,
                   experts: str | None = None, quantization=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_implementation(attention), **experts_implementation(experts),
        **_quantized(quantization))
    return model if quantization is None else _trainable_4bit(model)


def _trainable_4bit(model):
    """On a CPU with AVX-512 BF16, bitsandbytes repacks a 4-bit layer's weights for its bf16 inference
    kernel at the first forward in eval mode without gradients (a held-out evaluation), and every
    later forward, training ones included, runs that kernel, which has no backward: the gradients to
    everything before the layer silently vanish. Its ordinary path (dequantise, then matmul in the
    compute dtype) is kept for every forward instead, the path training and the published model use."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def load_reward_model(path: str, pad_token_id: int, value_head_prefix: str = "score", attention: str | bool = "sdpa",
                      dtype: torch.dtype = torch.float32, experts: str | None = None, quantization=None):
    """A one-label sequence classifier; a head saved as `{value_head_prefix}.*` is mapped onto `score`."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, attn_implementation=attention_implementation(attention),
        **experts_implementation(experts), **_quantized(quantization))
    model.config.pad_token_id = pad_token_id
    if quantization is not None:
        _trainable_4bit(model)
    if value_head_prefix != "score":
        load_renamed_head(model, path, value_head_prefix)
    return model


def load_renamed_head(model, path: str, prefix: str) -> None:
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key.startswith(prefix + ".") or key.startswith(f"model.{prefix}."):
                    name = key.split(prefix + ".", 1)[1]
                    getattr(model.score, name).data.copy_(f.get_tensor(key).reshape_as(getattr(model.score, name)))
                    return
    raise ValueError(f"--value_head_prefix {prefix!r}: no '{prefix}.*' weights in {path}")


def stored_parameters(path: str) -> int | None:
    """How many parameters a saved model folder holds, from its safetensors headers (no weights
    read): the files its index names where it has one, else every `*.safetensors` but a LoRA
    adapter's. None when there are none (a `.bin` checkpoint)."""
    import json
    import math
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [f for f in sorted(folder.glob("*.safetensors")) if not f.name.startswith("adapter_model")]
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return total


def backbone(model):
    """The transformer body of a causal LM or sequence classifier (e.g. `LlamaModel`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix)


def apply_lora(model, rank: int, alpha: int, dropout: float, target_modules: list[str] | str, is_reward_model: bool):
    from peft import LoraConfig, get_peft_model

    if isinstance(target_modules, str):  # "q_proj,v_proj"
        target_modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    targets = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type="SEQ_CLS" if is_reward_model else "CAUSAL_LM",
                        modules_to_save=["score"] if is_reward_model else None)
    return get_peft_model(model, config)


def merged_lora_state(module) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's weights as the plain model holds them after `merge_and_unload`: each
    adapted layer's base weight plus its adapter's delta, computed out of place (the live adapters
    are left as they are), by the base model's names; on the module's device. Not for ZeRO-3.
    4-bit base weights (QLoRA) are dequantised first: the result is the function that was trained,
    in plain floating-point weights."""
    from peft.tuners.lora import LoraLayer

    base = module.get_base_model()
    deltas = {}
    for name, layer in base.named_modules():
        if isinstance(layer, LoraLayer) and layer.active_adapters:
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            deltas[f"{name}.weight"] = delta
    state = {}
    for name, tensor in dequantized_state(base).items():
        if ".lora_" in name or ".original_module." in name:  # adapters; a trained head's frozen original
            continue
        plain = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        value = tensor.detach()
        if plain in deltas:
            value = value + deltas[plain].to(value.dtype)
        state[plain] = value
    return state


def dequantized_state(model) -> dict[str, torch.Tensor]:
    """`model.state_dict()`, with each 4-bit (bitsandbytes) weight as the floating-point matrix it
    stands for, in its layer's compute dtype, and its quantisation entries left out."""
    state = model.state_dict()
    four_bit = {name: layer for name, layer in model.named_modules() if hasattr(getattr(layer, "weight", None),
                                                                               "quant_state")}
    if not four_bit:
        return state
    from bitsandbytes.functional import dequantize_4bit

    out = {}
    for name, tensor in state.items():
        owner, _, rest = name.partition(".weight")
        if owner in four_bit and rest == "":
            weight = four_bit[owner].weight
            out[name] = dequantize_4bit(weight.data, weight.quant_state).to(four_bit[owner].compute_dtype)
        elif not (owner in four_bit and rest.startswith(".")):  # not one of its quantisation entries
            out[name] = tensor
    return out


def _gathered_state_dict(module, rank: int) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU state dict of a ZeRO-3 module on rank 0 (None elsewhere).

    Parameters are gathered one at a time (each rank holds only a shard); tied weights appear
    under every name `state_dict()` gives them. Every rank must call this.
    """
    import deepspeed

    entries = module.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}
    for name, tensor in entries.items():
        names_of.setdefault(id(tensor), []).append(name)
    state: dict[str, torch.Tensor] | None = {} if rank == 0 else None
    for _, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                full = param.detach().to("cpu", torch.float32).clone()
                for name in names_of.get(id(param), []):
                    state[name] = full
    if rank == 0:
        for name, tensor in entries.items():
            state.setdefault(name, tensor.detach().cpu().clone())
    return state


def _tensor_parallel_state_dict(module, rank: int, every_rank: bool = False, device: torch.device | None = None
                                ) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU state dict of a model whose layers DeepSpeed's AutoTP sharded, on rank 0 (None
    elsewhere): each module's slices gathered over its tensor-parallel group in turn. Every rank
    must call this. `every_rank`: the whole state dict on every rank, on `device` in the weights'
    own dtype (each rank feeding the rollout engine on its own GPU)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    keeps = every_rank or rank == 0
    state: dict[str, torch.Tensor] | None = {} if keeps else None

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if every_rank:
            return tensor.detach().to(device or tensor.device, copy=True)
        return tensor.detach().to("cpu", torch.float32).clone()

    def visit(owner, prefix: str) -> None:
        params = list(owner.named_parameters(recurse=False))
        with GatherReplacedLayerParams([p for _, p in params], owner, enabled=True):
            if keeps:
                for name, param in params:
                    state[prefix + name] = copy(param)
        for name, child in owner.named_children():
            visit(child, f"{prefix}{name}.")

    visit(module, "")
    if keeps:  # buffers, and tied weights under every name state_dict() gives them
        for name, tensor in module.state_dict(keep_vars=True).items():
            state.setdefault(name, tensor.detach().to(device or "cpu") if every_rank else tensor.detach().to("cpu").clone())
    return state


def split_weights(module) -> bool:
    """Whether each rank holds only its part of `module`'s weights: ZeRO-3's partitions, AutoTP's slices."""
    from rlhf_core.models.lean import tensor_parallel

    return partitioned(module) or tensor_parallel(module)


def whole_state_dict(module, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole fp32 CPU state dict of a model whose weights are split (`split_weights`), on rank 0
    (None elsewhere); every rank must call this."""
    if partitioned(module):
        return _gathered_state_dict(module, rank)
    return _tensor_parallel_state_dict(module, rank)


def checkpoint_state_dict(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (the in-memory state dict of `model`, or of the model inside a DeepSpeed engine) in the
    names and layout `save_pretrained` writes, which vLLM's loaders read. transformers 5 converts
    some checkpoints on load (a mixture of experts' per-expert matrices fused into one tensor each)
    and converts back on save; a model without such conversions comes back unchanged."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(unwrap(model), dict(state))


def export_model(module, rank: int):
    """A plain HF model (LoRA merged, fp32, on CPU) on rank 0, None elsewhere; call on every rank.

    Below ZeRO-3 every rank holds the full weights and rank 0 copies its own module; with ZeRO-3
    the shards are gathered into a freshly built model of the same class.
    """
    import copy

    if is_quantized(module):  # QLoRA: a new plain model of the merged, dequantised weights
        if rank != 0:
            return None
        return plain_copy(module, merged_lora_state(module) if hasattr(module, "peft_config")
                          else dequantized_state(module))
    if split_weights(module):
        state = whole_state_dict(module, rank)
        if rank != 0:
            return None
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        clone = _new_model(type(base), base.config)
        if hasattr(module, "peft_config"):
            from peft import get_peft_model

            clone = get_peft_model(clone, module.peft_config["default"])
        clone.load_state_dict(state, strict=True)
    elif rank != 0:
        return None
    else:
        clone = copy.deepcopy(module).cpu()
    if hasattr(clone, "merge_and_unload"):
        clone = clone.merge_and_unload()
    return clone.to(torch.float32)


def _new_model(cls, config):
    """An fp32 model of `cls` built from `config`, its weights to be loaded; its random initialisation
    draws from a forked generator, so exporting mid-run (a checkpoint's Hugging Face copy) leaves the
    training's random stream, and with it a resumed run's equality, as it was."""
    with torch.random.fork_rng(devices=[]):
        return cls._from_config(config, dtype=torch.float32)


def plain_copy(module, state: dict[str, torch.Tensor]):
    """A new fp32 model of `module`'s (base) class and config, without quantisation, holding `state`."""
    import copy

    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clone = _new_model(type(base), config)
    clone.load_state_dict({k: v.to("cpu", torch.float32) for k, v in state.items()}, strict=True)
    return clone


def model_writer(model, tokenizer):
    """`publish_output`'s `write` for a trained model: HF safetensors (with `use_cache` on) + the tokenizer."""

    def write(folder: Path) -> None:
        model.config.use_cache = True
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return write


def write_hf_checkpoint(module, tokenizer, folder, rank: int) -> None:
    """`module` as a plain Hugging Face model (LoRA merged) with `tokenizer` in `folder/hf`
    (`--ckpt.save_hf`); call on every rank (ZeRO-3 shards are gathered), rank 0 writes."""
    model = export_model(module, rank)
    if rank == 0:
        model_writer(model, tokenizer)(Path(folder) / "hf")
