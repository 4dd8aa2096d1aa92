"""The tensor engine, first slice: torch under ``mesh.activate()`` runs on every
rank of a real dp=2 mesh (real workers, ZeroMQ, gloo), layouts from FakeTensor."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import mesh_kernel, plain

import monarch_nb as mnb
from monarch_nb.api.tensor import plans as tensor_plans


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-engine")
    try:
        yield m
    finally:
        m.shutdown()


def fill_rank(t):
    """Remote: each rank writes its rank into its shard (in place)."""
    t.fill_(mnb.current_rank())
    return None


def shard_sum(t):
    return float(t.sum())


def test_factories_ops_and_layouts(mesh):
    with mesh.activate():
        a = torch.ones(3, 4)
        b = torch.arange(12.0).reshape(3, 4)
        c = a + b
        d = c @ c.T
        s = d.sum(0)
        z = torch.zeros(2, dtype=torch.int64)
        f = torch.full((2, 2), 7.0)
        e = torch.empty(5)
        r = torch.rand(2, 3)
        n = torch.randn(4)
    for t in (a, b, c, d, s, z, f, e, r, n):
        assert isinstance(t, mnb.Tensor) and isinstance(t, mnb.Ref)
    assert d.shape == (3, 3) and s.shape == (3,) and z.dtype == torch.int64
    assert e.shape == (5,) and r.shape == (2, 3) and n.dtype == torch.float32
    expect = torch.ones(3, 4) + torch.arange(12.0).reshape(3, 4)
    for rank in (0, 1):
        assert torch.equal(mnb.inspect(c, dp=rank), expect)
    assert torch.equal(mnb.inspect(d), expect @ expect.T)
    assert torch.equal(mnb.inspect(s), (expect @ expect.T).sum(0))
    assert torch.equal(mnb.inspect(f), torch.full((2, 2), 7.0))
    assert mnb.inspect(r).shape == (2, 3)
    # outside the block, ops on mesh tensors still go to their mesh
    g = c * 2
    assert isinstance(g, mnb.Tensor)
    assert torch.equal(mnb.inspect(g, dp=1), expect * 2)


def test_repr_names_layout_never_values(mesh):
    with mesh.activate():
        t = torch.full((2, 3), 123.25)
    text = repr(t)
    for part in ("mnb.Tensor", "(2, 3)", "float32", "tensor-engine", "dp=2", "default"):
        assert part in text, text
    assert "123" not in text and "123" not in str(t)
    assert "mnb.inspect" in str(t)


def test_a_number_format_of_a_0_dim_tensor_gives_its_value_as_torch_does(mesh):
    """f"{loss:.4f}", the logging line of every training loop: torch formats a 0-dim
    tensor as its number; a mesh tensor formatted its repr, and ".4f" of a str failed."""

    def per_rank():
        import torch.distributed as dist

        return torch.tensor(1.0 + dist.get_rank())

    with mesh.activate():
        loss = torch.tensor([1.0, 2.5]).mean()
        t = torch.zeros(2, 3)
        ranks_differ = mnb.remote(per_rank, propagate=lambda: torch.empty(()))()
    assert f"{loss:.4f} {loss:.1e} {loss:>8.2f}" == "1.7500 1.8e+00     1.75"
    assert f"{loss}" == str(loss)  # no spec: the repr, as before
    assert f"{t:>200}".strip() == str(t)  # a tensor of dims: a spec pads the repr
    with pytest.raises(ValueError, match="the ranks hold different values"):
        f"{ranks_differ:.2f}"
    assert f"{loss * 2:.1f}" == "3.5"  # and the mesh goes on


def test_views_share_the_base_storage_and_inplace_ops(mesh):
    with mesh.activate():
        base = torch.zeros(3, 4)
        row = base[1]
        col = base[:, 2]
        row.add_(5)
        col.fill_(-1)
        view = base.view(12)
    assert row.shape == (4,) and col.shape == (3,) and view.shape == (12,)
    expect = torch.zeros(3, 4)
    expect[1] += 5
    expect[:, 2] = -1
    assert torch.equal(mnb.inspect(base, dp=1), expect)
    assert torch.equal(mnb.inspect(view), expect.view(12))
    assert torch.equal(mnb.inspect(row), expect[1])


def test_multi_output_ops_and_torch_tensor(mesh):
    with mesh.activate():
        x = torch.tensor([[1.0, 9.0, 3.0], [7.0, 2.0, 8.0]])
        values, indices = x.max(dim=1)
    assert isinstance(values, mnb.Tensor) and indices.dtype == torch.int64
    assert torch.equal(mnb.inspect(values), torch.tensor([9.0, 8.0]))
    assert torch.equal(mnb.inspect(indices, dp=1), torch.tensor([1, 2]))


def test_mesh_tensor_is_a_ref(mesh):
    with mesh.activate():
        t = torch.ones(4)
    mnb.remote(fill_rank)(t, mesh=mesh)
    shards = t.fetch()
    assert [s.tolist() for s in shards] == [[0.0] * 4, [1.0] * 4]
    assert mnb.fetch_shard(t, dp=1).result().tolist() == [1.0] * 4
    assert mnb.remote(shard_sum)(t, mesh=mesh).fetch() == [0.0, 4.0]
    total = t.reduce("dp", "sum")
    assert isinstance(total, mnb.Tensor) and total.shape == (4,)
    assert mnb.inspect(total, dp=1).tolist() == [1.0] * 4
    stacked = t.reduce("dp", "stack")
    assert stacked.shape == (2, 4)
    assert mnb.inspect(stacked).tolist() == [[0.0] * 4, [1.0] * 4]
    with mesh.activate():
        after = total * 3
    assert mnb.inspect(after).tolist() == [3.0] * 4
    assert t.reduce_("dp", "max") is t
    assert [s.tolist() for s in t.fetch()] == [[1.0] * 4, [1.0] * 4]


def test_fetch_shard_is_an_async_result(mesh):
    with mesh.activate():
        t = torch.arange(3)
    r = mnb.fetch_shard(t, dp=1)
    assert isinstance(r, mnb.AsyncResult)
    assert r.result(timeout=30).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="no dim 'tp'"):
        mnb.inspect(t, tp=0)
    with pytest.raises(IndexError, match="out of range"):
        mnb.inspect(t, dp=2)


def test_no_mesh_runs_local_torch(mesh):
    with mesh.activate():
        with mnb.no_mesh():
            local = torch.ones(2) * 3
        remote = torch.ones(2)
    assert type(local) is torch.Tensor and local.tolist() == [3.0, 3.0]
    assert isinstance(remote, mnb.Tensor)


@pytest.mark.parametrize(
    "use",
    [
        lambda t: t.item(),
        lambda t: bool(t),
        lambda t: float(t),
        lambda t: t.tolist(),
        lambda t: torch.nonzero(t),
    ],
    ids=["item", "bool", "float", "tolist", "nonzero"],
)
def test_values_ranks_disagree_on_error_names_inspect(mesh, use):
    """Values come from the ranks when they agree (tests/test_tensor_from_data.py);
    a shard of each rank's own: the error names the ranks and mnb.inspect."""

    def rank_minus_one():
        import torch.distributed as dist

        return torch.full((1,), float(dist.get_rank() - 1))

    with mesh.activate():
        t = mnb.remote(rank_minus_one, propagate=lambda: torch.empty(1))()
        with pytest.raises(ValueError, match=r"rank 0: .*rank 1: .*mnb\.inspect"):
            use(t)
        assert mnb.inspect(t + 1, dp=1).tolist() == [1.0]  # the mesh keeps working


