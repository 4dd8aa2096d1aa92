"""One rank's part of ``Ref.reduce``, with the reference worker's semantics.

For an input of shape S on each of the n members of the group:

==================  =======  ===============  ==========================================
reduction           scatter  collective       result
==================  =======  ===============  ==========================================
sum avg max min     False    all_reduce       S: the reduction
product
sum ... product     True     reduce_scatter   S[1:]: S[0] must be n; member i gets the
                                              reduction of row i
stack               False    all_gather       (n, *S): row i from member i; over several
                                              dims, (*dim sizes, *S)
stack               True     all_to_all       S: S[0] divisible by n; chunk j of member
                                              i's result is chunk i of member j's input
==================  =======  ===============  ==========================================

"Member i" is the i-th in mesh order (not process-group rank order, which
differs on a mesh sliced with a negative step). ``inplace`` writes the result
into the input (only where the shape stays: all_reduce, all_to_all); ``out``
writes it into that tensor, which must have the result's dtype and shape on
every rank; otherwise the result is a new tensor. The reference refuses stack
and scatter over several dims; here they act on the group of all reduced dims
(its size is the product of theirs, mesh order).

On gloo, "avg" is a sum and a division (gloo has no AVG); integers divide
with truncation, as NCCL's average does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..protocol.reduce_options import check_combination
from .collectives import (
    Comms,
    HeaderExchange,
    all_gather_into,
    check_headers,
    describe,
    device_for,
    exchange_headers,
    header_dtype,
    header_of,
    header_shape,
    reduce_scatter_into,
)


@torch.no_grad()  # a collective is outside autograd: it may write a parameter's shard
def run_reduce(msg, comms: Comms, value, out):
    """A Reduce message's collective on this rank (``value`` and ``out`` may be
    DependentOnErrors)."""
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
        comms.agreed.setdefault(msg.key, {}),
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
    memo: dict | None = None,
):
    """Reduce ``value`` (a tensor, or the DependentOnError it failed with) over
    the group; returns the result tensor (the input, ``out`` or a new one).
    ``memo``: this group's state across calls (lets all_reduce go ahead)."""
    check_combination(reduction, scatter, inplace, out is not None)
    gloo = backend is None or "nccl" not in backend or device_for(backend, value).type == "cpu"
    avg = reduction == "avg"
    op = None if reduction == "stack" else getattr(dist.ReduceOp, reduction.upper())
    if avg and gloo:
        op = dist.ReduceOp.SUM
    n = len(members)
    if reduction != "stack" and not scatter:
        buf, target = _all_reduce(value, out, pg, members, reduction, op, inplace, backend, memo)
    else:
        buf, target = _reshaping(
            value, out, pg, members, reduction, op, scatter, inplace, dim_sizes, backend
        )
    if avg and gloo:
        if buf.is_floating_point() or buf.is_complex():
            buf.div_(n)
        else:
            buf.div_(n, rounding_mode="trunc")
    return _finish(buf, target)


def _all_reduce(value, out, pg, members, reduction, op, inplace, backend, memo):
    """all_reduce; returns (buffer holding the result, tensor to write it into).

    Going ahead: when this rank's input has the header the group agreed on last
    time (``memo``, the same on every rank) and its out= fits, it starts the
    data all_reduce together with the header exchange, so the header costs no
    extra wait. A rank that cannot go ahead (its input failed or differs) sees
    from the headers that others did and joins their all_reduce with a
    stand-in of the agreed shape holding the op's identity; then every rank
    raises the same error. So the in-place input (or out=) of a rank that went
    ahead holds the reduction over the ranks that did not fail (with 2 ranks:
    its own value, except "avg" on NCCL, which divides)."""
    memo = {} if memo is None else memo
    agreed = memo.get("header")
    target = value if inplace else out
    ahead = agreed is not None and _fits(value, out, agreed)
    if ahead:
        buf = _all_reduce_buffer(value, target)
        exchange = HeaderExchange(pg, members, value, backend, out, ahead=True)
        work = dist.all_reduce(buf, op=op, group=pg, async_op=True)
        headers, outs, _ = exchange.rows()
        work.wait()
    else:
        headers, outs, others_ahead = HeaderExchange(pg, members, value, backend, out).rows()
        if others_ahead:
            dtype = header_dtype(agreed)
            stand_in = torch.full(header_shape(agreed), _identity(reduction, dtype), dtype=dtype)
            dist.all_reduce(stand_in.to(memo["device"]), op=op, group=pg)
    if _alike(headers):  # every rank's input is a tensor here
        memo["header"], memo["device"] = headers[0], value.device
    else:
        memo["header"] = None
    check_headers(headers, outs, members)
    if out is not None:
        _check_out(outs, members, header_dtype(headers[0]), header_shape(headers[0]))
    if not ahead:
        if others_ahead:  # unreachable: some rank's input or out differed, checks raised
            raise RuntimeError("reduce: ranks disagree on going ahead")
        buf = _all_reduce_buffer(value, target)
        dist.all_reduce(buf, op=op, group=pg)
    return buf, target


