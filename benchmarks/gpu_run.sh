#!/usr/bin/env bash
# GPU checks and benchmarks in one call on a GPU machine, run from the repository root; everything lands under $OUT.
#
#   MOEFLOW_COMMIT=<commit> OUT=/tmp/out bash benchmarks/gpu_run.sh
#
# Give the commit as a literal from your checkout: a copy of the tree on the GPU machine may hold stale git metadata.
# Steps, in this order, each started only while time is left (DEADLINE_S, default 540 s) and cut at its own limit:
#   gpu_tests_triton, gpu_tests_layers, gpu_tests_gluon, gpu_tests_graphs   pytest -v -m gpu over tests/gpu, in groups
#                                                                           (a fresh machine needs several calls)
#   gpu_tests_portable     the portable and weight-only paths (other architectures' rules forced, MOEFLOW_KERNEL_ARCH,
#                          as mma.sync: DISABLE_MMA_V3=1): test_gpu_portable.py, and test_gpu_triton.py as sm_80
#   gpu_tests_invariant    tests/gpu/test_gpu_batch_invariant.py (MoEConfig.batch_invariant: bitwise rows at every T)
#   selftest               `moeflow selftest --json` on this GPU
#   layer_bench_baseline   with BASELINE=<dir>: bench_layer.py with PYTHONPATH=<dir> (an older copy of the package)
#   layer_bench            bench_layer.py: the 36 rows (3 presets x T = 1..16384 x {bf16, fp8-block}), triton runner
#   invariant_bench        the same rows with --batch-invariant; the summary compares the two (compare_runs.py)
#   portable_bench         the same rows with the portable kernels forced: bf16 as sm_80, fp8-block as sm_89
#                          (MOEFLOW_KERNEL_ARCH, DISABLE_MMA_V3=1); weight_only_bench: fp8 weight-only (sm_80), T <= 16
#   anchor_sglang          with .anchors/sglang (benchmarks/fetch_sglang_anchor.sh): SGLang's Triton GEMMs, same rows,
#                          under DISABLE_MMA_V3=1 as portable_bench
#   ep_tests, ep_bench, ep_layer   with 2+ GPUs: the expert-parallel GPU tests, bench_ep.py's transfers, its layer
#   hf                     bench_hf.py: transformers' Qwen3-MoE with its own experts against moeflow's
# Options (environment):
#   ONLY=<regex>      run only the steps whose names match, e.g. ONLY='layer_bench' or ONLY='gpu_tests|ep'
#   BASELINE=<dir>    a second tree (e.g. `git worktree add /tmp/base <commit>`, carried with the call); its
#                     benchmarks/bench_layer.py runs if it has one. The summary then compares the two runs.
#   LAYER_ARGS="..."  bench_layer.py's selection (default: the 36 rows), e.g. "--presets qwen3-30b-a3b --tokens 1,16"
#   DEADLINE_S=540    seconds after which no step starts; a step's limit is cut to the time left
# Output: $OUT/results.tgz (every log and result folder: layer/, layer_baseline/, ep/, hf/), $OUT/summary.txt (one line
# a step, the target lines, failures; printed last) and $OUT/triton-cache.tgz.part* (below): at most 5 files, none
# named with '=' or ',', as the GPU machine returns at most 8 files and no such names. Unpack: tar xzf results.tgz.
# Triton's compile cache travels between calls: a call restores .triton-cache/triton-cache.tgz.part* if the tree
# carries them, and leaves this call's cache as $OUT/triton-cache.tgz.part*. Copy those into .triton-cache/ (ignored
# by git) and carry that folder with the next call: a fresh machine compiles every kernel, which took most of a call.
set -u
OUT=${OUT:-./gpu-results}
DEADLINE_S=${DEADLINE_S:-540}
LAYER_ARGS=${LAYER_ARGS:---presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --schemes none,fp8-block --tokens 1,16,128,1024,4096,16384}
export MOEFLOW_COMMIT=${MOEFLOW_COMMIT:-unknown} MOEFLOW_DIST_TIMEOUT_S=${MOEFLOW_DIST_TIMEOUT_S:-60}
R=$(mktemp -d)
S="$R/summary.txt"
CACHE=/tmp/moeflow-triton-cache  # a fixed path: the cache's group files name their children by absolute path
PART=$((15 * 1024 * 1024))       # three parts at most: 45 MiB of the 64 MiB a call may carry

export TRITON_CACHE_DIR=$CACHE
mkdir -p "$CACHE" "$OUT"
if ls .triton-cache/triton-cache.tgz.part* > /dev/null 2>&1; then
    cat .triton-cache/triton-cache.tgz.part* | tar xzf - -C / && echo "triton cache: restored" >> "$S"
fi
touch "$CACHE/.call-start"  # files newer than this one were compiled by this call
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "commit $MOEFLOW_COMMIT, $(date -u +%FT%TZ), $GPUS GPU(s): $(nvidia-smi -L | head -1)" >> "$S"

