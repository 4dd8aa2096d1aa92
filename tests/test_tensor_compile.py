"""mnb.compile of tensor-engine code: a training step written in plain torch on
mesh tensors, recorded and replayed as one message per call (real dp=2 mesh)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import monarch_nb as mnb


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-compile")
    try:
        yield m
    finally:
        m.shutdown()


def _setup(mesh, momentum=0.0):
    with mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        x, y = torch.randn(32, 8), torch.randn(32, 1)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=momentum)
    return model, opt, twin, twin_opt, x, y


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _commands_done(mesh) -> int:
    mesh.wait()
    return mesh.status()["ranks"][0]["streams"]["default"]["done"]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_compiled_training_step_matches_the_op_by_op_one(mesh, momentum):
    model, opt, twin, twin_opt, x, y = _setup(mesh, momentum)
    step = mnb.compile(lambda: _step(model, opt, x, y))
    losses, twin_losses = [], []
    for _ in range(8):
        losses.append(mnb.inspect(step()).item())
        twin_losses.append(mnb.inspect(_step(twin, twin_opt, x, y)).item())
    assert losses == pytest.approx(twin_losses, rel=1e-5)
    assert losses[-1] < losses[0]
    for p, q in zip(model.parameters(), twin.parameters()):
        for rank in (0, 1):
            assert torch.allclose(mnb.inspect(p, dp=rank), mnb.inspect(q, dp=rank), atol=1e-6)
            # the controller's gradients name the last replay's values
            assert torch.allclose(
                mnb.inspect(p.grad, dp=rank), mnb.inspect(q.grad, dp=rank), atol=1e-6
            )
    # settled: a call is one command on the stream, however many ops the step holds
    before = _commands_done(mesh)
    step()
    assert _commands_done(mesh) - before == 1
    before = _commands_done(mesh)
    _step(twin, twin_opt, x, y)
    assert _commands_done(mesh) - before > 5  # op by op: forward, backward, SGD


def test_a_float_that_changes_on_every_call_is_lifted_and_each_call_replays(mesh):
    with mesh.activate():
        w = torch.zeros(4)
    calls = []

    def bump():
        calls.append(1)
        w.add_(float(len(calls)))  # a Python float that changes on every call
        return w

    step = mnb.compile(bump)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):  # recorded twice (its floats differ: each call is checked)
            step()
        before = _commands_done(mesh)
        for _ in range(3):
            step()
        assert _commands_done(mesh) - before == 3  # one CallRecording a call
    assert len(calls) == 6  # every call ran, held, for its floats
    assert mnb.inspect(w).tolist() == [21.0] * 4  # 1 + 2 + ... + 6, as eagerly


def test_a_step_that_differs_on_every_call_runs_uncompiled_with_a_warning(mesh):
    with mesh.activate():
        w = torch.arange(6.0)
    calls = []

    def shift():
        calls.append(1)
        w.copy_(torch.roll(w, len(calls)))  # an int that changes: another op each call
        return w

    step = mnb.compile(shift)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            step()
    messages = [str(c.message) for c in caught]
    assert any("runs uncompiled" in t and "aten.roll" in t for t in messages), messages
    assert len(calls) == 6  # every call ran for real
    assert mnb.inspect(w).tolist() == torch.roll(torch.arange(6.0), 21).tolist()


def test_a_call_that_asks_the_ranks_runs_op_by_op_and_the_others_replay(mesh):
    """A log line's ``t.item()`` every third call inside a compiled step: that call
    runs op by op (what it held first, in order), with one warning naming where; the
    other calls replay as one message. It raised RecordingError."""
    with mesh.activate():
        acc, x = torch.zeros(3), torch.ones(3)
    calls, seen = [], []

    def step():
        calls.append(1)
        acc.add_(x)
        y = acc * 2
        if len(calls) % 3 == 0:
            seen.append(y.sum().item())
        return y + 1

    step = mnb.compile(step)
    with pytest.warns(RuntimeWarning, match=r"t.item\(\), at test_tensor_compile.py:\d+ in step"):
        outs = [step() for _ in range(6)]
    before = _commands_done(mesh)
    outs.append(step())
    assert _commands_done(mesh) - before == 1  # the seventh call asks nothing: a replay
    assert seen == [18.0, 36.0]
    assert [mnb.inspect(o, dp=1).tolist() for o in outs] == [[2.0 * k + 1] * 3 for k in range(1, 8)]
    assert mnb.inspect(acc, dp=0).tolist() == [7.0] * 3


@pytest.mark.parametrize("pure", [False, True], ids=["checked", "pure"])
def test_a_replay_after_the_captured_tensor_is_replaced_records_again(mesh, pure):
    """A checked call reads the new tensor; a pure replay, whose input is gone, records."""
    with mesh.activate():
        data = torch.ones(3)
        acc = torch.zeros(3)

    def accumulate():
        acc.add_(data * 2)

    step = mnb.compile(accumulate, pure=pure)
    for _ in range(4):
        step()
    assert mnb.inspect(acc).tolist() == [8.0] * 3
    with mesh.activate():
        data = torch.full((3,), 10.0)  # the old tensor goes: the recording must not read it
    for _ in range(3):
        step()
    assert mnb.inspect(acc).tolist() == [68.0] * 3
    x = mnb.inspect(acc + 1)
    assert x.tolist() == [69.0] * 3  # the mesh keeps serving


def test_compiled_tensor_arguments_and_results(mesh):
    @mnb.compile
    def affine(t, k: float):
        return t * k + 1

    with mesh.activate():
        a = torch.arange(4.0)
        b = torch.ones(2, 2)
    for _ in range(3):
        out = affine(a, 2.0)
        assert isinstance(out, mnb.Tensor) and out.shape == (4,)
        assert mnb.inspect(out).tolist() == [1.0, 3.0, 5.0, 7.0]
    other = affine(b, 2.0)  # another layout records anew
    assert other.shape == (2, 2) and mnb.inspect(other, dp=1).tolist() == [[3.0, 3.0]] * 2
    assert mnb.inspect(affine(a, 3.0)).tolist() == [1.0, 4.0, 7.0, 10.0]


def test_mesh_tensors_and_a_compiled_step_after_a_restart(mesh):
    with mesh.activate():
        t = torch.ones(2)
    step = mnb.compile(lambda: t.add_(1))
    for _ in range(3):
        step()
    assert mnb.inspect(t).tolist() == [4.0, 4.0]
    mesh.restart()
    for use in (lambda: t + 1, lambda: mnb.inspect(t), step):
        with pytest.raises(mnb.RefUseError, match="restarted"):
            use()
    with mesh.activate():
        fresh = torch.ones(2)
    again = mnb.compile(lambda: fresh.mul_(2))
    for _ in range(4):
        again()
    assert mnb.inspect(fresh, dp=1).tolist() == [16.0, 16.0]


@pytest.mark.gpu
def test_training_on_a_cuda_mesh_op_by_op_compiled_and_reduced():
    gpu = mnb.local_mesh(dp=1, name="tensor-compile-cuda")
    try:
        assert gpu.device_type == "cuda"
        model, opt, twin, twin_opt, x, y = _setup(gpu)
        assert all(p.device.type == "cuda" for p in model.parameters())
        step = mnb.compile(lambda: _step(model, opt, x, y))
        losses, twin_losses = [], []
        for _ in range(8):
            losses.append(mnb.inspect(step()).item())
            twin_losses.append(mnb.inspect(_step(twin, twin_opt, x, y)).item())
        assert losses == pytest.approx(twin_losses, rel=1e-4)
        assert losses[-1] < losses[0]
        with gpu.activate():
            t = torch.full((4,), 3.0)
        assert t.device.type == "cuda"
        assert t.reduce_("dp", "sum") is t  # NCCL on the mesh's GPUs
        assert mnb.inspect(t).cpu().tolist() == [3.0] * 4
    finally:
        gpu.shutdown()


def test_recordings_are_bounded_and_values_do_not_pile_up(mesh):
    from worker_probes import env_sizes, recordings

    def kept() -> list:
        mesh.wait()
        return mnb.remote(recordings)(mesh=mesh).fetch(timeout=60)

    base = kept()
    with mesh.activate():
        acc = torch.zeros(3)

    @mnb.compile
    def scale(x):
        return x * 2 + acc.sum()

    for n in range(1, 13):  # 12 layouts: 12 keys, of which 8 are kept
        with mesh.activate():
            x = torch.ones(n)
        assert mnb.inspect(scale(x)).tolist() == [2.0] * n
    assert [k - b for k, b in zip(kept(), base)] == [8, 8]

    calls = []

    def bump():
        calls.append(1)
        acc.add_(float(len(calls)) / 1000)
        return acc.sum()

    step = mnb.compile(bump)
    for _ in range(5):
        step()
    held = env_sizes(mesh)
    for _ in range(200):
        step()
    assert env_sizes(mesh) == held  # each replay's values freed as the controller drops them
    assert kept()[0] - base[0] == 9


def test_slices_of_one_data_tensor_replay_one_recording(mesh):
    """A micro-batch as a slice: its storage offset changes per call and is no guard."""
    model, opt, twin, twin_opt, x, y = _setup(mesh)
    step = mnb.compile(lambda xb, yb: _step(model, opt, xb, yb))
    losses, twin_losses = [], []
    for i in range(8):
        rows = slice(8 * (i % 4), 8 * (i % 4) + 8)
        losses.append(step(x[rows], y[rows]))
        twin_losses.append(_step(twin, twin_opt, x[rows], y[rows]))
    assert len(step._recorded) == 1
    for a, b in zip(losses, twin_losses):
        assert torch.equal(mnb.inspect(a, dp=1), mnb.inspect(b, dp=1))
    before = _commands_done(mesh)
    step(x[8:16], y[8:16])
    assert _commands_done(mesh) - before == 3  # two slices and one replay


def _sgd_step_lr():
    """An SGD step with a StepLR schedule: its learning rate, a float that stays the
    same for ``step_size`` calls, then changes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    return model, opt, sched, torch.randn(8, 4)


