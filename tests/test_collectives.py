"""Meshes, collectives, point-to-point, streams and borrows on real torch.distributed (gloo).

The semantics of each reduce combination are in test_reduce.py."""

import time

import pytest
import torch

import monarch_nb as mnb


def rank_tensor(rows=4, cols=3):
    """A different tensor on every rank (small integers: exact in float32)."""
    r = mnb.current_rank()
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 5 + r + 1


def local_value(rank, rows=4, cols=3):
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 5 + rank + 1


@pytest.fixture(scope="module")
def grid():
    m = mnb.local_mesh(a=2, b=2, name="grid")
    yield m
    m.shutdown()


def test_failed_input_reports_original_failure_and_nobody_hangs(mesh):
    def maybe_fail():
        if mnb.current_rank() == 1:
            raise RuntimeError("data loader broke")
        return torch.ones(3)

    x = mnb.remote(maybe_fail)(mesh=mesh)
    y = x.reduce("dp", "sum")
    z = mnb.remote(torch.mul)(y, 2, mesh=mesh)
    for rank in (0, 1):
        with pytest.raises(mnb.RemoteError, match="data loader broke") as ei:
            z.fetch(rank=rank, timeout=60)
        assert set(ei.value.failures) == {1}
    errors = [e for e in mesh.status()["errors"] if "data loader broke" in e["message"]]
    assert len(errors) == 1 and errors[0]["ranks"] == [1]  # reported once, no cascade
    ok = mnb.remote(rank_tensor)(mesh=mesh).reduce("dp")
    assert torch.equal(ok.fetch(rank=0), local_value(0) + local_value(1))


def test_bad_collective_input_is_clear_and_mesh_keeps_serving(mesh):
    x = mnb.remote(rank_tensor)(mesh=mesh)
    with pytest.raises(ValueError, match="unknown dim 'tp'"):
        x.reduce("tp")
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        x.reduce("dp", "mean")
    with mnb.local_mesh(dp=2, name="other") as other:
        y = mnb.remote(torch.ones)(2, mesh=other)
        with pytest.raises(mnb.RefUseError, match="another world"):
            y.to_mesh(mesh)
        with pytest.raises(mnb.RefUseError, match="lives on mesh 'other'"):
            mnb.remote(torch.add)(y, 1, mesh=mesh)
    uneven = mnb.remote(lambda: torch.ones(mnb.current_rank() + 1))(mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="one dtype and shape") as ei:
        uneven.reduce("dp").fetch(timeout=60)
    assert set(ei.value.failures) == {0, 1}
    odd = mnb.remote(torch.ones)(3, mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="does not divide"):
        odd.reduce("dp", "stack", scatter=True).fetch(rank=1, timeout=60)
    not_tensor = mnb.remote(lambda: "text")(mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="not a tensor"):
        not_tensor.reduce("dp").fetch(rank=0, timeout=60)
    mesh.wait()
    assert torch.equal(x.reduce("dp").fetch(rank=1), local_value(0) + local_value(1))


def test_to_mesh(mesh):
    a, b = mesh.slice(dp=0), mesh.slice(dp=1)
    xa = mnb.remote(lambda: torch.arange(5.0) * 7)(mesh=a)
    xb = xa.to_mesh(b)
    assert xb.mesh.ranks == [1] and torch.equal(xb.fetch(rank=1), torch.arange(5.0) * 7)
    # a swap: each rank sends to the other in one batched isend/irecv
    x = mnb.remote(rank_tensor)(mesh=mesh)
    swapped = x.to_mesh(mesh.slice(dp=slice(None, None, -1)))
    got = swapped.fetch()
    assert torch.equal(got[0], local_value(0)) and torch.equal(got[1], local_value(1))
    assert swapped.mesh.ranks == [1, 0]
    assert torch.equal(
        mnb.remote(lambda t: t)(swapped, mesh=swapped.mesh).fetch(rank=0), local_value(1)
    )
    # same rank: a copy-on-write clone, still a copy
    same = x.to_mesh(mesh)
    mnb.remote(lambda t: t.add_(100))(x, mesh=mesh)
    assert torch.equal(same.fetch(rank=0), local_value(0))