step() {  # step NAME LIMIT_S COMMAND...: run it if selected and time is left; output to $R/NAME.log
    local name=$1 limit=$2
    shift 2
    [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]] && return
    if [ $((SECONDS + 20)) -ge "$DEADLINE_S" ]; then
        echo "$name: skipped (no time left)" >> "$S"
        return
    fi
    [ $((SECONDS + limit)) -gt "$DEADLINE_S" ] && limit=$((DEADLINE_S - SECONDS))
    # SIGINT first, so that a pytest run cut by its limit still prints its failures; KILL 10 s later
    timeout -s INT -k 10 "$((limit > 20 ? limit - 10 : limit))" "$@" > "$R/$name.log" 2>&1
    echo "$name: exit $? at ${SECONDS}s: $(tail -n 1 "$R/$name.log" | cut -c1-200)" >> "$S"
}

left() { local t=$((DEADLINE_S - SECONDS - 120)); echo $((t > 30 ? t : 30)); }  # bench_layer's --deadline-s
one_gpu=(env CUDA_VISIBLE_DEVICES=0)
pytest_gpu=("${one_gpu[@]}" PYTHONPATH="$PWD" python -m pytest -v -m gpu)
# pytest-xdist, where installed: the suites are bound by compiling kernels, which runs in parallel workers on one GPU
# (12 for the small-tensor files; the Triton kernels' file holds model-sized weights: 14 workers ran an H100 out of
# memory, 3 passed)
xdist() { python -c "import xdist" 2> /dev/null && echo "-n $1"; }
# shellcheck disable=SC2046  # xdist's output is two words or none
step gpu_tests_triton 450 "${pytest_gpu[@]}" $(xdist 3) tests/gpu/test_gpu_triton.py
pytest_base=("${pytest_gpu[@]}")
pytest_gpu+=($(xdist "${PYTEST_WORKERS:-12}"))
step gpu_tests_layers 300 "${pytest_gpu[@]}" tests/gpu/test_gpu_fused_layer.py tests/gpu/test_gpu_layer_graph.py \
    tests/gpu/test_gpu_runners.py tests/gpu/test_gpu_hf.py tests/gpu/test_gpu_cli.py tests/gpu/test_gpu_gate_up_wgmma.py
step gpu_tests_gluon 420 "${pytest_gpu[@]}" tests/gpu/test_gpu_down_wgmma.py tests/gpu/test_gpu_warp_specialized.py
step gpu_tests_graphs 240 "${pytest_gpu[@]}" tests/gpu/test_gpu_eager_graphs.py tests/gpu/test_gpu_compile.py \
    tests/gpu/test_gpu_eplb.py
portable=(env DISABLE_MMA_V3=1)
step gpu_tests_portable 420 "${portable[@]}" "${pytest_gpu[@]}" tests/gpu/test_gpu_portable.py \
    tests/gpu/test_gpu_weight_only_fp8.py
step gpu_tests_triton_sm80 420 "${portable[@]}" MOEFLOW_KERNEL_ARCH=sm_80 "${pytest_base[@]}" $(xdist 3) \
    tests/gpu/test_gpu_triton.py
step gpu_tests_invariant 240 "${pytest_gpu[@]}" tests/gpu/test_gpu_batch_invariant.py
step selftest 120 "${one_gpu[@]}" PYTHONPATH="$PWD" python -m moeflow selftest --json "$R/selftest.json"

# shellcheck disable=SC2086  # LAYER_ARGS is a list of arguments
if [ -n "${BASELINE:-}" ]; then
    base_script=$BASELINE/benchmarks/bench_layer.py
    [ -f "$base_script" ] || base_script=benchmarks/bench_layer.py
    step layer_bench_baseline 300 "${one_gpu[@]}" PYTHONPATH="$BASELINE" python "$base_script" $LAYER_ARGS \
        --runners triton --deadline-s "$(left)" --out "$R/layer_baseline"
fi
step layer_bench 300 "${one_gpu[@]}" PYTHONPATH="$PWD" python benchmarks/bench_layer.py $LAYER_ARGS \
    --runners triton --deadline-s "$(left)" --out "$R/layer"
grep -h -A3 "^targets, " "$R/layer_bench.log" 2> /dev/null | cut -c1-300 >> "$S"
# shellcheck disable=SC2086
step invariant_bench 300 "${one_gpu[@]}" PYTHONPATH="$PWD" python benchmarks/bench_layer.py $LAYER_ARGS \
    --runners triton --batch-invariant --deadline-s "$(left)" --out "$R/layer_invariant"
if [ -f "$R/layer/bench.json" ] && [ -f "$R/layer_invariant/bench.json" ]; then
    PYTHONPATH="$PWD" python benchmarks/compare_runs.py "$R/layer/bench.json" "$R/layer_invariant/bench.json" \
        > "$R/compare_invariant.txt" 2>&1
    grep -E "^new over old" "$R/compare_invariant.txt" | sed 's/^new over old/batch-invariant over default/' >> "$S"
