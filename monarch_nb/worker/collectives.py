"""Collectives on torch.distributed: the default process group, process groups
per (mesh, dims, stream), the header every collective starts with, the flat
gather / reduce-scatter helpers, and point-to-point copies (the reductions of
``Ref.reduce`` themselves are in ``reductions``).

Every collective starts with a small all-gather of a header (status, dtype,
shape; for a reduce also out='s, and a go-ahead flag) on its group. It lets each
rank see whether any rank's input failed (then every rank skips the data
collective, or joins it with a stand-in, and its result depends on the original
failure: no rank hangs, nothing cascades) or whether inputs disagree (then every
rank raises the same clear error). This replaces the reference's "take part
with zeros of the right shape" and costs one small collective, which an
all_reduce of the shape its group agreed on last time runs alongside its data
(reductions._all_reduce).
"""

from __future__ import annotations

import datetime
import queue
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..config import process_settings
from .ref_cell import DependentOnError

HEADER_DIMS = 8
HEADER_LEN = 3 + HEADER_DIMS
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
NOT_A_TENSOR = -1
TOO_MANY_DIMS = -2
UNSUPPORTED_DTYPE = -3
NO_OUT = -4  # the out slot of a collective called without out=
WRONG_DEVICE = -5
_STATUS_TEXT = {
    NOT_A_TENSOR: "not a tensor",
    TOO_MANY_DIMS: f"more than {HEADER_DIMS} dims",
    UNSUPPORTED_DTYPE: "an unsupported dtype",
    NO_OUT: "no out= tensor",
    WRONG_DEVICE: "a tensor on another device than the input",
}
_NO_SLOT = object()


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=process_settings()["collective_timeout"])


class Comms:
    """One worker's torch.distributed state."""

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world
        self.backend: str | None = None
        self.store_generation: int | None = None  # of the controller's store, if joined by it
        self.ready = threading.Event()
        self.init_error: BaseException | None = None
        self.groups: dict[int, Future] = {}
        self.agreed: dict[int, dict] = {}  # per group: what its last all_reduce agreed on
        self._setup_q: queue.SimpleQueue = queue.SimpleQueue()
        self._setup_thread: threading.Thread | None = None

    # -------------------------------------------------------------- set-up

    def init_backend(self, address: str, backend: str, link=None) -> None:
        """Join the default process group (runs on the default stream, first) through
        the store of ``address`` (the controller's is reached through ``link``)."""
        from .store import open_store

        try:
            store = open_store(address, self.world, link, _timeout())
            self.store_generation = getattr(store, "generation", None)
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


def header_of(value, device: torch.device | None = None) -> list:
    """[status, dtype index, ndim, *shape, 0...] of ``value`` (HEADER_LEN ints);
    with ``device``, a tensor elsewhere gets WRONG_DEVICE."""
    if isinstance(value, DependentOnError):
        status = value.ident
    elif not isinstance(value, torch.Tensor):
        status = NOT_A_TENSOR
    elif value.dim() > HEADER_DIMS:
        status = TOO_MANY_DIMS
    elif value.dtype not in _DTYPES:
        status = UNSUPPORTED_DTYPE
    elif device is not None and value.device != device:
        status = WRONG_DEVICE
    else:
        shape = list(value.shape)
        return [0, _DTYPES.index(value.dtype), len(shape), *shape] + [0] * (
            HEADER_DIMS - len(shape)
        )
    return [status] + [0] * (HEADER_LEN - 1)


def describe(h) -> str:
    """A header in words: "torch.float32 (4, 3)", "not a tensor"..."""
    status = int(h[0])
    if status < 0:
        return _STATUS_TEXT[status]
    return f"{_DTYPES[int(h[1])]} {header_shape(h)}"


def header_shape(h) -> tuple:
    return tuple(int(x) for x in h[3 : 3 + int(h[2])])


def header_dtype(h) -> torch.dtype:
    return _DTYPES[int(h[1])]


