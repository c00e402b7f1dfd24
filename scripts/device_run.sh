#!/usr/bin/env bash
# One GPU call: GPU tests, then the benchmark, then `python -m cute_flash` (check + speed vs SDPA).
#
# The caller has already run `source .devsite/device-site.sh` (DSL + peers on PYTHONPATH) in the repo
# root. Everything is written under $OUT (default ./out); a failing part is reported and the next one
# still runs; the benchmark table is printed last because the reply carries only the output's tail.
#
# Usage: scripts/device_run.sh [PART ...]      PART: tests | bench | bench-quick | main | all (default)
#   extra benchmark flags: BENCH_ARGS="--hdim 128 --seqlen 4096" scripts/device_run.sh bench
#   our sm80 forward too:  BENCH_ARGS="--providers ours ours-sm80 sdpa-flash" scripts/device_run.sh bench
#   forward family:        CUTE_FLASH_FWD_KERNEL=sm80 scripts/device_run.sh tests   (default auto)
#   extra pytest flags:    PYTEST_ARGS="-k fwd" scripts/device_run.sh tests
set -uo pipefail  # no -e: one failing part must not stop the others

cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
PY=${PYTHON:-$(command -v python || command -v python3)}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(all)
want() {  # want PART -> true if PART (or all) was asked for
  local p
  for p in "${parts[@]}"; do [ "$p" = "$1" ] || [ "$p" = all ] && return 0; done
  return 1
}
for p in "${parts[@]}"; do
  case "$p" in tests|bench|bench-quick|main|all) ;; *) echo "unknown part: $p" >&2; exit 2 ;; esac
done

declare -A status
t_all=$(date +%s)

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu \
    --format=csv 2>&1 || true
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  $PY -c "import cutlass; print('cutlass-dsl', getattr(cutlass, '__version__', '?'))" 2>&1 | tail -1
  $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  git log -1 --oneline 2>/dev/null || true
} | tee "$OUT/env.txt"

run_part() {  # run_part NAME LOG CMD... : runs CMD, tees to $OUT/LOG, records the exit code
  local name=$1 log=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  echo
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$log"
  rc=${PIPESTATUS[0]}
  status[$name]="rc=$rc $(( $(date +%s) - t0 ))s"
  echo "== $name: ${status[$name]}"
}

if want tests; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of flags
  run_part tests gpu_tests.log $PY -m pytest -q -m gpu -x --tb=short ${PYTEST_ARGS:-} tests
fi

bench_out=""
if want bench || want bench-quick; then
  quick=""
  want bench || quick="--quick"  # 'bench-quick' alone: the small grid; 'bench' or 'all': the full one
  # shellcheck disable=SC2086
  run_part bench bench.log $PY benchmarks/bench.py $quick --out "$OUT" ${BENCH_ARGS:-}
  bench_out="$OUT/bench.log"
fi

if want main; then
  run_part main main.log $PY -m cute_flash
fi

echo
echo "== summary ($(( $(date +%s) - t_all ))s total; logs and bench.json/bench.png in $OUT)"
for k in tests bench main; do
  [ -n "${status[$k]:-}" ] && echo "  $k: ${status[$k]}"
done
if [ -n "${status[tests]:-}" ]; then
  # pytest's own one-line verdict, so a failing test is visible even when the table fills the tail
  grep -E " in [0-9.]+s" "$OUT/gpu_tests.log" | tail -n 1 | sed 's/^/  tests: /'
  grep -E "^(FAILED|ERROR) " "$OUT/gpu_tests.log" | head -n 5 | sed 's/^/  /'
fi
if [ -n "${status[main]:-}" ]; then
  grep -E "^RESULT:" "$OUT/main.log" | sed 's/^/  main: /'
fi
if [ -n "$bench_out" ] && [ -f "$bench_out" ]; then
  echo
  # The table is everything from the TFLOP/s caption to the end of the bench log.
  awk '/^TFLOP\/s, /{p=1} p' "$bench_out"
fi
# Non-zero if any part failed, so the caller can tell at a glance.
for k in "${!status[@]}"; do
  case "${status[$k]}" in rc=0*) ;; *) exit 1 ;; esac
done
exit 0
