"""Rollout engines on this machine: vLLM's CPU build against the project's transformers engine.

For each model size `rlhf prep` builds (tiny, small, and 100m: a Llama of GPT-2 small's shape),
each engine generates what an RL step of the built-in task asks:
64 chat-formatted `sort` prompts x 4 samples at temperature 1, up to 32 new tokens, in the
trainer's precision (`--dtype`: fp32, or bf16 where the CPU has it natively). Each engine runs in a process of its own, as the RL stage runs it in a
Ray actor (vLLM's CPU worker binds the threads of its process). Printed per size and engine: the
start (load, and for vLLM its engine and KV cache), the first generation (warm-up) and the mean
of the next `--repeats`, as generated tokens per second, and the ratio vLLM / transformers.

    python benchmarks/bench_rollout_engines.py [--sizes tiny,small,100m] [--repeats 3]

It prints figures and asserts nothing. The default engine (`rlhf_core.rollout.auto_backend`) is set
from its results: benchmarks/README.md, "Rollout engines on CPU".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scale import SIZES

PROMPTS, SAMPLES, MAX_NEW, TEMPERATURE = 64, 4, 32, 1.0


def build_models(root: Path, sizes: list[str]) -> tuple[dict[str, str], str]:
    """Model directories by size, and the prompts file."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.models.tiny import build_tiny_llama
    from rlhf_core.stages.prep import prepare

    paths = prepare(root / "prep", task="sort", seed=0, model_size="tiny", n_train=256, n_test=PROMPTS)
    tok = load_tokenizer(paths["base"])
    models = {"tiny": str(paths["base"])}
    for size in sizes:
        if size == "tiny":
            continue
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size!r} ({', '.join(SIZES)})")
        model = build_tiny_llama(tok, size, seed=0)
        out = root / size
        model.save_pretrained(out)
        tok.save_pretrained(out)
        models[size] = str(out)
    return models, str(paths["prompts_test"])


def run_engine(engine: str, model: str, prompts_file: str, repeats: int, dtype: str) -> dict:
    """In this process: start the engine, generate 1 + `repeats` times, return the timings."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout import load_prompt_set, prompt_formatter

    tok = load_tokenizer(model)
    prompts = load_prompt_set(prompts_file, "train", max_samples=PROMPTS, chat=True)
    fmt = prompt_formatter(tok, apply_chat_template=True)
    ids = [tok(fmt.prompt_text(p), add_special_tokens=False)["input_ids"] for p in prompts.prompts]
    start = time.perf_counter()
    if engine == "vllm":
        from rlhf_core.rollout.vllm_engine import VLLMEngine

        eng = VLLMEngine(model, seed=0, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
    else:
        import torch

        from rlhf_core.rollout.hf import TransformersEngine

        # as the RL stage samples on CPU: fp32 weights, under bf16 autocast when the trainer is in bf16
        eng = TransformersEngine.from_pretrained(model, dtype=torch.float32,
                                                 autocast_dtype=torch.bfloat16 if dtype == "bf16" else None)
    started = time.perf_counter() - start
    runs = []
    for r in range(1 + repeats):
        t = time.perf_counter()
        groups = eng.generate_ids(ids, SAMPLES, TEMPERATURE, MAX_NEW, seed=r)
        seconds = time.perf_counter() - t
        runs.append({"seconds": seconds, "tokens": sum(len(s.token_ids) for g in groups for s in g)})
    import torch

    return {"start_s": started, "runs": runs, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small,100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--_child", nargs=3, metavar=("ENGINE", "MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        print(json.dumps(run_engine(*args._child, args.repeats, args.dtype)))
        return
    sizes = args.sizes.split(",")
    from rlhf_core.infra.precision import describe_hardware

    print(f"machine: {describe_hardware()}; {PROMPTS} prompts x {SAMPLES} samples, "
          f"up to {MAX_NEW} new tokens, T={TEMPERATURE}, {args.dtype}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        models, prompts_file = build_models(Path(tmp), sizes)
        print(f"{'size':>6} {'engine':>12} {'start s':>8} {'warm-up s':>9} {'tokens/s':>9} {'vs transformers':>16}")
        for size in sizes:
            rates = {}
            for engine in args.engines.split(","):
                done = subprocess.run([sys.executable, __file__, "--repeats", str(args.repeats), "--dtype", args.dtype,
                                       "--_child", engine,
                                       models[size], prompts_file], capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{size:>6} {engine:>12} failed:\n{done.stderr[-2000:]}", flush=True)
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                measured = result["runs"][1:]
                rates[engine] = sum(r["tokens"] for r in measured) / sum(r["seconds"] for r in measured)
                ratio = f"{rates[engine] / rates['transformers']:.2f}x" if "transformers" in rates else ""
                print(f"{size:>6} {engine:>12} {result['start_s']:8.1f} {result['runs'][0]['seconds']:9.2f} "
                      f"{rates[engine]:9.0f} {ratio:>16}", flush=True)


if __name__ == "__main__":
    main()
