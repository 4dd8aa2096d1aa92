"""Ref.reduce against the reference worker's semantics, every reduction x scatter x
(new result, inplace, out), on real gloo meshes: dp=2, a reversed dp=2 slice, 2x2."""

import pytest
import torch

import monarch_nb as mnb
from monarch_nb.protocol.ndslice import NDSlice

REDUCTIONS = ["sum", "avg", "max", "min", "product", "stack"]
COMBOS = [(red, sc) for red in REDUCTIONS for sc in (False, True)]
KEEPS_SHAPE = [(red, sc) for red, sc in COMBOS if (red == "stack") == sc]  # can be in place


def value(rank: int, rows: int, cols: int = 3) -> torch.Tensor:
    """Rank ``rank``'s input: small integers 1..7, exact in float32 for every reduction."""
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * (rank + 2)) % 7 + 1


def make(rows: int) -> torch.Tensor:
    return value(mnb.current_rank(), rows)


def rows_for(reduction: str, scatter: bool, n: int) -> int:
    """reduce_scatter needs dim 0 == n; all_to_all needs it divisible by n."""
    return n if scatter and reduction != "stack" else 4


def model(values: list, reduction: str, scatter: bool, i: int, sizes: tuple) -> torch.Tensor:
    """What member ``i`` (mesh order) of a group with inputs ``values`` gets."""
    n = len(values)
    stacked = torch.stack(values)
    if reduction == "stack":
        if scatter:  # chunk j of member i's result is chunk i of member j's input
            return torch.cat([v.chunk(n)[i] for v in values])
        return stacked.view(*sizes, *values[0].shape) if len(sizes) > 1 else stacked
    red = {
        "sum": stacked.sum(0),
        "avg": stacked.sum(0) / n,
        "max": stacked.amax(0),
        "min": stacked.amin(0),
        "product": stacked.prod(0),
    }[reduction]
    return red[i] if scatter else red  # scatter: row i, dim 0 removed


def check(m, dims, reduction, scatter, mode, groups, sizes):
    """Run one combination on mesh ``m``; compare every rank with the model, and
    check which tensor holds the result."""
    n = len(groups[0])
    rows = rows_for(reduction, scatter, n)
    x = mnb.remote(make)(rows, mesh=m)
    want = {}
    for members in groups:
        values = [value(r, rows) for r in members]
        for i, r in enumerate(members):
            want[r] = model(values, reduction, scatter, i, sizes)
    out = None
    if mode == "out":
        shape = tuple(next(iter(want.values())).shape)
        out = mnb.remote(torch.full)(shape, -1.0, mesh=m)
    y = x.reduce(dims, reduction, scatter=scatter, inplace=mode == "inplace", out=out)
    for r, w in want.items():
        got = y.fetch(rank=r, timeout=60)
        assert got.shape == w.shape and torch.equal(got, w), (r, got, w)
    written = {"inplace": x, "out": out}.get(mode)
    same = mnb.remote(lambda a, b: a is b)(y, x if written is None else written, mesh=m)
    assert same.fetch() == [written is not None] * len(want)
    if mode != "inplace":
        for r in want:
            assert torch.equal(x.fetch(rank=r), value(r, rows))  # the input is untouched
    if mode == "out":
        for r, w in want.items():
            assert torch.equal(out.fetch(rank=r), w)


def modes(reduction, scatter):
    return ["new", "out"] + (["inplace"] if (reduction, scatter) in KEEPS_SHAPE else [])


@pytest.fixture(scope="module")
def grid():
    m = mnb.local_mesh(a=2, b=2, name="grid")
    yield m
    m.shutdown()


@pytest.mark.parametrize(
    "reduction,scatter,mode", [(r, s, md) for r, s in COMBOS for md in modes(r, s)]
)
def test_dp2(mesh, reduction, scatter, mode):
    check(mesh, "dp", reduction, scatter, mode, [(0, 1)], (2,))


@pytest.mark.parametrize("reduction,scatter", COMBOS)
def test_members_in_mesh_order(mesh, reduction, scatter):
    """On a slice with a negative step, member 0 is global rank 1: stack and
    scatter follow the mesh order, not the process group's rank order."""
    rev = mesh.slice(dp=slice(None, None, -1))
    assert rev.ranks == [1, 0]
    check(rev, "dp", reduction, scatter, "new", [(1, 0)], (2,))


