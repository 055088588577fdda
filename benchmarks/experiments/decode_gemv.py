"""Decode GEMMs on CUDA cores (_gemv_kernels.py) against the shipped tuned tiles, graph-timed as the
tuner times them (8 batches of different routing, rows by index as the single-process layer feeds them).
gate_up is timed with what follows it in the runner (fp8-block: the 1x128 group quantization, a
separate launch for narrow tiles and for the CUDA-core kernels). One H200.

    PYTHONPATH=$PWD OUT=DIR python benchmarks/experiments/decode_gemv.py [preset ...]
"""
import json, os, sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _gemv_kernels import gemv_gate_up, gemv_down  # noqa: E402
from moeflow.kernels.autotune import Shape, _layer_parts, batches_for, graph_time_ms, random_batch, random_weights  # noqa: E402
from moeflow.kernels.common import RowLayout  # noqa: E402
from moeflow.kernels.down import down  # noqa: E402
from moeflow.kernels.gate_up import gate_up  # noqa: E402
from moeflow.kernels.quant import down_input, quantize_activation  # noqa: E402
from moeflow.presets import PRESETS  # noqa: E402

dev = torch.device("cuda")
presets = sys.argv[1:] or ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"]
GU = [(1, 8, 128, 4, 2, False), (1, 8, 256, 4, 2, False), (1, 16, 128, 4, 2, False), (1, 16, 128, 4, 2, True),
      (1, 16, 256, 4, 2, False), (1, 32, 128, 4, 2, False), (1, 16, 128, 4, 3, False), (1, 16, 128, 8, 2, False),
      (2, 16, 128, 4, 2, False), (4, 16, 128, 4, 2, False)]
DN = GU + [(1, 32, 128, 4, 2, True), (1, 64, 128, 4, 2, False)]
res = []


def rec(**kw):
    res.append(kw)
    print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


for preset in presets:
    p = PRESETS[preset]
    for scheme in ("fp8-block", "none"):
        shape = Shape(p["num_experts"], p["hidden_size"], p["intermediate_size"], p["top_k"], scheme)
        w = random_weights(shape, dev)
        q = 3 if scheme == "fp8-block" else 0
        meta = SimpleNamespace(w13=w.w13, w2=w.w2)
        for t in (1, 16):
            inputs = []
            for b in range(batches_for(t)):
                batch = random_batch(shape, t, dev, seed=t * 1000 + b, indexed=True)
                lay = RowLayout.of(batch)
                xq, xs = quantize_activation(batch.hidden, scheme) if q else (batch.hidden, None)
                inputs.append((batch, lay, xq, xs))
            kcfg = _layer_parts(shape)[1].kernel_config(inputs[0][0], meta)

            def shipped_gu(inp):
                batch, lay, xq, xs = inp
                inter, extra = gate_up(xq, xs, w.w13, w.w13_scale, lay, scheme, "silu", shape.dtype, kcfg.gate_up,
                                       source_rows=batch.source_rows, copy_rows=batch.copy_rows)
                return down_input(inter, extra, scheme) if q else (inter, None)

            def gemv_gu(inp, v):
                batch, lay, xq, xs = inp
                inter = gemv_gate_up(xq, xs, w.w13, w.w13_scale, lay, q, shape.dtype, *v, source_rows=batch.source_rows)
                return down_input(inter, None, scheme) if q else (inter, None)

            ref_gu = [shipped_gu(i) for i in inputs]
            us = graph_time_ms([lambda i=i: shipped_gu(i) for i in inputs], 15) * 1e3
            rec(preset=preset, scheme=scheme, T=t, kernel="gate_up", variant="shipped " + str(kcfg.gate_up), us=us)
            for v in GU:
                if q == 3 and v[2] != 128:
                    continue
                try:
                    got = gemv_gu(inputs[0], v)
                    err = (got[0].float() - ref_gu[0][0].float()).abs().max().item() if q == 0 else \
                        ((got[0].float() * got[1].repeat_interleave(128, 1)[:, :got[0].shape[1]]) -
                         (ref_gu[0][0].float() * ref_gu[0][1].repeat_interleave(128, 1)[:, :got[0].shape[1]]))[
                            inputs[0][1].valid_rows()].abs().max().item()
                    us = graph_time_ms([lambda i=i, v=v: gemv_gu(i, v) for i in inputs], 15) * 1e3
                except Exception as exc:
                    us, err = repr(exc)[:100], float("nan")
                rec(preset=preset, scheme=scheme, T=t, kernel="gate_up", variant="gemv " + str(v), us=us, err=err)
            d_in = [(a, a_s, inp[0].weights, inp[1]) for (a, a_s), inp in zip(ref_gu, inputs)]
            ref_dn = down(*d_in[0][:2], w.w2, w.w2_scale, d_in[0][2], d_in[0][3], scheme, shape.dtype, kcfg.down)
            us = graph_time_ms([lambda d=d: down(d[0], d[1], w.w2, w.w2_scale, d[2], d[3], scheme, shape.dtype,
                                                 kcfg.down) for d in d_in], 15) * 1e3
            rec(preset=preset, scheme=scheme, T=t, kernel="down", variant="shipped " + str(kcfg.down), us=us)
            for v in DN:
                if q == 3 and v[2] != 128:
                    continue
                try:
                    got = gemv_down(*d_in[0][:2], w.w2, w.w2_scale, d_in[0][2], d_in[0][3], q, shape.dtype, *v)
                    valid = d_in[0][3].valid_rows()
                    err = (got.float() - ref_dn.float())[valid].abs().max().item()
                    us = graph_time_ms([lambda d=d, v=v: gemv_down(d[0], d[1], w.w2, w.w2_scale, d[2], d[3], q,
                                                                   shape.dtype, *v) for d in d_in], 15) * 1e3
                except Exception as exc:
                    us, err = repr(exc)[:100], float("nan")
                rec(preset=preset, scheme=scheme, T=t, kernel="down", variant="gemv " + str(v), us=us, err=err)
        del w
        torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_gemv.json"), "w"), indent=1)
best = {}
for r in res:
    if isinstance(r["us"], float):
        key = (r["preset"], r["scheme"], r["T"], r["kernel"], r["variant"].split()[0])
        if key not in best or r["us"] < best[key][0]:
            best[key] = (r["us"], r["variant"])
print("\n| preset | scheme | T | kernel | shipped µs | best gemv µs | variant |")
for (pr, sc, t, k, fam), (us, var) in sorted(best.items()):
    if fam == "shipped":
        g = best.get((pr, sc, t, k, "gemv"), (float("nan"), ""))
        print(f"| {pr} | {sc} | {t} | {k} | {us:.1f} | {g[0]:.1f} | {g[1]} |")
