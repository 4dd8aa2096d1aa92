"""``loss.backward()`` on mesh tensors runs on the ranks in one command (each rank's
autograd engine on the graph of its shards), and gives local torch's grads bit for
bit; where the ranks cannot run it (hooks, custom autograd.Functions,
create_graph, inputs=), torch's engine on the controller does, with the same
numbers (real dp=2 mesh, gloo)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import monarch_nb as mnb


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-backward")
    try:
        yield m
    finally:
        m.shutdown()


def _done(mesh) -> int:
    mesh.wait()
    return mesh.status()["ranks"][0]["streams"]["default"]["done"]


def _model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 3)
    )
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    return model, x, y


def _both(mesh, body):
    """``body(model, x, y)`` locally and on the mesh from the same seed; returns the
    local and the mesh model."""
    torch.manual_seed(1)
    local = _model_and_data()
    body(*local)
    with mesh.activate():
        ours = _model_and_data()
        body(*ours)
    return local[0], ours[0]


def _assert_same_grads(mesh, local, ours):
    for (name, p), q in zip(local.named_parameters(), ours.parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        for rank in (0, 1):
            assert torch.equal(mnb.inspect(q.grad, dp=rank), p.grad), name


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def test_backward_is_one_command_with_local_grads(mesh):
    def body(model, x, y):
        loss = _loss(model, x, y)
        if isinstance(loss, mnb.Tensor):
            before = _done(mesh)
            loss.backward()
            assert _done(mesh) - before == 1  # the whole backward: one command
        else:
            loss.backward()

    local, ours = _both(mesh, body)
    _assert_same_grads(mesh, local, ours)


def test_accumulation_retain_graph_and_a_given_gradient(mesh):
    def body(model, x, y):
        out = model(x)
        out.backward(torch.ones_like(out) * 0.5, retain_graph=True)  # non-scalar, gradient=
        out.sum().backward()  # through the retained graph: accumulates
        _loss(model, x, y).backward()

    local, ours = _both(mesh, body)
    _assert_same_grads(mesh, local, ours)


def test_zero_grad_in_place_and_a_frozen_parameter(mesh):
    def body(model, x, y):
        _loss(model, x, y).backward()
        model.zero_grad(set_to_none=False)
        model[0].bias.requires_grad_(False)
        _loss(model, x, y).backward()

    local, ours = _both(mesh, body)
    _assert_same_grads(mesh, local, ours)


def test_a_second_backward_of_a_freed_graph_fails_and_the_mesh_goes_on(mesh):
    with mesh.activate():
        model, x, y = _model_and_data()
        loss = _loss(model, x, y)
        loss.backward()
        loss.backward()
        with pytest.raises(mnb.RemoteError, match="backward through the graph a second time"):
            mnb.inspect(model[0].weight.grad)
        model.zero_grad()
        _loss(model, x, y).backward()
        assert mnb.inspect(model[0].weight.grad).abs().sum() > 0


def test_the_graph_frees_its_saved_tensors_as_torch_does(mesh):
    with mesh.activate():
        w = torch.randn(4, requires_grad=True)
        y = w * 2
        held = weakref.ref(y)
        loss = y.sin().sum()  # sin saves its input: only the graph holds it after del
        del y
        gc.collect()
        assert held() is not None
        loss.backward()
        assert held() is None  # the controller dropped it, and its shards with it
        assert torch.equal(mnb.inspect(w.grad), (mnb.inspect(w) * 2).cos() * 2)


class _Clip(torch.autograd.Function):
    """A straight-through estimator: a backward that is not the forward's."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-0.1, 0.1)

    @staticmethod
    def backward(ctx, g):
        return g * 3.0


