"""Values and data-dependent results come from the ranks when they agree: ``t.item()``,
``bool(t)``, ``nonzero``, ``x[mask]``, ``unique`` on a real dp=2 mesh, equal to local
torch; ranks that disagree get a clear error, and the next op works; a compiled
function that asks runs op by op, with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import monarch_nb as mnb


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="fromdata")
    try:
        yield m
    finally:
        m.shutdown()


def _per_rank(mesh):
    """A mesh tensor whose values differ per rank: [0, 1, 2, 3] * (rank + 1)."""

    def make():
        import torch.distributed as dist

        return torch.arange(4.0) * (dist.get_rank() + 1)

    return mnb.remote(make, propagate=lambda: torch.empty(4))()


def _same_everywhere(mesh, t, local):
    for rank in (0, 1):
        assert torch.equal(mnb.inspect(t, dp=rank), local)


def test_data_dependent_ops_equal_local(mesh):
    def program():
        x = torch.arange(12.0).reshape(3, 4) - 5
        return [
            torch.nonzero(x > 0),
            x[x > 2],
            torch.masked_select(x, x < 0),
            *torch.unique(x.abs(), return_counts=True),
            torch.repeat_interleave(torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1])),
            x.narrow(1, torch.tensor(1), 2),
        ]

    local = program()
    with mesh.activate():
        ours = program()
    assert all(isinstance(t, mnb.Tensor) for t in ours)
    for a, b in zip(ours, local):
        assert a.shape == b.shape and a.dtype == b.dtype
        _same_everywhere(mesh, a, b)


def test_values_every_rank_agrees_on(mesh):
    with mesh.activate():
        x = torch.arange(6.0) - 2
        assert x.sum().item() == 3.0
        assert bool((x > -3).all()) is True
        assert float(x.max()) == 3.0 and int(x.argmax()) == 5
        assert x[:3].tolist() == [-2.0, -1.0, 0.0]
        assert torch.equal(x, x.clone()) and not torch.equal(x, x + 1)
        assert torch.allclose(x, x + 1e-9)
        if (x > 0).any():  # Python control flow on a mesh tensor
            y = x * 2
    _same_everywhere(mesh, y, (torch.arange(6.0) - 2) * 2)


def test_grad_through_a_mask_equals_local(mesh):
    def step():
        torch.manual_seed(0)
        w = torch.randn(8, requires_grad=True)
        loss = (w[w > 0] ** 2).sum() + torch.masked_select(w, w < 0).abs().sum()
        loss.backward()
        return w.grad

    local = step()
    with mesh.activate():
        ours = step()
    _same_everywhere(mesh, ours, local)


def test_ranks_that_disagree_are_named_and_the_mesh_goes_on(mesh):
    with mesh.activate():
        t = _per_rank(mesh)
        with pytest.raises(ValueError, match=r"t.item\(\): the ranks hold different values \(rank 0: 6.0; rank 1: 12.0\)"):
            t.sum().item()
        with pytest.raises(ValueError, match=r"aten.index.Tensor: the ranks made results of other layouts \(rank 0: shape \(1,\)"):
            t[t > 2]
        with pytest.raises(ValueError, match="mnb.inspect"):
            torch.nonzero(t > 2)
        assert bool((t >= 0).all())  # the same on both ranks: fine
        z = (t * 0)[t > 100]  # empty on both: agreed
        assert z.shape == (0,)
        after = t + 1
    assert torch.equal(mnb.inspect(after, dp=1), torch.arange(4.0) * 2 + 1)


def test_a_compiled_function_that_asks_the_ranks_runs_op_by_op_and_says_where(mesh):
    """A value asked of the ranks inside mnb.compile (a data-dependent op, bool(t)):
    the call runs op by op from there, as torch.compile breaks its graph, with one
    warning naming what asked and where; it raised RecordingError, so a transformers
    T5 with an attention mask could not be compiled."""
    asks = mnb.compile(lambda x: x[x > 0] * 2)
    branches = mnb.compile(lambda x: x * 2 if bool(x.sum() > 0) else x)
    with mesh.activate():
        x = torch.arange(5.0) - 2
        for f, what in ((asks, "aten.index.Tensor"), (branches, r"bool\(t\)")):
            with pytest.warns(RuntimeWarning, match=rf"asks the workers for a value \({what}, at test_tensor_from_data.py:\d+ in <lambda>\)"):
                first = f(x)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # once per place
                second = f(x)
            assert torch.equal(mnb.inspect(first, dp=1), mnb.inspect(second, dp=0))
        results = asks(x), branches(x + 1)
        y = x[x > 0] * 2  # uncompiled, the same; the mesh and its caches go on
    _same_everywhere(mesh, results[0], torch.tensor([2.0, 4.0]))
    _same_everywhere(mesh, results[1], (torch.arange(5.0) - 1) * 2)
    _same_everywhere(mesh, y, torch.tensor([2.0, 4.0]))
