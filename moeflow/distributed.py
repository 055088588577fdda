"""Expert parallelism on torch.distributed: the group (resolve_group, init_distributed), its timeout
(MOEFLOW_DIST_TIMEOUT_S: wait, collective), and the agreement of ranks at construction (check_agreement).
Every collective moeflow starts is ``async_op=True`` and ends in :func:`wait`.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from . import env
from .errors import MoeflowError, error


# torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single; 2.11 has the old name only
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_start(out: Tensor, t: Tensor, group):
    """Start an all-gather of ``t`` [n, ...] from every rank into ``out`` [W * n, ...]; -> work."""
    return _ALL_GATHER(out, t, group=group, async_op=True)


def resolve_group(process_group):
    """The group expert parallelism runs on: ``process_group`` itself, else the default group when
    torch.distributed is initialized (so ``torchrun`` + ``MoE(...)`` is expert-parallel with no extra argument),
    else None (one process). A group of size 1 (``dist.new_group([rank])``) keeps a layer local inside a
    distributed job."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def timeout_s() -> float:
    return env.DIST_TIMEOUT_S.get_positive()


def init_distributed(backend: str | None = None, device: torch.device | None = None) -> torch.device:
    """Initialize the default group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    backend: "nccl" when CUDA is available, else "gloo". Returns this rank's device
    (``cuda:LOCAL_RANK`` for NCCL, made current; ``cpu`` for gloo). The collective timeout comes from
    ``MOEFLOW_DIST_TIMEOUT_S``; NCCL gets ``device_id=`` (without it a ``barrier()`` can hang).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if device is None:
        local = env.LOCAL_RANK.get_count()
        device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s()), **kwargs)
    return device


def comm_device(device: torch.device) -> torch.device:
    """The device collectives of a layer on ``device`` use (an index for bare "cuda")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextmanager
def collective(what: str, group):
    """Turn a backend exception raised while starting or waiting for ``what`` into MF502 / MF505."""
    try:
        yield
    except MoeflowError:
        raise
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError subclasses (DistBackendError, ...)
        rank = dist.get_rank(group) if group is not None else 0
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            raise error("MF502", what=what, seconds=timeout_s(), rank=rank) from exc
        raise error("MF505", what=what, rank=rank, why=text) from exc


def wait(work, what: str, group, device: torch.device, host: bool = False) -> None:
    """Finish an ``async_op=True`` collective.

    CPU: the host waits up to MOEFLOW_DIST_TIMEOUT_S (MF502 after). CUDA with ``host=False``: the
    current stream waits for the collective, the host does not (low-latency dispatch, CUDA graphs); a stopped
    rank is then caught by the NCCL watchdog at the group's own timeout, which init_distributed sets from the
    same variable. CUDA with ``host=True``: the host polls the collective until it completes or the timeout
    passes (MF502). A backend failure raises MF505 (collective).
    """
    seconds = timeout_s()
    with collective(what, group):
        if device.type != "cuda":
            work.wait(timeout=timedelta(seconds=seconds))
            return
        if host:
            deadline, polls = time.monotonic() + seconds, 0
            while not work.is_completed():  # spin first: a sleep costs ~60 µs, about a whole small exchange
                polls += 1
                if polls > 2000:
                    if time.monotonic() > deadline:
                        raise error("MF502", what=what, seconds=seconds, rank=dist.get_rank(group))
                    time.sleep(1e-4)
        work.wait()


def all_gather_host(t: Tensor, group, what: str) -> Tensor:
    """All-gather a small tensor [n, ...] from every rank -> [W * n, ...], waited on the host."""
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    with collective(what, group):
        work = all_gather_start(out, t.contiguous(), group)
    wait(work, what, group, t.device, host=True)
    return out


def all_gather_json(value, group, what: str, device: torch.device) -> list:
    """Every rank's ``value`` (JSON-able), in rank order: two small all-gathers (lengths, then the padded JSON
    bytes), each bounded by MOEFLOW_DIST_TIMEOUT_S (MF502 if a rank never joins), where torch's
    all_gather_object waits for as long as the group's own timeout."""
    blob = json.dumps(value, sort_keys=True, default=str).encode()
    sizes = all_gather_host(torch.tensor([len(blob)], dtype=torch.int64, device=device), group, what).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:len(blob)] = torch.tensor(list(blob), dtype=torch.uint8, device=device)
    rows = all_gather_host(padded[None], group, what).cpu()
    return [json.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(sizes)]


def check_agreement(fields: dict, group, device: torch.device) -> None:
    """Raise MF501 on every rank, naming the first field that differs, when the ranks' ``fields`` (JSON-able
    values) differ (all_gather_json): every rank raises, so no rank is left waiting."""
    rank = dist.get_rank(group)
    everyone = all_gather_json(fields, group, "the expert-parallel configuration check", device)
    ours = everyone[rank]
    for other, theirs in enumerate(everyone):
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                raise error("MF501", rank=rank, other=other, field=key, mine=ours.get(key), theirs=theirs.get(key))
