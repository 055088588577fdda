#!/usr/bin/env bash
# Extract SGLang's Triton fused-MoE kernel, its tuned-config lookup and the tuned configs that match moeflow's
# presets into .anchors/sglang/ (git-ignored through .git/info/exclude), for benchmarks/anchor_sglang.py.
#
#   bash benchmarks/fetch_sglang_anchor.sh [DEST]        (DEST: default <repo>/.anchors/sglang)
#
# SGLang's code is never committed here: it is run as an external anchor only. What is extracted, unmodified:
#   fused_moe_triton_kernels.py   the @triton.jit fused_moe_kernel and its launcher invoke_fused_moe_kernel
#   fused_moe_triton_config.py    get_config_file_name / get_moe_configs / try_get_optimal_moe_config
#   configs/triton_X_Y_Z/E=..,N=..,device_name=..[,dtype=fp8_w8a8,block_shape=[128, 128]][_down].json
#                                 for the three presets' (E, N) and the devices NVIDIA_H100_80GB_HBM3 / NVIDIA_H200;
#                                 N is SGLang's lookup key w2.shape[2] = the expert intermediate size I (per TP
#                                 shard; README of their configs folder: "N = original_intermediate_size / tp_size")
#   configs_bundle.json           the same configs verbatim in one file of a plain name ({path: text}), for
#                                 transfers that drop names holding '=', ',' or ' '
#   LICENSE, MANIFEST.txt         SGLang's Apache-2.0 license; the source, version and sha256 of every file
# Source (SGLANG_SOURCE=auto|mirror|pypi, default auto):
#   mirror  a snapshot brought by the session's fetch tool (git dir under /work/.mirror/sgl-project+sglang/), HEAD;
#           github:sgl-project/sglang is over the fetch tool's size limit, so there is usually none
#   pypi    the sglang wheel of the pinned release (SGLANG_VERSION, default 0.5.23) through pip download --no-deps,
#           kept in ${XDG_CACHE_HOME:-~/.cache}/moeflow-anchors/; only the files above are taken out of it
#   auto    mirror where one exists, else pypi
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.anchors/sglang}
SOURCE=${SGLANG_SOURCE:-auto}
VERSION=${SGLANG_VERSION:-0.5.23}
MIRROR=${SGLANG_MIRROR:-/work/.mirror/sgl-project+sglang}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/moeflow-anchors
PY=${PYTHON:-python3}

# (E, N = I) of moeflow/presets.py: qwen3-30b-a3b, deepseek-v3, mixtral-8x7b
SHAPES_RE='E=(128,N=768|256,N=2048|8,N=14336)'
DEVICES_RE='NVIDIA_H100_80GB_HBM3|NVIDIA_H200'
CONFIG_RE="^${SHAPES_RE},device_name=(${DEVICES_RE})(,dtype=fp8_w8a8,block_shape=\\[128, 128\\])?(_down)?\\.json\$"

mirror_git=""
for d in "$MIRROR/repo/.git" "$MIRROR/repo" "$MIRROR"; do
    if [ -f "$d/HEAD" ] && [ -d "$d/objects" ]; then mirror_git=$d; break; fi
done
if [ "$SOURCE" = auto ]; then SOURCE=$([ -n "$mirror_git" ] && echo mirror || echo pypi); fi

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
LIST="$STAGE/list.txt"  # the source's paths, one a line; the package's under $PY_ROOT (sglang/...)

case "$SOURCE" in
mirror)
    [ -n "$mirror_git" ] || { echo "no fetch-tool mirror of sgl-project/sglang under $MIRROR" >&2; exit 1; }
    git --git-dir="$mirror_git" ls-tree -r --name-only HEAD > "$LIST"
    ORIGIN="github:sgl-project/sglang@$(git --git-dir="$mirror_git" rev-parse HEAD) (fetch-tool mirror $mirror_git)"
    PY_ROOT=python/
    get() { git --git-dir="$mirror_git" show "HEAD:$1"; }
    ;;
