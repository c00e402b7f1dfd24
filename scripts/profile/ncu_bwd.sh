#!/usr/bin/env bash
# Nsight Compute on the backward main kernel, ours beside flash-attn-4's (developer tool, device
# call; Firecracker machines read the counters). Args: d N causal [overrides for ours, "k=v,k=v"].
# Reports + text under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
d=${1:-64}; n=${2:-2048}; c=${3:-1}; ov=${4:-}
for who in ${NCU_WHO:-ours fa4}; do
  timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:'FlashBwdSm90(Wide|Fp8)?_object|FlashAttentionBackwardSm90' \
    --launch-skip 2 --launch-count 1 --set full -f -o "$OUT/${who}_d${d}" \
    python scripts/profile/ncu_bwd.py "$who" "$d" "$n" "$c" $ov > "/tmp/${who}_d${d}_run.log" 2>&1
  echo "== ncu $who rc=$?"; tail -3 "/tmp/${who}_d${d}_run.log"
  ncu --import "$OUT/${who}_d${d}.ncu-rep" --page details > "$OUT/${who}_d${d}.txt" 2>&1
  # Per-instruction stall samples and raw counters, for reading on a machine without ncu.
  ncu --import "$OUT/${who}_d${d}.ncu-rep" --page source --csv --print-source sass > "$OUT/${who}_d${d}_src.csv" 2>&1
  ncu --import "$OUT/${who}_d${d}.ncu-rep" --page raw --csv > "$OUT/${who}_d${d}_raw.csv" 2>&1
  [ -n "${NCU_KEEP_REP:-}" ] || rm -f "$OUT/${who}_d${d}.ncu-rep"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Shared Memory Configuration Size|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|L2 Hit Rate|Executed Ipc Active|Warp Cycles Per Issued" "$OUT/${who}_d${d}.txt" | head -20
done
