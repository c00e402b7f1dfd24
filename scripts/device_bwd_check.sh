#!/usr/bin/env bash
# One device call (developer tool): the FP8 tests alone, the other GPU tests in 8 shards, the
# standard backward grid beside the peers, FP8 tuning and benchmarks. Logs under $OUT
# (at most 8 files come back: keep it that way). Run after `source .devsite/device-site.sh`.
#   scripts/device_bwd_check.sh [fp8tests] [tests] [bwdnew] [bench] [bwdtune] [fp8tune] [fp8]   (default: fp8tests tests bench)
# Session 20: the 80-row tile (d = 128 non-causal) from 2k query rows, its postprocess staged
# through smem; scripts/wave_tail.py showed the partial last wave costs ~nothing (power-bound).
# fp8tests runs the FP8 test files alone (first, so a fault there cannot poison the other shards);
# tests then runs everything else.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(fp8tests tests bench)
for p in "${parts[@]}"; do
  case "$p" in
    fp8tests)
      timeout "${FP8_TESTS_TIMEOUT:-200}" scripts/gpu_tests_sharded.sh 6 /tmp/fp8shards tests/test_quant.py \
        tests/test_fp8_fwd.py tests/test_fp8_api.py > "$OUT/fp8_tests.log" 2>&1
      echo "== fp8tests rc=$?"
      cat /tmp/fp8shards/shard_*.log >> "$OUT/fp8_tests.log" 2>/dev/null
      grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/fp8_tests.log" | cut -c1-300 | head -30 ;;
    tests)
      timeout "${TESTS_TIMEOUT:-300}" scripts/gpu_tests_sharded.sh 8 /tmp/shards tests --ignore=tests/test_quant.py \
        --ignore=tests/test_fp8_fwd.py --ignore=tests/test_fp8_api.py > "$OUT/tests_summary.txt" 2>&1
      echo "== tests rc=$?"
      cat /tmp/shards/shard_*.log > "$OUT/tests_all.log" 2>/dev/null
      cut -c1-200 "$OUT/tests_summary.txt" ;;
    bench)
      timeout "${BENCH_TIMEOUT:-320}" python benchmarks/bench.py --dir bwd --seqlen 2048 4096 8192 16384 --rounds 3 \
        --providers ours ours-det sdpa-flash sdpa-cudnn fa4 fa4-det --out "$OUT" > "$OUT/bench.log" 2>&1
      echo "== bench rc=$?"
      awk '/^TFLOP\/s, /{p=1} p' "$OUT/bench.log" ;;
    bwdtune)
      # Issue 4 (session 18): `mask_always` and the deterministic modes by head dim (measured at
      # every head dim that session; the causal cells report the rotated walk's ValueError and go on).
      # BWD_TUNE_HDIMS picks the head dims (one or two per call fit the 10 minutes).
      timeout "${BWD_TUNE_TIMEOUT:-400}" python scripts/tune_bwd_sm90.py --hdim ${BWD_TUNE_HDIMS:-128} \
        --seqlen ${BWD_TUNE_SEQLENS:-2048 8192} --causal ${BWD_TUNE_CAUSAL:-0 1} \
        --variant ${BWD_TUNE_VARIANTS:-mask_always=1 deterministic=1 deterministic=1,dq_warp=1 deterministic=1,dq_warp=1,rotate_m=1} \
        --peers ${BWD_TUNE_PEERS:-fa4 cudnn fa4-det} \
        > "$OUT/tune_bwd.log" 2>&1
      echo "== bwdtune rc=$?"
      grep -E "^d[0-9]|WRONG|Error" "$OUT/tune_bwd.log" | cut -c1-300 ;;
    bwdnew)
      # The GPU tests of the backward's newest switches alone (BWD_NEW_TESTS: a pytest -k filter).
      timeout "${BWD_NEW_TIMEOUT:-200}" scripts/gpu_tests_sharded.sh 8 /tmp/newshards tests/test_compile_sm90_bwd.py \
        -k "${BWD_NEW_TESTS:-persistent or direct}" > "$OUT/bwd_new.log" 2>&1
      echo "== bwdnew rc=$?"
      cat /tmp/newshards/shard_*.log >> "$OUT/bwd_new.log" 2>/dev/null
      grep -E "passed|failed|^(FAILED|ERROR)" "$OUT/bwd_new.log" | cut -c1-300 | head -20 ;;
    fp8tune)
      # Issue 5, d = 128 (bar 950). Session 8 put P's row sums on the tensor cores with every
      # exponential on the MUFU (the new default). Around it: the old schedule, 224 keys, three
      # K / V stages, the lazy O rescale, 1 in 16 exponentials on the FMA pipe.
      timeout "${FP8_TUNE_TIMEOUT:-280}" python scripts/tune_fp8.py --hdim 128 --seqlen 8192 16384 --causal 0 1 \
        --variant v_perm=1 "v_perm=1,sum_mma=0" "v_perm=1,tile_n=224" "v_perm=1,stages=3" \
        "v_perm=1,lazy_rescale=1" "v_perm=1,exp2_emu=16" > "$OUT/tune_fp8.log" 2>&1
      echo "== fp8tune rc=$?"
      grep -E "^d[0-9]|WRONG|ERROR" "$OUT/tune_fp8.log" ;;
    fp8)
      # Issue 5: accuracy with the kernels, quantize bandwidth, FP8 vs bf16 vs FA4.
      timeout "${FP8_TIMEOUT:-200}" python scripts/bench_fp8.py > "$OUT/fp8.log" 2>&1
      echo "== fp8 rc=$?"
      grep -E "^(accuracy|quantize|attn)|FAILED" "$OUT/fp8.log" ;;
    *) echo "unknown part $p" >&2; exit 2 ;;
  esac
done
