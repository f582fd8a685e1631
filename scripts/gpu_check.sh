#!/usr/bin/env bash
# On one CUDA GPU, in under 5 minutes: the `cuda` tests, both benchmarks, and absolute figures.
#   1. nvidia-smi, torch / CUDA / GPU versions (fails at once when torch sees no CUDA device)
#   2. pytest -m cuda tests/integration/test_cuda.py: correction, drift metrics (each memory plan), Fisher
#      estimation and a bf16 Trainer run on CUDA tensors against float64 CPU references (about 30 s)
#   3. scripts/bench_memory.py --device cuda --rounds 5 (135M-shaped bf16 model): bytes per parameter per memory
#      plan, correction vs copy, and its BANDWIDTH line: GB/s of copy and of the dense / bf16-F correction from
#      the bytes each must move per parameter (copy 2 read + 2 written; correction: parameter 2 + theta0 2 +
#      F 4 (2 as bf16) read, parameter 2 written = 10 (8)). The copy's GB/s is the device's attainable bandwidth.
#   4. estimate_fisher on CUDA (135M-shaped bf16 model, 32 sequences of 32 new tokens, batch 16): sequences/s of
#      the batched engine and of the per-sequence loop, and the peak CUDA memory
#   5. scripts/bench_sampling.py --device cuda --rounds 3: on-policy sampling of the embedded SmolLM2-135M (16 prompts x
#      32 new tokens, batch 8) by `model.generate` with the support recorder against the token-by-token sampler it
#      replaced (read from git: in a copy of the tree without .git, generate's tokens/s alone); its RESULT line
#      carries sampling_generate_vs_by_hand (issue 32)
#   6. scripts/bench_fisher.py --models tiny small: the engines side by side. It runs on the CPU (it has no device
#      option): CPU figures of this machine, to set beside the CPU table of docs/reports/performance.md.
#   7. scripts/bench_kfac.py --device cuda --rounds 2 --threads 8: the K-FAC estimate (full rank, and rank 256 with its tails)
#      vs the diagonal one; the K-FAC correction (full rank; rank 256 with tails, and with a zero tail; rank 256 of
#      the factored weights alone) vs an AdamW step; floats per parameter (full; rank 256, factored weights). Its
#      RESULT line carries the kfac_rank256_* keys of issue 30 and its tables are printed in the SUMMARY. The
#      eigendecompositions run on the CPU (float64), hence 8 threads; two K-FAC estimates a round, hence 2 rounds
#      (about 30 s of eigendecompositions per K-FAC estimate expected: 2 minutes or more in all).
#   8. scripts/plan_7b.py: the paper-plan for Qwen2.5-7B, Llama-3-8B and Llama-3-70B on 8 GPUs, FSDP2 and DDP, rank
#      256 with tails beside kfac_rank=None (computed, not measured; seconds); its RESULT lines in the SUMMARY
# Each step is capped (580 s in all, under the 10 minutes of one device call; about 6 minutes expected). Then a
# SUMMARY block with every RESULT line. Optional, with >= 2 GPUs:
# `scripts/gpu_check.sh --multi-gpu` also runs scripts/multi_gpu_check.py under accelerate launch with each
# config of scripts/accelerate/ (see the end).
# Python: $PYTHON, else .venv/bin/python, else python3 (a CUDA build of torch). Exit status: 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
logs="$(mktemp -d)"
failed=()

step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to the terminal and $logs/NAME.log
  local name="$1" limit="$2"
  shift 2
  echo; echo "=== $name"
  if ! timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"; then failed+=("$name"); fi
}

echo "=== versions"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
"$python" - <<'PY' || exit 1
import torch
import transformers

assert torch.cuda.is_available(), "no CUDA device visible to torch: this check is for a CUDA machine"
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0),
      "| bf16", torch.cuda.is_bf16_supported(), "| transformers", transformers.__version__)
PY

step cuda_tests 70 "$python" -m pytest -m cuda -q -rs -p no:cacheprovider tests/integration/test_cuda.py
step bench_memory 120 "$python" scripts/bench_memory.py --device cuda --rounds 5
step cuda_estimate 90 "$python" - <<'PY'
import sys
import time

import torch

sys.path.insert(0, "scripts")
from bench_peft import smollm2_135m_shaped  # noqa: E402

from hf_cfp import estimate_fisher  # noqa: E402

