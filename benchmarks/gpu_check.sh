#!/bin/bash
# The checks to run when a GPU machine is lent (one short call): every `gpu` test, then GRPO and
# SFT/DPO against TRL on a random-init Qwen2.5-0.5B-shaped model (`rlhf prep --model_family qwen2
# --model_size 500m`), side by side on the same GPU; `profile` runs our GRPO side once under cProfile
# (ours.prof in $OUT, for pstats). Each phase has its own time limit, so a phase that fails or hangs
# leaves the next its time; logs and raw results go to $OUT (default /tmp/gpu_check).
#
# Packages the machine's image lacks travel as wheels in .whl (benchmarks/README.md, "On a lent
# GPU"); where .whl is absent the environment is used as it is.
#
#   bash benchmarks/gpu_check.sh   # PHASES="pytest grpo sftdpo" (also: profile); limits PYTEST_S=150
#                                  # GRPO_S=250 SFT_S=180 PROFILE_S=150; SIZE=500m
set -u
OUT=${OUT:-/tmp/gpu_check}
SIZE=${SIZE:-500m}
PHASES=${PHASES:-pytest grpo sftdpo}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
phase() { echo "=== $(date +%T) $*"; }
wanted() { [[ " $PHASES " == *" $1 "* ]]; }

if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RLHF_HOME=${RLHF_HOME:-/tmp/rlhf_home} TOKENIZERS_PARALLELISM=false

phase environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, deepspeed, trl; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| deepspeed', deepspeed.__version__, '| trl', trl.__version__, '|', torch.cuda.get_device_name(),
'| bf16', torch.cuda.is_bf16_supported())" 2>&1 | tail -3

if wanted pytest; then
  phase "pytest -m gpu"
  timeout "${PYTEST_S:-150}" python3 -m pytest tests/gpu -m gpu -p no:cacheprovider -q -rs 2>&1 | tee "$OUT/pytest.log" | tail -25
fi

grpo=(--model_size "$SIZE" --model_family qwen2 --threads 8)
if wanted grpo; then
  phase "GRPO vs TRL, qwen2 $SIZE"
  timeout "${GRPO_S:-250}" python3 benchmarks/bench_grpo_vs_trl.py "${grpo[@]}" --steps 3 --warmup 2 --repeats 2 \
    --timeout 200 --json_out "$OUT/grpo.json" > "$OUT/grpo.log" 2>&1
  code=$?; echo "exit $code"; tail -25 "$OUT/grpo.log"
  [ "$code" = 124 ] && [ -f "$OUT/grpo.json" ] && python3 benchmarks/bench_grpo_vs_trl.py --report "$OUT/grpo.json" | tail -12
fi

if wanted sftdpo; then
  phase "SFT and DPO vs TRL, qwen2 $SIZE"
  timeout "${SFT_S:-180}" python3 benchmarks/bench_vs_trl.py --model_size "$SIZE" --model_family qwen2 --stages sft,dpo \
    --variants ours,trl --steps 10 --warmup 3 --repeats 1 --threads 8 --timeout 100 --json_out "$OUT/sft_dpo.json" \
    > "$OUT/sft_dpo.log" 2>&1
  code=$?; echo "exit $code"; tail -25 "$OUT/sft_dpo.log"
  [ "$code" = 124 ] && [ -f "$OUT/sft_dpo.json" ] && python3 benchmarks/bench_vs_trl.py --report "$OUT/sft_dpo.json" | tail -12
fi

if wanted profile; then
  phase "profile: our GRPO side under cProfile, qwen2 $SIZE"
  work=/tmp/gpu_check_grpo
  (
    timeout "${PROFILE_S:-150}" python3 benchmarks/bench_grpo_vs_trl.py "${grpo[@]}" --repeats 0 --work_dir "$work" \
      > "$OUT/profile_prep.log" 2>&1 || { tail -20 "$OUT/profile_prep.log"; exit 1; }
    cd "$work/snapshot" && timeout "${PROFILE_S:-150}" python3 -m cProfile -o "$OUT/ours.prof" bench_grpo_vs_trl.py \
      --side ours --policy "$work/rl-$SIZE/sft" --prompts_dir "$work/rl-$SIZE/data/prompts" --out_dir "$work/prof" \
      --precision bf16 --steps 3 --warmup 2 --threads 8 > "$OUT/profile.log" 2>&1
    echo "exit $?"; tail -3 "$OUT/profile.log"
    python3 -c "import pstats; pstats.Stats('$OUT/ours.prof').sort_stats('tottime').print_stats(25)" | tail -40
  )
fi
phase done
