"""`moeflow selftest`: every (scheme, runner, dispatcher, dtype) cell the planner accepts on a device, run at a small
shape against the reference runner on the same weights and inputs, held to moeflow/tolerances.py's table.

Shape SHAPE: E=8, H=256, I=128, top_k=2 (fp8-block's multiples of 128); layer dtypes DTYPES (bf16, fp16, fp32); the
single-process dispatchers. Batches: TOKENS (1 and 37 tokens, random router logits) and IDLE_BATCH (16 tokens routed
to every expert but IDLE_EXPERT). Weights: one seeded float32 draw, given to FP8 layers as an FP8 checkpoint
(float8_e4m3fn weights + ``*_scale_inv``, quantized on the CPU). Every call runs launch by launch with its buffers
poisoned (an element never written shows as NaN). Error: ‖out − ref‖ / ‖ref‖ in float64, the worst over the
batches. The reference runner's cells are the comparand; on a GPU each is checked against the reference runner on
the CPU.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from .benchmark import poisoned_allocations, relative_error
from .capabilities import Environment
from .config import MoEConfig
from .dispatch import DISPATCHERS
from .errors import MoeflowError
from .experts import RUNNERS
from .layer import MoE
from .planner import cell_status, plan
from .quant import SCHEMES, create_scheme
from .tolerances import rel_tol

SHAPE = dict(num_experts=8, hidden_size=256, intermediate_size=128, top_k=2)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOKENS = (1, 37)  # random routing: a single token, and a count that is no power of two (partial tiles)
IDLE_BATCH, IDLE_EXPERT = 16, 3  # a batch in which one expert in the middle of the sorted order gets no token
COMPARAND = "reference"


@dataclass(frozen=True)
class Batch:
    tokens: int
    idle_expert: int | None = None  # an expert the batch's router logits exclude

    @property
    def label(self) -> str:
        return f"{self.tokens}*" if self.idle_expert is not None else str(self.tokens)


def batches(tokens=TOKENS) -> list[Batch]:
    """The batches each cell runs: ``tokens`` with random routing, then IDLE_BATCH with IDLE_EXPERT left idle."""
    return [Batch(t) for t in tokens] + [Batch(IDLE_BATCH, IDLE_EXPERT)]


@dataclass
class Row:
    """One cell's result. status: "pass", "FAIL", "refused" (``code``: the planner's error code) or "comparand" (the
    reference runner where nothing else checks it: on the CPU)."""

    scheme: str
    runner: str
    dispatcher: str
    dtype: str
    status: str
    code: str | None = None
    tokens: list[str] = field(default_factory=list)  # the batches run (Batch.label)
    errors: list[float] = field(default_factory=list)  # per batch, ‖out − ref‖ / ‖ref‖
    rel_err: float | None = None  # the worst of errors (NaN where an output holds NaN)
    tol: float | None = None
    seconds: float | None = None  # build, load and run
    weight_only: bool = False  # an FP8 scheme run with unquantized activations (Plan.weight_only: no FP8 tensor cores)
    detail: str = ""  # why a cell failed; what a passing one was compared with

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def as_json(self) -> dict:
        """The row for --json: NaN and infinite errors as strings ("nan"), which JSON has no number for."""
        def number(x):
            return x if x is None or math.isfinite(x) else str(x)
        d = asdict(self)
        d["errors"] = [number(e) for e in self.errors]
        d["rel_err"] = number(self.rel_err)
        return d


def single_process_dispatchers() -> list[str]:
    return [d for d in DISPATCHERS.names() if not DISPATCHERS.get(d).caps.distributed]


def cells(device: torch.device, schemes=None, runners=None, dtypes=DTYPES) -> list[tuple[MoEConfig, str]]:
    """[(the cell's configuration, "ok" or the code refusing it)] on ``device``, asked of the planner (cell_status)
    for every scheme × runner × single-process dispatcher × dtype (None: every registered scheme / runner)."""
    env = Environment.detect(device)
    out = []
    for scheme in schemes or SCHEMES.names():
        for runner in runners or RUNNERS.names():
            for dispatcher in single_process_dispatchers():
                for dtype in dtypes:
                    cfg = MoEConfig(**SHAPE, quant=scheme, runner=runner, dispatcher=dispatcher, dtype=dtype,
                                    device=device)
                    out.append((cfg, cell_status(cfg, env)))
    return out


def checkpoint(scheme: str, w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weights under Hugging Face names as a checkpoint of ``scheme`` holds them: w13 [E, 2I, H] and w2 [E, H, I]
    as given (float32) for "none"; for an FP8 scheme float8_e4m3fn weights with ``*_scale_inv`` in the scheme's
    shape, which load_weights keeps as they are."""
    s = create_scheme(scheme)
    if not s.quantized:
        return {"gate_up_proj": w13, "down_proj": w2}
    state = {}
    for name, w in (("gate_up_proj", w13), ("down_proj", w2)):
        state[name], state[name + "_scale_inv"] = s.quantize_weight(w)
    return state


class _Inputs:
    """The seeded weights and batches, drawn once on the CPU (float32) and given to each cell in its dtype and on its
    device (each scheme's checkpoint moved once per device); the comparand's outputs kept per (scheme, dispatcher,
    dtype)."""

    def __init__(self, tokens, seed: int):
        g = torch.Generator().manual_seed(seed)
        e, h, i = SHAPE["num_experts"], SHAPE["hidden_size"], SHAPE["intermediate_size"]
        self.batches = batches(tokens)
        self.w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5  # outputs O(1), as nn.Linear's init
        self.w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
        self.calls = []
        for b in self.batches:
            x, logits = torch.randn(b.tokens, h, generator=g), torch.randn(b.tokens, e, generator=g)
            if b.idle_expert is not None:
                logits[:, b.idle_expert] = -1e4  # never among a token's top-k
            self.calls.append((x, logits))
        self._states, self.expected = {}, {}

    def state(self, scheme: str, device: torch.device) -> dict[str, torch.Tensor]:
        key = (scheme, device)
        if key not in self._states:
            self._states[key] = {k: v.to(device) for k, v in checkpoint(scheme, self.w13, self.w2).items()}
        return self._states[key]

    def outputs(self, layer: MoE) -> list[torch.Tensor]:
        """The layer's outputs for every batch, its buffers poisoned, in float64 on the CPU."""
        cfg = layer.config
        layer.load_weights(self.state(cfg.quant, cfg.device))
        with torch.no_grad(), poisoned_allocations():
            outs = [layer(x.to(cfg.dtype).to(cfg.device), logits.to(cfg.device)) for x, logits in self.calls]
        return [o.double().cpu() for o in outs]


def run_cell(cfg: MoEConfig, inputs: _Inputs) -> Row:
    """Build the cell's layer, load the weights, run the batches and compare with the comparand: the reference runner
    on the same device, or, for the reference runner on a GPU, the reference runner on the CPU. Anything raised is
    the cell's failure (a cell the planner accepts must build and run)."""
    dtype = str(cfg.dtype).removeprefix("torch.")
    row = Row(cfg.quant, cfg.runner, cfg.dispatcher, dtype, "pass", tokens=[b.label for b in inputs.batches],
              tol=rel_tol(cfg.quant, cfg.dtype))
    start = time.perf_counter()
    try:
        layer = MoE(cfg, init_weights=False)
        row.weight_only = layer.plan.weight_only
        got = inputs.outputs(layer)
        if cfg.runner == COMPARAND:
            inputs.expected[(cfg.quant, cfg.dispatcher, dtype)] = got
            want = _cpu_reference(cfg, layer, inputs)
            if want is None:
                row.status, row.tol, row.detail = "comparand", None, "the other cells' comparand"
                return row
            row.detail = "against the reference runner on the CPU"
        else:
            want = inputs.expected.get((cfg.quant, cfg.dispatcher, dtype))
            if want is None:  # the reference cell was not asked for (--runners), or failed
                want = _comparand(cfg, inputs)
    except Exception as exc:  # a compile error, a CUDA fault, a coded error: the cell's failure, reported as such
        row.status, row.tol = "FAIL", None
        row.detail = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:500]
        return row
    finally:
        row.seconds = time.perf_counter() - start
    row.errors = [relative_error(g, w) for g, w in zip(got, want)]
    worst = max(range(len(row.errors)), key=lambda j: (math.isnan(row.errors[j]), row.errors[j]))
    row.rel_err = row.errors[worst]
    if not all(e <= row.tol for e in row.errors):  # NaN fails
        row.status = "FAIL"
        row.detail = f"worst at {inputs.batches[worst].label} tokens; {row.detail}".rstrip("; ")
    return row


def _comparand(cfg: MoEConfig, inputs: _Inputs) -> list[torch.Tensor]:
    """The reference runner's outputs for ``cfg``'s scheme, dispatcher and dtype, where its own cell did not run
    (kept for the next cell of the three)."""
    key = (cfg.quant, cfg.dispatcher, str(cfg.dtype).removeprefix("torch."))
    try:
        inputs.expected[key] = inputs.outputs(MoE(cfg.replace(runner=COMPARAND), init_weights=False))
        return inputs.expected[key]
    except Exception as exc:  # said as the comparand's failure, not the cell's
        raise RuntimeError(f"the comparand (runner {COMPARAND!r}) failed: {type(exc).__name__}: {exc}") from exc


def _cpu_reference(cfg: MoEConfig, layer: MoE, inputs: _Inputs) -> list[torch.Tensor] | None:
    """The reference runner's outputs on the CPU for a reference cell on a GPU; None on the CPU, or where the CPU
    layer's scheme is of another kind than the GPU layer's (one computes something else by design)."""
    if cfg.device.type == "cpu":
        return None
    cpu = MoE(cfg.replace(device="cpu"), init_weights=False)
    if type(cpu.scheme) is not type(layer.scheme):
        return None
    return inputs.outputs(cpu)


def run(device: torch.device, schemes=None, runners=None, dtypes=DTYPES, tokens=TOKENS, seed: int = 0,
        progress=None) -> list[Row]:
    """Every cell of ``cells`` on ``device``: refused ones as "refused" rows, the others run (run_cell); the rows in
    ``cells``' order. The reference runner's cells run first, so the others reuse their outputs.
    ``progress(done, total, what)`` is called before each cell."""
    planned = cells(device, schemes, runners, dtypes)
    inputs = _Inputs(tokens, seed)
    order = sorted(range(len(planned)), key=lambda j: planned[j][0].runner != COMPARAND)
    rows: dict[int, Row] = {}
    with warnings.catch_warnings():  # a layer on an unvalidated GPU warns "run `moeflow selftest`": this is it
        warnings.filterwarnings("ignore", message="moeflow: .*moeflow selftest")
        for done, j in enumerate(order):
            rows[j] = _cell_row(*planned[j], inputs, progress, done, len(planned))
    if progress:
        progress(len(planned), len(planned), "")
    return [rows[j] for j in range(len(planned))]


def _cell_row(cfg: MoEConfig, status: str, inputs: _Inputs, progress, done: int, total: int) -> Row:
    dtype = str(cfg.dtype).removeprefix("torch.")
    if progress:
        progress(done, total, f"{cfg.quant} {cfg.runner} {cfg.dispatcher} {dtype}")
    if status != "ok":
        return Row(cfg.quant, cfg.runner, cfg.dispatcher, dtype, "refused", code=status)
    return run_cell(cfg, inputs)


def machine(device: torch.device, rows: list[Row]) -> dict:
    """What the JSON and the header say of the machine: device name, compute capability, the environment as the
    planner sees it, its word on the runners and on the GPU (validation), versions, moeflow's commit, date."""
    env = Environment.detect(device)
    cuda = device.type == "cuda"
    info = dict(device=str(device), name=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
                capability="{}.{}".format(*torch.cuda.get_device_capability(device)) if cuda else None,  # the GPU's own
                environment=env.describe(), planner=planner_note(rows),
                moeflow=_version(), commit=_commit(), torch=torch.__version__, triton=_triton_version(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    info["unvalidated"], info["validation"] = validation(device)
    return info


def planner_note(rows: list[Row]) -> str:
    """Which runners the planner builds here and which it refuses, with the codes, from the cells' rows:
    "runs reference, grouped_mm (some cells refused: MF202); refuses triton (MF203)"."""
    ran, refused = {}, {}
    for r in rows:
        if r.status == "refused":
            refused.setdefault(r.runner, set()).add(r.code)
        else:
            ran[r.runner] = True
    runs = [name + (f" (some cells refused: {', '.join(sorted(refused[name]))})" if name in refused else "")
            for name in ran]
    off = [f"{name} ({', '.join(sorted(codes))})" for name, codes in refused.items() if name not in ran]
    note = f"runs {', '.join(runs) or 'nothing'}" + (f"; refuses {', '.join(off)}" if off else "")
    return note


def validation(device: torch.device) -> tuple[str, str]:
    """The planner's word on this device, from the "auto" plan of the default cell (bf16, no quantization):
    (its Plan.unvalidated, "" where nothing in the plan is unvalidated; the header's line)."""
    try:
        chosen = plan(MoEConfig(**SHAPE, device=device), Environment.detect(device))
    except MoeflowError as exc:
        return "", f"no plan for the default cell ({exc.code})"
    if chosen.unvalidated:
        return chosen.unvalidated, f"NOT VALIDATED: {chosen.unvalidated}"
    if device.type != "cuda":
        return "", f"{device.type}: torch code, no GPU kernels to validate"
    return "", f"validated (the auto plan's runner {chosen.runner!r}, router {chosen.router!r})"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _version() -> str:
    from . import __version__
    return __version__


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or a broken install raising anything: no version to report
        return None
    return getattr(triton, "__version__", None)


def _commit() -> str | None:
    """`git describe --always --dirty` of the checkout moeflow is imported from, where it is one (an installed wheel:
    None)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             timeout=10, check=False)
        if top.returncode or os.path.realpath(top.stdout.strip()) != os.path.realpath(root):
            return None
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() or None
