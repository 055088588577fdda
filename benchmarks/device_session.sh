#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks, highest priority first, each started only
# while time is left (DEADLINE_S, default 540 s: under the device tool's 600 s per call).
#
#   MOEFLOW_COMMIT=<commit> bash benchmarks/device_session.sh   # on the GPU machine
# Give the commit as a literal from your checkout: the device tool copies the working tree, and a
# `git rev-parse` evaluated on the GPU machine read stale metadata there (bcedbe1 all of one session).
#
#   0. with NEW_TESTS=<pytest -k expression>: those tests of tests/gpu/test_gpu_triton.py first (step gpu_tests_new:
#      the changes no GPU has run yet), GPU 0
#   1. pytest -m gpu: the single-GPU suites (triton, one-launch layer, layer graph, runners, transformers, the
#      command line, the Gluon fp8-block gate_up whose 64- and 128-row tiles the H200 tables use), GPU 0; then
#      the Gluon down and warp-specialized kernels' suites (step gpu_tests_gluon; the warp-specialized file
#      took about 4 minutes, in parts, on 2026-12-03: run it in its own call with ONLY=gpu_tests_gluon), GPU 0
#      then the eager-graph and torch.compile files (step gpu_tests_graphs), GPU 0
#   2. with 2 GPUs: pytest -m gpu tests/gpu/test_gpu_ep.py, then benchmarks/bench_ep.py --profile
#   3. benchmarks/bench_layer.py: PERF.md's 36 rows, triton runner, GPU 0
#   4. the T=1 and 16 rows again with MOEFLOW_TRITON_PDL=0 (programmatic dependent launch off), GPU 0
#   5. benchmarks/experiments/sort_variants.py, GPU 0
#   6. moeflow bench per preset for fp8-tensor and fp8-channel (their tables, b2d9282, not yet run through the
#      layer but for Qwen3 fp8-channel), triton and the reference, GPU 0
#   7. benchmarks/experiments/mid_gate_up.py: the fp8-block gate_up candidates at 8 < rows per expert <= 96 and the
#      Gluon kernel at 64 rows, GPU 0
#   8. fp8-tensor and fp8-channel tables (b2d9282: T = 1, 16, 128, 1024, 4096, 16384) tuned at T = 256, 512, 2048
#      and 8192 too (moeflow tune --merge into $R/tuned), GPU 0
#   9. the decode rows (T=1, 16) of the six shipped tables re-tuned into $R/tuned (moeflow tune --merge
#      over copies of them: the candidates include split-K forms of both GEMMs), GPU 0; copy the files
#      back into moeflow/kernels/configs/ only after comparing the layer rows
#  10. prepared without a GPU on 2026-12-05: ws_bounds.py at five tile orders (Qwen3 bf16 T=4096, the loads alone
#      against the full GEMMs; not yet run), graph_vs_eager.py (why the graph replay times GPU-bound rows slower than
#      eager calls) and zero_padding.py (zero rows instead of the next expert's as the tiles' padding); the last two
#      ran on an H200 on 2026-12-05 (gpu_session_2026-12-05_h200_3d1f7f3.md), ws_bounds_order on an H100 the same day
#      (gpu_session_2026-12-05_h100_76b441b.md), GPU 0; about a call each:
#      ONLY=ws_bounds_order (likewise graph_vs_eager, zero_padding)
#  11. x_tma_repeat.py: the gate_up's x_tma and pointer-load forms compared over 200 rounds of varied GPU memory
#      garbage (run on an H100 at 617a4ac: no mismatch; the test's one failure was its reference running out of
#      memory, gpu_session_2026-12-05_h100_617a4ac.md): ONLY=x_tma_repeat
#  12. (removed) the warp-specialized loader's L2 prefetch: measured on an H100 on 2026-12-05 (6a059c6), 1.3-2x
#      slower, and removed (ws_prefetch_2026-12-05_h100_6a059c6.md)
#  13. eager calls past MOEFLOW_EAGER_GRAPHS padded to a power-of-two bucket and replayed (MOEFLOW_EAGER_BUCKETS;
#      first run on an H100 on 2026-12-05, eager_buckets_2026-12-05_h100_6a059c6.md): the GPU tests of the bucketed calls,
#      then eager_buckets.py (host and eager µs a call launched against bucketed, T = 24-4096, and the memory four
#      layers' bucket graphs hold): ONLY=eager_buckets
#  14. the kernels a bucketed call adds over the launched one (bucket_kernels.py: Qwen3 bf16 and fp8-block, T = 512
#      and 4096, with the old row gather for comparison; first run on an H100 on 2026-12-06,
#      gpu_session_2026-12-06_h100_7f4a2c2.md); the bucketed GPU tests first: ONLY=bucket_kernels
# ONLY=<regex> runs only the steps whose names match (gpu_tests alone took 394 s on 2026-12-01, so a second call
# can skip it: ONLY='layer_bench$|moeflow_bench'). On 2026-12-03 a fresh machine ran 123 of the single-GPU suites'
# tests in 420 s (compiling as it went), so they are three steps now: gpu_tests_triton (test_gpu_triton.py),
# gpu_tests_layers (the other files of step 1) and gpu_tests_gluon; one call may not reach all three.
# On 2026-12-04 a fresh machine with no carried cache ran 125 of test_gpu_triton.py's 128 tests in its 450 s; with
# the cache carried, the next calls ran gpu_tests_layers' 162 in 170 s and gpu_tests_gluon's 598 in 296 s.
# pytest runs with -v (a -q log's dots did not name the test that failed: a cut gpu_tests_triton run at bb6f075 left
# one F; counted, test_tune_searches_one_launch_tiles), and a step's time limit interrupts it (SIGINT) so that a cut
# run still prints its failures' tracebacks.
# Everything lands in one folder, packed as $OUT/results.tgz (the device tool returns at most 8
# files, and none whose name holds '=' or ','), with summary.txt beside it and printed last.
# Compiled kernels travel between calls (benchmarks/triton_cache.sh): the call restores .triton-cache/ if it was
# carried, and leaves $OUT/triton-cache.tgz.part* to copy there for the next call's carry [".triton-cache"].
set -u
OUT=${OUT:-./gpu-results}
R=$(mktemp -d)
DEADLINE_S=${DEADLINE_S:-540}
export PYTHONPATH=${PYTHONPATH:-$PWD} MOEFLOW_DIST_TIMEOUT_S=${MOEFLOW_DIST_TIMEOUT_S:-60}
export MOEFLOW_COMMIT=${MOEFLOW_COMMIT:-unknown}
source benchmarks/triton_cache.sh restore
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$OUT"
S="$R/summary.txt"
echo "commit $MOEFLOW_COMMIT, $(date -u +%FT%TZ), $GPUS GPU(s): $(nvidia-smi -L | head -1)" > "$S"

