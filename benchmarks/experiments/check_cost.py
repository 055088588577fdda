"""What tune()'s correctness check of a config costs (kernels/verify.py, autotune.gemm_checks), against the GEMM it
checks, at the largest shapes the tuner meets: each GEMM and each check run once after a warm-up call, wall time
with a sync after (the check syncs once itself), and the relative error the check returns (the check itself, on
real shapes). The GEMMs run with the Hopper default tiles (configs.default_config), not the shipped tables.
    python benchmarks/experiments/check_cost.py [preset:scheme:T,...]   (OUT=dir for the JSON)"""
import json
import os
import sys
import time

import torch

from moeflow.kernels.autotune import Shape, gemm_checks, gemm_inputs, gemm_runners, random_weights, tuner_routings
from moeflow.kernels.configs import default_config
from moeflow.kernels.quant import down_input
from moeflow.presets import preset_config

CASES = "deepseek-v3:fp8-block:16384,qwen3-30b-a3b:none:16384,mixtral-8x7b:fp8-channel:16384"


def wall_s(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main():
    rows = []
    for case in (sys.argv[1] if len(sys.argv) > 1 else CASES).split(","):
        preset, scheme, t = case.split(":")
        c = preset_config(preset)
        shape = Shape(c.num_experts, c.hidden_size, c.intermediate_size, c.top_k, scheme)
        weights = random_weights(shape, torch.device("cuda"))
        cfg = default_config(int(t), c.top_k, c.num_experts, scheme, hidden=c.hidden_size, inter=c.intermediate_size,
                             capability=torch.cuda.get_device_capability())
        run_gu, run_dn = gemm_runners(shape, weights)
        check_gu, check_dn = gemm_checks(shape, weights)
        inp = gemm_inputs(shape, tuner_routings(shape, int(t), torch.device("cuda"))[:1], True)[0]
        gu = lambda: run_gu(cfg.gate_up, inp)
        inter, extra = gu()  # warm: compiles
        a, a_s = down_input(inter, extra, scheme)  # as tune() does (fp8-block: already quantized, passed on)
        dn = lambda: run_dn(cfg.down, a, a_s, inp[0].weights, inp[1])
        dn()
        gu_s, dn_s = wall_s(gu)[0], wall_s(dn)[0]
        check_gu(cfg.gate_up, inp), check_dn(cfg.down, a, a_s, inp[0].weights, inp[1])  # warm (compiles, caches)
        cgu_s, gu_err = wall_s(lambda: check_gu(cfg.gate_up, inp))
        cdn_s, dn_err = wall_s(lambda: check_dn(cfg.down, a, a_s, inp[0].weights, inp[1]))
        rows.append(dict(case=case, gate_up_ms=gu_s * 1e3, check_gate_up_ms=cgu_s * 1e3, gate_up_err=gu_err,
                         down_ms=dn_s * 1e3, check_down_ms=cdn_s * 1e3, down_err=dn_err))
        del weights, inp, inter, extra, a, a_s
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "check_cost.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print(f"{'case':<36} {'gate_up ms':>10} {'check ms':>9} {'err':>9} {'down ms':>8} {'check ms':>9} {'err':>9}")
    for r in rows:
        print(f"{r['case']:<36} {r['gate_up_ms']:>10.2f} {r['check_gate_up_ms']:>9.1f} {r['gate_up_err']:>9.2e} "
              f"{r['down_ms']:>8.2f} {r['check_down_ms']:>9.1f} {r['down_err']:>9.2e}")


if __name__ == "__main__":
    main()
