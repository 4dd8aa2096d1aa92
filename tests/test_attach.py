"""Attaching to a kept-alive mesh (``mnb.attach``, ``%monarch_mesh --attach``): a
new process takes over the running workers of a mesh whose controller died, with
their namespaces, streams, process groups and pending output, and continues the
training where it was; one controller at a time (``steal`` takes over); only the
mesh's user gets in; a mesh attached and let go of again still expires."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap

import pytest
from keepalive_helpers import cli, start_controller
from kernel_helpers import Kernel, errors_text, text
from wait_helpers import alive, pids_gone, wait_for
from worker_probes import definitions, rank_pids

import monarch_nb as mnb
from monarch_nb.protocol import keepalive

# a data-parallel training step on the workers: a model and optimizer in their
# namespace, gradients averaged over the mesh with gloo
TRAIN = """
import torch, torch.distributed as dist
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)
losses = []
def step():
    x = torch.randn(8, 4, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2
    opt.step()
    losses.append(loss.item())
    print(f"step {len(losses)} loss {loss.item():.6f}", flush=True)
"""

# the first controller, once its mesh ``m`` is up: 3 steps, then 5 more in flight
MID_TRAINING = """
m.stream("side")
m.exec(train).fetch(timeout=60)
m.exec("for _ in range(3): step()").fetch(timeout=60)
# in flight when this process dies: it finishes without a controller
m.exec("import time\\nfor _ in range(5):\\n    time.sleep(0.3)\\n    step()")
for _ in range(600):  # (bounded) until both ranks run it: it left this process
    ranks = m.status()["ranks"].values()
    now = [r["streams"]["default"]["running"] for r in ranks]
    if all(x and x["what"].startswith("exec: import time") for x in now):
        break
    time.sleep(0.05)
sys.stdout.write("READY\\n"); sys.stdout.flush()  # one write (see test_attach.SAY)
"""

# print() writes its pieces one by one and a rank's output line (written whole by the
# controller's thread) came out between them: a script's own lines go in one write
SAY = "def say(line): sys.stdout.write(line + '\\n'); sys.stdout.flush()"

FIRST = textwrap.dedent(
    """
    import sys, time
    import monarch_nb as mnb
    SAY
    name, keep, train = sys.argv[1], sys.argv[2], open(sys.argv[3]).read()
    m = mnb.local_mesh(dp=2, keep_alive=keep, name=name)
    """
).replace("SAY", SAY) + MID_TRAINING + textwrap.dedent(
    """
    if sys.argv[4] == "stay":  # drive on until another process takes the mesh over
        while True:
            try:
                m.exec("1").fetch(timeout=30)
            except mnb.MeshClosedError as e:
                say(f"LET GO: {e}")
                break
            time.sleep(0.05)
    else:
        time.sleep(600)
    """
).replace("SAY", SAY)


def _reference(steps: int) -> list[list[float]]:
    """The same training on a plain dp=2 mesh that no process ever left."""
    with mnb.local_mesh(dp=2, name="att_ref") as ref:
        ref.exec(TRAIN).fetch(timeout=60)
        ref.exec(f"for _ in range({steps}): step()").fetch(timeout=60)
        return ref.exec("losses").fetch(timeout=30)


def _first(tmp_path, name: str, keep: str, mode: str = "die"):
    script, train = tmp_path / "first.py", tmp_path / "train.py"
    script.write_text(FIRST)
    train.write_text(TRAIN)
    return start_controller(script, name, keep, train, mode)


def _line(p: subprocess.Popen, *starts: str) -> str:
    """``p``'s first line that starts with one of ``starts`` (the ranks' output, which
    comes out there too, may come first)."""
    for line in p.stdout:
        if line.startswith(starts):
            return line.strip()
    return f"ended ({p.wait()}) without a word"


def test_a_new_process_attaches_after_a_sigkill_and_trains_on(tmp_path, mesh_dir, capfd):
    p, pids = _first(tmp_path, "att_train", "8s")
    os.kill(p.pid, signal.SIGKILL)  # mid-training: 5 steps in flight
    p.wait(10)
    mesh = mnb.attach("att_train")
    try:
        assert mesh.name == "att_train" and mesh.size == 2
        assert sorted(mesh.streams) == ["default", "side"]
        entry = keepalive.read_entry("att_train")
        assert entry["controller_pid"] == os.getpid() and entry["orphaned_at"] is None
        row = [line for line in cli("list").stdout.splitlines() if line.startswith("att_train")]
        assert row and str(os.getpid()) in row[0] and "(gone)" not in row[0]
        mesh.exec("for _ in range(4): step()").fetch(timeout=60)
        losses = mesh.exec("losses").fetch(timeout=30)
        assert [len(x) for x in losses] == [12, 12], mesh._controller.workers.rejoined
        assert losses == _reference(12)  # the same numbers as a run never interrupted
        assert mesh.exec("x = 5\nx * rank", stream=mesh.streams["side"]).fetch() == [0, 5]
        # what the ranks printed while no controller listened came here
        out = capfd.readouterr().out
        assert "[rank 0] step 8 loss" in out and "[rank 1] step 12 loss" in out
        with pytest.raises(ValueError, match="drives mesh 'att_train' already"):
            mnb.attach("att_train")
        mesh.restart()  # fresh ranks, forked by the same agent through its door
        assert mesh.exec("'losses' in globals()").fetch(timeout=60) == [False, False]
        new_pids = list(rank_pids(mesh).values())
        assert set(new_pids).isdisjoint(pids)
        mesh.detach()  # the agent waits again ...
        with pytest.raises(mnb.MeshClosedError, match=rf"pid {os.getpid()}\) detached it"):
            mesh.exec("1")
        assert "att_train" not in mnb.api.mesh.all_meshes()
        wait_for(lambda: keepalive.read_entry("att_train")["orphaned_at"], 10, "orphaned")
    finally:
        if mesh.alive:
            mesh.detach()
    assert pids_gone([pids[0], *new_pids], timeout=30) == []  # ... and expires: 0 processes
    assert keepalive.read_entry("att_train") is None


@pytest.mark.parametrize("rendezvous", ["file", "controller"])
def test_ranks_attached_again_make_new_process_groups(mesh_dir, monkeypatch, rendezvous):
    """A collective over a dim no earlier one used makes a process group through the
    ranks' rendezvous store: after a detach and an attach that store still serves them
    (the directory of a file store stays; the new controller serves their generation)."""
    import torch

    monkeypatch.setenv("MONARCH_NB_RENDEZVOUS", rendezvous)
    name = f"att_groups_{rendezvous}"
    mesh = mnb.local_mesh(dp=2, tp=2, name=name, keep_alive="60s")
    try:
        with mesh.activate():
            assert mnb.inspect(torch.ones(2).reduce("dp", "sum"), timeout=60).tolist() == [2, 2]
        step = mnb.compile(lambda t: t * 2 + 1)
        with mesh.activate():
            for _ in range(3):
                step(torch.ones(2))
        ops, recs = zip(*mnb.remote(definitions)(mesh=mesh).fetch(timeout=60))
        assert min(ops) > 0 and min(recs) > 0
        mesh.detach()
        mesh = mnb.attach(name)
        # the earlier controller's tensor ops and recordings are dropped on the ranks
        assert mnb.remote(definitions)(mesh=mesh).fetch(timeout=60) == [(0, 0)] * 4
        with mesh.activate():
            x = torch.ones(2)
            assert mnb.inspect(x.reduce("tp", "sum"), timeout=30).tolist() == [2, 2]
            assert mnb.inspect(x.reduce(("dp", "tp"), "sum"), timeout=30).tolist() == [4, 4]
            assert mnb.inspect(step(x)).tolist() == [3, 3]  # recorded anew, this mesh's
            assert mnb.inspect(step(x)).tolist() == [3, 3]
    finally:
        mesh.shutdown()


def test_a_store_directory_lives_while_ranks_use_it_and_is_swept_after(mesh_dir):
    """A kept-alive mesh's file store outlives its controller while its ranks live
    (they hold it), and the next mesh to start removes it once they are gone."""
    import glob
    import tempfile
    import time

    from monarch_nb.controller.rendezvous import PREFIX

    def dirs():
        return set(glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")))

    def age(path):  # as if made ten minutes ago: old enough to be swept
        t = time.time() - 600
        os.utime(path, (t, t))

    before = dirs()
    mesh = mnb.local_mesh(dp=2, name="att_sweep", keep_alive="60s")
    try:
        (mine,) = dirs() - before
        pids = list(rank_pids(mesh).values())
        mesh.detach()
        age(mine)
        with mnb.local_mesh(dp=1, name="att_sweeper"):  # its start sweeps
            assert os.path.isdir(mine)  # the ranks hold it
        mesh = mnb.attach("att_sweep")
    finally:
        mesh.shutdown()  # not this controller's directory: it stays ...
    assert pids_gone(pids, 30) == [] and os.path.isdir(mine)
    age(mine)
    with mnb.local_mesh(dp=1, name="att_sweeper"):
        assert not os.path.exists(mine)  # ... until the next start


def test_one_controller_at_a_time_and_steal(tmp_path, mesh_dir):
    p, pids = _first(tmp_path, "att_steal", "60s", mode="stay")
    with pytest.raises(RuntimeError, match=rf"attached to the controller of pid {p.pid}"):
        mnb.attach("att_steal")
    assert alive(p.pid)  # refused: the first goes on
    mesh = mnb.attach("att_steal", steal=True)
    try:
        said = _line(p, "LET GO:")  # the first process was told
        assert f"pid {os.getpid()} took it over" in said
        assert p.wait(30) == 0
        assert mesh.exec("len(losses)").fetch(timeout=60) == [8, 8]
        assert keepalive.read_entry("att_steal")["controller_pid"] == os.getpid()
    finally:
        mesh.shutdown()
    assert pids_gone(pids, timeout=30) == []  # a shutdown ends a kept-alive mesh
    assert keepalive.read_entry("att_steal") is None


def test_attach_refuses_unknown_meshes_and_strangers(tmp_path, mesh_dir, mesh):
    with pytest.raises(LookupError, match="no live kept-alive mesh named 'nope'"):
        mnb.attach("nope")
    with pytest.raises(LookupError, match="no kept-alive mesh of this user is live"):
        mnb.attach()
    with pytest.raises(ValueError, match="needs a mesh name"):
        mnb.attach("")
    with pytest.raises(ValueError, match="is not kept alive: its workers end with it"):
        mesh.detach()  # (a plain mesh)
    assert mesh.exec("1").fetch(rank=0) == 1
    kept = mnb.local_mesh(dp=1, keep_alive="60s", name="att_mine")
    try:
        # the door is this user's alone: a 0600 socket in the registry's 0700 directory
        door = keepalive.door_path("att_mine")
        assert stat.S_IMODE(os.stat(door).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(door)).st_mode) == 0o700
        # a caller whose first line is not an Attach is told why and let go
        for line in (b"hello\n", b'{"t": "Quit"}\n'):
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(10)
                s.connect(door)
                s.sendall(line)
                answer = s.makefile("rb").readline()
            assert b"Refused" in answer and b"expected an Attach line" in answer
        with pytest.raises(ValueError, match="this process drives mesh 'att_mine' already"):
            mnb.attach(timeout=10)  # (the only live one)
        assert kept.exec("6 * 7").fetch(rank=0) == 42  # nothing lost
    finally:
        kept.shutdown()


ATTACHER = textwrap.dedent(
    """
    import os, sys, time
    import monarch_nb as mnb
    SAY
    try:
        m = mnb.attach(sys.argv[1])
    except RuntimeError as e:
        say(f"REFUSED {e}")
    else:
        say(f"ATTACHED {os.getpid()} {m.exec('6 * 7').fetch(rank=0)}")
        time.sleep(600)
    """
).replace("SAY", SAY)




def test_two_processes_attaching_at_once_one_gets_it(tmp_path, mesh_dir):
    p, pids = _first(tmp_path, "att_race", "60s")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    script = tmp_path / "attacher.py"
    script.write_text(ATTACHER)
    racers = [
        subprocess.Popen([sys.executable, str(script), "att_race"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        said = {r.pid: _line(r, "ATTACHED", "REFUSED") for r in racers}
        winners = [pid for pid, line in said.items() if line.startswith("ATTACHED")]
        assert len(winners) == 1, said
        loser = next(pid for pid in said if pid != winners[0])
        assert said[winners[0]] == f"ATTACHED {winners[0]} 42"
        assert said[loser].startswith("REFUSED") and f"controller of pid {winners[0]}" in said[loser]
        assert racers[[r.pid for r in racers].index(loser)].wait(30) == 0
        assert keepalive.read_entry("att_race")["controller_pid"] == winners[0]
    finally:
        for r in racers:
            r.kill()
    assert cli("kill", "att_race").returncode == 0
    assert pids_gone(pids, timeout=30) == []


@pytest.mark.kernel
def test_a_new_kernel_attaches_with_the_magic(tmp_path, mesh_dir):
    first, second = Kernel(tmp_path), Kernel(tmp_path)
    try:
        first.ok("%load_ext monarch_nb\nimport os")
        first.ok("%monarch_mesh dp=2 --keep-alive 60s --name kk_att --dashboard none", timeout=120)
        first.ok("%%monarch\nanswer = 40 + rank")
        kernel_pid = first.value("os.getpid()")
        os.kill(kernel_pid, signal.SIGKILL)
        wait_for(lambda: not alive(kernel_pid), 10, "the first kernel's death")
        second.ok("%load_ext monarch_nb")
        reply, msgs = second.run("%monarch_mesh --steal")
        assert "--steal goes with --attach" in text(msgs) + errors_text(msgs)
        reply, msgs = second.run("%monarch_mesh --attach nope")
        assert "no live kept-alive mesh named 'nope'" in text(msgs) + errors_text(msgs)
        msgs = second.ok("%monarch_mesh --attach --dashboard none", timeout=120)  # the only one
        assert "attached to mesh 'kk_att': 2 ranks" in text(msgs)
        msgs = second.ok("%%monarch\nprint('answer', answer)")
        assert "answer 40" in text(msgs) and "answer 41" in text(msgs)
        second.ok("%monarch_mesh --shutdown --name kk_att")
        wait_for(lambda: keepalive.read_entry("kk_att") is None, 30, "the mesh's end")
    finally:
        for k in (first, second):
            k.kc.stop_channels()
            k.km.shutdown_kernel(now=True)