fi
ROWS="--presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens ${PORTABLE_TOKENS:-1,16,128,1024,4096,16384}"
# shellcheck disable=SC2086
step portable_bench 420 "${one_gpu[@]}" "${portable[@]}" MOEFLOW_KERNEL_ARCH=sm_80 PYTHONPATH="$PWD" \
    python benchmarks/bench_layer.py $ROWS --schemes none --runners triton --deadline-s "$(left)" --out "$R/portable_bf16"
# shellcheck disable=SC2086
step portable_bench_fp8 420 "${one_gpu[@]}" "${portable[@]}" MOEFLOW_KERNEL_ARCH=sm_89 PYTHONPATH="$PWD" \
    python benchmarks/bench_layer.py $ROWS --schemes fp8-block --runners triton --deadline-s "$(left)" \
    --out "$R/portable_fp8"
step weight_only_bench 240 "${one_gpu[@]}" "${portable[@]}" MOEFLOW_KERNEL_ARCH=sm_80 PYTHONPATH="$PWD" \
    python benchmarks/bench_layer.py --presets qwen3-30b-a3b,mixtral-8x7b,deepseek-v3 --tokens 1,16 \
    --schemes fp8-channel,fp8-block --runners triton --deadline-s "$(left)" --out "$R/weight_only"
if [ -d .anchors/sglang ]; then
    # shellcheck disable=SC2086
    # as the portable kernels run (mma.sync: DISABLE_MMA_V3=1), so the two compare kernel for kernel
    step anchor_sglang 300 "${one_gpu[@]}" "${portable[@]}" PYTHONPATH="$PWD" python benchmarks/anchor_sglang.py $ROWS \
        --schemes none,fp8-block --deadline-s "$(left)" --out "$R/anchor_sglang"
fi
if [ -f "$R/layer_baseline/bench.json" ] && [ -f "$R/layer/bench.json" ]; then
    PYTHONPATH="$PWD" python benchmarks/compare_runs.py "$R/layer_baseline/bench.json" "$R/layer/bench.json" \
        > "$R/compare_runs.txt" 2>&1
    grep -E "^new over old|^old ceilings|^new ceilings" "$R/compare_runs.txt" >> "$S"
fi

if [ "$GPUS" -ge 2 ]; then
    mkdir -p "$R/ep"
    step ep_tests 180 env PYTHONPATH="$PWD" python -m pytest -v -m gpu tests/gpu/test_gpu_ep.py
    step ep_bench 150 env PYTHONPATH="$PWD" torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py \
        --profile --skip layer --out "$R/ep/bench.json"
    grep -hE "^(alltoall|lowlatency)" "$R/ep_bench.log" 2> /dev/null | cut -c1-300 >> "$S"
    step ep_layer 240 env PYTHONPATH="$PWD" torchrun --standalone --nproc-per-node 2 benchmarks/bench_ep.py \
        --skip alltoall,lowlatency --out "$R/ep/layer.json"
fi
step hf 240 "${one_gpu[@]}" PYTHONPATH="$PWD" python benchmarks/bench_hf.py --commit "$MOEFLOW_COMMIT" --out "$R/hf"

if [ -f "$R/portable_bf16/bench.json" ] && [ -f "$R/layer/bench.json" ]; then
    anchor=(); [ -f "$R/anchor_sglang/anchor.json" ] && anchor=(--anchor "$R/anchor_sglang/anchor.json")
    wo=(); [ -f "$R/weight_only/bench.json" ] && wo=(--weight-only "$R/weight_only/bench.json")
    pfiles=("$R/portable_bf16/bench.json"); [ -f "$R/portable_fp8/bench.json" ] && pfiles+=("$R/portable_fp8/bench.json")
    PYTHONPATH="$PWD" python benchmarks/portable_report.py --hopper "$R/layer/bench.json" --portable "${pfiles[@]}" \
        "${anchor[@]}" "${wo[@]}" > "$R/portable_report.txt" 2>&1
    tail -n 3 "$R/portable_report.txt" | cut -c1-400 >> "$S"
fi
grep -hE "FAILED|Error" "$R"/*tests*.log 2> /dev/null | head -20 >> "$S"
tar czf "$OUT/results.tgz" -C "$R" .
# the loadable files of the cache (metadata, cubins, group files, launchers), only this call's if all would not fit
pack() { (cd / && find "${CACHE#/}" -type f \( -name '*.json' -o -name '*.cubin' -o -name '__grp__*' -o -name '*.so' \) \
    "$@" -print0 | tar czf - --null -T -); }
tmp=$(mktemp)
pack > "$tmp"
[ "$(stat -c %s "$tmp")" -gt $((3 * PART)) ] && pack -newer "$CACHE/.call-start" > "$tmp"
if [ "$(stat -c %s "$tmp")" -le $((3 * PART)) ]; then
    split -b "$PART" -d -a 1 "$tmp" "$OUT/triton-cache.tgz.part"
    echo "triton cache: $(ls "$OUT"/triton-cache.tgz.part* | wc -l) part(s), $(($(stat -c %s "$tmp") >> 10)) KiB" >> "$S"
else
    echo "triton cache: over three parts, not saved" >> "$S"
fi
rm -f "$tmp"
cp "$S" "$OUT/summary.txt"
cat "$S"