def test_local_tensor_mixed_with_mesh_tensors_is_refused(mesh):
    local = torch.ones(3)
    with mesh.activate():
        t = torch.ones(3)
        with pytest.raises(mnb.RefUseError, match=r"mixes a local tensor .*mnb\.inspect"):
            t + local
        with pytest.raises(mnb.RefUseError, match="mixes a local tensor"):
            torch.mm(local.view(1, 3), t.view(3, 1))
        # a 0-dim local tensor goes with the op by value, as a CPU scalar does with CUDA
        host = torch.tensor(2.5, dtype=torch.float64)  # a 0-dim torch.tensor stays local
        assert type(host) is torch.Tensor
        scaled = t * host
        assert isinstance(scaled, mnb.Tensor) and scaled.dtype == torch.float32
        # local tensors alone stay local: an inspected shard can be read and printed
        shard = mnb.inspect(t * 2)
        assert type(local * 2) is torch.Tensor
        assert float(shard.sum()) == 6.0 and "tensor([2., 2., 2.])" in repr(shard)
    assert mnb.inspect(scaled, dp=1).tolist() == [2.5] * 3


def test_shape_errors_at_the_call(mesh):
    with mesh.activate():
        a, b = torch.ones(3), torch.ones(4)
        with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor: .*broadcast"):
            a + b
        assert mnb.inspect(a + 1).tolist() == [2.0] * 3


def test_op_without_fake_kernel_names_the_op(mesh):
    lib = torch.library.Library("mnbtest", "FRAGMENT")  # noqa: TOR901 - a test-only op
    lib.define("nofake(Tensor x) -> Tensor")
    lib.impl("nofake", lambda x: x.clone(), "CPU")
    with mesh.activate():
        t = torch.ones(2)
        with pytest.raises(
            NotImplementedError, match=r"mnbtest\.nofake.*mnb\.remote\(fn, propagate="
        ):
            torch.ops.mnbtest.nofake(t)
        assert mnb.inspect(t + 1).tolist() == [2.0, 2.0]


def test_tensor_of_another_mesh(mesh):
    other = mnb.local_mesh(dp=1, name="tensor-other")
    try:
        with other.activate():
            theirs = torch.ones(2)
        with mesh.activate():
            ours = torch.ones(2)
            with pytest.raises(mnb.RefUseError, match="to_mesh"):
                ours + theirs
        assert mnb.inspect(ours + 1).tolist() == [2.0, 2.0]
    finally:
        other.shutdown()
    with pytest.raises(mnb.MeshClosedError, match="shut down"):
        theirs + 1
    ours.delete()
    with pytest.raises(mnb.RefUseError, match="was deleted"):
        ours * 2
    with mesh.activate():
        assert mnb.inspect(torch.ones(1)).tolist() == [1.0]


def test_failure_on_one_rank_surfaces_once_and_the_mesh_survives(mesh):
    with mesh.activate():
        x = torch.arange(4.0)
        idx = torch.zeros(1, dtype=torch.int64)
    mnb.remote(fill_rank)(idx, mesh=mesh)  # rank 0: index 0, rank 1: index 1
    with mesh.activate():
        big = idx * 10  # rank 1: index 10, out of range
        picked = x[big]
        dependent = picked + 1
    assert mnb.inspect(dependent, dp=0).tolist() == [1.0]
    with pytest.raises(mnb.RemoteError, match="rank 1") as info:
        mnb.inspect(dependent, dp=1)
    assert "index" in str(info.value).lower()
    mesh.wait()  # reported once: the wait does not raise it again
    with mesh.activate():
        fine = x + 1
    assert mnb.inspect(fine, dp=1).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_repeated_op_uses_the_layout_cache(mesh):
    with mesh.activate():
        x = torch.ones(8)
        y = x + 1
        before = len(tensor_plans._plans)
        for _ in range(20):
            y = y + 1
        assert len(tensor_plans._plans) == before
        z = x.double() + 1  # another dtype: another entry
        assert len(tensor_plans._plans) > before
    assert z.dtype == torch.float64
    assert mnb.inspect(y, dp=1).tolist() == [22.0] * 8


def test_adam_steps_on_the_mesh(mesh):
    with mesh.activate():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        x = torch.randn(32, 4)
        y = x.sum(1, keepdim=True)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss)
        step = opt.state[model.weight]["step"]
        assert type(step) is torch.Tensor and float(step) == 30.0  # the host step count
        assert isinstance(opt.state[model.weight]["exp_avg"], mnb.Tensor)
    assert float(mnb.inspect(losses[-1])) < float(mnb.inspect(losses[0])) / 2


