#!/usr/bin/env bash
# Triton's compiled kernels carried from one device call to the next. A fresh lent machine compiles every kernel a
# call runs: on 2026-12-03 test_gpu_triton.py took 334 s for 105 tests on a fresh machine, where a warm one had run
# 150 of its tests in 96 s. The cache key holds triton's own build hash, the kernel's source, the target and the
# options, so a cache made on one lent H200 serves the next one (the same software image), and a kernel whose source
# changed misses and compiles again.
#
# On the GPU machine, in the command of a call:
#   source benchmarks/triton_cache.sh restore       # TRITON_CACHE_DIR=/tmp/moeflow-triton-cache, filled from
#                                                   # .triton-cache/triton-cache.tgz.* if the call carried it
#   ... the call's work ...
#   bash benchmarks/triton_cache.sh save "$OUT"     # $OUT/triton-cache.tgz.part0 (.part1, .part2): 15 MiB a part
# Here, after the call:
#   mkdir -p .triton-cache && cp <files_at>/triton-cache.tgz.part* .triton-cache/  # ignored by git
# and the next call passes carry [".triton-cache"].
#
# Only what loading a kernel needs is kept: each kernel's metadata (.json), binary (.cubin), group file (__grp__*)
# and the compiled launchers (.so); not its intermediate forms (.ttir, .ttgir, .llir, .ptx). The group files name
# their children by absolute path, so the cache always lives at the same path. If the parts would pass 45 MiB
# (three parts: the device tool carries 64 MiB in all, the tree included), only the files this call wrote are kept.
DIR=/tmp/moeflow-triton-cache
PART=$((15 * 1024 * 1024))

case "${1:-}" in
restore)
    export TRITON_CACHE_DIR=$DIR
    mkdir -p "$DIR"
    if ls .triton-cache/triton-cache.tgz.part* > /dev/null 2>&1; then
        cat .triton-cache/triton-cache.tgz.part* | tar xzf - -C / && \
            echo "triton cache: $(find "$DIR" -name '*.cubin' | wc -l) kernels restored" >&2
    fi
    touch "$DIR/.call-start"  # after the restore: files newer than this one were written by this call
    ;;
save)
    out=${2:?usage: triton_cache.sh save OUT_DIR}
    pack() {  # pack [find tests...]: the loadable files of the cache, as one gzipped tar on stdout
        (cd / && find "${DIR#/}" -type f \( -name '*.json' -o -name '*.cubin' -o -name '__grp__*' -o -name '*.so' \) \
            "$@" -print0 | tar czf - --null -T -)
    }
    tmp=$(mktemp)
    pack > "$tmp"
    if [ "$(stat -c %s "$tmp")" -gt $((3 * PART)) ]; then
        echo "triton cache: $(($(stat -c %s "$tmp") >> 20)) MiB in all; keeping this call's files only" >&2
        pack -newer "$DIR/.call-start" > "$tmp"
    fi
    if [ "$(stat -c %s "$tmp")" -gt $((3 * PART)) ]; then
        echo "triton cache: $(($(stat -c %s "$tmp") >> 20)) MiB, over three parts: not saved" >&2
    else
        split -b "$PART" -d -a 1 "$tmp" "$out/triton-cache.tgz.part"
        echo "triton cache: $(ls "$out"/triton-cache.tgz.part* | wc -l) part(s), $(($(stat -c %s "$tmp") >> 10)) KiB" >&2
    fi
    rm -f "$tmp"
    ;;
*)
    echo "usage: source benchmarks/triton_cache.sh restore | bash benchmarks/triton_cache.sh save OUT_DIR" >&2
    return 2 2> /dev/null || exit 2
    ;;
esac