pypi)
    mkdir -p "$CACHE"
    wheel=$(ls "$CACHE"/sglang-"$VERSION"-*.whl 2> /dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$CACHE" "sglang==$VERSION"
        wheel=$(ls "$CACHE"/sglang-"$VERSION"-*.whl | head -1)
    fi
    ORIGIN="pypi sglang==$VERSION $(basename "$wheel") sha256=$(sha256sum "$wheel" | cut -d' ' -f1)"
    "$PY" -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel" > "$LIST"
    PY_ROOT=
    get() { "$PY" -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
        "$wheel" "$1"; }
    ;;
*)
    echo "SGLANG_SOURCE: auto, mirror or pypi, not $SOURCE" >&2
    exit 1
    ;;
esac

first() {  # first PATH... : the first of the paths that the source holds
    local p
    for p in "$@"; do grep -qxF "$p" "$LIST" && { echo "$p"; return; }; done
    return 1
}
# the kernel module moved over releases: newest layout first
P=${PY_ROOT}sglang
kernels=$(first $P/kernels/ops/moe/fused_moe_triton_kernels.py \
    $P/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_kernels.py \
    $P/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py) ||
    { echo "no fused_moe_triton_kernels.py in $ORIGIN" >&2; exit 1; }
config=$(first $P/srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py \
    $P/srt/layers/moe/fused_moe_triton/fused_moe_triton_config.py) ||
    { echo "no fused_moe_triton_config.py in $ORIGIN" >&2; exit 1; }
configs_dir=$(dirname "$config")/configs
license=$(first LICENSE python/LICENSE sglang-"$VERSION".dist-info/licenses/LICENSE \
    sglang-"$VERSION".dist-info/LICENSE || true)

NEW="$STAGE/sglang"
mkdir -p "$NEW/configs"
get "$kernels" > "$NEW/fused_moe_triton_kernels.py"
get "$config" > "$NEW/fused_moe_triton_config.py"
[ -n "$license" ] && get "$license" > "$NEW/LICENSE"
n=0
while IFS= read -r p; do
    rel=${p#"$configs_dir"/}
    [[ "$(basename "$rel")" =~ $CONFIG_RE ]] || continue
    mkdir -p "$NEW/configs/$(dirname "$rel")"
    get "$p" > "$NEW/configs/$rel"
    n=$((n + 1))
done < <(grep -F "$configs_dir/" "$LIST" | grep '\.json$')

# the same JSONs again, verbatim, in one file of a plain name (paths holding '=', ',' or ' ' may not travel to a
# device machine): anchor_sglang.py recreates configs/ from it where the tree arrived incomplete
"$PY" - "$NEW" << 'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
files = sorted((root / "configs").rglob("*.json"))
bundle = {p.relative_to(root / "configs").as_posix(): p.read_text() for p in files}
(root / "configs_bundle.json").write_text(json.dumps(bundle, indent=1, sort_keys=True) + "\n")
EOF

{
    echo "source: $ORIGIN"
    echo "extracted: $(date -u +%FT%TZ) by benchmarks/fetch_sglang_anchor.sh"
    echo "kernels: $kernels"
    echo "config: $config"
    echo "configs: $configs_dir ($n files matching $CONFIG_RE)"
    echo "files (sha256):"
    (cd "$NEW" && find . -type f ! -name MANIFEST.txt | sort | while IFS= read -r f; do
        echo "  $(sha256sum "$f" | cut -d' ' -f1)  ${f#./}"; done)
} > "$NEW/MANIFEST.txt"

mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST"
mv "$NEW" "$DEST"
# keep it out of git without touching .gitignore
exclude="$ROOT/.git/info/exclude"
if [ -d "$ROOT/.git" ] && ! grep -qxF '/.anchors/' "$exclude" 2> /dev/null; then
    mkdir -p "$ROOT/.git/info"
    echo '/.anchors/' >> "$exclude"
fi
echo "$DEST: $(find "$DEST" -type f | wc -l) files, $(du -sh "$DEST" | cut -f1) ($n configs) from $ORIGIN"
