#!/usr/bin/env bash
# The trainer's GPU checks and measurements (tree packing, exact savings), in one command on one GPU (H200):
#
#     bash tools/gpu_trainer_checks.sh            # logs under $OUT (default runs/gpu_trainer_checks)
#
# Needs the model in place (`model.path=smollm2-135m-instruct` resolving offline). Steps, each
# under its own `timeout` and all under one deadline (GPU_CHECKS_BUDGET_S, default 340 s, so the
# whole command stays under 6 minutes; a step that would pass the deadline is cut short and
# marked TIMEOUT):
#   1. pytest -m gpu tests/test_packing_gpu.py tests/test_engine_gpu.py tests/test_trainer_step.py
#   2. tools/bench_tree_attention.py, SmolLM2-135M heads (9/3/64), then Qwen3-0.6B heads (16/8/128)
#   3. tools/bench_trainer.py --shape gpu --device cuda --dtype bfloat16 --steps 3 --breakdown
#      --tree-attention varlen,flex (the savings with the varlen tree path, and on:flex with FlexAttention)
# Each step's output is teed to $OUT/<step>.log; a summary (exit status, seconds, the result
# lines) is printed at the end and written to $OUT/summary.txt. Exit status 1 if any step failed.
#
# Expected duration on one H200 (the trainer does ~90k tok/s there unshared): the GPU shape is
# ~360k sequence tokens a step, ~4 s unshared; 3 steps x 5 variants of bench_trainer, the
# FlexAttention compile of its first shared step and the model load ~2 minutes; each attention
# benchmark ~30-60 s (mostly FlexAttention's compile); the pytest run ~1-2 minutes.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu_trainer_checks}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
BUDGET="${GPU_CHECKS_BUDGET_S:-340}"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0

# run NAME CAP_S CMD...: CMD under `timeout min(CAP_S, seconds to the deadline)`, teed to $OUT/NAME.log
run() {
  local name="$1" cap="$2"
  shift 2
  local now left limit rc t0 t1 status
  now=$(date +%s)
  left=$((DEADLINE - now))
  limit=$(( cap < left ? cap : left ))
  if [ "$left" -le 5 ]; then
    echo "== $name: SKIPPED (deadline of ${BUDGET} s reached)" | tee -a "$SUMMARY"
    FAILED=1
    return
  fi
  echo "== $name (timeout ${limit} s): $*" | tee "$OUT/$name.log"
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s)
  case "$rc" in
    0) status=ok ;;
    124|137) status=TIMEOUT ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || FAILED=1
  echo "== $name: $status in $((t1 - t0)) s (log $OUT/$name.log)" | tee -a "$SUMMARY"
}

"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.log"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: these checks are for the GPU")
EOF
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  echo "no CUDA device; nothing run" | tee -a "$SUMMARY"
  exit 1
fi

run pytest_gpu 150 "$PY" -m pytest -m gpu tests/test_packing_gpu.py tests/test_engine_gpu.py \
  tests/test_trainer_step.py -q -rs -s -p no:cacheprovider
run tree_attention_smollm2 75 "$PY" tools/bench_tree_attention.py --heads 9,3,64 --warmup 2 --iters 5
run tree_attention_qwen3 75 "$PY" tools/bench_tree_attention.py --heads 16,8,128 --warmup 2 --iters 5
run bench_trainer 150 "$PY" tools/bench_trainer.py --shape gpu --device cuda --dtype bfloat16 --steps 3 --breakdown \
  --tree-attention varlen,flex

{
  echo
  echo "== results"
  echo "-- pytest: $(grep -E '(passed|failed|error)' "$OUT/pytest_gpu.log" 2>/dev/null | tail -1)"
  grep -E "^(float32|torch\.|bfloat16)" "$OUT/pytest_gpu.log" 2>/dev/null | sed 's/^/   /'
  for h in smollm2 qwen3; do
    echo "-- tree attention, $h heads:"
    grep -E "^(batch:|heads |variant|-{10}|a |b |c |d |b: |Δ against|peak GPU|FAILED)" \
      "$OUT/tree_attention_$h.log" 2>/dev/null | sed 's/^/   /'
  done
  echo "-- bench_trainer (GPU shape, bf16):"
  grep -E "^(step |median|peak)" "$OUT/bench_trainer.log" 2>/dev/null | sed 's/^/   /'
  echo "total $(( $(date +%s) - START )) s of a ${BUDGET} s budget; $( [ "$FAILED" -eq 0 ] && echo 'all steps ok' || echo 'SOME STEPS FAILED')"
} | tee -a "$SUMMARY"
exit "$FAILED"
