"""Experiment helper (no GPU needed to run it): copies of the shipped fp8-block tables of Mixtral and DeepSeek-V3 whose
gate_up entries from T = 1024 on take the warp-specialized kernel's 128 x 128 tile shared by its two consumers
(COOP, 4 stages), for a layer A/B through MOEFLOW_KERNEL_CONFIG_DIR.

Why: those two presets' tables run the per-tile Gluon gate_up (kernels/gate_up_wgmma.py) at large T, and that
kernel has no multicast form. The warp-specialized COOP gate_up lost to it on DeepSeek-V3 (0.83-0.90x alone) and tied
on Mixtral T=16384 (benchmarks/results/ws_coop_gate_up_2026-12-03_h200.md). With MOEFLOW_TRITON_WS_MULTICAST=gate_up
(branch `multicast`) each weight tile it reads serves 256 rows instead of 128; whether that turns the loss into a gain
is what benchmarks/experiments/ws_multicast.sh's `wsgu` step measures.

    PYTHONPATH=$PWD python benchmarks/experiments/ws_gate_up_tables.py OUT_DIR

Writes OUT_DIR/<table>.json for the two tables; the down entries, the one-launch tiles and the smaller T stay as
shipped. The entries' edit is recorded in each file's "edits" note.
"""
import sys
from dataclasses import replace
from pathlib import Path

from moeflow.kernels.configs import SHIPPED_DIR, GemmConfig, file_name, read_table, table_notes, write_table
from moeflow.presets import PRESETS

TILE = GemmConfig(128, 128, 128, 8, 4, 4, warp_specialize=1)  # COOP: 64 rows a consumer
FROM_T = 1024


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for preset in ("mixtral-8x7b", "deepseek-v3"):
        p = PRESETS[preset]
        name = file_name("NVIDIA H200", p["num_experts"], p["intermediate_size"], p["hidden_size"], "fp8-block")
        table, measured = read_table(SHIPPED_DIR / name)
        changed = sorted(t for t in table if t >= FROM_T)
        table = {t: replace(c, gate_up=TILE) if t >= FROM_T else c for t, c in table.items()}
        meta = table_notes(SHIPPED_DIR / name)
        meta["edits"] = list(meta.get("edits", [])) + [
            f"experiment (benchmarks/experiments/ws_gate_up_tables.py): gate_up at T = {changed} set to {TILE}"]
        write_table(out / name, meta, table, measured)
        print(f"{preset}: gate_up at T = {changed} -> warp-specialized 128 x 128 COOP, {TILE.num_stages} stages")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ws-gate-up-tables")
