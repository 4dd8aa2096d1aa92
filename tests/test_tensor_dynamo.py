"""``torch.compile(fn, backend=mnb.mesh_backend)`` on a real dp=2 mesh: dynamo's
graphs of mesh tensors run on the ranks, one command a graph a call, with local
torch's numbers bit for bit (the transformer LM of ``benchmarks/lm.py``)."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys

import pytest
import torch
from connect_helpers import TESTS_ENV
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from worker_probes import env_sizes

import monarch_nb as mnb
from benchmarks import cnn, lm
from benchmarks.lm import one_thread
from benchmarks.tensor_real import commands_per_call as _commands
from monarch_nb.api.tensor import traced
from monarch_nb.api.tensor.dispatch import dispatch
from monarch_nb.api.tensor.mode import MeshMode

STEPS = 3


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-dynamo")
    try:
        yield m
    finally:
        m.shutdown()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_function_runs_on_the_ranks_as_one_command(mesh):
    with mesh.activate():
        x, w = torch.randn(4, 8), torch.randn(8, 3)
        x2 = torch.randn(4, 8)

    def f(x, w):
        pos = torch.arange(3, dtype=torch.float32)  # made on each rank, in the graph
        return torch.relu(x @ w) * 0.5 + pos

    with mesh.activate():
        want, want2 = f(x, w).fetch(), mnb.inspect(f(x2, w))
    compiled = torch.compile(f, backend=mnb.mesh_backend)
    y = compiled(x, w)
    assert isinstance(y, mnb.Tensor) and y.shape == (4, 3)
    assert all(torch.equal(a, b) for a, b in zip(y.fetch(), want))  # every rank's shard
    assert _commands(mesh, lambda: compiled(x2, w)) == 1
    assert torch.equal(mnb.inspect(compiled(x2, w)), want2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(3):
        compiled(x2, w)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile


def _inside(mesh, inside: bool):
    """``mesh.activate()`` where a test calls its compiled function inside it."""
    return mesh.activate() if inside else contextlib.nullcontext()


def test_inside_activate_a_compiled_function_is_still_one_graph_and_one_command(mesh):
    """torch.compile runs a frame eagerly under a TorchDispatchMode that does not
    ignore compile internals: the mesh's mode does, and the compiled call's own
    bookkeeping (meta outputs, host scalars) never becomes ops of the mesh."""
    with mesh.activate():
        x, w = torch.randn(4, 8), torch.randn(8, 3)

        def f(x, w):
            return torch.relu(x @ w) * 0.5 + torch.arange(3, dtype=torch.float32)

        want = mnb.inspect(f(x, w))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled = torch.compile(f, backend=mnb.mesh_backend)
        assert torch.equal(mnb.inspect(compiled(x, w)), want)
        assert _commands(mesh, lambda: compiled(x, w)) == 1
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
        assert torch.equal(mnb.inspect(f(x, w)), want)  # eager under the mode goes on
    assert torch.equal(mnb.inspect(compiled(x, w)), want)  # and outside it, the same graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-activate"])
def test_the_lm_gradients_are_one_graph_with_local_torchs_numbers(mesh, inside):
    with one_thread():
        # the reference first: making the mesh's model seeds the local generator too
        local = lm.make()
        losses = [lm.step(*local).detach().clone() for _ in range(STEPS + 1)]
        with mesh.activate():
            model, opt, sched, data = lm.make()
        grads = torch.compile(lm.accumulate, backend=mnb.mesh_backend)
        with torch._dynamo.config.patch(trace_autograd_ops=True), _inside(mesh, inside):
            got = [lm.compiled_step(grads, model, opt, sched, data) for _ in range(STEPS)]
            # the graph (2 micro-batches, backward, accumulation, clipping) and AdamW's
            # few foreach commands; op by op the step is ~220
            step = lm.compiled_step
            assert _commands(mesh, lambda: got.append(step(grads, model, opt, sched, data))) <= 20
        for a, b in zip(got, losses, strict=True):
            assert torch.equal(mnb.inspect(a), b)
    ours = dict(model.named_parameters())
    for name, p in local[0].named_parameters():
        assert torch.equal(mnb.inspect(ours[name]), p.detach()), name
        assert torch.equal(mnb.inspect(ours[name].grad), p.grad), name


@pytest.mark.unit
def test_the_lm_graphs_gradient_copies_are_dropped_with_the_same_results():
    """AOTAutograd writes each new ``.grad`` as ``copy(empty_like(p), g)``: where ``g``
    has ``p``'s layout already, ``drop_layout_copies`` returns ``g`` itself (a real
    graph of the LM's gradients, traced locally; the program each rank runs)."""
    from torch._dynamo.backends.common import aot_autograd

    from monarch_nb.api.tensor.graph_copies import drop_layout_copies
    from monarch_nb.protocol.graph_program import GraphProgram

    seen = {}

    def keep(gm, example_inputs):
        seen["gm"] = gm

        def run(*args):
            seen["args"] = list(args)
            return gm(*args)

        return run

    with one_thread(), torch._dynamo.config.patch(trace_autograd_ops=True):
        model, opt, _, data = lm.make()
        opt.zero_grad(set_to_none=True)
        torch.compile(lm.accumulate, backend=aot_autograd(fw_compiler=keep))(model, data)
    gm, args = seen["gm"], seen["args"]
    before = GraphProgram.of(gm, "before")

    def copies():
        return len(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.copy.default))

    n = 2 * len(list(model.parameters()))  # a copy per parameter per micro-batch
    assert copies() == n
    # every gradient has its parameter's layout here (a Linear's weight grad is
    # t(t(mm)), contiguous): no copy is left
    assert drop_layout_copies(gm) == n and copies() == 0
    after = GraphProgram.of(gm, "after")
    torch.manual_seed(1)
    want = before(*args)
    torch.manual_seed(1)
    got = after(*args)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.stride() == b.stride()