@pytest.mark.parametrize(
    "dims,reduction,scatter,mode",
    [(d, r, s, "new") for d in ["a", "b", ("a", "b")] for r, s in COMBOS]
    + [(("b", "a"), r, s, md) for r, s in COMBOS for md in modes(r, s) if md != "new"],
)
def test_grid(grid, dims, reduction, scatter, mode):
    names = list(grid.dims)
    reduced = tuple(sorted(names.index(d) for d in dims))
    groups = NDSlice.contiguous((2, 2)).groups(reduced)
    check(grid, dims, reduction, scatter, mode, groups, tuple(2 for _ in reduced))


def test_non_contiguous_input_and_out(mesh):
    """A transposed input, in place and into a transposed out, for the collectives
    that write a separate buffer (all_to_all) and the one that does not (all_reduce)."""
    t = mnb.remote(lambda: make(3).t())(mesh=mesh)  # (3, 3), column-major
    want_sum = value(0, 3).t() + value(1, 3).t()
    assert torch.equal(t.reduce("dp").fetch(rank=1), want_sum)
    out = mnb.remote(lambda: torch.zeros(3, 3).t())(mesh=mesh)
    y = t.reduce("dp", "max", out=out)
    assert torch.equal(out.fetch(rank=0), torch.maximum(value(0, 3), value(1, 3)).t())
    assert mnb.remote(lambda a, b: a is b)(y, out, mesh=mesh).fetch() == [True, True]
    t.reduce("dp", inplace=True)
    assert torch.equal(t.fetch(rank=0), want_sum)
    u = mnb.remote(lambda: make(4).t().contiguous().t())(mesh=mesh)  # (4, 3), column-major
    u.reduce("dp", "stack", scatter=True, inplace=True)
    v0, v1 = value(0, 4), value(1, 4)
    assert torch.equal(u.fetch(rank=1), torch.cat([v0[2:], v1[2:]]))
    assert torch.equal(u.fetch(rank=0), torch.cat([v0[:2], v1[:2]]))


def test_impossible_combinations_are_refused_here(mesh):
    x = mnb.remote(make)(2, mesh=mesh)
    out = mnb.remote(torch.zeros)(2, 3, mesh=mesh)
    for reduction, scatter in COMBOS:
        if (reduction, scatter) not in KEEPS_SHAPE:
            with pytest.raises(ValueError, match="cannot be in place: the result has a new shape"):
                x.reduce("dp", reduction, scatter=scatter, inplace=True)
    with pytest.raises(ValueError, match="inplace=True and out= both"):
        x.reduce("dp", inplace=True, out=out)
    assert torch.equal(x.reduce("dp").fetch(rank=0), value(0, 2) + value(1, 2))


def test_shape_errors_are_alike_on_every_rank_and_nobody_hangs(mesh):
    x = mnb.remote(make)(3, mesh=mesh)
    cases = [
        (dict(scatter=True), "needs dim 0 of size 2, the group's size"),
        (dict(reduction="stack", scatter=True), r"splits dim 0 into 2 .*does not divide"),
        (dict(out=mnb.remote(torch.zeros)(3, mesh=mesh)), r"out= must be a torch.float32 "),
        (
            dict(out=mnb.remote(torch.zeros)(3, 3, dtype=torch.int64, mesh=mesh)),
            r"shape \(3, 3\) \(the result's\) on every rank \(rank 0: torch.int64",
        ),
        (dict(reduction="stack", out=mnb.remote(torch.zeros)(3, 3, mesh=mesh)), r"\(2, 3, 3\)"),
        (dict(out=mnb.remote(lambda: "text")(mesh=mesh)), "rank 1: not a tensor"),
    ]
    for kwargs, message in cases:
        with pytest.raises(mnb.RemoteError, match=message) as ei:
            x.reduce("dp", **kwargs).fetch(timeout=60)
        assert set(ei.value.failures) == {0, 1}  # every rank raised, none waits
    zero_dim = mnb.remote(torch.tensor)(1.0, mesh=mesh)
    with pytest.raises(mnb.RemoteError, match=r"got shape \(\)"):
        zero_dim.reduce("dp", scatter=True).fetch(rank=0, timeout=60)
    assert torch.equal(x.reduce("dp").fetch(rank=1), value(0, 3) + value(1, 3))


def test_integer_avg_truncates_like_nccl(mesh):
    x = mnb.remote(lambda: torch.tensor([-3, 3, 4]) + mnb.current_rank())(mesh=mesh)
    got = x.reduce("dp", "avg").fetch(rank=0)  # sums -5, 7, 9 over 2
    assert got.dtype == torch.int64 and got.tolist() == [-2, 3, 4]