def test_mesh_dims_slicing_rename_flatten(grid):
    assert grid.dims == {"a": 2, "b": 2} and grid.size == 4 and grid.ranks == [0, 1, 2, 3]
    assert grid.slice(a=1).ranks == [2, 3] and grid.slice(a=1).dims == {"b": 2}
    assert grid.slice(b=slice(0, 1)).dims == {"a": 2, "b": 1}
    assert grid.slice(b=slice(0, 1)).ranks == [0, 2]
    assert grid.coords(3) == {"a": 1, "b": 1}
    one = grid.slice(a=0, b=1)
    assert one.ranks == [1] and one.dims == {}
    r = grid.rename(a="data")
    assert r.dims == {"data": 2, "b": 2}
    x = mnb.remote(rank_tensor)(mesh=r)
    assert torch.equal(x.reduce("data").fetch(rank=3), local_value(1) + local_value(3))
    f = grid.flatten("all")
    assert f.dims == {"all": 4} and f.ranks == [0, 1, 2, 3]
    assert mnb.remote(mnb.current_coords)(mesh=grid).fetch() == [
        {"a": 0, "b": 0},
        {"a": 0, "b": 1},
        {"a": 1, "b": 0},
        {"a": 1, "b": 1},
    ]
    assert "<table>" in grid._repr_html_()
    with pytest.raises(IndexError):
        grid.slice(a=2)


def test_streams_overlap_without_timing(mesh):
    """The side stream waits for a flag that only the default stream sets: if the
    streams did not run at the same time, the side stream would time out."""
    side = mesh.stream("overlap")
    mesh.exec("import threading\nflag = threading.Event()")
    mesh.wait()  # streams are independent queues: define the flag before the side stream reads it
    waiter = mesh.exec("flag.wait(20)", stream=side)
    mesh.exec("flag.set()")
    assert waiter.fetch() == [True, True]


MEET = """
import threading, time
started = {"default": threading.Event(), "meet": threading.Event()}
def meet(me, other):
    begin = time.monotonic()
    started[me].set()
    met = started[other].wait(20)
    return met, begin, time.monotonic()
"""


def test_two_streams_overlap_in_time(mesh):
    """A rendezvous: each stream's command starts, then waits for the other's to
    start. Run one after the other, the first would give up waiting; run at the
    same time, both meet and their intervals on the worker's clock overlap."""
    side = mesh.stream("meet")
    mesh.exec(MEET)
    mesh.wait()  # the side stream reads what the default stream defined
    a = mesh.exec("meet('meet', 'default')", stream=side)
    b = mesh.exec("meet('default', 'meet')")
    for (met_a, a0, a1), (met_b, b0, b1) in zip(a.fetch(timeout=60), b.fetch(timeout=60)):
        assert met_a and met_b, "one stream's command ran while the other's was not running"
        assert a0 < b1 and b0 < a1  # the intervals overlap: timestamps of one process


def test_borrow_prevents_a_race(mesh):
    side = mesh.stream("borrower")
    x = mnb.remote(torch.ones)(3, mesh=mesh)
    xs = x.borrow(side)

    def slow_sum(t):
        time.sleep(0.5)  # a race would mutate t meanwhile
        return float(t.sum())

    total = mnb.remote(slow_sum)(xs, mesh=mesh, stream=side)
    del xs  # drop the borrow: the default stream waits for the borrower's last use
    mnb.remote(lambda t: t.add_(100))(x, mesh=mesh)
    assert total.fetch() == [3.0, 3.0]
    assert x.fetch(rank=0).tolist() == [101.0, 101.0, 101.0]


