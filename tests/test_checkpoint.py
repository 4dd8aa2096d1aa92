"""Checkpoints: ``mesh.save(path, *names)``, ``mesh.load(path)`` and
``mesh.restart(restore=path)`` on real meshes with torch.distributed.checkpoint (gloo)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
import torch
from wait_helpers import wait_for
from worker_probes import rank_pids

import monarch_nb as mnb

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
model(torch.randn(3, 4)).sum().backward(); opt.step()
x = torch.arange(6.0) + rank          # differs by rank: kept per rank
cfg = {"lr": 0.01, "rank": rank}      # a plain value, per rank
steps = [1, 2, 3]                     # equal on every rank
"""

STATE = "[model.state_dict(), opt.state_dict(), x, cfg, steps]"

FSDP = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
fully_shard(net, mesh=init_device_mesh("cpu", (size,)))
nopt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
net(torch.randn(2, 8)).sum().backward(); nopt.step()
"""

FULL = """
from torch.distributed.tensor import DTensor
def full(sd):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
def full_opt():
    st = get_optimizer_state_dict(net, nopt)["state"]
    return {k: full(v) for k, v in st.items()}
[full(net.state_dict()), full_opt()]
"""


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2)
    yield m
    m.shutdown()


def same(a, b) -> bool:
    """Equal, tensors by torch.equal, down through dicts and lists."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_is_exact(mesh, tmp_path):
    mesh.exec(SETUP).fetch()
    path = str(tmp_path / "ck")
    assert mesh.save(path, "model", "opt", "x", "cfg", "steps") == path
    files = sorted(os.listdir(path))
    assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 2
    assert [f for f in os.listdir(tmp_path) if f != "ck"] == []  # no temporary left
    before = mesh.exec(STATE).fetch()
    mesh.exec(
        "with torch.no_grad():\n    [p.zero_() for p in model.parameters()]\n"
        "opt.state.clear(); x = cfg = steps = None"
    ).fetch()
    assert not same(mesh.exec(STATE).fetch(), before)
    assert sorted(mesh.load(path)) == ["cfg", "model", "opt", "steps", "x"]
    after = mesh.exec(STATE).fetch()
    assert same(after, before)
    assert after[1][2].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # rank 1's own x
    assert mesh.checkpoint_contents(path) == {
        "model": "module", "opt": "optimizer", "x": "tensor", "cfg": "value", "steps": "value"
    }
    # a second save replaces the first whole; load of some names only
    mesh.exec("steps = [4]").fetch()
    mesh.save(path, "steps")
    mesh.exec("steps = None").fetch()
    assert mesh.load(path, "steps") == ["steps"]
    assert mesh.exec("steps").fetch() == [[4], [4]]
    with pytest.raises(LookupError, match="not in the checkpoint at .*: model"):
        mesh.load(path, "model")


