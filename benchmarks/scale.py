"""Model sizes and compute figures shared by the benchmarks: the ~100M Llama, FLOPs per token, the
machine's measured matmul peak and model FLOPs utilisation (MFU).

Sizes are `rlhf prep --model_size`'s (`rlhf_core/models/sizes.py`): `100m` is a Llama of GPT-2-small
width and depth (hidden 768, 12 layers, 12 heads, gated MLP of 3072: about 113M parameters besides
the embeddings, which the task's tokenizer keeps tiny), so every size trains the same data and tokens.

FLOPs (benchmarks/README.md, "Scale figures"): a pass over a token at position t of a row of T
real tokens costs 2 x (N + V x d) in the matmuls of the weights (N the parameters besides the
embeddings, V x d the tied LM head) and 4 x L x d x T in attention's two batched matmuls (scores and
values over all T keys, PaLM's convention; causal masking halves what is needed). A backward costs
two forwards. So a token trained costs 6 x (N + V x d) + 12 x L x d x T, and a frozen model's
forward over it 2 x (N + V x d) + 4 x L x d x T; rows of different lengths use the token-weighted
mean length sum(T^2) / sum(T). These are model FLOPs: the work the model's definition needs for the
tokens counted, whatever an implementation skips (padding never counts; a prompt shared by a
pair's two answers or a group's samples counts once per sequence). MFU is achieved model FLOP/s
over the measured peak of a square matmul in the precision the run trains in, on the run's
number of threads.

    python benchmarks/scale.py [--threads 2] [--model_size 100m]   # the peaks and the model's counts
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rlhf_core.models.sizes import MODEL_SIZES

SIZES = tuple(MODEL_SIZES)  # rlhf prep's sizes
PEAK_N = 2048  # the square matmul the peak is timed on
PEAK_REPEATS = 10


# ---------------------------------------------------------------------------------------------
# The model's counts and FLOPs per token.

def model_counts(path) -> dict:
    """Parameters of the model saved at `path`, counted on the meta device (nothing allocated):
    `n` besides the input embedding and LM head, `head` = V x d (the LM head's matmul, tied or not),
    layers, hidden size, vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    total = sum(p.numel() for p in model.parameters())
    return {"n": n, "total": total, "head": config.vocab_size * config.hidden_size,
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size}


def flops_per_token(counts: dict, mean_len: float, passes: float = 3.0) -> float:
    """Model FLOPs per token: `passes` forwards' worth of work (3: forward and backward; 4: that
    and a frozen reference's forward) at token-weighted mean row length `mean_len`."""
    return passes * (2 * (counts["n"] + counts["head"]) + 4 * counts["layers"] * counts["hidden"] * mean_len)


def formula(passes: float) -> str:
    k = {3.0: "", 4.0: " (policy trained + reference forward)"}.get(passes, f" ({passes} passes)")
    return f"{int(2 * passes)} x (N + V x d) + {int(4 * passes)} x L x d x T{k}"


def length_stats(lengths) -> dict:
    """Token count, row count and token-weighted mean length of rows of these lengths."""
    lengths = list(lengths)
    tokens = sum(lengths)
    return {"rows": len(lengths), "tokens": tokens,
            "mean_len": sum(t * t for t in lengths) / tokens if tokens else 0.0}


def row_lengths(tokenizer, rows: list[dict], stage: str, max_len: int) -> list[int]:
    """Real tokens of each sequence the stage trains on, as our trainers build them
    (`data/examples.PromptFormatter`: the chat-formatted prompt, the answer, EOS): SFT one per row,
    DPO two (the prompt with the chosen answer, the prompt with the rejected one)."""
    from rlhf_core.config import DataConfig
    from rlhf_core.data.examples import PromptFormatter

    fmt = PromptFormatter(tokenizer, DataConfig(apply_chat_template=True, max_len=max_len, truncate=True))
    answers = ("response",) if stage == "sft" else ("chosen", "rejected")
    lengths = []
    for i, row in enumerate(rows, start=1):
        prompt = fmt.prompt_ids(row["prompt"])
        lengths += [len(fmt.join(prompt, fmt.completion_ids(row[a]), "bench", i).input_ids) for a in answers]
    return lengths


# ---------------------------------------------------------------------------------------------
# The measured peak.

def matmul_peak(precision: str, threads: int, n: int = PEAK_N, repeats: int = PEAK_REPEATS) -> dict:
    """GFLOP/s of an n x n by n x n matmul in `precision` ("bf16" or "fp32") where the runs train: on
    the GPU where there is one (n at least 8192, so the product fills it), else on `threads` torch
    threads; the best of `repeats` timed products after two untimed ones (the peak), and their median."""
    import torch

    gpu = torch.cuda.is_available()
    n = max(n, 8192) if gpu else n
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(device="cuda" if gpu else "cpu", dtype=dtype) for _ in range(2))
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        for _ in range(2):
            torch.mm(a, b)
        rates = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            torch.mm(a, b)
            sync()
            rates.append(2 * n ** 3 / (time.perf_counter() - start) / 1e9)
    finally:
        torch.set_num_threads(before)
    return {"precision": precision, "threads": threads, "n": n, "peak_gflops": max(rates),
            "median_gflops": statistics.median(rates), "device": torch.cuda.get_device_name() if gpu else "cpu"}


