"""Collectives on torch.distributed: the default process group, process groups
per (mesh, dims, stream), reductions and point-to-point copies.

Every collective starts with a small all-gather of a header (status, dtype,
shape) on its group. It lets each rank see, before the data moves, whether any
rank's input failed (then every rank skips the data collective and its result
depends on the original failure: no rank hangs, nothing cascades) or whether
inputs disagree (then every rank raises the same clear error). This replaces
the reference's "take part with zeros of the right shape" and costs one small
collective.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

from .cell import DependentOnError

HEADER_DIMS = 8
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
NOT_A_TENSOR = -1
TOO_MANY_DIMS = -2
UNSUPPORTED_DTYPE = -3
REDUCTIONS = ("sum", "avg", "max", "min", "product", "stack")


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("MONARCH_NB_COLLECTIVE_TIMEOUT", "300")))


class Comms:
    """One worker's torch.distributed state."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        self.backend: str | None = None
        self.ready = threading.Event()
        self.init_error: BaseException | None = None
        self.groups: dict[int, Future] = {}
        self._setup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._setup_thread: threading.Thread | None = None

    # -------------------------------------------------------------- set-up

    def init_backend(self, address: str, backend: str) -> None:
        """Join the default process group (runs on the default stream, first)."""
        try:
            if address.startswith("file://"):
                store = dist.FileStore(address[len("file://") :], self.world)
            else:
                host, port = address[len("tcp://") :].rsplit(":", 1)
                store = dist.TCPStore(host, int(port), is_master=False, timeout=_timeout())
            if backend == "nccl":
                backend = "cpu:gloo,cuda:nccl"
            dist.init_process_group(
                backend, store=store, rank=self.rank, world_size=self.world, timeout=_timeout()
            )
            self.backend = backend
        except BaseException as e:
            self.init_error = e
            raise
        finally:
            self.ready.set()

    def create_groups(self, key: int, groups: tuple) -> None:
        """Create one process group per member list, in the order given. Every
        world rank takes part in each creation (on one set-up thread, in the
        controller's order), so names and store keys agree across ranks."""
        self.groups[key] = Future()
        self._setup_q.put((key, groups))
        if self._setup_thread is None:
            self._setup_thread = threading.Thread(
                target=self._setup_loop, name="monarch-pg-setup", daemon=True
            )
            self._setup_thread.start()

    def _setup_loop(self) -> None:
        while True:
            key, groups = self._setup_q.get()
            fut = self.groups[key]
            try:
                self.ready.wait()
                if self.init_error is not None:
                    raise RuntimeError(f"torch.distributed failed to start: {self.init_error!r}")
                mine = None
                for members in groups:
                    pg = dist.new_group(list(members), timeout=_timeout())
                    if self.rank in members:
                        mine = (pg, tuple(members))
                fut.set_result(mine)
            except BaseException as e:
                fut.set_exception(e)

    def group(self, key: int) -> tuple:
        """(process group, member ranks) of ``key`` for this rank; waits for its creation."""
        fut = self.groups.get(key)
        if fut is None:
            raise RuntimeError(f"process group {key} was never created on rank {self.rank}")
        mine = fut.result(timeout=_timeout().total_seconds())
        if mine is None:
            raise RuntimeError(f"rank {self.rank} is not a member of process group {key}")
        return mine


# ------------------------------------------------------------------ headers