step() {  # step NAME SECONDS COMMAND...: run if time is left, bounded by SECONDS; log to $R/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then
        return
    fi
    if [ $((SECONDS + 20)) -ge "$DEADLINE_S" ]; then
        echo "$name: skipped (no time left)" >> "$S"
        return
    fi
    [ $((SECONDS + limit)) -gt "$DEADLINE_S" ] && limit=$((DEADLINE_S - SECONDS))
    # SIGINT first: a pytest run cut by its limit then prints the failures so far, with their tracebacks (a TERM
    # printed nothing: the H100 run of 2026-12-05 left one FAILED line and no message); KILL 10 s later
    timeout -s INT -k 10 "$((limit > 20 ? limit - 10 : limit))" "$@" > "$R/$name.log" 2>&1
    echo "$name: exit $? at ${SECONDS}s: $(tail -n 1 "$R/$name.log")" >> "$S"
}

# first, the tests of changes no GPU has run yet (NEW_TESTS); they run again inside gpu_tests_triton
if [ -n "${NEW_TESTS:-}" ]; then
    step gpu_tests_new 120 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_triton.py \
        -k "$NEW_TESTS"
fi
step gpu_tests_triton 450 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_triton.py
step gpu_tests_layers 300 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_fused_layer.py \
    tests/gpu/test_gpu_layer_graph.py tests/gpu/test_gpu_runners.py \
    tests/gpu/test_gpu_hf.py tests/gpu/test_gpu_cli.py tests/gpu/test_gpu_gate_up_wgmma.py
step gpu_tests_gluon 420 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_down_wgmma.py \
    tests/gpu/test_gpu_warp_specialized.py
step gpu_tests_graphs 240 env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_eager_graphs.py \
    tests/gpu/test_gpu_compile.py
if [ "$GPUS" -ge 2 ]; then
    step ep_tests 120 python -m pytest -v -m gpu tests/gpu/test_gpu_ep.py
    step ep_bench 120 torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py --profile --skip layer \
        --out "$R/ep_bench.json"
    grep -E "^(alltoall|lowlatency)" "$R/ep_bench.log" | cut -c1-300 >> "$S"
fi
step layer_bench 150 env CUDA_VISIBLE_DEVICES=0 python benchmarks/bench_layer.py \
    --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --schemes none,fp8-block --runners triton --out "$R/layer"
grep -A3 "^targets, " "$R/layer_bench.log" 2>/dev/null | cut -c1-400 >> "$S"
step layer_bench_nopdl 60 env CUDA_VISIBLE_DEVICES=0 MOEFLOW_TRITON_PDL=0 python benchmarks/bench_layer.py \
    --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --schemes none,fp8-block --runners triton --tokens 1,16 \
    --out "$R/layer_nopdl"
