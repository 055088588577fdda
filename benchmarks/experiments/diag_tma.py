"""Diagnose (GPU): the library gate_up with TMA weights vs gemm_variants.py's TMA kernel, registers and time.

    PYTHONPATH=$PWD python benchmarks/experiments/diag_tma.py
At 1831dc9 it printed 253 registers (library, fp8-block) vs 181 (experiment): the cause was the
per-column `cols % I` weight-scale index in the K loop (fixed in 7d7588c; ptxas -v confirms 174).
"""
import sys

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor
from triton.testing import do_bench
from moeflow.kernels.autotune import Shape, random_batch, random_weights
from moeflow.kernels.common import RowLayout
from moeflow.kernels import gate_up as G
from moeflow.kernels.quant import quantize_rows
from moeflow.presets import preset_config
sys.path.insert(0, 'benchmarks/experiments')
import gemm_variants as V
dev='cuda'
for preset, scheme in [("deepseek-v3","fp8-block"),("qwen3-30b-a3b","fp8-block"),("qwen3-30b-a3b","none")]:
    cfg=preset_config(preset); t=16384 if preset!="deepseek-v3" else 8192
    shape=Shape(cfg.num_experts,cfg.hidden_size,cfg.intermediate_size,cfg.top_k,scheme)
    w=random_weights(shape,dev); b=random_batch(shape,t,dev); lay=RowLayout.of(b)
    e,i,h=shape.num_experts,shape.inter,shape.hidden
    x=b.hidden; q=3 if scheme=="fp8-block" else 0
    xq,xs=quantize_rows(x,scheme,lay) if q else (x,None)
    bk=128 if q else 64; bm,bn,nw,ns=(64,128,8,4) if q else (128,128,8,3)
    from moeflow.kernels.configs import GemmConfig
    c=GemmConfig(bm,bn,bk,8,nw,ns)
    f=lambda: G.gate_up(xq,xs,w.w13,w.w13_scale,lay,scheme,"silu",torch.bfloat16,c)
    f(); us_lib=do_bench(f,rep=60)*1e3
    try:
        info=[(k.n_regs,k.n_spills) for cache in G._gate_up_kernel.device_caches.values() for k in cache[0].values()]
    except Exception as exc:
        info=repr(exc)[:100]
    xs_=xs if xs is not None else xq; ws=w.w13_scale if q else xq
    wse,wsn=(ws.stride(0),ws.stride(1)) if q else (0,0)
    inter=torch.empty((x.shape[0],i),dtype=torch.float8_e4m3fn if q else torch.bfloat16,device=dev)
    isc=torch.empty((x.shape[0],i//128),dtype=torch.float32,device=dev)
    nbm=lay.num_row_blocks(bm); grid=(nbm*triton.cdiv(i,bn),)
    desc=TensorDescriptor.from_tensor(w.w13.view(e*2*i,h),[bn,bk])
    run=lambda: V._gu_tma[grid](xq,xs_,desc,ws,inter,isc,lay.meta,e,nbm,i,h,xq.stride(0),xs_.stride(0),wse,wsn,inter.stride(0),isc.stride(0),Q=q,E_POW2=lay.e_pow2,BLOCK_M=bm,BLOCK_N=bn,BLOCK_K=bk,GROUP_M=8,num_warps=nw,num_stages=ns)
    k2=run(); us_exp=do_bench(run,rep=60)*1e3
    print(preset,scheme,t,"lib",round(us_lib),info,"exp",round(us_exp),(k2.n_regs,k2.n_spills),flush=True)
    del w,b; torch.cuda.empty_cache()