def measured_peaks(threads: int, previous: dict | None = None) -> dict:
    """bf16 and fp32 peaks; with `previous` (an earlier call's result) each keeps the higher of
    the two readings, so a reading taken while other work had the cores counts less."""
    peaks = {p: matmul_peak(p, threads) for p in ("bf16", "fp32")}
    if previous:
        for p, old in previous.items():
            readings = old.get("readings", [old["peak_gflops"]]) + [peaks[p]["peak_gflops"]]
            peaks[p] = {**peaks[p], "peak_gflops": max(readings), "readings": readings}
    else:
        for p in peaks:
            peaks[p]["readings"] = [peaks[p]["peak_gflops"]]
    return peaks


def peak_line(peaks: dict, precision: str) -> str:
    p = peaks[precision]
    others = ", ".join(f"{k} {v['peak_gflops']:.0f}" for k, v in peaks.items() if k != precision)
    readings = ", ".join(f"{r:.0f}" for r in p["readings"])
    where = p.get("device", "cpu")
    where = f"{p['threads']} torch threads" if where == "cpu" else f"on the GPU, {where}"
    return (f"Measured matmul peak ({p['n']}x{p['n']} square matmul, best of {PEAK_REPEATS}, {where}; the highest of the readings {readings}, taken before and after the runs): "
            f"**{precision} {p['peak_gflops']:.0f} GFLOP/s**; {others} GFLOP/s. MFU is against the {precision} figure.")


def counts_line(counts: dict) -> str:
    return (f"Model: N = {counts['n'] / 1e6:.1f}M parameters besides the embeddings ({counts['total'] / 1e6:.1f}M "
            f"in all), L = {counts['layers']}, d = {counts['hidden']}, V = {counts['vocab']}.")


def gflops(flops_per_s: float) -> str:
    """FLOP/s as GFLOP/s for a table: whole numbers from 10 on, two significant digits below."""
    g = flops_per_s / 1e9
    return f"{g:.0f}" if g >= 10 else f"{g:.2g}"


def mfu(flops_per_s: float | None, peaks: dict, precision: str) -> float | None:
    return flops_per_s / (1e9 * peaks[precision]["peak_gflops"]) if flops_per_s else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model_size", choices=SIZES, default=None, help="also build this size and print its counts")
    args = p.parse_args(argv)
    from rlhf_core.infra.precision import describe_hardware, resolve_here

    precision = resolve_here("auto").value
    peaks = measured_peaks(args.threads)
    print(f"{describe_hardware()}; auto trains in {precision}")
    print(peak_line(peaks, precision))
    if args.model_size:
        import tempfile

        from rlhf_core.stages.prep import prepare

        with tempfile.TemporaryDirectory() as tmp:
            paths = prepare(Path(tmp), task="sort", seed=0, model_size=args.model_size, n_train=64, n_test=8)
            counts = model_counts(paths["base"])
        print(counts_line(counts))
        print(json.dumps(counts))


if __name__ == "__main__":
    main()