@pytest.mark.parametrize(
    "case", ["hook", "retain_grad", "function", "leaf_hook", "module_hook", "inputs"]
)
def test_what_the_ranks_cannot_run_runs_on_the_controller(mesh, case):
    seen = []

    def body(model, x, y):
        h = model[0](x)
        if case == "hook":
            h.register_hook(lambda g: g * 2)
        elif case == "retain_grad":
            h.retain_grad()
        elif case == "function":
            h = _Clip.apply(h)
        elif case == "leaf_hook":
            model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
        elif case == "module_hook":
            model[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
        loss = torch.nn.functional.cross_entropy(model[3](model[2](model[1](h))), y)
        if case == "inputs":
            loss.backward(inputs=[model[3].weight])
        else:
            loss.backward()
        if case == "retain_grad":
            seen.append(h.grad)

    local, ours = _both(mesh, body)
    _assert_same_grads(mesh, local, ours)
    if seen:
        assert len(seen) == 2
        assert torch.equal(mnb.inspect(seen[1], dp=1), seen[0])


def test_double_backward_and_autograd_grad(mesh):
    def body(model, x, y):
        x = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(_loss(model, x, y), x, create_graph=True)
        (gx.pow(2).sum() + _loss(model, x, y)).backward()  # the gradient penalty, on the ranks

    local, ours = _both(mesh, body)
    _assert_same_grads(mesh, local, ours)


def test_a_compiled_step_keeps_one_command_per_call(mesh):
    with mesh.activate():
        model, x, y = _model_and_data()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        return loss

    compiled = mnb.compile(step)
    with mesh.activate():
        first = [mnb.inspect(compiled()).item() for _ in range(6)]
    before = _done(mesh)
    compiled()
    assert _done(mesh) - before == 1
    torch.manual_seed(0)
    lmodel, lx, ly = _model_and_data()
    lopt = torch.optim.AdamW(lmodel.parameters(), lr=1e-2)
    want = []
    for _ in range(6):
        lopt.zero_grad()
        loss = _loss(lmodel, lx, ly)
        loss.backward()
        lopt.step()
        want.append(loss.item())
    assert first == want


def test_detach_in_place_ends_the_graph_on_the_ranks_too(mesh):
    """torch's detach_() is autograd's own kernel (no dispatch): the ranks' graph
    used to go on through the shard, so the new leaf got no grad and the tensor it
    came from got one there."""

    def run():
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        y = (x * 2).detach_().requires_grad_()
        z = x.sum(0).detach_()  # a detached result used later without grad
        (y.pow(2).sum() + (x * z).sum()).backward()
        return y, x, z

    want = run()
    with mesh.activate():
        got = run()
    assert got[0].is_leaf and got[0].grad is not None
    assert torch.equal(mnb.inspect(got[0].grad), want[0].grad)
    assert torch.equal(mnb.inspect(got[1].grad), want[1].grad)
    assert not mnb.inspect(got[2]).requires_grad
    with mesh.activate():
        v = torch.ones(4, requires_grad=True).mul(3)[1:]
        with pytest.raises(RuntimeError, match="Can't detach views in-place"):
            v.detach_()
        w = v + 1  # the mesh goes on
    assert torch.equal(mnb.inspect(w), torch.full((3,), 4.0))


def _halve(t):
    t.mul_(0.5)  # in place, on a parameter's shard: no autograd error on the rank


def test_remote_functions_and_pushes_see_shards_without_the_graph(mesh):
    with mesh.activate():
        model, x, y = _model_and_data()
        _loss(model, x, y).backward()
        w = model[0].weight
        before = mnb.inspect(w)
        assert not before.requires_grad
        mnb.remote(_halve)(w)
        assert torch.equal(mnb.inspect(w), before * 0.5)
        mesh.push(w=w)
        assert mesh.exec("w.requires_grad").fetch(rank=0) is False
        model.zero_grad()
        _loss(model, x, y).backward()  # the graph on the ranks still goes to the shard
        assert mnb.inspect(w.grad).abs().sum() > 0


@pytest.mark.gpu
def test_backward_on_a_cuda_mesh_gives_local_cuda_grads():
    """On a GPU the ranks' engine runs the backward of CUDA ops on its device
    thread; the grads equal local torch's on the same GPU."""
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    gpu_mesh = mnb.local_mesh(dp=1, name="tensor-backward-cuda")
    try:
        with gpu_mesh.activate():
            torch.manual_seed(0)
            ours = torch.nn.Sequential(
                torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
            )
            x = torch.randn(10, 6)
            loss = ours(x).pow(2).sum()
            before = _done(gpu_mesh)
            loss.backward()
            assert _done(gpu_mesh) - before == 1
        local.cuda()
        lx = mnb.inspect(x)
        local(lx).pow(2).sum().backward()
        for p, q in zip(local.parameters(), ours.parameters()):
            assert torch.equal(mnb.inspect(q.grad), p.grad)
    finally:
        gpu_mesh.shutdown()