def fail_on(rank: int, rows: int):
    if mnb.current_rank() == rank:
        raise RuntimeError(f"input broke on rank {rank}")
    return make(rows)


def test_after_agreement_a_failure_or_a_change_on_one_rank_is_exact(mesh):
    """Once a group agreed on an all_reduce input (dtype, shape), ranks with the
    same again go ahead: a rank that then fails or differs joins with a stand-in,
    and every rank still gets the exact error; nobody hangs."""
    agree = mnb.remote(make)(2, mesh=mesh)
    want = value(0, 2) + value(1, 2)
    assert torch.equal(agree.reduce("dp").fetch(rank=0), want)
    broken = mnb.remote(fail_on)(1, 2, mesh=mesh)
    with pytest.raises(mnb.RemoteError, match="input broke on rank 1") as ei:
        broken.reduce("dp", "max").fetch(timeout=60)
    assert set(ei.value.failures) == {1}  # the original failure, not a cascade
    assert torch.equal(agree.reduce("dp").fetch(rank=1), want)  # agreed again
    other = mnb.remote(lambda: make(2 + mnb.current_rank()))(mesh=mesh)  # rank 1: (3, 3)
    with pytest.raises(mnb.RemoteError, match=r"rank 0: torch.float32 \(2, 3\), rank 1: torch"):
        other.reduce("dp").fetch(timeout=60)
    assert torch.equal(agree.reduce("dp").fetch(rank=1), want)
    bad_out = mnb.remote(
        lambda: torch.zeros(2, 3, dtype=[torch.float32, torch.int32][mnb.current_rank()])
    )(mesh=mesh)
    with pytest.raises(mnb.RemoteError, match=r"out= must be .* \(rank 1: torch.int32 \(2, 3\)\)"):
        agree.reduce("dp", out=bad_out).fetch(timeout=60)
    assert torch.equal(agree.reduce("dp").fetch(rank=0), want)
    both = mnb.remote(make)(5, mesh=mesh)  # a new shape on every rank: nobody goes ahead
    assert torch.equal(both.reduce("dp").fetch(rank=0), value(0, 5) + value(1, 5))
    # in place, a failure on the other rank: the identity stand-in leaves the input as it was
    for reduction in ("max", "min", "product", "sum", "avg"):
        mnb.remote(make)(5, mesh=mesh).reduce("dp", reduction)  # agree on (5, 3)
        failing = mnb.remote(fail_on)(1, 5, mesh=mesh)
        with pytest.raises(mnb.RemoteError, match="input broke on rank 1"):
            failing.reduce("dp", reduction, inplace=True).fetch(timeout=60)
        assert torch.equal(failing.fetch(rank=0), value(0, 5)), reduction


def test_going_ahead_leaves_the_healthy_ranks_reduction_in_place(grid):
    """On 2x2 after agreement, rank 3 fails: ranks 0-2 went ahead, so their in-place
    inputs hold the sum over ranks 0-2 (rank 3 contributed zeros); all get the error."""
    x = mnb.remote(make)(4, mesh=grid)
    x.reduce(("a", "b"), inplace=True)
    grid.wait()
    y = mnb.remote(fail_on)(3, 4, mesh=grid)
    with pytest.raises(mnb.RemoteError, match="input broke on rank 3") as ei:
        y.reduce(("a", "b"), inplace=True).fetch(timeout=60)
    assert set(ei.value.failures) == {3}
    partial = sum(value(r, 4) for r in range(3))
    for r in range(3):
        assert torch.equal(y.fetch(rank=r), partial), r
    z = mnb.remote(make)(4, mesh=grid)
    assert torch.equal(z.reduce(("a", "b")).fetch(rank=3), sum(value(r, 4) for r in range(4)))


def _zeros_or_fail(rows: int):
    if mnb.current_rank() == 1:
        raise ValueError("no out tensor on rank 1")
    return torch.zeros(rows, 3)


def test_an_out_that_failed_on_one_rank_fails_every_rank_without_a_hang(mesh):
    x = mnb.remote(make)(4, mesh=mesh)
    out = mnb.remote(_zeros_or_fail)(4, mesh=mesh)
    r = x.reduce("dp", out=out)
    # the collective's own timeout is minutes: a rank left waiting in it would show here
    with pytest.raises(mnb.RemoteError) as ei:
        r.fetch(timeout=60)
    assert "no out tensor on rank 1" in str(ei.value)
    assert torch.equal(x.reduce("dp").fetch(rank=0, timeout=60), value(0, 4) + value(1, 4))