def _all_reduce_buffer(local: torch.Tensor, target) -> torch.Tensor:
    """The contiguous tensor all_reduce runs on: a clone (no target), the target
    holding a copy of the input, or a contiguous stand-in for the target."""
    if target is None:
        return local.clone(memory_format=torch.contiguous_format)
    if target.is_contiguous():
        buf = target
    else:
        buf = torch.empty_like(local, memory_format=torch.contiguous_format)
    if buf is not local:
        buf.copy_(local)
    return buf


def _reshaping(value, out, pg, members, reduction, op, scatter, inplace, dim_sizes, backend):
    """stack and scatter: returns (buffer holding the result, tensor to write it into)."""
    headers, outs = exchange_headers(pg, members, value, backend, out)
    local, n = value, len(members)
    shape = header_shape(headers[0])
    result_shape = _result_shape(reduction, scatter, shape, n, dim_sizes)
    if out is not None:
        _check_out(outs, members, header_dtype(headers[0]), result_shape)
    target = local if inplace else out  # None: a new tensor
    order = _mesh_order(pg, members)
    buf = _buffer(target, result_shape, local)
    if reduction != "stack":
        reduce_scatter_into(buf, _rows(local, n, order), op, pg, n)
        return buf, target
    if scatter:
        dist.all_to_all_single(buf, _rows(local, n, order), group=pg)
    else:
        all_gather_into(buf, local.contiguous(), pg)
    return _rows(buf, n, _inverse(order)), target


def _result_shape(reduction: str, scatter: bool, shape: tuple, n: int, dim_sizes: tuple) -> tuple:
    if reduction == "stack" and not scatter:
        return (*dim_sizes, *shape) if len(dim_sizes) > 1 else (n, *shape)
    if not scatter:
        return shape
    if reduction == "stack":
        if not shape or shape[0] % n:
            raise ValueError(
                f"stack with scatter=True splits dim 0 into {n} equal parts (one per member): "
                f"shape {shape} does not divide"
            )
        return shape
    if not shape or shape[0] != n:
        raise ValueError(
            f"scatter=True needs dim 0 of size {n}, the group's size (member i gets the "
            f"reduction of row i, shape {shape[1:] if shape else '()'}): got shape {shape}"
        )
    return shape[1:]


def _fits(value, out, agreed: list) -> bool:
    """Whether this rank can go ahead: its input has the agreed header and its
    out= (if any) the input's dtype, shape and device."""
    if not isinstance(value, torch.Tensor) or header_of(value) != agreed:
        return False
    return out is None or (
        isinstance(out, torch.Tensor)
        and (out.dtype, out.shape, out.device) == (value.dtype, value.shape, value.device)
    )


def _alike(headers: list) -> bool:
    return headers[0][0] == 0 and all(h == headers[0] for h in headers[1:])


def _identity(reduction: str, dtype: torch.dtype):
    """x op identity == x: the stand-in a rank that did not go ahead contributes."""
    if reduction in ("sum", "avg") or dtype.is_complex:
        return 0
    if reduction == "product":
        return 1
    if dtype == torch.bool:
        return reduction == "min"
    if dtype.is_floating_point:
        return float("-inf") if reduction == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if reduction == "max" else info.max


def _check_out(outs: list, members: tuple, dtype: torch.dtype, shape: tuple) -> None:
    want = f"{dtype} {shape}"
    bad = [(r, describe(h)) for r, h in zip(members, outs) if describe(h) != want]
    if bad:
        detail = ", ".join(f"rank {r}: {d}" for r, d in bad)
        raise ValueError(
            f"out= must be a {dtype} tensor of shape {shape} (the result's) on every rank "
            f"({detail})"
        )


def _mesh_order(pg, members: tuple) -> torch.Tensor | None:
    """``pos`` with pos[g] = mesh position of group rank g; None when they agree."""
    by_group = dist.get_process_group_ranks(pg)
    if list(by_group) == list(members):
        return None
    return torch.tensor([members.index(r) for r in by_group], dtype=torch.long)


def _inverse(order: torch.Tensor | None) -> torch.Tensor | None:
    return None if order is None else torch.argsort(order)


def _rows(t: torch.Tensor, n: int, order: torch.Tensor | None) -> torch.Tensor:
    """``t`` contiguous, its n equal chunks of dim 0 reordered by ``order`` (None: as is)."""
    if order is None:
        return t.contiguous()
    return t.reshape(n, -1)[order.to(t.device)].view(t.shape)


def _buffer(target, shape: tuple, local: torch.Tensor) -> torch.Tensor:
    """Where a collective with a separate output writes: ``target`` when it is
    contiguous and not the input's memory, else a fresh tensor."""
    if (
        target is not None
        and target.is_contiguous()
        and target.untyped_storage().data_ptr() != local.untyped_storage().data_ptr()
    ):
        return target
    return torch.empty(shape, dtype=local.dtype, device=local.device)


def _finish(result: torch.Tensor, target):
    if target is None:
        return result
    if result is not target:
        target.copy_(result)
    return target
