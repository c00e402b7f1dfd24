#!/usr/bin/env bash
# Run the GPU tests in N parallel pytest processes on one GPU (developer tool: the kernels' JIT
# compiles are CPU-bound, so shards overlap them). Usage: scripts/gpu_tests.sh N LOGDIR [pytest args]
set -uo pipefail
n=$1 logdir=$2
shift 2
rm -rf "$logdir" && mkdir -p "$logdir"
# One compile cache for all shards (a variant compiled by one is loaded by the others).
export CUTE_FLASH_CACHE=1 CUTE_FLASH_CACHE_DIR="${CUTE_FLASH_CACHE_DIR:-$logdir/compile_cache}"
python -m pytest -q -m gpu --collect-only "$@" 2>/dev/null | grep "::" > "$logdir/ids.txt"
split -n "r/$n" -d "$logdir/ids.txt" "$logdir/shard_"
pids=()
for f in "$logdir"/shard_??; do
  mapfile -t ids < "$f"  # one test id per line (ids may contain spaces)
  [ ${#ids[@]} -eq 0 ] && continue  # (an empty shard would run the whole suite)
  python -m pytest -q -m gpu --tb=short -p no:cacheprovider "${ids[@]}" > "$f.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "collected $(wc -l < "$logdir/ids.txt")"
for f in "$logdir"/shard_*.log; do tail -n 1 "$f"; grep -E "^(FAILED|ERROR) " "$f"; done
exit $rc