def test_a_copy_the_graph_needs_stays_its_own_tensor(mesh):
    """A copy whose source is also returned, or has another layout, is kept: the
    results are tensors of their own, of local torch's layouts and values."""
    with mesh.activate():
        x = torch.randn(4, 4)

    def f(x):
        y = x * 2
        same = torch.empty_like(x).copy_(y)  # y is returned too: a tensor of its own
        other = torch.empty_like(x).copy_((x + 3).t())  # its strides are not x's
        lone = torch.empty_like(x).copy_(x + 1)  # droppable: nothing else sees x + 1
        return same, y, other, lone

    want = f(mnb.inspect(x))
    got = torch.compile(f, backend=mnb.mesh_backend)(x)
    for a, b in zip(got, want, strict=True):
        assert a.stride() == b.stride()
        assert torch.equal(mnb.inspect(a), b)
    same, y, other, lone = got
    with mesh.activate():
        y.add_(1)
    assert torch.equal(mnb.inspect(same), want[0])  # y's change did not reach it
    assert torch.equal(mnb.inspect(y), want[1] + 1)
    assert torch.equal(mnb.inspect(lone), want[3])


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-activate"])
def test_a_backward_outside_the_graph_runs_the_compiled_backward(mesh, inside):
    """Without trace_autograd_ops dynamo ends the graph at ``backward()`` (in a loop,
    its frame runs eagerly and the model's forward is a graph of its own): torch's
    engine runs the compiled backward (one more command), reading the activations
    the forward saved, and accumulates the grads op by op."""
    with one_thread():
        local = lm.make()  # the reference first (making the mesh's model seeds it)
        losses = [lm.step(*local).detach().clone() for _ in range(STEPS)]
        with mesh.activate():
            model, opt, sched, data = lm.make()
        grads = torch.compile(lm.accumulate, backend=mnb.mesh_backend)
        with _inside(mesh, inside):
            got = [lm.compiled_step(grads, model, opt, sched, data) for _ in range(STEPS)]
    # the eager ops after the graph break pass through the mesh's mode: dynamo
    # compiles no frame of it (its __torch_dispatch__ is not wrapped in a disable)
    for fn in (MeshMode.__torch_dispatch__, dispatch):
        assert not _debug_get_cache_entry_list(fn.__code__), fn.__qualname__
    for a, b in zip(got, losses, strict=True):
        assert torch.equal(mnb.inspect(a), b)
    ours = dict(model.named_parameters())
    for name, p in local[0].named_parameters():
        assert torch.equal(mnb.inspect(ours[name].grad), p.grad), name


