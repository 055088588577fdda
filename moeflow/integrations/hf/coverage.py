"""Coverage of the MoE families (families.py): each family's tiny random model (build.py) run with transformers'
eager experts, with experts_implementation="moeflow" and with replace_moe_blocks, on the same token ids (CPU,
float32 unless asked), and the logits compared. ``check_family`` -> one Row (scripts/family_table.py: the page).

Each path ends in one Outcome: works (moeflow ran, relative error within the layer's tolerance), wrong (moeflow ran,
error above it), refused (a MoeflowError: its code and why), error (any other exception: a bug of moeflow, of the
harness or of transformers, to look into), n/a (no experts interface) or skipped (no tiny model could be built).
"""
from __future__ import annotations

import copy
import pathlib
import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import MoeflowError
from ...tolerances import rel_tol
from .build import VOCAB, tiny_family_model
from .experts import is_experts_module
from .families import Family, experts_classes

TOKENS = (2, 8)  # batch, sequence
_FLAGS = {"has_gate": True, "has_bias": False, "is_concatenated": True, "is_transposed": False,
          "has_post_expert_norm": False}  # use_experts_implementation's flags and their defaults
_CUTS = (" is not supported by", "; supported blocks", "; valid")  # where a refusal's reason ends and its fix begins
_REPOSITORY = str(pathlib.Path(__file__).resolve().parents[3]) + "/"  # file names shown relative to it


@dataclass
class Outcome:
    """status: works | wrong | refused | error | n/a | skipped; err: relative error of the logits (works, wrong);
    code: the MoeflowError code (refused); why: the refusal's reason or the exception; where: file:line raised."""
    status: str
    err: float | None = None
    code: str = ""
    why: str = ""
    where: str = ""


@dataclass
class Row:
    family: str
    interface: bool
    model: str = ""
    experts: Outcome = field(default_factory=lambda: Outcome("skipped"))
    blocks: Outcome = field(default_factory=lambda: Outcome("skipped"))
    traits: list[str] = field(default_factory=list)  # what its MoE is: see _traits
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _why(exc: BaseException) -> str:
    text = exc.detail if isinstance(exc, MoeflowError) else f"{type(exc).__name__}: {exc}"
    for cut in _CUTS:
        text = text.split(cut)[0]
    return " ".join(text.split())[:300]


def _where(exc: BaseException) -> str:
    """The innermost frame in moeflow if the traceback passes through moeflow, else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/moeflow/" in f.filename and "/integrations/hf/coverage.py" not in f.filename]
    f = (ours or frames or [None])[-1]
    return f"{f.filename.split('site-packages/')[-1].replace(_REPOSITORY, '')}:{f.lineno}" if f else ""


def _failed(exc: BaseException) -> Outcome:
    if isinstance(exc, MoeflowError):
        return Outcome("refused", code=exc.code, why=_why(exc), where=_where(exc))
    return Outcome("error", why=_why(exc), where=_where(exc))


class Expired(BaseException):
    """A family's time box ran out (a BaseException, so that no ``except Exception`` of a path catches it)."""


@contextmanager
def _time_box(seconds: float):
    """Expired after ``seconds`` (SIGALRM: main thread of a POSIX process only; elsewhere no limit)."""
    def expire(*_):
        raise Expired(f"over the time box of {seconds:g} s")
    try:
        old = signal.signal(signal.SIGALRM, expire)
    except (ValueError, AttributeError):
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@torch.no_grad()
def _logits(model, ids):
    extra = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    return model(input_ids=ids, **extra)[0]


def _compare(out, ref, ran: bool, what: str) -> Outcome:
    err = rel_err(out, ref)
    if not ran:
        return Outcome("error", err, why=f"{what}: moeflow did not run (the model's output never reached it)")
    return Outcome("works" if err <= rel_tol("none", ref.dtype) else "wrong", err)  # NaN reads wrong