def _scheduled_step(model, opt, sched, x, counter):
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    counter.append(sched.get_last_lr()[0])
    return loss


def test_a_step_with_state_runs_its_python_on_every_call(mesh):
    """A scheduler's step inside the compiled function advances on every call, as
    eagerly: its learning rate stays the same for 3 calls (the recordings agree on every
    float), then decays. A replay that skipped the Python would keep lr 0.1 forever."""
    local, local_lrs = _sgd_step_lr(), []
    with mesh.activate():
        state = _sgd_step_lr()
    lrs: list = []
    step = mnb.compile(lambda: _scheduled_step(*state, lrs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels, the same bits
    try:
        twin = [_scheduled_step(*local, local_lrs).item() for _ in range(10)]
    finally:
        torch.set_num_threads(threads)
    losses = []
    for _ in range(10):
        losses.append(step())
    assert [mnb.inspect(t).item() for t in losses] == twin  # bit for bit, one thread
    assert lrs == local_lrs and lrs[-1] == pytest.approx(1e-4)
    assert state[2].state_dict() == local[2].state_dict()  # last_epoch 10, as eagerly
    before = _commands_done(mesh)
    step()
    assert _commands_done(mesh) - before == 1  # still one message a call
    assert len(lrs) == 11


def test_pure_replays_skip_the_python(mesh):
    """``pure=True``: the caller promises the Python has no other effect, so a settled
    call replays without running it (and a scheduler inside would not advance)."""
    model, opt, twin, twin_opt, x, y = _setup(mesh)
    calls = []

    @mnb.compile(pure=True)
    def step():
        calls.append(1)
        return _step(model, opt, x, y)

    losses = [mnb.inspect(step()).item() for _ in range(6)]
    twin_losses = [mnb.inspect(_step(twin, twin_opt, x, y)).item() for _ in range(6)]
    assert losses == pytest.approx(twin_losses, rel=1e-5)
    assert len(calls) == 2  # recorded twice (the same commands, the same floats), then replayed
    with pytest.raises(TypeError, match="pure"):
        mnb.compile(step, pure="yes")


TEMPERATURE = 1.0


def test_a_global_the_function_reads_is_read_on_every_call(mesh):
    """A function without state reads a module global (a float that changes between
    calls, lifted into the replay): each call uses its value, as eagerly, in one message."""
    global TEMPERATURE
    with mesh.activate():
        logits = torch.arange(4.0)

    @mnb.compile
    def scaled(x):
        return x / TEMPERATURE

    try:
        got = []
        for t in (1.0, 2.0, 4.0, 8.0):
            TEMPERATURE = t
            got.append(mnb.inspect(scaled(logits)).tolist())
        assert got == [(torch.arange(4.0) / t).tolist() for t in (1.0, 2.0, 4.0, 8.0)]
        before = _commands_done(mesh)
        scaled(logits)
        assert _commands_done(mesh) - before == 1
    finally:
        TEMPERATURE = 1.0


def _fill_rank(t):
    t.fill_(mnb.current_rank())


def test_a_foreach_op_failing_in_a_replay_fails_what_it_writes_and_its_views(mesh):
    @mnb.compile
    def add(xs, y):
        torch._foreach_add_(xs, [y, y])  # writes both, returns nothing

    with mesh.activate():
        xs, y = [torch.zeros(4), torch.zeros(4)], torch.ones(4)
        idx = torch.zeros(1, dtype=torch.int64)
    add(xs, y)
    add(xs, y)
    mnb.remote(_fill_rank)(idx, mesh=mesh)
    with mesh.activate():
        bad = y.clone()
        bad[idx * 10] = 1.0  # index_put_: out of range on rank 1 only
        view = xs[0][1:3]
    with pytest.raises(mnb.RemoteError, match="index_put_"):
        mesh.wait()
    before = _commands_done(mesh)
    add(xs, bad)
    assert _commands_done(mesh) - before == 1  # replayed
    assert mnb.inspect(xs[0], dp=0).tolist() == [3.0] * 4
    assert mnb.inspect(view, dp=0).tolist() == [3.0, 3.0]
    for t in (*xs, view):
        with pytest.raises(mnb.RemoteError, match="rank 1"):
            mnb.inspect(t, dp=1)
    with mesh.activate():
        fresh = torch.zeros(4)
    add([fresh, fresh.clone()], y)  # the recording goes on
    assert mnb.inspect(fresh, dp=1).tolist() == [1.0] * 4