def test_linear_data_parallel_training(mesh):
    with mesh.activate():
        model = torch.nn.Linear(4, 1)
        w = model.weight
        assert isinstance(w, mnb.Tensor) and isinstance(w, torch.nn.Parameter)
        assert w.requires_grad and w.shape == (1, 4)
        with torch.no_grad():  # the same start on every rank
            for p in model.parameters():
                p.copy_(p.reduce("dp", "avg"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(32, 4)
        y = x @ torch.arange(1.0, 5.0).view(4, 1)
        losses = []
        for _ in range(40):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():
                assert isinstance(p.grad, mnb.Tensor) and p.grad.shape == p.shape
                p.grad.reduce("dp", "avg", inplace=True)
            opt.step()
            losses.append(loss)
        assert isinstance(loss, mnb.Tensor) and loss.shape == ()
    for rank in (0, 1):
        first = float(mnb.inspect(losses[0], dp=rank))
        last = float(mnb.inspect(losses[-1], dp=rank))
        assert last < first / 4, (rank, first, last)
    w0, w1 = model.weight.fetch()
    assert torch.allclose(w0, w1)  # averaged gradients keep the replicas equal


def test_failing_inplace_op_marks_the_mutated_tensor(mesh):
    with mesh.activate():
        x = torch.zeros(4)
        idx = torch.zeros(1, dtype=torch.int64)
    mnb.remote(fill_rank)(idx, mesh=mesh)
    with mesh.activate():
        x[idx * 10] = 1.0  # index_put_: out of range on rank 1 only
    assert mnb.inspect(x, dp=0).tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(mnb.RemoteError, match="rank 1"):
        mnb.inspect(x, dp=1)
    with mesh.activate():
        y = torch.ones(2) * 2
    assert mnb.inspect(y, dp=1).tolist() == [2.0, 2.0]


def test_push_a_mesh_tensor_to_the_workers_namespace(mesh):
    # what %%monarch --push t sends: the name bound to each rank's shard
    with mesh.activate():
        t = torch.arange(3.0) + 1
    mesh.push(pushed=t)
    mesh.exec("pushed_sum = float(pushed.sum())").fetch()
    assert mesh.pull("pushed_sum") == [6.0, 6.0]


def test_borrow_on_another_stream(mesh):
    comms = mesh.stream("tensor-comms")
    with mesh.activate():
        t = torch.ones(3)
        with pytest.raises(mnb.RefUseError, match="borrow"):
            with comms.activate():
                t + 1
        b = t.borrow(comms)
        assert isinstance(b, mnb.Tensor) and b.stream.name == "tensor-comms"
        with comms.activate():
            c = b * 5
    assert c.stream.name == "tensor-comms"
    assert mnb.inspect(c, dp=1).tolist() == [5.0] * 3
    del b
    assert mnb.inspect(t + 1).tolist() == [2.0] * 3


def test_sub_meshes_and_to_mesh(mesh):
    first, second = mesh.slice(dp=slice(0, 1)), mesh.slice(dp=slice(1, 2))
    with first.activate():
        a = torch.arange(3.0) * 2
    assert a.mesh is first
    b = a.to_mesh(second)
    assert isinstance(b, mnb.Tensor) and b.mesh is second and b.shape == (3,)
    assert mnb.inspect(b).tolist() == [0.0, 2.0, 4.0]
    with mesh.activate():
        with pytest.raises(mnb.RefUseError, match="ranks"):
            a + 1  # its values are on rank 0 only; the op would run on both
    with second.activate():
        assert mnb.inspect(b + 1).tolist() == [1.0, 3.0, 5.0]


def test_public_names_are_documented():
    from pathlib import Path

    api = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    table = api.split("| name | what |", 1)[1].split("\n\n", 1)[0]
    first_cells = [row.split("|")[1] for row in table.strip().splitlines()[1:]]
    documented = {w.strip("` ") for cell in first_cells for w in cell.split(",")}
    assert set(mnb.__all__) == documented
    for name in ("Tensor", "inspect", "fetch_shard", "no_mesh"):
        assert getattr(mnb, name) is getattr(mnb.api.tensor, name)


@pytest.mark.kernel
def test_notebook_repr_and_monarch_push(tmp_path):
    # a real kernel: the cell shows the layout, and %%monarch --push t binds each shard
    with mesh_kernel(tmp_path) as k:
        k.ok("import torch\nwith mnb.get_mesh().activate():\n    t = torch.arange(4.0) * 2")
        (shown,) = plain(k.ok("t"))
        assert "mnb.Tensor(shape=(4,)" in shown and "'default' (dp=2)" in shown
        assert "6." not in shown
        out = plain(
            k.ok(
                "%%monarch --push t\nimport monarch_nb\nfloat(t.sum()) + monarch_nb.current_rank()"
            )
        )
        assert out == ["[rank 0] 12.0", "[rank 1] 13.0"], out


def test_commands_are_named_after_their_ops(mesh):
    with mesh.activate():
        a = torch.ones(2, 2)
        b = a @ a
        c = b + 1
    # what the dashboard's running column shows for each command
    state = mesh._controller.state
    assert state.what_of(0, b.ident) == "aten.mm"
    assert state.what_of(0, c.ident) == "aten.add.Tensor"
    mnb.inspect(c)


def test_failing_inplace_op_on_a_view_marks_its_base(mesh):
    with mesh.activate():
        base = torch.zeros(2, 3)
        row = base[1]
        other = base[0]
        idx = torch.zeros(1, dtype=torch.int64)
    mnb.remote(fill_rank)(idx, mesh=mesh)
    with mesh.activate():
        row[idx * 10] = 5.0  # out of range on rank 1 only
    assert mnb.inspect(base, dp=0).tolist() == [[0.0] * 3, [5.0, 0.0, 0.0]]
    assert mnb.inspect(other, dp=0).tolist() == [0.0] * 3
    for alias in (base, other, row):
        with pytest.raises(mnb.RemoteError, match="rank 1"):
            mnb.inspect(alias, dp=1)
    with mesh.activate():
        fresh = torch.ones(2)
    assert mnb.inspect(fresh, dp=1).tolist() == [1.0, 1.0]


def test_mesh_tensor_from_a_worker_variable(mesh):
    mesh.exec(
        "import monarch_nb\nworker_made = torch.arange(6.0).reshape(2, 3) + monarch_nb.current_rank()"
    ).fetch()
    t = mesh.tensor("worker_made")
    assert isinstance(t, mnb.Tensor) and t.shape == (2, 3) and t.dtype == torch.float32
    with mesh.activate():
        doubled = t * 2
    assert mnb.inspect(doubled, dp=1).tolist() == [[2.0, 4.0, 6.0], [8.0, 10.0, 12.0]]
    mesh.exec("not_a_tensor = 3").fetch()
    with pytest.raises(mnb.RemoteError, match="expected a torch.Tensor"):
        mesh.tensor("not_a_tensor")
    with pytest.raises(mnb.RemoteError, match="NameError"):
        mesh.tensor("no_such_variable")
    with pytest.raises(ValueError, match="variable name"):
        mesh.tensor("1x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a controller without CUDA")
def test_cuda_on_a_cpu_mesh_fails_at_the_call(mesh):
    # torch's own check on the controller, before any op reaches the mesh
    with mesh.activate():
        t = torch.ones(2)
        with pytest.raises(AssertionError, match="CUDA"):
            t.to("cuda")
        with pytest.raises(AssertionError, match="CUDA"):
            torch.nn.Linear(2, 2).to("cuda")
        assert mnb.inspect(t + 1).tolist() == [2.0, 2.0]


def test_deepcopy_of_a_module_on_the_mesh(mesh):
    import copy

    with mesh.activate():
        model = torch.nn.Linear(3, 2)
        twin = copy.deepcopy(model)
        with torch.no_grad():
            model.weight.add_(1.0)  # the copy has storage of its own
    w, tw = twin.weight, model.weight
    assert isinstance(w, mnb.Tensor) and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert w.id != tw.id and w.shape == (2, 3)
    assert torch.allclose(mnb.inspect(tw, dp=1), mnb.inspect(w, dp=1) + 1)


def test_seeding_every_rank_makes_factories_agree(mesh):
    mnb.remote(torch.random.manual_seed)(1234, mesh=mesh)
    with mesh.activate():
        r = torch.randn(5)
    first, second = r.fetch()
    assert torch.equal(first, second)
    mnb.remote(torch.manual_seed)(1234, mesh=mesh)  # sent by reference
    with mesh.activate():
        again = torch.randn(5)
    assert torch.equal(mnb.inspect(again), first)


def test_manual_seed_under_the_mesh_seeds_every_rank(mesh):
    with mesh.activate():
        torch.manual_seed(7)
        a = torch.rand(6)
        b = torch.randn(2, 3)
        torch.manual_seed(7)  # a rerun: the same shards
        a2 = torch.rand(6)
        torch.manual_seed(8)
        c = torch.rand(6)
    a0, a1 = a.fetch()
    assert torch.equal(a0, a1)  # every rank the same stream (as Monarch's default)
    assert torch.equal(mnb.inspect(a2, dp=1), a0)
    assert not torch.equal(mnb.inspect(c), a0)
    assert not torch.equal(mnb.inspect(b).flatten()[:6], a0)
    # the controller is seeded too, and inside no_mesh() the seed is local only
    torch.manual_seed(7)
    assert torch.equal(torch.rand(6), a0)
    with mesh.activate():
        torch.manual_seed(8)
        with mnb.no_mesh():
            torch.manual_seed(7)
        d = torch.rand(6)
    assert torch.equal(mnb.inspect(d, dp=1), mnb.inspect(c))


def _seed_by_rank():
    torch.manual_seed(100 + mnb.current_rank())


def test_rng_state_under_the_mesh_is_the_ranks_so_checkpoint_redraws_dropout(mesh):
    """torch.get_rng_state()/set_rng_state() under the mesh read and set the ranks'
    generators (each its own), as torch.utils.checkpoint and fork_rng use them to draw
    a recomputed dropout mask again. They were the controller's alone: a reentrant
    checkpoint of dropout gave other gradients than local torch, without a word."""
    import torch.utils.checkpoint as checkpoint

    def checkpointed():
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Dropout(0.5))
        x = torch.randn(4, 8, requires_grad=True)
        checkpoint.checkpoint(block, x, use_reentrant=True).sum().backward()
        return x.grad, block[0].weight.grad

    local = checkpointed()
    with mesh.activate():
        ours = checkpointed()
    for a, b in zip(ours, local):
        assert torch.equal(mnb.inspect(a, dp=1), b)
    mnb.remote(_seed_by_rank)(mesh=mesh).fetch()  # each rank its own stream
    with mesh.activate():
        state = torch.get_rng_state()
        assert isinstance(state, mnb.Tensor)
        first = torch.rand(3)
        with torch.random.fork_rng():
            torch.rand(5)
        torch.set_rng_state(state)
        again = torch.rand(3)
    firsts = first.fetch()
    assert not torch.equal(*firsts)
    assert all(torch.equal(a, b) for a, b in zip(again.fetch(), firsts))
    with mesh.activate():  # a local state: every rank's
        torch.set_rng_state(torch.random.default_generator.get_state())
        same = torch.rand(3)
    assert torch.equal(*same.fetch())


def test_distributions_of_host_scalar_parameters_draw_on_the_ranks_in_order(mesh):
    """A distribution built from 0-dim tensors (host scalars under the mesh) expanded
    them locally and drew from the controller's generator, while dropout drew from the
    ranks': the samples, and every random op after them, left local torch's numbers."""

    def draws():
        torch.manual_seed(0)
        drop, x = torch.nn.Dropout(0.5), torch.ones(8)
        first = drop(x)
        normal = torch.distributions.Normal(torch.tensor(0.0), torch.tensor(1.0)).sample((4,))
        uniform = torch.distributions.Uniform(torch.tensor(0.0), torch.tensor(2.0)).rsample((3,))
        return [first, normal, uniform, drop(x)]

    local = draws()
    with mesh.activate():
        ours = draws()
    for a, b in zip(ours, local):
        assert isinstance(a, mnb.Tensor)
        assert torch.equal(mnb.inspect(a, dp=1), b)


def test_a_local_generator_draws_here_as_local_torch_and_advances(mesh):
    """``generator=`` of a local torch.Generator under the mesh: a copy of it went to
    the ranks and it never advanced here, so every draw repeated the first one's
    numbers (a DataLoader given generator= shuffled every epoch alike). It draws here,
    advancing as locally, and every rank gets the values."""
    from torch.utils.data import DataLoader

    def draws():
        g = torch.Generator().manual_seed(3)
        w = torch.empty(2, 3)
        torch.nn.init.normal_(w, generator=g)  # in place, on a mesh tensor under the mesh
        order = [
            torch.cat(list(DataLoader(torch.arange(6.0), batch_size=3, shuffle=True, generator=g)))
            for _ in range(2)
        ]
        return [torch.randn(4, generator=g), torch.randperm(5, generator=g), w, *order]

    local = draws()
    with mesh.activate():
        ours = draws()
        noise = torch.rand(4)
        with pytest.raises(mnb.RefUseError, match=r"local torch\.Generator .*mesh tensors"):
            torch.bernoulli(noise, generator=torch.Generator())  # it reads the ranks' values
        with pytest.raises(mnb.RecordingError, match=r"local torch\.Generator"):
            mnb.compile(lambda: torch.rand(2, generator=torch.Generator()))()
        after = noise + 1  # the mesh goes on
    assert not torch.equal(local[3], local[4])  # two epochs, two orders
    for a, b in zip(ours, local):
        assert isinstance(a, mnb.Tensor)
        assert all(torch.equal(s, b) for s in a.fetch())
    assert torch.equal(mnb.inspect(after), mnb.inspect(noise) + 1)


def double_plus_rank(t):
    return t * 2 + mnb.current_rank()


def halves(t):
    return t[:1].clone(), t[1:] + 0


def test_remote_with_a_propagator_returns_mesh_tensors(mesh):
    with mesh.activate():
        a = torch.arange(4.0)
    out = mnb.remote(double_plus_rank, propagate=lambda t: torch.empty_like(t))(a)
    assert isinstance(out, mnb.Tensor) and out.shape == (4,) and out.dtype == torch.float32
    assert mesh._controller.state.what_of(0, out.ident) == "double_plus_rank"  # the dashboard
    assert mnb.inspect(out, dp=1).tolist() == [1.0, 3.0, 5.0, 7.0]
    with mesh.activate():
        assert mnb.inspect(out + 1).tolist() == [1.0, 3.0, 5.0, 7.0]
    # outside a mesh block the call goes where its mesh tensors live (as ops do)
    second = mesh.slice(dp=slice(1, 2))
    with second.activate():
        b = torch.ones(2)
    on_second = mnb.remote(double_plus_rank)(b)
    assert on_second.mesh is second and mnb.inspect(on_second).tolist() == [3.0, 3.0]
    # mesh tensors inside a dict reach the propagator as fakes too
    pick = mnb.remote(lambda d: d["x"] + 1, propagate=lambda d: d["x"].clone())({"x": a})
    assert pick.shape == (4,) and mnb.inspect(pick).tolist() == [1.0, 2.0, 3.0, 4.0]
    # a factory-like function: no mesh tensor in, a mesh tensor out
    ones = mnb.remote(torch.ones, propagate=lambda *size: torch.ones(*size))(2, 3, mesh=mesh)
    assert isinstance(ones, mnb.Tensor) and ones.shape == (2, 3)
    assert mnb.inspect(ones, dp=1).sum().item() == 6.0


def test_remote_cached_and_inspect_propagation(mesh):
    with mesh.activate():
        a = torch.arange(4.0)
        b = torch.zeros(6)
    # "cached" (the default with mesh tensors): the first call per layout asks rank 0
    f = mnb.remote(halves)
    first, rest = f(a)
    assert isinstance(first, mnb.Tensor) and first.shape == (1,) and rest.shape == (3,)
    assert mnb.inspect(rest, dp=1).tolist() == [1.0, 2.0, 3.0]
    from monarch_nb.api.tensor import remote_call

    key_count = len(remote_call._layouts[halves])
    first2, rest2 = mnb.remote(halves)(a)  # the same layout: cached, nothing asked
    assert len(remote_call._layouts[halves]) == key_count
    _, rest3 = f(b)  # another layout: asked again
    assert rest3.shape == (5,) and len(remote_call._layouts[halves]) == key_count + 1
    # "inspect": asked every time; the result list keeps its type
    g = mnb.remote(lambda t: [t.sum(), t], propagate="inspect")
    s, same = g(b)
    assert s.shape == () and same.shape == (6,)
    # a result that is no tensor stays a plain Ref
    v = mnb.remote(shard_sum)(a)
    assert type(v) is mnb.Ref and v.fetch() == [6.0, 6.0]


def test_remote_propagator_with_the_wrong_shape_fails_at_first_inspect(mesh):
    with mesh.activate():
        a = torch.arange(4.0)
    bad = mnb.remote(double_plus_rank, propagate=lambda t: t[:2])(a)
    assert bad.shape == (2,)  # what the propagator said
    with pytest.raises(
        mnb.RemoteError, match=r"returned shape \(4,\).*propagator said shape \(2,\)"
    ):
        mnb.inspect(bad)
    with mesh.activate():
        fine = torch.ones(2)
    assert mnb.inspect(fine, dp=1).tolist() == [1.0, 1.0]  # the mesh keeps serving
    with pytest.raises(ValueError, match="propagate must be"):
        mnb.remote(double_plus_rank, propagate="sometimes")
    with pytest.raises(TypeError, match="must return the fake outputs"):
        mnb.remote(double_plus_rank, propagate=lambda t: 3)(a)


def wait_for_file(path: str) -> None:
    """Remote: hold this stream until ``path`` exists (at most 60 s)."""
    import os
    import time

    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cached_propagation_does_not_wait_for_the_workers(mesh, tmp_path):
    import threading

    from wait_helpers import wait_for

    with mesh.activate():
        a = torch.arange(4.0)
    mnb.remote(halves)(a)  # the first call of this layout asks rank 0 (and waits)
    gate = tmp_path / "open"
    mnb.remote(wait_for_file)(str(gate), mesh=mesh)  # the stream is busy until the gate opens
    got = []
    caller = threading.Thread(target=lambda: got.append(mnb.remote(halves)(a)), daemon=True)
    try:
        caller.start()
        # the layout is cached: the call returns while the workers are still busy
        wait_for(lambda: got, timeout=30, what="the cached call to return")
    finally:
        gate.touch()
    caller.join(timeout=60)
    first, rest = got[0]
    assert rest.shape == (3,) and mnb.inspect(rest, dp=1).tolist() == [1.0, 2.0, 3.0]


@mnb.remote(propagate=lambda t: t.sum(0))
def column_sums(t):
    return t.sum(0)


def fail_on_first_rank(t):
    if mnb.current_rank() == 0:
        raise ValueError("rank 0 refuses")
    return t


def test_remote_decorator_with_propagate_and_a_failing_first_call(mesh):
    with mesh.activate():
        m = torch.ones(3, 2)
    sums = column_sums(m, mesh=mesh)
    assert isinstance(sums, mnb.Tensor) and sums.shape == (2,)
    assert mnb.inspect(sums, dp=1).tolist() == [3.0, 3.0]
    # "cached", first call: the layout is read from rank 0, so its failure shows at the call
    with pytest.raises(mnb.RemoteError, match="rank 0 refuses"):
        mnb.remote(fail_on_first_rank)(m)
    with mesh.activate():
        assert mnb.inspect(m + 1, dp=1).tolist() == [[2.0, 2.0]] * 3


def test_remote_without_propagator_inside_compile_names_propagate(mesh):
    with mesh.activate():
        m = torch.ones(2)

    def plus_one(t):  # new here: no layout of it is cached yet
        return t + 1

    @mnb.compile
    def step(t):
        return mnb.remote(plus_one)(t)

    with pytest.raises(RuntimeError, match="propagate="):
        step(m)
    with mesh.activate():
        assert mnb.inspect(m * 2, dp=1).tolist() == [2.0, 2.0]


def test_a_failing_foreach_op_marks_every_tensor_it_writes(mesh):
    with mesh.activate():
        a = [torch.zeros(4), torch.zeros(2)]
        idx = torch.zeros(1, dtype=torch.int64)
    mnb.remote(fill_rank)(idx, mesh=mesh)
    with mesh.activate():
        bad = torch.zeros(4)
        bad[idx * 10] = 1.0  # index_put_: out of range on rank 1 only
        view = a[0][1:3]  # shares a[0]'s storage: fails with it
        other = torch.zeros(2)
        torch._foreach_add_(a, [bad, torch.ones(2)])  # returns nothing, writes both
    assert mnb.inspect(a[0], dp=0).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert mnb.inspect(a[1], dp=0).tolist() == [1.0, 1.0]
    assert mnb.inspect(other, dp=1).tolist() == [0.0, 0.0]
    for t in (*a, view):
        with pytest.raises(mnb.RemoteError, match="rank 1"):
            mnb.inspect(t, dp=1)
    with mesh.activate():
        y = torch.ones(2) * 2
    assert mnb.inspect(y, dp=1).tolist() == [2.0, 2.0]


def _done(mesh) -> int:
    mesh.wait()
    return mesh.status()["ranks"][0]["streams"]["default"]["done"]


def test_an_op_of_several_outputs_is_one_command_and_long_lists_key_by_place(mesh):
    def body(xs, x):
        roots = torch._foreach_sqrt(xs)  # a list of 20 values: one command
        # the same tensors twice, in two lists of 20: each keeps its place in the key
        torch._foreach_addcmul_(xs, roots, roots, value=0.5)
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [4], None, None, 1e-5)
        parts = x.split(1)
        values, where = x.max(dim=1)
        return [*roots, *xs, out, mean, rstd, *parts, values, where]

    torch.manual_seed(0)
    xs, x = [torch.rand(3) + i for i in range(20)], torch.randn(3, 4)
    local = body([t.clone() for t in xs], x)
    with mesh.activate():
        mxs, mx = [torch.tensor(t.tolist()) for t in xs], torch.tensor(x.tolist())
        before = _done(mesh)
        torch._foreach_sqrt(mxs)
        assert _done(mesh) - before == 1
        before = _done(mesh)
        torch.ops.aten.native_layer_norm(mx, [4], None, None, 1e-5)
        assert _done(mesh) - before == 1
        ours = body(mxs, mx)
    for a, b in zip(ours, local):
        assert torch.equal(mnb.inspect(a, dp=1), b)


