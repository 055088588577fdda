"""`moeflow check`: validate a configuration on this machine; print the plan or the coded error."""
from __future__ import annotations

from ..capabilities import Environment
from ..planner import plan
from .common import add_layer_args, config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="validate a configuration on this machine and print the plan")
    add_layer_args(p)
    p.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[1, 16, 128, 1024, 4096, 16384],
                   help="token counts whose GEMM kernels and tiles to print (triton runner; default 1,...,16384)")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = config_from_args(args)  # MF1xx errors surface here
    env = Environment.detect(cfg.device)
    chosen = plan(cfg, env)  # MF2xx errors surface here; cli.main prints them with exit code 2
    print(chosen)
    if chosen.runner == "triton":  # which tuned file (or defaults) its kernels take their tiles from
        import torch

        from ..kernels.configs import table_source
        source = table_source(torch.cuda.get_device_name(cfg.device), cfg.num_experts // env.world_size,
                              cfg.intermediate_size, cfg.hidden_size, cfg.quant, env.capability)
        print(f"kernel configs: {source}")
        from ..experts import create_runner
        from ..quant import create_scheme
        runner = create_runner("triton", cfg, create_scheme(chosen.scheme))
        for tokens in args.tokens:
            kernels = runner.describe_kernels(tokens, cfg.num_experts // env.world_size, chosen.layout == "masked",
                                              chosen.fused_layer)
            print(f"  T={tokens}: {kernels}")
    return 0
