"""Training precision: asked for by the user (`--param_dtype`, or the older `--bf16`), decided by the hardware.

Half precision pays only where the device computes it natively; emulated bf16 is many times slower
than fp32. So `auto` means bf16 where native (CUDA with bf16, a CPU whose oneDNN reports bf16) and
fp32 elsewhere, and an explicit half request on hardware without it falls back to fp32 with one
warning (`RLHF_ALLOW_EMULATED_HALF=1` keeps it, for tests). fp16 is GPU-only: the CPU path
(autocast over fp32 master weights) has no loss scaling. Each rank resolves on its own device
(driver and workers may differ); records and cache keys hold the resolved value, never `auto`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from enum import Enum
from functools import cache


class Precision(str, Enum):
    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def is_half(self) -> bool:
        return self in (Precision.BF16, Precision.FP16)


EMULATED_HALF_ENV = "RLHF_ALLOW_EMULATED_HALF"
HARDWARE_PREFIX = "rlhf-hardware: "  # the line `rlhf hardware` prints, read back by the flow (orchestration/hardware.py)


@dataclass(frozen=True)
class Hardware:
    """What a device computes natively (`device_type` is "cuda" or "cpu")."""

    device_type: str
    native_bf16: bool
    name: str = ""


def resolve(requested: Precision | str, hw: Hardware, allow_emulated: bool = False) -> tuple[Precision, str | None]:
    """The precision to train in on `hw`, and a warning when an explicit request is not honoured.

    Pure: `auto` -> bf16 where native, else fp32; an explicit bf16/fp16 the device does not
    compute natively -> fp32 (unless `allow_emulated`); fp16 on CPU -> fp32 (no loss scaling).
    """
    requested = Precision(requested)
    if requested == Precision.AUTO:
        return (Precision.BF16 if hw.native_bf16 else Precision.FP32), None
    if requested == Precision.FP32 or allow_emulated:
        return requested, None
    if requested == Precision.FP16 and hw.device_type == "cpu":
        return Precision.FP32, ("fp16 asked for, but fp16 training on CPU needs loss scaling, which the CPU path "
                                "does not do: training in fp32")
    if requested == Precision.BF16 and not hw.native_bf16:
        return Precision.FP32, (f"bf16 asked for, but {hw.name or hw.device_type} has no native bf16 (it would "
                                f"run many times slower than fp32): training in fp32. Set {EMULATED_HALF_ENV}=1 "
                                "to force emulated bf16.")
    return requested, None


def this_hardware() -> Hardware:
    """The device this process trains on: CUDA when present, else the CPU as oneDNN reports it."""
    import torch

    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        return Hardware("cuda", torch.cuda.is_bf16_supported(), torch.cuda.get_device_name(index))
    return Hardware("cpu", bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), cpu_name())


@cache
def resolve_here(requested: str) -> Precision:
    """`resolve` on this process's device; rank 0 prints the fallback warning once, on stderr
    (ranks ignore Python's UserWarnings, so `warnings.warn` would never reach the job log)."""
    precision, warning = resolve(requested, this_hardware(), os.environ.get(EMULATED_HALF_ENV) == "1")
    if warning and os.environ.get("RANK", "0") == "0":
        print(f"rlhf: warning: {warning}", file=sys.stderr, flush=True)
    return precision


def cpu_name() -> str:
    """The CPU's model name (Linux), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def cpu_details(cpuinfo: str) -> str:
    """Pure: what a figure should name beside a CPU's model name, which on a cloud VM is often just
    the vendor's line ("AMD EPYC"): its family and model numbers and the widest matrix ISA its
    flags list (AMX, AVX-512 with bf16, AVX-512, AVX2), from /proc/cpuinfo's text ('' if none)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if not line.strip():  # the first processor's block only
            break
        fields.setdefault(key, value.strip())
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 with bf16, no AMX"),
                                        ("avx512f", "AVX-512 without bf16"), ("avx2", "AVX2, no AVX-512"))
                if flag in flags), "")
    family = f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields \
        else ""
    return ", ".join(part for part in (family, isa) if part)


def describe_hardware() -> str:
    """One line for benchmark and README figures: CPU (or GPU) model (a CPU's family, model and
    matrix ISA too) and whether bf16 is native."""
    hw = this_hardware()
    details = ""
    if hw.device_type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                details = cpu_details(f.read())
        except OSError:
            pass
    details = f"{details}; " if details else ""
    return f"{hw.name} ({details}{hw.device_type}, native bf16: {'yes' if hw.native_bf16 else 'no'})"