def test_foreach_lists_of_the_same_tensors_in_other_orders_get_their_own_plans(mesh):
    # a long list keys as one mark of its run of tensors when it is new or the same
    # run again; any other arrangement must key (and compute) otherwise
    xs = [torch.full((2,), float(i)) for i in range(10)]
    ys = [torch.full((2,), 100.0 + i) for i in range(10)]

    def arrangements(a, b):
        return [
            (a, a),  # the same run twice
            (a, b),  # two new runs
            (a, a[::-1]),  # the same tensors reversed
            (a, a[1:] + a[:1]),  # rotated
            (a, a[:5] + a[:5]),  # a run of half, twice
            (a, b[:5] + a[5:]),  # new tensors, then a part of the first run
        ]

    def triples(a, b):  # the same count of tensors, told apart only by the marks
        return [(a, b, b), (a, b, a)]

    def run(a, b):
        out = [torch._foreach_add(u, v) for u, v in arrangements(a, b)]
        return out + [torch._foreach_addcmul(u, v, w, value=0.5) for u, v, w in triples(a, b)]

    local = run(xs, ys)
    with mesh.activate():
        mxs, mys = [torch.tensor(t.tolist()) for t in xs], [torch.tensor(t.tolist()) for t in ys]
        for _ in range(2):  # the second time from the plans the first made
            for got, want in zip(run(mxs, mys), local):
                assert [mnb.inspect(t, dp=1).tolist() for t in got] == [t.tolist() for t in want]