class _HeadAndLoss(torch.nn.Module):
    """A model whose loss comes after a graph break, as a transformers model's does
    (its loss_function logs a warning once): the logits are the first graph's
    output and the second graph's input, which its backward reads."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 6)

    def forward(self, x, y):
        logits = torch.tanh(self.head(x))
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits * logits, y)


def test_a_value_between_two_graphs_lives_for_the_backward_that_reads_it(mesh):
    """The logits of _HeadAndLoss, dropped once the loss was made, freed their value
    on the ranks while the second graph's backward still needed it: backward() failed
    with "a compiled graph's input was freed before the graph ran" (a transformers
    GPT-2 under torch.compile with labels did). Both shards of such a value now keep
    it while torch holds them: the loss and the grads are local torch's."""

    def run():
        torch.manual_seed(0)
        model = _HeadAndLoss()
        x, y = torch.randn(5, 4), torch.randint(0, 6, (5,))
        loss = torch.compile(model, backend=backend)(x, y)
        loss.backward()
        return loss.detach(), model.head.weight.grad

    backend = "eager"
    with one_thread():
        local = run()
        torch._dynamo.reset()
        backend = mnb.mesh_backend
        with mesh.activate():
            ours = run()
    for a, b in zip(ours, local, strict=True):
        assert torch.equal(mnb.inspect(a, dp=1), b)