def _traits(model: nn.Module) -> list[str]:
    """Descriptive, not a verdict: the first experts module's class with the decorator flags that differ from their
    defaults, a custom gate function and the activation; the block holding it, with its router module."""
    block = next((m for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)), None)
    if block is None:
        return []
    experts = block.experts
    marks = [f"{k}={getattr(experts, k)}" for k, d in _FLAGS.items() if getattr(experts, k, d) != d]
    gate = getattr(getattr(type(experts), "_apply_gate", None), "__qualname__", "_default_apply_gate")
    marks += [f"gate {gate}"] if gate != "_default_apply_gate" else []
    act = getattr(experts, "act_fn", None)
    marks += [f"act {getattr(act, '__name__', type(act).__name__)}"] if act is not None else []
    router = next((a for a in ("gate", "router") if isinstance(getattr(block, a, None), nn.Module)), None)
    routed = f" (router `{router}`: {type(getattr(block, router)).__name__})" if router else ""
    described = type(experts).__name__ + (f": {', '.join(marks)}" if marks else "")
    return [described, f"block {type(block).__name__}{routed}"]


def _experts_path(model, ids, ref, fam: Family) -> Outcome:
    classes = tuple(experts_classes(fam))
    try:
        model.set_experts_implementation("moeflow")
        out = _logits(model, ids)
    except Exception as exc:
        return _failed(exc)
    finally:
        model.set_experts_implementation("eager")
    ran = [bool(m.__dict__.get("_moeflow_paths")) for m in model.modules() if isinstance(m, classes)]
    outcome = _compare(out, ref, any(ran), "experts_implementation='moeflow'")
    if any(ran) and not all(ran):  # e.g. a vision-language model's image experts, idle on text
        outcome.why = f"moeflow ran {sum(ran)} of {len(ran)} experts modules (the others got no tokens)"
    return outcome


def _block_path(model, ids, ref) -> tuple[Outcome, list[str]]:
    from . import replace_moe_blocks
    from .blocks import MoeflowBlock
    try:
        replaced = copy.deepcopy(model)
        names = replace_moe_blocks(replaced)
        out = _logits(replaced, ids)
    except Exception as exc:
        return _failed(exc), []
    ran = any(isinstance(m, MoeflowBlock) for m in replaced.modules())
    return _compare(out, ref, ran, "replace_moe_blocks"), names


def check_family(fam: Family, time_box_s: float = 120.0, seed: int = 0, dtype: torch.dtype = torch.float32) -> Row:
    """Build, run and compare one family (see the module docstring) in ``dtype``, each path held to the layer's
    tolerance for that dtype (moeflow/tolerances.py); never raises for the family's own failures."""
    row, start = Row(fam.name, fam.interface), time.perf_counter()
    try:
        with _time_box(time_box_s):
            try:
                model, _ = tiny_family_model(fam, seed=seed)
            except Exception as exc:
                row.notes.append(f"no tiny model: {_why(exc)} ({_where(exc)})")
                return row
            model, row.model, row.traits = model.to(dtype), type(model).__name__, _traits(model)
            if model.main_input_name != "input_ids":
                row.notes.append(f"takes {model.main_input_name}, not token ids")
                return row
            ids = torch.randint(0, VOCAB, TOKENS, generator=torch.Generator().manual_seed(seed))
            if fam.interface:
                model.set_experts_implementation("eager")
            try:
                ref = _logits(model, ids)
            except Exception as exc:
                row.notes.append(f"transformers' eager forward failed: {_why(exc)} ({_where(exc)})")
                return row
            classes = tuple(experts_classes(fam))
            unseen = [m for m in model.modules() if isinstance(m, classes) and not is_experts_module(m)]
            if unseen:  # prepare_experts skips them and replace_moe_blocks finds no block around them
                row.notes.append(f"is_experts_module misses {type(unseen[0]).__name__} ({len(unseen)} modules)")
            row.experts = _experts_path(model, ids, ref, fam) if fam.interface else Outcome(
                "n/a", why="no experts interface: transformers computes these experts in the model's own code")
            row.blocks, names = _block_path(model, ids, ref)
            if names:
                row.notes.append(f"blocks replaced: {len(names)}")
    except Expired as exc:
        row.notes.append(str(exc))
    finally:
        row.seconds = time.perf_counter() - start
    return row
