#!/usr/bin/env bash
# compute-sanitizer over one small problem per kernel family (scripts/sanitize/sanitize.py): memcheck,
# racecheck and synccheck, every (tool, family) in its own process, several at once (the JIT
# compiles are CPU-bound). One device call; run after `source .devsite/device-site.sh`.
#
#   scripts/sanitize/sanitize.sh [FAMILY ...]          (default: every family)
#   TOOLS="racecheck" JOBS=8 scripts/sanitize/sanitize.sh sm90-d128
#   SANITIZE_ARGS="--override prefetch_stats=0" scripts/sanitize/sanitize.sh sm90-d128
#
# Writes $OUT/sanitize_summary.txt (one line per tool and family) and $OUT/sanitize_logs.tar.gz.
# memcheck runs without PyTorch's caching allocator, so a read past a tensor is past its
# allocation; API errors are not reported (PyTorch probes the driver with calls that fail).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
logs=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export CUTE_DSL_LINEINFO=1  # file:line in the sanitizer's reports
families=("$@")
[ ${#families[@]} -eq 0 ] && mapfile -t families < <(python scripts/sanitize/sanitize.py --list)
read -r -a tools <<< "${TOOLS:-memcheck racecheck synccheck}"

one() {  # one TOOL FAMILY: run it, leave the log in $logs/TOOL.FAMILY.log
  local tool=$1 fam=$2 extra=()
  case $tool in
    memcheck) extra=(--report-api-errors no); export PYTORCH_NO_CUDA_MEMORY_CACHING=1 ;;
    racecheck) extra=(--racecheck-report analysis) ;;
  esac
  # shellcheck disable=SC2086  # SANITIZE_ARGS is a list of flags
  compute-sanitizer --tool "$tool" "${extra[@]}" --print-limit 40 \
    python scripts/sanitize/sanitize.py --family "$fam" ${SANITIZE_ARGS:-} > "$logs/$tool.$fam.log" 2>&1
  echo "rc=$?" >> "$logs/$tool.$fam.log"
}
export -f one
export logs SANITIZE_ARGS

for t in "${tools[@]}"; do for f in "${families[@]}"; do echo "$t $f"; done; done \
  | xargs -P "${JOBS:-12}" -L 1 bash -c 'one "$0" "$1"'

# racecheck's own blind spot, measured beside the kernels (scripts/sanitize/racecheck_probe.py): a correct
# async-copy hand-off (bulk, tma) and a correct thread hand-off through an mbarrier (sts).
probes=""
if [[ " ${tools[*]} " == *" racecheck "* ]]; then
  for m in bulk tma sts; do
    compute-sanitizer --tool racecheck python scripts/sanitize/racecheck_probe.py "$m" > "$logs/probe.$m.log" 2>&1
    probes+="$(printf '%-10s %-26s %s' racecheck "probe-$m" "$(grep -hoE 'RACECHECK SUMMARY: .*' "$logs/probe.$m.log") $(grep -ho 'probe .*' "$logs/probe.$m.log")")"$'\n'
  done
fi

# A racecheck report is "known" when its write is the sm90 backward producer's LSE2 / D bulk copy
# (hopper/bwd_load.py): the WAR over a Q / dO stage that the consumers hand back through the
# stage's EMPTY mbarrier, an edge racecheck does not model (docs/design.md). Anything else is
# listed as unexplained.
{
  printf '%-10s %-26s %-44s %s\n' tool family sanitizer checks
  for t in "${tools[@]}"; do
    for f in "${families[@]}"; do
      log=$logs/$t.$f.log
      verdict=$(grep -hoE '(ERROR|RACECHECK) SUMMARY: .*' "$log" | tail -n 1)
      checks=$(grep -cE "^\[$f\] .*: ok" "$log")
      extra=""
      if [ "$t" = racecheck ]; then
        races=$(grep -c 'Race reported between' "$log")
        known=$(grep 'Race reported between' "$log" | grep -c 'in bwd_load.py:')
        [ "$races" -gt 0 ] && extra=" [$known of $races known, $((races - known)) unexplained]"
      fi
      printf '%-10s %-26s %-44s %s/2 ok %s%s\n' "$t" "$f" "${verdict:-no summary}" "$checks" "$(tail -n 1 "$log")" "$extra"
    done
  done
  printf '%s' "$probes"
} | tee "$OUT/sanitize_summary.txt"
tar czf "$OUT/sanitize_logs.tar.gz" -C "$logs" .