def _optimizer_steps(backend, foreach) -> list:
    """An eager Adam step, then three under torch.compile (torch's tutorial's way):
    the weights after each."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), 1e-2, foreach=foreach)

    @torch.compile(backend=backend)
    def compiled_step():
        opt.step()

    weights = []
    for k in range(4):
        model(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step() if k == 0 else compiled_step()
        opt.zero_grad()
        weights.append(model.weight.detach().clone())
    assert opt.param_groups[0]["foreach"] is foreach  # as the user left it
    return weights


@pytest.mark.parametrize("foreach", [None, False], ids=["default", "per-tensor"])
def test_a_compiled_optimizer_step_gives_local_compiled_numbers(mesh, foreach):
    """A compiled Adam step on the mesh: its graph failed on the ranks (dynamo writes
    addcmul with a value as inductor's prims.fma, which no rank had imported), the
    step count it reads by value went to the ranks after the step had written it in
    place (the IO thread encodes a graph's command later: other numbers, by timing),
    and an Adam of mesh tensors took the foreach path under torch.compile too, which
    decomposes otherwise than the per-tensor path local torch takes there (an ulp a
    step). Each step now equals a local compiled step, and the first (eager) one a
    local eager step, also after dynamo forgot its graphs."""
    with one_thread():
        local = _optimizer_steps("eager", foreach)
        for _ in range(2):
            torch._dynamo.reset()
            with mesh.activate():
                ours = _optimizer_steps(mnb.mesh_backend, foreach)
            for a, b in zip(ours, local, strict=True):
                assert torch.equal(mnb.inspect(a, dp=1), b)
    del ours
    torch._dynamo.reset()  # its graphs hold the optimizer's values: freed now, not in
    gc.collect()  # a later test that counts the values on the ranks
    mnb.remote(gc.collect)(mesh=mesh).fetch()


def test_a_graphs_values_are_freed_on_the_ranks(mesh):
    with mesh.activate():
        model, opt, sched, data = lm.make()
    grads = torch.compile(lm.accumulate, backend=mnb.mesh_backend)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for _ in range(3):
            lm.compiled_step(grads, model, opt, sched, data)
        gc.collect()
        base = env_sizes(mesh)
        for _ in range(10):
            lm.compiled_step(grads, model, opt, sched, data)
        gc.collect()
    assert env_sizes(mesh) == base
    # a model shown to torch.compile and then dropped frees its values on the ranks
    del model, opt, sched, data, grads
    torch._dynamo.reset()  # dynamo's cache holds the compiled frame (and its guards)
    gc.collect()
    assert all(n < b for n, b in zip(env_sizes(mesh), base))


def test_gradients_dropped_by_zero_grad_are_freed_at_once(mesh, monkeypatch):
    """A graph's output that nothing but its mesh tensor holds (a gradient, dropped by
    zero_grad) frees its value there and then: no mesh tensor is made to hand it over
    (31 a step were, each made and freed again, when a local in Tensor.delete held the
    shard that hand_over counts the holders of)."""
    with mesh.activate():
        model, opt, sched, data = lm.make()
    grads = torch.compile(lm.accumulate, backend=mnb.mesh_backend)
    handed: list = []
    real = traced.hand_over
    monkeypatch.setattr(traced, "hand_over", lambda t: handed.append(real(t)) or handed[-1])
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        for _ in range(2):
            lm.compiled_step(grads, model, opt, sched, data)
        before = env_sizes(mesh)
        handed.clear()
        opt.zero_grad(set_to_none=True)
        after = env_sizes(mesh)
    n = len(list(model.parameters()))
    assert handed == [False] * n
    assert [b - a for a, b in zip(after, before)] == [n, n]


def test_bad_input_gives_a_clear_error_and_the_mesh_goes_on(mesh):
    with mesh.activate():
        x = torch.randn(4, 8)

    def f(a, b):
        return a @ b

    compiled = torch.compile(f, backend=mnb.mesh_backend)
    with pytest.raises(Exception, match="local tensor"):
        compiled(x, torch.randn(8, 3))  # a local tensor beside mesh tensors
    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend=mnb.mesh_backend"):
        mnb.inspect(torch.compile(f)(x, x.t()))  # another backend runs graphs here
    with mesh.activate():
        assert mnb.inspect(x @ x.t()).shape == (4, 4)  # the engine works on
        torch._dynamo.reset()  # the same inside activate(), where dynamo compiles too
        with pytest.raises(Exception, match="backend=mnb.mesh_backend"):
            mnb.inspect(torch.compile(f)(x, x.t()))
        assert mnb.inspect(x @ x.t()).shape == (4, 4)
    torch._dynamo.reset()
    assert mnb.inspect(torch.compile(f, backend=mnb.mesh_backend)(x, x.t())).shape == (4, 4)
    # inductor's C++ kernels read the shards, which hold no data: the process crashed
    torch._dynamo.reset()
    with mesh.activate():
        lin = torch.nn.Linear(8, 3)
        with pytest.raises(Exception, match=r"backend 'inductor' .*backend=mnb\.mesh_backend"):
            torch.compile(lambda a: (a * 2).sin())(x)
        with pytest.raises(Exception, match=r"backend 'inductor' .*backend=mnb\.mesh_backend"):
            torch.compile(lin)(x)
        torch._dynamo.reset()
        eager = torch.compile(lin, backend="eager")(x)  # torch's own ops: on the mesh
        assert torch.equal(mnb.inspect(eager), mnb.inspect(lin(x)))
    torch._dynamo.reset()


def test_a_higher_order_op_on_mesh_tensors_is_refused_naming_it_and_what_works(mesh):
    """torch.cond and flex_attention run eagerly by compiling a wrapper of theirs;
    dynamo's tracer failed on mesh tensors with an assertion about FakeTensors (a
    2,000-character message naming neither the op nor a way out)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    with mesh.activate():
        x = torch.randn(4)
        q = torch.randn(1, 2, 8, 4)
        with pytest.raises(Exception, match=r"torch.cond on mesh tensors: .*pred.item\(\)"):
            torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t - 1, (x,))
        with pytest.raises(Exception, match=r"flex_attention on mesh tensors: .*scaled_dot_prod"):
            flex_attention(q, q, q, score_mod=lambda score, b, h, i, j: score + (i - j))
        assert mnb.inspect(x * 2).shape == (4,)  # the engine works on, dynamo too
        lin = torch.nn.Linear(4, 2)
        compiled = torch.compile(lin, backend=mnb.mesh_backend)
        assert torch.equal(mnb.inspect(compiled(x)), mnb.inspect(lin(x)))
    torch._dynamo.reset()


def test_a_new_batch_size_gives_each_result_its_own_shape(mesh):
    """dynamo makes the batch dim symbolic on a second size: the results' layouts
    are worked out per call from the sizes the call has."""
    with mesh.activate():
        w = torch.randn(8, 3)
        xs = [torch.randn(n, 8) for n in (4, 5, 6, 7)]

    def f(x, w):
        return torch.relu(x @ w) * x.shape[0]

    compiled = torch.compile(f, backend=mnb.mesh_backend)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for x in xs:
        y = compiled(x, w)
        assert y.shape == (x.shape[0], 3) and all(type(d) is int for d in y.shape)
        with mesh.activate():
            assert torch.equal(mnb.inspect(y + 0), mnb.inspect(f(x, w)))  # usable on
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2