step sort_variants 60 env CUDA_VISIBLE_DEVICES=0 python benchmarks/experiments/sort_variants.py "$R/sort_variants.json"
for preset in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    step "moeflow_bench_${preset}" 120 env CUDA_VISIBLE_DEVICES=0 python -m moeflow bench --preset "$preset" \
        --quant fp8-tensor,fp8-channel --runners triton --json "$R/moeflow_bench_${preset}.json" \
        --png "$R/moeflow_bench_${preset}.png"
done
mkdir -p "$R/tuned" && cp moeflow/kernels/configs/*.json "$R/tuned/"
for preset in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    for quant in none fp8-block; do
        step "tune_decode_${preset}_${quant}" 90 env CUDA_VISIBLE_DEVICES=0 python -m moeflow tune --preset "$preset" \
            --quant "$quant" --tokens 1,16 --rep-ms 20 --merge --out "$R/tuned"
    done
done
step mid_gate_up 150 env CUDA_VISIBLE_DEVICES=0 python benchmarks/experiments/mid_gate_up.py "$R/mid_gate_up.json"
for preset in qwen3-30b-a3b mixtral-8x7b deepseek-v3; do
    for quant in fp8-tensor fp8-channel; do
        step "tune_more_${preset}_${quant}" 90 env CUDA_VISIBLE_DEVICES=0 python -m moeflow tune --preset "$preset" \
            --quant "$quant" --tokens 256,512,2048,8192 --merge --out "$R/tuned"
    done
done
# prepared 2026-12-05 without a GPU (docs/performance.md, "Prepared on 2026-12-05"); last, so a default session
# reaches them only with time to spare: ONLY=zero_padding (or graph_vs_eager, ws_bounds_order) runs one alone
for gemm in gate_up down; do
    step "ws_bounds_order_${gemm}" 120 env CUDA_VISIBLE_DEVICES=0 GEMM=$gemm SCHEME=none FORMS=full,loads \
        GROUP_MS=1,2,4,8,16 python benchmarks/experiments/ws_bounds.py "$R/ws_bounds_order_${gemm}.json" \
        qwen3-30b-a3b:4096
    tail -n 6 "$R/ws_bounds_order_${gemm}.log" >> "$S" 2>/dev/null
done
step graph_vs_eager 400 env CUDA_VISIBLE_DEVICES=0 OUT="$R/graph_vs_eager" python \
    benchmarks/experiments/graph_vs_eager.py
tail -n 10 "$R/graph_vs_eager.log" >> "$S" 2>/dev/null
step zero_padding 400 env CUDA_VISIBLE_DEVICES=0 OUT="$R/zero_padding" python benchmarks/experiments/zero_padding.py
tail -n 10 "$R/zero_padding.log" >> "$S" 2>/dev/null
# the H100 run of 2026-12-05 failed test_gate_up_rows_through_tma_on_gpu[4-fp8-channel-deepseek-v3-300] once in a full
# test_gpu_triton.py run, then passed alone about 25 times: its two forms, repeated over varied memory garbage
step x_tma_repeat 240 env CUDA_VISIBLE_DEVICES=0 python benchmarks/experiments/x_tma_repeat.py "$R/x_tma_repeat"
tail -n 4 "$R/x_tma_repeat.log" >> "$S" 2>/dev/null
# 13: do bucketed graphs take eager prefill calls off the host's launch path (MOEFLOW_EAGER_BUCKETS)?
# the bucketed calls' GPU tests, run first by steps 13 and 14
BUCKETED_TESTS=(env CUDA_VISIBLE_DEVICES=0 python -m pytest -v -m gpu tests/gpu/test_gpu_eager_graphs.py -k bucketed)
step eager_buckets_tests 240 "${BUCKETED_TESTS[@]}"
step eager_buckets 300 env CUDA_VISIBLE_DEVICES=0 python benchmarks/experiments/eager_buckets.py "$R/eager_buckets"
tail -n 50 "$R/eager_buckets.log" >> "$S" 2>/dev/null
# 14: what a bucketed call adds on the GPU, kernel by kernel
step bucket_kernels_tests 240 "${BUCKETED_TESTS[@]}"
step bucket_kernels 300 env CUDA_VISIBLE_DEVICES=0 CASES=qwen3-30b-a3b:none,qwen3-30b-a3b:fp8-block TOKENS=512,4096 \
    python benchmarks/experiments/bucket_kernels.py "$R/bucket_kernels"
tail -n 60 "$R/bucket_kernels.log" >> "$S" 2>/dev/null
grep -hE "FAILED|Error" "$R"/*tests*.log 2>/dev/null | head -20 >> "$S"
tar czf "$OUT/results.tgz" -C "$R" .
bash benchmarks/triton_cache.sh save "$OUT" 2>> "$S"
cp "$S" "$OUT/summary.txt"
cat "$S"
