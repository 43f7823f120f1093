#!/usr/bin/env bash
# The GPU acceptance checklist on one CUDA GPU, in three parts that each fit a 10-minute call.
#
#   bash benchmarks/gpu_checklist.sh tests     # the quick suite on CUDA, then benchmarks/gpu_real.py and gpu_proxies.py
#   bash benchmarks/gpu_checklist.sh train     # Qwen2.5-1.5B's shape: --preset a100 --sampler hf, save, --resume,
#                                              # the export loaded by transformers
#   bash benchmarks/gpu_checklist.sh lora      # the same shape with LoRA rank 32; benchmarks/gpu.py
#   bash benchmarks/gpu_checklist.sh compile   # gpu_profile.py on a spread of lengths: padded and packed, by token
#                                              # budgets of 16k and 64k, eager and compiled layers (MFU, GPU idle share)
#   bash benchmarks/gpu_checklist.sh async     # the train part's shape at --async-steps 0 and 1 (ASYNC_STEPS), 4 steps
#                                              # each: step times, waits, staleness and the sampler/trainer gap
#
# The model is random (built from the shape, no download) with the offline byte-level tokenizer, so every
# completion runs to --max-new-tokens (512 here: about a trained 1.5B model's GSM8K completions, not the
# preset's 1024 limit) and prompts are bytes, 2-3x longer than with Qwen's tokenizer. DATA is GSM8K's train
# file; OUT collects the logs and each run's metrics.jsonl; TRAIN_EXTRA adds flags to the train part's runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checklist}
DATA=${DATA:-../shared/data/gsm8k/train.jsonl}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MINIGDPO_CACHE=${MINIGDPO_CACHE:-/tmp/minigdpo-cache}

summary() {  # per-step phases, peak memory and MFU (989 TFLOP/s: H100 SXM dense bf16) of a run's metrics.jsonl
  python3 - "$1" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
for r in rows:
    t = {k[5:]: round(v, 2) for k, v in r.items() if k.startswith("time/")}
    print(f"step {r['step']}: {t} peak_alloc {r.get('memory/peak_allocated_gib', 0):.1f} GiB "
          f"reserved {r.get('memory/peak_reserved_gib', 0):.1f} GiB update {r['throughput/update_tokens_per_s']:.0f} tok/s "
          f"{r['throughput/update_tflops_per_device']:.1f} TFLOP/s (MFU {100 * r['throughput/update_tflops_per_device'] / 989:.1f}%) "
          f"gen {r['throughput/gen_tokens_per_s']:.0f} tok/s gap {r.get('sampler/logp_gap')} "
          f"staleness {r.get('async/staleness_max', 0)}")
EOF
}

a100_args() {  # the random Qwen2.5-1.5B-shaped model (built once into the cache) and the checklist's train.py flags
  # SHAPE: layers hidden heads kv_heads intermediate vocab (a tiny one dry-runs the parts on a CPU)
  MODEL=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu import model_dir
print(model_dir(*map(int, sys.argv[1:])))" ${SHAPE:-28 1536 12 2 8960 151936})
  # shellcheck disable=SC2206  # TRAIN_EXTRA: more flags, split on spaces (a shorter run: --batch-size 64 ...)
  COMMON=(--preset a100 --sampler hf --model "$MODEL" --data "$DATA" --max-new-tokens 512 --samples-every 0 --final-eval 0
          ${TRAIN_EXTRA:-})
}

case "${1:-}" in
tests)
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
  # pytest-xdist; the whole suite does not finish in a 10-minute call with the rest
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 14 -m "not slow" -rf tests 2>&1 | tee "$OUT/pytest.log" | tail -30
  timeout 150 python3 benchmarks/gpu_real.py --layers 8 2>&1 | tee "$OUT/gpu_real.log" | grep -v Warning | tail -12
  timeout 60 python3 benchmarks/gpu_proxies.py 2>&1 | tee "$OUT/gpu_proxies.log" | tail -14
  ;;
train)
  a100_args
  RUN=$OUT/a100
  timeout 360 python3 train.py "${COMMON[@]}" --max-steps 3 --save-every 2 --output-dir "$RUN" 2>&1 | tail -8
  summary "$RUN"
  cp "$RUN/metrics.jsonl" "$OUT/a100_metrics.jsonl"
  rm -rf "$RUN/checkpoints/step_000003"  # as if killed after step 2's checkpoint: step 3 again, from it
  timeout 180 python3 train.py "${COMMON[@]}" --max-steps 3 --save-every 2 --output-dir "$RUN" --resume 2>&1 | grep -E "resumed|saved|error"
  summary "$RUN" | tail -1
  python3 -c "
import sys, torch; from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype='auto')
print('export loads:', type(m).__name__, m.dtype, sum(p.numel() for p in m.parameters()), 'parameters')" "$RUN/checkpoints/step_000003/hf"
  rm -rf "$RUN"
  ;;
lora)
  a100_args
  timeout 300 python3 train.py "${COMMON[@]}" --lora-rank 32 --lora-alpha 64 --max-steps 2 --save-every 0 --output-dir "$OUT/lora" 2>&1 | tail -3
  summary "$OUT/lora"; cp "$OUT/lora/metrics.jsonl" "$OUT/lora_metrics.jsonl"
  rm -rf "$OUT/lora"
  timeout 120 python3 benchmarks/gpu.py --steps 4 2>&1 | tail -6
  ;;
compile)  # the default measured: padded and packed on a spread of lengths, by token budgets, eager and compiled
  # 128 sequences (16 prompts x 8 completions of 100-1,000 tokens, about 73k real tokens): two 64k micro-batches.
  # COMPILE=true gives the compiled layers a call of their own (on an H200 their first update outlasted a shared one).
  # compile.log keeps dynamo's recompilation lines, with their times (on a CPU the layers' forward compiled twice in
  # one update, with 2 layers as with 4).
  TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout "${COMPILE_TIMEOUT:-560}" python3 benchmarks/gpu_profile.py \
    --lengths 100,1000 --profile packed \
    --profile-seqs 16 --sizes "" --budgets 16384,65536 --sweep-seqs 128 --passes padded,packed \
    --compile "${COMPILE:-false,true}" \
    --reps 1 --json "$OUT/compile.json" 2>&1 \
    | tee "$OUT/compile.log" | grep -v Warning | grep -E "GPU idle|by kind|tokens \(|compiled|eager layers|host waits"
  ;;
async)  # colocated asynchronous rollouts on one GPU: the same run at each K in ASYNC_STEPS, run dirs in /tmp
  a100_args
  for K in ${ASYNC_STEPS:-0 1}; do
    RUN=/tmp/gpu-checklist-async-k$K
    rm -rf "$RUN"
    timeout "${ASYNC_TIMEOUT:-300}" python3 train.py "${COMMON[@]}" --max-steps 4 --save-every 0 --async-steps "$K" \
      --output-dir "$RUN" 2>&1 | grep -E "^(compute|error|minigdpo)|Traceback|Error" | head -5
    echo "--async-steps $K:"
    summary "$RUN"
    cp "$RUN/metrics.jsonl" "$OUT/async_k${K}_metrics.jsonl"
    rm -rf "$RUN"
  done
  ;;
*) echo "usage: bash benchmarks/gpu_checklist.sh tests|train|lora|compile|async" >&2; exit 2 ;;
esac