def test_borrow_first_use_waits_for_the_producer(mesh):
    side = mesh.stream("late")

    def slow_make():
        time.sleep(0.5)
        return torch.full((2,), 7.0)

    x = mnb.remote(slow_make)(mesh=mesh)
    xs = x.borrow(side)
    y = mnb.remote(lambda t: t * 2)(xs, mesh=mesh, stream=side)
    assert y.fetch(rank=0).tolist() == [14.0, 14.0]
    with pytest.raises(mnb.RefUseError, match="borrow"):
        mnb.remote(torch.neg)(x, mesh=mesh, stream=side)
    # a collective on a borrowed value, on the borrowing stream
    assert xs.reduce("dp").fetch(rank=1).tolist() == [14.0, 14.0]
    del xs
    mesh.wait()


def test_collectives_on_several_streams(mesh):
    side = mesh.stream("comm")
    a = mnb.remote(rank_tensor)(mesh=mesh)
    b = mnb.remote(rank_tensor)(mesh=mesh, stream=side)
    ra, rb = a.reduce("dp"), b.reduce("dp", "max")
    assert torch.equal(ra.fetch(rank=0), local_value(0) + local_value(1))
    assert torch.equal(rb.fetch(rank=0), torch.maximum(local_value(0), local_value(1)))


def test_distributed_is_initialised_on_workers(mesh):
    got = mesh.exec(
        "import torch.distributed as dist\n"
        "t = torch.ones(1) * (rank + 1)\n"
        "dist.all_reduce(t)\n"
        "(dist.get_backend(), dist.get_world_size(), float(t))"
    ).fetch()
    assert got == [("gloo", 2, 3.0), ("gloo", 2, 3.0)]


@pytest.mark.gpu
def test_nccl_reduce_and_cuda_streams():
    n = min(2, torch.cuda.device_count())  # NCCL wants a GPU per rank
    with mnb.local_mesh(dp=n, name="gpus") as m:
        assert m.backend == "nccl"
        x = mnb.remote(lambda: torch.ones(1024, device="cuda") * (mnb.current_rank() + 1))(mesh=m)
        total = float(sum(range(1, n + 1)))
        assert x.reduce("dp").fetch(rank=0).tolist() == [total] * 1024
        side = m.stream("comm")
        xs = x.borrow(side)
        y = mnb.remote(lambda t: (torch.cuda.current_stream().cuda_stream != 0, t * 2))(
            xs, mesh=m, stream=side
        )
        on_side_stream, val = y.fetch(rank=n - 1)
        assert on_side_stream and val.device.type == "cpu" and float(val[0]) == 2.0 * n
        st = x.reduce("dp", "stack").fetch(rank=0)
        assert st.shape == (n, 1024)
        del xs
        m.wait()


def allreduce_with(group, t):
    import torch.distributed as dist

    dist.all_reduce(t, group=group)
    return t, dist.get_world_size(group)


def test_remote_process_group(grid):
    pg = grid.process_group("b")
    x = mnb.remote(rank_tensor)(mesh=grid)
    out = mnb.remote(allreduce_with)(pg, x, mesh=grid).fetch()
    for r, (t, size) in enumerate(out):
        partner = r ^ 1  # b is the inner dim: ranks 0-1 and 2-3
        assert size == 2 and torch.equal(t, local_value(r) + local_value(partner))
    side = grid.stream("pg-side")
    y = mnb.remote(rank_tensor)(mesh=grid, stream=side)
    both = mnb.remote(allreduce_with)(grid.process_group(("a", "b")), y, mesh=grid, stream=side)
    t, size = both.fetch(rank=2)
    assert size == 4 and torch.equal(t, sum(local_value(r) for r in range(4)))
    with pytest.raises(ValueError, match="unknown dim"):
        grid.process_group("zz")
    with pytest.raises(mnb.RefUseError, match="remote function"):
        grid.push(g=pg)
