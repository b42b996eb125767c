#!/usr/bin/env bash
# Everything that needs a GPU, in one run (step limits add up to 7m40s; one H100/H200-class GPU):
#   1. the Triton kernel tests on CUDA tensors (tests/kernels/triton_cases.py, no interpreter),
#   2. the IKBO kernel benchmarks at full shapes (benchmarks/kernels.py --device cuda),
#   3. the model speed benchmark, if benchmarks/speed.py exists (--device cuda --quick).
#
# Usage: benchmarks/gpu_check.sh [--dry-run] [RESULTS_FILE]     (default gpu_results.txt)
#
# Results (environment, test summary, benchmark tables) go to RESULTS_FILE; the benchmark
# JSON goes next to it (RESULTS_FILE without .txt + _kernels.json / _speed.json). Each step
# has its own timeout and a failing step does not stop the others; the exit status is
# non-zero if any step failed.
#
# --dry-run: the same steps on CPU with tiny shapes, Triton under its interpreter
# (TRITON_INTERPRET=1 ROCS_TRITON_ON_CPU=1), to check the script itself without a GPU.
set -u

DRY_RUN=0
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) OUT="$arg" ;;
  esac
done
OUT="${OUT:-gpu_results.txt}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
STEM="${OUT%.txt}"
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export ROCS_KERNEL_CACHE_DIR="${ROCS_KERNEL_CACHE_DIR:-$(mktemp -d)}"
cd "$ROOT"

if [ "$DRY_RUN" = 1 ]; then
  export TRITON_INTERPRET=1 ROCS_TRITON_ON_CPU=1 ROCS_TRITON_TEST_DEVICE=cpu
  DEVICE=cpu
  KERNEL_ARGS=(--device cpu --tiny)
  SPEED_ARGS=(--device cpu --quick --no-inductor --models dlrm)
else
  export ROCS_TRITON_TEST_DEVICE=cuda
  DEVICE=cuda
  KERNEL_ARGS=(--device cuda)
  SPEED_ARGS=(--device cuda --quick --no-inductor)
fi

FAILED=0
log() { echo "$@" | tee -a "$OUT"; }

step() {  # step NAME TIMEOUT_S CMD...
  local name="$1" limit="$2"; shift 2
  log ""
  log "=== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s) ==="
  log "\$ $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT"
  local rc=${PIPESTATUS[0]}
  log "--- $name: exit $rc after $((SECONDS - start))s"
  [ "$rc" = 0 ] || FAILED=1
}

: > "$OUT"
log "rocs_compiler GPU check ($([ "$DRY_RUN" = 1 ] && echo 'DRY RUN on CPU' || echo 'device cuda'))"
log "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)   git: $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$OUT"
import platform, torch
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed")
if torch.cuda.is_available():
    print(f"gpu: {torch.cuda.get_device_name()}  capability {torch.cuda.get_device_capability()}")
EOF
if [ "$DEVICE" = cuda ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT"
fi

# Index range checks (a device sync per call) only for the tests, not the benchmarks.
step "triton kernel tests ($DEVICE)" 120 \
  env ROCS_DEBUG_CHECKS=1 "$PYTHON" -m pytest -q -o addopts= -p no:cacheprovider -rfEs tests/kernels/triton_cases.py

step "IKBO kernel benchmarks ($DEVICE)" 200 \
  "$PYTHON" benchmarks/kernels.py "${KERNEL_ARGS[@]}" --json "${STEM}_kernels.json"

if [ -f benchmarks/speed.py ]; then
  step "model speed benchmark ($DEVICE)" 140 \
    "$PYTHON" benchmarks/speed.py "${SPEED_ARGS[@]}" --json "${STEM}_speed.json"
else
  log ""
  log "=== model speed benchmark: skipped (benchmarks/speed.py not found) ==="
fi

log ""
log "overall: $([ "$FAILED" = 0 ] && echo OK || echo 'FAILED (see above)')   results: $OUT"
exit "$FAILED"