def test_bad_input_is_refused_and_nothing_is_lost(mesh, tmp_path):
    mesh.exec(SETUP).fetch()
    path = str(tmp_path / "ck")
    mesh.save(path, "model", "opt")
    before = mesh.exec(STATE).fetch()
    # a name not defined on the workers: nothing written
    with pytest.raises(NameError, match="name 'nothere' is not defined on any rank"):
        mesh.save(str(tmp_path / "other"), "model", "nothere")
    assert not os.path.exists(tmp_path / "other")
    mesh.exec("only0 = 1 if rank == 0 else None\nif rank: del only0").fetch()
    with pytest.raises(NameError, match=r"'only0' is not defined on ranks \[1\]"):
        mesh.save(path, "only0")
    # a missing path; a directory that is no checkpoint; a file in the way
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nope: it does not exist"):
        mesh.load(str(tmp_path / "nope"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        mesh.load(str(tmp_path / "plain"))
    with pytest.raises(FileExistsError, match="exists and is not a checkpoint"):
        mesh.save(str(tmp_path / "plain"), "model")
    assert (tmp_path / "plain" / "notes.txt").read_text() == "mine"
    # the checkpoint of another model: the names that differ, listed; the model untouched
    mesh.exec("model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))").fetch()
    other = mesh.exec("model.state_dict()").fetch()
    with pytest.raises(ValueError) as e:
        mesh.load(path, "model")
    text = str(e.value)
    assert "'model' does not match the checkpoint's" in text
    assert "not in the checkpoint: 1.bias, 1.weight" in text
    assert "in the checkpoint only: 2.bias, 2.weight" in text
    assert same(mesh.exec("model.state_dict()").fetch(), other)
    mesh.exec("model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))").fetch()
    with pytest.raises(ValueError, match=r"shapes differ: 2.weight \(2, 8\) there, \(3, 8\) here"):
        mesh.load(path, "model")
    # the mesh works on, and the checkpoint is whole
    mesh.exec(SETUP).fetch()
    mesh.exec("with torch.no_grad():\n    [p.zero_() for p in model.parameters()]").fetch()
    mesh.load(path)
    assert same(mesh.exec("model.state_dict()").fetch(), [b[0] for b in before])
    mesh.exec("import threading\nlock = threading.Lock()").fetch()
    with pytest.raises(RuntimeError, match="'lock' cannot be saved: TypeError: cannot pickle"):
        mesh.save(str(tmp_path / "lock"), "lock")
    assert not os.path.exists(tmp_path / "lock")
    with pytest.raises(ValueError, match="not a variable name"):
        mesh.save(path, "not a name")
    with pytest.raises(ValueError, match="needs the names"):
        mesh.save(path)


def _root() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.skipif(not _root(), reason="mounting a small tmpfs needs root")
def test_full_disk_leaves_the_old_checkpoint(mesh, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mount failed: {r.stderr.decode().strip()}")
    try:
        mesh.exec(SETUP).fetch()
        path = str(disk / "ck")
        mesh.save(path, "model", "steps")
        before = mesh.exec("[model.state_dict(), steps]").fetch()
        mesh.exec("big = torch.randn(64, 1024) + rank").fetch()  # 256 KiB per rank
        with pytest.raises(OSError, match=f"writing the checkpoint failed, {path} is unchanged.*No space left"):
            mesh.save(path, "model", "steps", "big")
        assert sorted(os.listdir(disk)) == ["ck"]  # the temporary is gone
        mesh.exec("steps = None\nwith torch.no_grad():\n    [p.zero_() for p in model.parameters()]").fetch()
        assert sorted(mesh.load(path)) == ["model", "steps"]
        assert same(mesh.exec("[model.state_dict(), steps]").fetch(), before)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_resharding_dp4_to_dp2(mesh, tmp_path):
    path = str(tmp_path / "ck")
    four = mnb.local_mesh(dp=4, name="four")
    try:
        four.exec(FSDP).fetch()
        four.exec(
            "from torch.distributed.tensor import Shard, distribute_tensor\n"
            "d = distribute_tensor(torch.arange(12.0).reshape(6, 2), net[0].weight.device_mesh, [Shard(0)])\n"
            "x = torch.arange(4.0) + rank\nsteps = [7]"
        ).fetch()
        want = four.exec(FULL).fetch(rank=0)
        four.save(path, "net", "nopt", "x", "steps", "d")
    finally:
        four.shutdown()
    mesh.exec(FSDP.replace("torch.manual_seed(1)", "torch.manual_seed(2)")).fetch()
    assert not same(mesh.exec(FULL).fetch(rank=0)[0], want[0])
    with pytest.raises(ValueError, match="'x' differed across the 4 ranks .* cannot go onto 2 ranks"):
        mesh.load(path)
    assert sorted(mesh.load(path, "net", "nopt", "steps")) == ["net", "nopt", "steps"]
    got = mesh.exec(FULL).fetch()
    assert same(got[0], want) and same(got[1], want)
    assert mesh.exec("steps").fetch() == [[7], [7]]
    assert mesh.exec("isinstance(net[0].weight, DTensor)").fetch(rank=0)
    # a DTensor where no DTensor is defined: the full tensor
    assert mesh.load(path, "d") == ["d"]
    assert mesh.exec("type(d).__name__, d.tolist()").fetch(rank=1) == (
        "Tensor", torch.arange(12.0).reshape(6, 2).tolist()
    )
    # a slice of the mesh saves and loads over its own ranks
    one = mesh.slice(dp=1)
    one.exec("solo = torch.full((2,), 5.0)").fetch()
    one.save(str(tmp_path / "solo"), "solo")
    one.exec("solo = None").fetch()
    assert one.load(str(tmp_path / "solo")) == ["solo"]
    assert one.exec("solo.tolist()").fetch() == [[5.0, 5.0]]


def test_restart_restore_gives_fresh_workers_with_the_state(mesh, tmp_path):
    mesh.exec(SETUP).fetch()
    path = str(tmp_path / "ck")
    mesh.save(path, "model", "opt", "x", "cfg", "steps")
    before = mesh.exec(STATE).fetch()
    pids = mesh.exec("__import__('os').getpid()").fetch()
    with pytest.raises(FileNotFoundError):
        mesh.restart(restore=str(tmp_path / "nope"))
    assert mesh.exec("__import__('os').getpid()").fetch() == pids  # not restarted for nothing
    mesh.restart(restore=path)
    assert not set(mesh.exec("__import__('os').getpid()").fetch()) & set(pids)
    assert same(mesh.exec(STATE).fetch(), before)
    # the rebuilt optimizer drives the rebuilt model
    mesh.exec("model(torch.ones(1, 4)).sum().backward(); opt.step()").fetch()
    assert not same(mesh.exec("model.state_dict()").fetch(), [b[0] for b in before])
    # after a crash: the mesh is broken, the restore brings it back with the state
    victim = rank_pids(mesh)[1]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not mesh.alive, 30, "the mesh to notice the crash")
    mesh.restart(restore=path)
    assert same(mesh.exec(STATE).fetch(), before)


def test_restart_restore_rebuilds_a_sharded_module_with_setup(mesh, tmp_path):
    """FSDP2: fresh workers cannot rebuild a sharded module from the checkpoint; the
    restart refuses before anything stops, and ``setup=`` builds it for the load."""
    mesh.exec(FSDP).fetch()
    want = mesh.exec(FULL).fetch(rank=0)
    path = str(tmp_path / "ck")
    mesh.save(path, "net", "nopt")
    pids = mesh.exec("__import__('os').getpid()").fetch()
    with pytest.raises(ValueError, match=r"'net' in the checkpoint: sharded .* setup="):
        mesh.restart(restore=path)
    with pytest.raises(SyntaxError):
        mesh.restart(restore=path, setup="net = (")
    with pytest.raises(ValueError, match="goes with restore=PATH"):
        mesh.restart(setup="x = 1")
    assert mesh.exec("__import__('os').getpid()").fetch() == pids  # nothing stopped
    build = FSDP.split("nopt =")[0].replace("torch.manual_seed(1)", "torch.manual_seed(5)")
    mesh.restart(restore=path, setup=build)
    assert not set(mesh.exec("__import__('os').getpid()").fetch()) & set(pids)
    got = mesh.exec(FULL).fetch()
    assert same(got[0], want) and same(got[1], want)  # the model and its rebuilt optimizer


def test_a_big_save_shows_a_progress_bar(mesh, tmp_path, capfd, monkeypatch):
    # by its variable: a value set on config.settings() would stay "set here" after the
    # test, over every later test's variable
    monkeypatch.setenv("MONARCH_NB_PROGRESS_DELAY", "0")
    mesh.exec("big = torch.randn(9 << 20) + rank\nsmall = torch.ones(3)").fetch()  # 36 MiB a rank
    capfd.readouterr()
    mesh.save(str(tmp_path / "small"), "small")
    assert "saving" not in capfd.readouterr().err
    path = str(tmp_path / "big")
    mesh.save(path, "big")
    err = capfd.readouterr().err
    assert f"saving {path}" in err and "100%" in err
    mesh.exec("del big").fetch()


def test_a_tensor_engine_module_saved_and_loaded_in_place(mesh, tmp_path):
    path = str(tmp_path / "ck")
    with mesh.activate():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        net(torch.randn(5, 4))  # running stats and a host step count
    before = {k: mnb.inspect(v).clone() for k, v in net.state_dict().items()}
    mesh.exec("w = torch.ones(2)").fetch()
    mesh.save(path, "w", net=net)
    assert mesh.checkpoint_contents(path) == {"w": "tensor", "net": "engine"}
    weight = net[0].weight
    with mesh.activate(), torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net[1].num_batches_tracked.zero_()
    assert not torch.equal(mnb.inspect(net[0].weight), before["0.weight"])
    assert mesh.load(path, net=net) == ["net"]
    after = {k: mnb.inspect(v) for k, v in net.state_dict().items()}
    assert all(same(before[k], after[k]) for k in before)
    assert net[0].weight is weight  # in place
    assert mesh.load(path) == ["w"]  # worker names only
    with mesh.activate():
        other = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="'net' does not match .* not in the checkpoint: bias, weight"):
        mesh.load(path, net=other)
    with pytest.raises(TypeError, match="net= takes a module or an optimizer of mesh tensors"):
        mesh.save(path, net=3)


def _engine_training(seed: int):
    """A model, AdamW and a warm-up LambdaLR of mesh tensors (the active mesh's)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return net, opt, sched


def _engine_steps(net, opt, sched, x, y, n: int) -> list:
    losses = []
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(mnb.inspect(loss).item())
    return losses


def test_tensor_engine_training_resumes_from_a_checkpoint_after_a_restart(tmp_path):
    """Issue 29: a model, its optimizer and its scheduler of mesh tensors saved mid-run;
    fresh ones on fresh workers loaded from it continue with the same losses, bit for bit."""
    path = str(tmp_path / "engine")
    mesh = mnb.local_mesh(dp=2, name="engine-resume")
    try:
        with mesh.activate():
            torch.manual_seed(5)
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            net, opt, sched = _engine_training(0)
            _engine_steps(net, opt, sched, x, y, 3)
        mesh.save(path, net=net, opt=opt, sched=sched)
        assert mesh.checkpoint_contents(path) == {"net": "engine", "opt": "engine", "sched": "engine"}
        with mesh.activate():
            expected = _engine_steps(net, opt, sched, x, y, 3)
            data = (mnb.inspect(x).clone(), mnb.inspect(y).clone())
        mesh.restart()
        with mesh.activate():
            x, y = torch.tensor(data[0].tolist()), torch.tensor(data[1].tolist())
            net, opt, sched = _engine_training(1)  # other weights, no optimizer state
            assert not opt.state
            mesh.load(path, net=net, opt=opt, sched=sched)
            assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
            assert all(float(s["step"]) == 3.0 for s in opt.state.values())
            assert _engine_steps(net, opt, sched, x, y, 3) == expected
            other = torch.optim.AdamW(torch.nn.Linear(4, 5).parameters())
        with pytest.raises(ValueError, match="'opt' does not match the checkpoint's: .*shapes differ"):
            mesh.load(path, opt=other)
        assert not other.state  # the state it was given for the load is taken back
    finally:
        mesh.shutdown()


@pytest.mark.kernel
def test_restart_restore_magic(tmp_path):
    from kernel_helpers import errors, mesh_kernel, plain, stream

    path = str(tmp_path / "ck")
    (tmp_path / "kernel").mkdir()
    with mesh_kernel(tmp_path / "kernel") as k:
        k.ok("%%monarch\nkept = [rank, 'kept']\nmodel = torch.nn.Linear(2, 2)")
        want = k.value("mnb.get_mesh('default').exec('model.weight.tolist()').fetch()")
        k.ok(f"mnb.get_mesh('default').save({path!r}, 'kept', 'model')")
        reply, msgs = k.run("%monarch_mesh --restore " + path)
        assert reply["content"]["status"] == "error" and not errors(msgs)
        assert "--restore PATH goes with --restart" in stream(msgs, "stderr")
        old = k.value("sorted(i['pid'] for i in mnb.get_mesh('default').status()['ranks'].values())")
        k.ok(f"%monarch_mesh --restart --restore {path}", timeout=120)
        new = k.value("sorted(i['pid'] for i in mnb.get_mesh('default').status()['ranks'].values())")
        assert not set(old) & set(new)
        _, msgs = k.run("%%monarch\nkept")
        assert plain(msgs) == ["[rank 0] [0, 'kept']", "[rank 1] [1, 'kept']"]
        assert k.value("mnb.get_mesh('default').exec('model.weight.tolist()').fetch()") == want


def test_a_short_write_on_a_full_disk_is_named_no_space():
    """torch's zip writer reports a write the full disk cut short as a RuntimeError of
    its own ("unexpected pos"): a save that failed on a full disk says so all the same."""
    from monarch_nb.protocol.checkpoint_ops import _problem

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    kind, message = _problem(short, "writing the checkpoint failed, ck is unchanged", full=True)
    assert kind == "OSError"
    assert "No space left on device" in message and "unexpected pos 704" in message
    assert _problem(short, "writing", full=False)[0] == "RuntimeError"
    assert _problem(OSError(28, "No space left on device"), "writing", full=True)[0] == "OSError"