def test_a_graph_failing_on_the_ranks_is_reported_and_the_mesh_goes_on(mesh):
    with mesh.activate():
        table = torch.randn(10, 4)
        bad = torch.tensor([1, 2, 99])  # out of the table's range: fails on the ranks

    def lookup(i, t):
        return torch.nn.functional.embedding(i, t) * 2

    compiled = torch.compile(lookup, backend=mnb.mesh_backend)
    y = compiled(bad, table)
    with pytest.raises(mnb.RemoteError, match="compiled forward graph"):
        mnb.inspect(y)
    with mesh.activate():
        good = torch.tensor([1, 2, 3])
    assert torch.equal(mnb.inspect(compiled(good, table)), mnb.inspect(table)[1:4] * 2)


def _cnn_loss(net, x, y):
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("inside", [False, True], ids=["outside", "inside-activate"])
def test_a_cnn_with_batchnorm_trains_and_evaluates_as_local_torch(mesh, inside):
    """BatchNorm's running stats are updated in the graph (on the ranks) and its
    ``num_batches_tracked``, a 0-dim tensor on the controller, by the part of the
    graph that reads only it, run on the controller."""
    with one_thread():
        net, opt, x, y = cnn.make(6)
        want = []
        for _ in range(STEPS):
            opt.zero_grad()
            want.append(_cnn_loss(net, x, y))
            opt.step()
        net.eval()
        want_eval = net(x).detach()
        with mesh.activate():
            ours, our_opt, mx, my = cnn.make(6)
        train = torch.compile(_cnn_loss, backend=mnb.mesh_backend)
        with torch._dynamo.config.patch(trace_autograd_ops=True), _inside(mesh, inside):
            for expected in want:
                our_opt.zero_grad()
                assert torch.equal(mnb.inspect(train(ours, mx, my)), expected)
                our_opt.step()
        ours.eval()
        evaluate = torch.compile(lambda n, x: n(x), backend=mnb.mesh_backend)
        with _inside(mesh, inside):
            assert torch.equal(mnb.inspect(evaluate(ours, mx)), want_eval)
    bn, local_bn = ours[1], net[1]
    assert torch.equal(mnb.inspect(bn.running_mean), local_bn.running_mean)
    assert torch.equal(mnb.inspect(bn.running_var), local_bn.running_var)
    assert bn.num_batches_tracked.item() == local_bn.num_batches_tracked.item() == STEPS


def test_a_torch_compiled_function_inside_mnb_compile_replays(mesh):
    """mnb.compile records the graph's command like any other and replays it."""
    with mesh.activate():
        x, w = torch.randn(4, 8), torch.randn(8, 3)

    def f(x, w):
        return torch.relu(x @ w) * 0.5

    compiled = torch.compile(f, backend=mnb.mesh_backend)
    recorded = mnb.compile(lambda: compiled(x, w))
    with mesh.activate():
        want = mnb.inspect(f(x, w))
    outs = [recorded() for _ in range(4)]
    assert all(torch.equal(mnb.inspect(o), want) for o in outs)
    assert _commands(mesh, recorded) == 1


_MODULE_COMPILE_FIRST = """
import torch, monarch_nb as mnb
torch.set_num_threads(1)
def run(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model.compile(backend=backend)
    model(torch.randn(3, 4)).sum().backward()
    return model[0].weight.grad
local = run("eager")
mesh = mnb.local_mesh(dp=2)
try:
    with mesh.activate():
        grad = run(mnb.mesh_backend)
    assert torch.equal(mnb.inspect(grad, dp=1), local)
finally:
    mesh.shutdown()
print("as locally")
"""


def test_module_compile_as_a_process_first_compile_of_mesh_tensors_trains_as_locally():
    """``model.compile(backend=mnb.mesh_backend)`` as the first compile of mesh tensors in
    a process (a fresh one: which package dynamo skips is the process's): torch runs
    its own module frames eagerly, so dynamo compiled the mesh's dispatch frames
    instead, a graph of them ran on the ranks apart from autograd, and the backward
    failed ("gave 1 of the graph's leaves no gradient")."""
    out = subprocess.run(
        [sys.executable, "-c", _MODULE_COMPILE_FIRST],
        capture_output=True, text=True, timeout=300, env=TESTS_ENV,
    )
    assert out.returncode == 0 and "as locally" in out.stdout, out.stderr[-3000:]