model = smollm2_135m_shaped().to("cuda", torch.bfloat16)
prompts = [[(7 * i + j) % 4000 + 100 for j in range(16)] for i in range(16)]  # 16 token prompts of 16 ids
sequences, new_tokens = 32, 32
batch = torch.tensor(prompts, device="cuda")
for repeat in range(2):  # sampling alone, for the share of the estimate it takes (the second run is timed)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(sequences // 16):
        model.generate(batch, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    torch.cuda.synchronize()
print(f"GENERATE seconds={time.perf_counter() - start:.2f} ({sequences} sequences x {new_tokens} new tokens, batch 16)")
for engine in ("batched", "loop"):
    options = dict(batch_size=16, seed=0, show_progress=False, engine=engine)
    estimate_fisher(model, None, prompts, num_sequences=16, max_new_tokens=8, **options)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    estimate_fisher(model, None, prompts, num_sequences=sequences, max_new_tokens=new_tokens, **options)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"ESTIMATE engine={engine} sequences_per_s={sequences / seconds:.1f} seconds={seconds:.2f} peak_cuda_GiB={peak:.2f}"
          f" (135M-shaped bf16, {sequences} sequences x {new_tokens} new tokens, batch 16, sampling included)")
PY
step bench_sampling 40 "$python" scripts/bench_sampling.py --device cuda --rounds 3
step bench_fisher_cpu 60 env BENCH_THREADS=8 "$python" scripts/bench_fisher.py --models tiny small --batch 16 --max-new-tokens 32 --repeats 2
step bench_kfac 180 "$python" scripts/bench_kfac.py --device cuda --sequences 8 --new-tokens 32 --rounds 2 --threads 8 --no-two-anchors
step plan_7b 20 "$python" scripts/plan_7b.py

echo; echo "=== SUMMARY (logs in $logs)"
grep -h "passed\|failed\|skipped" "$logs/cuda_tests.log" | tail -1
grep -h "^BANDWIDTH\|^RESULT" "$logs/bench_memory.log"
awk '/^BANDWIDTH/ { for (i = 2; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] + 0 }
     if (v["copy"] > 0) printf "correction dense at %.0f%% of copy bandwidth, bf16 F at %.0f%%\n",
       100 * v["correction_dense"] / v["copy"], 100 * v["correction_bf16f"] / v["copy"] }' "$logs/bench_memory.log"
grep -h "^ESTIMATE\|^GENERATE" "$logs/cuda_estimate.log"
grep -h "^RESULT" "$logs/bench_sampling.log" | sed 's/^/bench_sampling (cuda) /'
grep -h "^RESULT" "$logs/bench_fisher_cpu.log" | sed 's/^/bench_fisher (CPU) /'
grep -h "^|" "$logs/bench_kfac.log"
grep -h "^RESULT" "$logs/bench_kfac.log" | sed 's/^/bench_kfac (cuda) /'
grep -h "^RESULT" "$logs/plan_7b.log" | sed 's/^/plan_7b /'

# ---------------------------------------------------------------- optional: >= 2 GPUs
# FSDP and DeepSpeed through accelerate launch, each config's num_processes (2) on one machine. DeepSpeed needs
# `bash scripts/setup.sh dev,deepspeed`. Each runs scripts/multi_gpu_check.py (two 8-step Trainer runs per anchor
# structure, diagonal and K-FAC rank 8 + tails):
#   accelerate launch --config_file scripts/accelerate/ddp.yaml             scripts/multi_gpu_check.py
#   accelerate launch --config_file scripts/accelerate/fsdp1.yaml           scripts/multi_gpu_check.py
#   accelerate launch --config_file scripts/accelerate/fsdp2.yaml           scripts/multi_gpu_check.py
#   accelerate launch --config_file scripts/accelerate/deepspeed_zero2.yaml scripts/multi_gpu_check.py
#   accelerate launch --config_file scripts/accelerate/deepspeed_zero3.yaml scripts/multi_gpu_check.py
if [[ "${1:-}" == "--multi-gpu" ]]; then
  gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
  if ((gpus < 2)); then
    echo "--multi-gpu needs >= 2 GPUs, torch sees $gpus"; failed+=(multi_gpu)
  else
    for config in ddp fsdp1 fsdp2 deepspeed_zero2 deepspeed_zero3; do
      step "multi_gpu_$config" 300 "$python" -m accelerate.commands.launch \
        --config_file "scripts/accelerate/$config.yaml" scripts/multi_gpu_check.py
      grep -h "^MULTI_GPU_CHECK" "$logs/multi_gpu_$config.log" | sed "s/^/$config /"
    done
  fi
fi

if ((${#failed[@]})); then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "gpu_check: all steps passed"