def _header(value) -> torch.Tensor:
    h = torch.zeros(3 + HEADER_DIMS, dtype=torch.int64)
    if isinstance(value, DependentOnError):
        h[0] = value.ident
    elif not isinstance(value, torch.Tensor):
        h[0] = NOT_A_TENSOR
    elif value.dim() > HEADER_DIMS:
        h[0] = TOO_MANY_DIMS
    elif value.dtype not in _DTYPES:
        h[0] = UNSUPPORTED_DTYPE
    else:
        h[1] = _DTYPES.index(value.dtype)
        h[2] = value.dim()
        h[3 : 3 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
    return h


def _describe(h: torch.Tensor) -> str:
    status = int(h[0])
    if status == NOT_A_TENSOR:
        return "not a tensor"
    if status == TOO_MANY_DIMS:
        return f"more than {HEADER_DIMS} dims"
    if status == UNSUPPORTED_DTYPE:
        return "an unsupported dtype"
    return f"{_DTYPES[int(h[1])]} {tuple(int(x) for x in h[3 : 3 + int(h[2])])}"


def _device(backend: str | None, value) -> torch.device:
    if isinstance(value, torch.Tensor):
        return value.device
    if backend and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange_headers(pg, members: tuple, value, backend: str | None) -> list:
    """All-gather every member's header; raise DependentOnError if any input failed,
    and the same clear error on every rank if inputs are not alike tensors."""
    dev = _device(backend, value)
    mine = _header(value).to(dev)
    headers = [torch.empty_like(mine) for _ in members]
    dist.all_gather(headers, mine, group=pg)
    headers = [h.cpu() for h in headers]
    failed = [int(h[0]) for h in headers if int(h[0]) > 0]
    if failed:
        raise DependentOnError(min(failed))
    descs = [_describe(h) for h in headers]
    if any(int(h[0]) < 0 for h in headers) or len(set(descs)) > 1:
        detail = ", ".join(f"rank {r}: {d}" for r, d in zip(members, descs))
        raise ValueError(
            f"collective inputs must be tensors of one dtype and shape on every rank ({detail})"
        )
    return headers


# ------------------------------------------------------------------ reductions


def run_reduce(msg, comms: Comms, value, out):
    """A Reduce message's collective on this rank (``value`` may be a DependentOnError)."""
    pg, members = comms.group(msg.key)
    return reduce(
        value,
        out,
        pg,
        members,
        msg.reduction,
        msg.scatter,
        msg.inplace,
        msg.dim_sizes,
        comms.backend,
    )


def reduce(
    value,
    out,
    pg,
    members: tuple,
    reduction: str,
    scatter: bool,
    inplace: bool,
    dim_sizes: tuple,
    backend: str | None,
):
    """One rank's part of ``Ref.reduce``. ``value`` may be a DependentOnError.

    stack -> all_gather_into_tensor; scatter -> reduce_scatter_tensor; stack +
    scatter -> all_to_all_single; else all_reduce. On gloo, "avg" is a sum
    followed by a division (gloo has no AVG), and if the installed gloo lacks
    all_gather_into_tensor or reduce_scatter_tensor they are composed from
    all_gather / all_reduce.
    """
    exchange_headers(pg, members, value, backend)
    n = len(members)
    local = value
    gloo = backend is None or "nccl" not in backend or local.device.type == "cpu"
    if scatter and (local.dim() == 0 or local.shape[0] % n):
        raise ValueError(
            f"scatter splits dim 0 into {n} parts: shape {tuple(local.shape)} does not divide"
        )
    if reduction == "stack":
        if scatter:
            output = out if out is not None else torch.empty_like(local)
            dist.all_to_all_single(output, local.contiguous(), group=pg)
            if inplace:
                local.copy_(output)
                return local
            return output
        if inplace:
            raise ValueError("reduction 'stack' cannot be in place (the result has a new shape)")
        output = out if out is not None else local.new_empty((n, *local.shape))
        _all_gather_into(output, local.contiguous(), pg, n)
        return output.view(*dim_sizes, *local.shape) if len(dim_sizes) > 1 else output
    avg = reduction == "avg"
    op = dist.ReduceOp.SUM if avg and gloo else getattr(dist.ReduceOp, reduction.upper())
    if scatter:
        if inplace:
            raise ValueError(
                "a scattered reduction cannot be in place (the result has a new shape)"
            )
        output = (
            out if out is not None else local.new_empty((local.shape[0] // n, *local.shape[1:]))
        )
        _reduce_scatter(output, local.contiguous(), op, pg, n)
    else:
        if inplace:
            output = local
        elif out is not None:
            output = out.copy_(local)
        else:
            output = local.clone()
        dist.all_reduce(output, op=op, group=pg)
    if avg and gloo:
        if output.is_floating_point() or output.is_complex():
            output.div_(n)
        else:
            output.floor_divide_(n)
    return output


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _unsupported(e: BaseException) -> bool:
    text = str(e).lower()
    return "not supported" in text or "unsupported" in text or "not implemented" in text


def _all_gather_into(output, local, pg, n):
    """Gather ``local`` from every member into ``output`` of shape (n, *local.shape)."""
    try:
        _gather_flat(output.view(-1), local.reshape(-1), group=pg)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        dist.all_gather(list(output.unbind(0)), local, group=pg)


def _reduce_scatter(output, local, op, pg, n):
    """Reduce ``local`` over members; this member keeps its 1/n of dim 0 in ``output``."""
    try:
        _scatter_flat(output.view(-1), local.reshape(-1), op=op, group=pg)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        full = local.clone()
        dist.all_reduce(full, op=op, group=pg)
        output.copy_(full.chunk(n)[dist.get_rank(pg)])


# ------------------------------------------------------------------ point to point


def send_recv(value, pg, rank: int, send_to: int | None, recv_from: int | None, backend=None):
    """One rank's part of ``Ref.to_mesh``: send ``value`` to ``send_to`` and/or
    receive from ``recv_from`` (global ranks). Headers go first, so a receiver
    learns the shape, or the failure it depends on. A rank sending to itself
    makes a copy-on-write clone."""
    if send_to == rank and recv_from == rank:
        if isinstance(value, DependentOnError):
            raise value
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"to_mesh needs a tensor, got {type(value).__name__}")
        return value._lazy_clone() if hasattr(value, "_lazy_clone") else value.clone()
    dev = _device(backend, value)
    header_out = _header(value).to(dev) if send_to is not None else None
    header_in = (
        torch.empty(3 + HEADER_DIMS, dtype=torch.int64, device=dev)
        if recv_from is not None
        else None
    )
    _p2p([(dist.isend, header_out, send_to), (dist.irecv, header_in, recv_from)], pg)
    sending = header_out is not None and int(header_out[0]) == 0
    output = None
    if header_in is not None and int(header_in[0]) == 0:
        h = header_in.cpu()
        shape = tuple(int(x) for x in h[3 : 3 + int(h[2])])
        output = torch.empty(shape, dtype=_DTYPES[int(h[1])], device=dev)
    _p2p(
        [
            (dist.isend, value.contiguous() if sending else None, send_to),
            (dist.irecv, output, recv_from),
        ],
        pg,
    )
    if header_in is not None:
        status = int(header_in[0])
        if status > 0:
            raise DependentOnError(status)
        if status < 0:
            raise TypeError(
                f"to_mesh: rank {recv_from} holds {_describe(header_in.cpu())}, not a tensor"
            )
        return output
    # a rank that only sends: its own failure is reported there, once
    if isinstance(value, DependentOnError):
        raise value
    if not sending:
        raise TypeError(f"to_mesh needs a tensor, got {type(value).__name__}")
    return None


def _p2p(ops, pg) -> None:
    batch = [dist.P2POp(op, t, peer, pg) for op, t, peer in ops if t is not None]
    if batch:
        for w in dist.batch_isend_irecv(batch):
            w.wait()
