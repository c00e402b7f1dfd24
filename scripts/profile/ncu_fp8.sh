#!/usr/bin/env bash
# Nsight Compute on the FP8 forward kernel (developer tool, device call; Firecracker machines read
# the counters). Args: d N causal. Reports + per-instruction csv under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
d=${1:-128}; n=${2:-16384}; c=${3:-0}
tag="fp8_d${d}_n${n}_c${c}"
timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none -k regex:'FlashFwdSm90Fp8' --launch-skip 2 --launch-count 1 \
  --set full --import-source no -f -o "$OUT/$tag" python scripts/profile/ncu_fp8.py "$d" "$n" "$c" > "/tmp/${tag}_run.log" 2>&1
echo "== ncu $tag rc=$?"; tail -3 "/tmp/${tag}_run.log"
ncu --import "$OUT/$tag.ncu-rep" --page details > "$OUT/$tag.txt" 2>&1
ncu --import "$OUT/$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/${tag}_src.csv" 2>&1
ncu --import "$OUT/$tag.ncu-rep" --page raw --csv > "$OUT/${tag}_raw.csv" 2>&1
rm -f "$OUT/$tag.ncu-rep"
grep -E "Duration|SM Frequency|Compute \(SM\) Throughput|Registers Per|Issue Slots Busy|No Eligible|Eligible Warps|Executed Ipc Active|Warp Cycles Per Issued" "$OUT/$tag.txt" | head -20
