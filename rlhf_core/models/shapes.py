"""Few matmul shapes where each new shape costs a kernel build.

On a CPU in half precision (bf16, fp16) PyTorch's matmuls run oneDNN, which JIT-compiles a kernel
for each new problem shape and keeps the last 1024 it built (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`).
A packed batch is as wide as its fullest row, and the lean forward's last layer and head run on
as many rows as the batch has loss tokens, so nearly every micro-batch brings shapes never seen:
measured on an Intel Xeon with AMX (family 6 model 167, 2 cores, bf16), a `[315, 2048] x [2048,
256]` matmul took 10.9 ms the first time and 0.33 ms once built, and DPO's whole process at
micro-batch 8 went from 214.8 s to 149.3 s with the shapes rounded up as here (benchmarks/README.md).
The varying dimensions are rounded up to a multiple: a batch's width (`Batch.widened`) and the rows
the lean head gathers (`gathered_rows`, supervised and RL passes); the slots added carry no loss.

fp32 on a CPU (MKL's GEMM) and GPUs (cuBLAS) build no kernel per shape: there the multiple is 1
and nothing is added.
"""

from __future__ import annotations

import torch

WIDTH_MULTIPLE = 16  # a batch's width, in slots (a few percent more slots on rows of ~100)
ROWS_MULTIPLE = 32  # rows gathered for the lean forward's last layer and LM head
HALF = (torch.bfloat16, torch.float16)


def builds_kernel_per_shape(device: torch.device | str, half: bool) -> bool:
    """Whether a matmul of a new shape compiles a kernel first: oneDNN's half-precision path on a CPU."""
    return half and torch.device(device).type == "cpu"


def width_multiple(device: torch.device | str, precision) -> int:
    """The multiple a batch's width is rounded up to on `device` for a stage trained in `precision`
    (`infra.precision.Precision`, resolved: its matmuls run in that dtype, under autocast on a CPU)."""
    return WIDTH_MULTIPLE if builds_kernel_per_shape(device, precision.is_half) else 1


def gathered_rows(index: torch.Tensor, matmul_dtype: torch.dtype) -> torch.Tensor:
    """`index` (1-D) followed by copies of its first entry up to a multiple of ROWS_MULTIPLE where
    matmuls build a kernel per shape: the caller keeps the first `len(index)` rows of what it computes."""
    n = index.numel()
    extra = -n % ROWS_MULTIPLE
    if not n or not extra or not builds_kernel_per_shape(index.device, matmul_dtype in HALF):
        return index
    return torch.cat([index, index[:1].expand(extra)])