def device_for(backend: str | None, value) -> torch.device:
    if isinstance(value, torch.Tensor):
        return value.device
    if backend and "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class HeaderExchange:
    """One collective's header all-gather, started at construction. This rank's
    row: its input's header, then (for a collective with out=) the out tensor's
    (NO_OUT for none), then a go-ahead flag: whether this rank has already
    started the data collective (see reductions). Headers are lists of ints:
    one tensor per row sent, one ``tolist`` per gather, no small tensor ops."""

    def __init__(self, pg, members: tuple, value, backend, out=_NO_SLOT, ahead: bool = False):
        self.with_out = out is not _NO_SLOT
        row = header_of(value)
        if self.with_out:
            if out is None:
                row += [NO_OUT] + [0] * (HEADER_LEN - 1)
            else:
                row += header_of(out, value.device if isinstance(value, torch.Tensor) else None)
        row.append(int(ahead))
        dev = device_for(backend, value)
        mine = torch.tensor(row, dtype=torch.int64, device=dev)
        self._gathered = torch.empty((len(members), len(row)), dtype=torch.int64, device=dev)
        self._work = all_gather_into(self._gathered, mine, pg, async_op=True)

    def rows(self) -> tuple:
        """Wait; (input headers, out headers or None, whether any rank went ahead)."""
        if self._work is not None:
            self._work.wait()
        rows = self._gathered.tolist()
        outs = [r[HEADER_LEN : 2 * HEADER_LEN] for r in rows] if self.with_out else None
        return [r[:HEADER_LEN] for r in rows], outs, any(r[-1] for r in rows)


def check_headers(headers: list, outs: list | None, members: tuple) -> None:
    """Raise DependentOnError if any input or out failed, and the same clear error
    on every rank if the inputs are not tensors of one dtype and shape."""
    failed = [int(h[0]) for h in headers + (outs or []) if int(h[0]) > 0]
    if failed:
        raise DependentOnError(min(failed))
    descs = [describe(h) for h in headers]
    if any(int(h[0]) < 0 for h in headers) or len(set(descs)) > 1:
        detail = ", ".join(f"rank {r}: {d}" for r, d in zip(members, descs))
        raise ValueError(
            f"collective inputs must be tensors of one dtype and shape on every rank ({detail})"
        )


def exchange_headers(pg, members: tuple, value, backend: str | None, out=_NO_SLOT) -> tuple:
    """Gather every member's header (and, when ``out`` is passed, the header of
    that ``out`` tensor, None for none) and check them (check_headers).
    Returns (input headers, ``out`` headers or None), one per member, on the CPU."""
    headers, outs, _ = HeaderExchange(pg, members, value, backend, out).rows()
    check_headers(headers, outs, members)
    return headers, outs


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _unsupported(e: BaseException) -> bool:
    text = str(e).lower()
    return "not supported" in text or "unsupported" in text or "not implemented" in text


def all_gather_into(output, local, pg, async_op: bool = False):
    """Gather contiguous ``local`` from every member into contiguous ``output``
    of shape (n, *local.shape), in group-rank order; the Work if ``async_op``.
    Flat views: gloo checks dim 0 of a shaped output against world * dim 0 of
    the input."""
    try:
        return _gather_flat(output.view(-1), local.view(-1), group=pg, async_op=async_op)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        rows = list(output.view(-1, *local.shape).unbind(0))
        return dist.all_gather(rows, local, group=pg, async_op=async_op)


def reduce_scatter_into(output, local, op, pg, n) -> None:
    """Reduce contiguous ``local`` (numel n * output.numel()) over members; group
    rank g keeps chunk g of the flattened result in contiguous ``output``."""
    try:
        _scatter_flat(output.view(-1), local.view(-1), op=op, group=pg)
    except (RuntimeError, NotImplementedError) as e:
        if not _unsupported(e):
            raise
        full = local.clone()
        dist.all_reduce(full, op=op, group=pg)
        output.view(-1).copy_(full.view(-1).chunk(n)[dist.get_rank(pg)])


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
    dev = device_for(backend, value)
    header_out = (
        torch.tensor(header_of(value), dtype=torch.int64, device=dev)
        if send_to is not None
        else None
    )
    header_in = (
        torch.empty(HEADER_LEN, dtype=torch.int64, device=dev) if recv_from is not None else None
    )
    _p2p([(dist.isend, header_out, send_to), (dist.irecv, header_in, recv_from)], pg)
    sending = header_out is not None and int(header_out[0]) == 0
    output = None
    if header_in is not None and int(header_in[0]) == 0:
        h = header_in.tolist()
        output = torch.empty(header_shape(h), dtype=header_dtype(h), device=dev)
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
                f"to_mesh: rank {recv_from} holds {describe(header_in.tolist())}, not a tensor"
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