def test_clip_grad_norm_takes_the_foreach_path_with_local_numbers(mesh):
    torch.manual_seed(3)
    local = [torch.randn(5, requires_grad=True) for _ in range(12)]
    for p in local:
        p.grad = torch.randn(5)
    with mesh.activate():
        ours = [torch.tensor(p.tolist(), requires_grad=True) for p in local]
        for p, q in zip(ours, local):
            p.grad = torch.tensor(q.grad.tolist())
        before = _done(mesh)
        norm = torch.nn.utils.clip_grad_norm_(ours, 0.5)
        commands = _done(mesh) - before
    total = torch.nn.utils.clip_grad_norm_(local, 0.5)
    assert commands < 12  # a few foreach commands for 12 grads, not two per grad
    assert torch.equal(mnb.inspect(norm, dp=1), total)
    for p, q in zip(ours, local):
        assert torch.equal(mnb.inspect(p.grad, dp=0), q.grad)


_OPTIMIZERS = [
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adamax, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Adafactor,
]  # fmt: skip


def _train(opt_cls, steps: int = 3, **options) -> tuple:
    """A small model (made where this runs: under mesh.activate(), on the mesh) after
    ``steps`` of ``opt_cls``: ``(model, optimizer, losses)``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = opt_cls(model.parameters(), lr=0.01, **options)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss)
    return model, opt, losses


@pytest.mark.parametrize("opt_cls", _OPTIMIZERS, ids=lambda c: c.__name__)
def test_torchs_optimizers_give_local_numbers_taking_foreach_where_it_keeps_them(mesh, opt_cls):
    """Each of torch's optimizers with its defaults: local torch's numbers bit for bit.
    Those whose foreach path does the per-tensor path's arithmetic take it on the mesh
    (a few commands a step); the others (NAdam, RAdam, ASGD, Adafactor round otherwise
    there) keep torch's per-tensor choice, as locally. Before, all took foreach, and
    those four drifted from local torch by an ulp a step."""
    from monarch_nb.api.tensor.optim import SAME_NUMBERS

    local_model, _, local_losses = _train(opt_cls)
    with mesh.activate():
        model, opt, losses = _train(opt_cls)
    assert [mnb.inspect(v).item() for v in losses] == [v.item() for v in local_losses]
    for p, q in zip(model.parameters(), local_model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q)
    seen: list = []  # what the step sees (the mesh's pre-hook ran before this one)
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["foreach"]))
    with mesh.activate():
        opt.step()
    assert seen == [True if opt_cls in SAME_NUMBERS else None]
    assert opt.param_groups[0]["foreach"] is None  # as the user left it (a state_dict too)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_fused_optimizers_give_local_fused_numbers(mesh, opt_cls):
    options = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {"amsgrad": True}
    local_model = _train(opt_cls, fused=True, **options)[0]
    with mesh.activate():
        model = _train(opt_cls, fused=True, **options)[0]
    for p, q in zip(model.parameters(), local_model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=0), q)


@pytest.mark.unit
def test_the_optimizers_given_foreach_equal_their_per_tensor_path_in_this_torch():
    """What ``SAME_NUMBERS`` stands on, checked against the torch installed: each
    listed optimizer's foreach path gives its per-tensor path's numbers bit for bit."""
    from monarch_nb.api.tensor.optim import SAME_NUMBERS

    options = {torch.optim.SGD: {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}}
    options[torch.optim.Adam] = options[torch.optim.AdamW] = {"amsgrad": True}
    options[torch.optim.RMSprop] = {"momentum": 0.5, "centered": True}
    options[torch.optim.Rprop] = {"etas": (0.4, 1.3), "maximize": True}
    for opt_cls in SAME_NUMBERS:
        for extra in ({}, options.get(opt_cls, {"weight_decay": 0.01})):
            a = _train(opt_cls, 5, foreach=True, **extra)[0]
            b = _train(opt_cls, 5, foreach=False, **extra)[0]
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p, q), (opt_cls.__name__, extra)


def _rank_value():
    return torch.tensor(float(mnb.current_rank()))


def test_writing_a_host_scalar_with_mesh_values_takes_the_ranks_value(mesh):
    """A 0-dim tensor of a Python number stays local under activate(). An op writing
    it with mesh tensors' values ran on the ranks on a copy and left it unchanged
    (ASGD's foreach path lost its step sizes so); then it was refused, and ASGD with
    foreach=True failed. Now it takes the value every rank agrees on (one round trip,
    as t.item()), so ASGD's foreach path gives local numbers; ranks that disagree are
    named; inside mnb.compile that call runs op by op."""
    with mesh.activate():
        eta, mu = torch.as_tensor(0.01).clone(), torch.as_tensor(1, dtype=torch.float64)
        value = torch.ones(()) * 0.5
        assert eta.copy_(value) is eta
        assert not isinstance(eta, mnb.Tensor) and eta.item() == 0.5
        torch._foreach_copy_([eta, mu], [value * 3, torch.full((), 0.25, dtype=torch.float64)])
        assert (eta.item(), mu.item()) == (1.5, 0.25)
        on_mesh = torch.zeros(())
        on_mesh.copy_(value)  # a mesh tensor takes it; a local value still goes in
        on_mesh.add_(torch.as_tensor(0.25))
        differs = mnb.remote(_rank_value, propagate=lambda: torch.empty(()))()
        with pytest.raises(ValueError, match="ranks"):
            eta.copy_(differs)
        with pytest.warns(RuntimeWarning, match=r"aten.copy_, at test_tensor.py"):
            mnb.compile(lambda: eta.copy_(value * 2))()  # a compiled call runs it op by op
    assert eta.item() == 1.0
    assert mnb.inspect(on_mesh, dp=1).item() == 0.75

    def asgd():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.ASGD(model.parameters(), lr=0.1, t0=1, foreach=True)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
        return model.weight.detach(), opt.state[model.weight]["ax"]

    local = asgd()
    with mesh.activate():
        ours = asgd()
    for a, b in zip(ours, local):
        assert torch.equal(mnb.inspect(a, dp=1), b)


def test_a_cuda_result_on_a_cpu_mesh_is_refused_at_the_call(mesh):
    assert mesh.device_type == "cpu"
    with mesh.activate():
        t = torch.ones(2)
        assert t.device.type == "cpu"
        for _ in range(2):  # and again, with its plan known: refused on every call
            with pytest.raises(mnb.RefUseError, match="no GPUs"):
                torch.ops.aten._to_copy.default(t, device=torch.device("cuda"))
            with pytest.raises(mnb.RefUseError, match="no GPUs"):
                torch.ops.aten.ones.default([2], device=torch.device("cuda"))
        assert mnb.inspect(t + 1).tolist() == [2.0, 2.0]


@pytest.mark.gpu
def test_a_cuda_mesh_makes_cuda_tensors_by_default():
    gpu_mesh = mnb.local_mesh(dp=1, name="tensor-cuda")
    try:
        assert gpu_mesh.device_type == "cuda"
        with gpu_mesh.activate():
            a = torch.ones(3)
            b = torch.tensor([1.0, 2.0, 3.0])
            model = torch.nn.Linear(3, 1)
            c = model(a + b)
            on_cpu = (a + b).cpu()
        assert a.device.type == b.device.type == c.device.type == "cuda"
        assert model.weight.device.type == "cuda" and on_cpu.device.type == "cpu"
        assert mnb.inspect(a + b).cpu().tolist() == [2.0, 3.0, 4.0]
        assert mnb.inspect(on_cpu).tolist() == [2.0, 3.0, 4.0]
    finally:
        gpu_mesh.shutdown()


def test_stream_borrow_rules_are_checked_at_the_call(mesh):
    comms = mesh.stream("tensor-lend")
    with mesh.activate():
        t = torch.ones(3)
        u = torch.ones(3)
    on_comms, borrow = comms.borrow(t)
    assert on_comms.stream is comms and not borrow.dropped and not borrow.mutable
    with mesh.activate():
        assert mnb.inspect(t * 2).tolist() == [2.0] * 3  # its stream may still read it
        with pytest.raises(mnb.RefUseError, match="borrowed by stream 'tensor-lend'"):
            t.add_(1)  # ... but not write it
        with comms.activate():
            s = on_comms.sum()  # the borrower reads it
            with pytest.raises(mnb.RefUseError, match="without mutable=True"):
                on_comms.mul_(2)
    borrow.drop()
    assert borrow.dropped
    with mesh.activate():
        t.add_(1)  # given back: its stream writes it again
    assert mnb.inspect(t).tolist() == [2.0] * 3 and mnb.inspect(s).item() == 3.0

    on_comms, borrow = comms.borrow(u, mutable=True)
    with comms.activate():
        on_comms.mul_(5)  # a mutable borrow writes the shared storage
    with mesh.activate():
        with pytest.raises(mnb.RefUseError, match="mutable=True"):
            u + 1  # its own stream may not even read it meanwhile
    borrow.drop()
    with mesh.activate():
        assert mnb.inspect(u + 1).tolist() == [6.0] * 3
    with pytest.raises(TypeError, match="mesh tensor"):
        comms.borrow(3)


def test_reduce_onto_a_slice_of_the_mesh(mesh):
    with mesh.activate():
        t = torch.ones(2)
    mnb.remote(fill_rank)(t, mesh=mesh)  # rank r holds [r, r]
    first = mesh.slice(dp=slice(0, 1))
    total = t.reduce("dp", "sum", mesh=first)  # a reduce to rank 0
    assert total.mesh is first and total.shape == (2,)
    assert mnb.inspect(total).tolist() == [1.0, 1.0]
    stacked = t.reduce("dp", "stack", mesh=first)  # a gather to rank 0
    assert stacked.shape == (2, 2) and mnb.inspect(stacked).tolist() == [[0.0, 0.0], [1.0, 1.0]]
    with first.activate():
        assert mnb.inspect(total * 3).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="new tensor"):
        t.reduce("dp", "sum", inplace=True, mesh=first)


def test_inplace_view_ops_change_the_layout_on_every_rank(mesh):
    with mesh.activate():
        t = torch.arange(6.0).reshape(2, 3)
        same = t.t_()
        assert same is t and t.shape == (3, 2) and t.stride() == (1, 3)
        u = torch.ones(3)
        u.unsqueeze_(0)
        v = u + 1
        w = torch.ones(2)
        w.resize_(4)
        assert w.shape == (4,)
    assert mnb.inspect(w)[:2].tolist() == [1.0, 1.0]  # resize_ keeps what was there
    assert v.shape == (1, 3) and mnb.inspect(v, dp=1).tolist() == [[2.0, 2.0, 2.0]]
    assert mnb.inspect(t).tolist() == torch.arange(6.0).reshape(2, 3).t().tolist()
    assert mnb.inspect(t.sum(0)).tolist() == [3.0, 12.0]


def test_reduce_in_place_on_a_view_reaches_its_base(mesh):
    with mesh.activate():
        base = torch.ones(2, 3)
        row, col = base[1], base[:, 0]
    row.reduce_("dp", "sum")
    col.reduce_("dp", "sum")  # a strided view, written in place too
    assert mnb.inspect(base, dp=1).tolist() == [[2.0, 1.0, 1.0], [4.0, 2.0, 2.0]]
    with mesh.activate():
        base = torch.zeros(2, 3)
        row = base[1]
        idx = torch.zeros(1, dtype=torch.int64)
    mnb.remote(fill_rank)(idx, mesh=mesh)
    with mesh.activate():
        row[idx * 10] = 5.0  # out of range on rank 1 only
    assert mnb.inspect(base, dp=0).tolist()[1] == [5.0, 0.0, 0.0]
    row.reduce_("dp", "sum")  # rank 1's input failed: the reduce fails on both ranks
    with pytest.raises(mnb.RemoteError):
        mnb.inspect(base, dp=0)  # never the values from before the reduce
    with mesh.activate():
        assert mnb.inspect(torch.ones(1) * 3).tolist() == [3.0]


def test_pipelined_ops_travel_packed_in_few_messages(mesh):
    routes = mesh._controller.io.routes
    encode_ops, packed = routes.encode_ops, []

    def counting(ops):  # the real encoder, counted
        packed.append(len(ops))
        return encode_ops(ops)

    with mesh.activate():
        x = torch.zeros(4)
        mesh.wait()
        routes.encode_ops = counting
        try:
            for _ in range(1000):
                x = x + 1
            mesh.wait()
        finally:
            routes.encode_ops = encode_ops
    assert mnb.inspect(x, dp=1).tolist() == [1000.0] * 4
    assert sum(packed) == 1000
    # one RunOps per drain of the queue (the ops of about a millisecond), not one per op
    assert len(packed) <= 500, packed


def test_ops_of_interleaved_slices_and_new_ops_keep_their_order(mesh):
    first, second = mesh.slice(dp=slice(0, 1)), mesh.slice(dp=slice(1, 2))
    with first.activate():
        a = torch.zeros(3)
    with second.activate():
        b = torch.zeros(3)
    for i in range(200):  # the ranks change at every op; a new op shape now and then
        with first.activate():
            a = a + 1 if i % 50 else a.mul(1.0).add(1)
        with second.activate():
            b = b * 2 if i % 2 else b - 1
    assert mnb.inspect(a).tolist() == [200.0] * 3
    expected = 0.0
    for i in range(200):
        expected = expected * 2 if i % 2 else expected - 1
    assert mnb.inspect(b).tolist() == [expected] * 3
