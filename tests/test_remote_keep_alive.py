"""A ``connect_mesh(..., keep_alive=D)`` mesh's host agents on other hosts (relays
on loopback, as in test_remote_agents.py) keep their ranks when the controller
dies, wait for a process that attaches, and end after ``D`` or at ``monarch-nb
kill``: a controller SIGKILLed mid-training, the test process attaching and
training on with the losses of a run never interrupted, through the fan-out (the
relay carries its ranks' traffic) and without it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest
from keepalive_helpers import cli
from test_attach import MID_TRAINING, TRAIN, _reference
from test_remote_agents import relay, tree, wait_file
from wait_helpers import pids_gone, wait_for

import monarch_nb as mnb
from monarch_nb.protocol import keepalive

# heartbeat_timeout 20 s: under -n 4 a relay whose rank was starting was silent past
# 5 s and the controller gave it up (its rank "died"); nothing here waits on it
FIRST = (
    textwrap.dedent(
        """
        import sys, time
        import monarch_nb as mnb
        name, keep, train = sys.argv[1], sys.argv[2], open(sys.argv[3]).read()
        m = mnb.connect_mesh(
            2, connection_file=sys.argv[4], keep_alive=keep, name=name, timeout=120,
            heartbeat_timeout=20, dp=2,
        )
        """
    )
    + MID_TRAINING
    + "time.sleep(600)\n"
)


# each rank's step() also leaves its count of steps in a file: the test sees the
# orphaned command end (step 8) before anyone attaches
MARKED = """
import os as _os
_plain_step = step
def step():
    _plain_step()
    with open(_os.path.join({marks!r}, f"rank{{rank}}"), "w") as f:
        f.write(str(len(losses)))
"""

# The winner lets go once the ranks' output printed while no controller listened has
# come (bounded): it comes as the ranks reconnect, each stream's socket on its own, so
# it may land just after attach() returned (the ranks rejoin on their receivers' sockets).
# With RACE_DIR set, racers attach once all of them are ready, and the winner holds the
# mesh until the loser was refused: under load one may start seconds after the other.
RACER = textwrap.dedent(
    """
    import os, sys, time
    import monarch_nb as mnb

    race = os.environ.get("RACE_DIR")

    def wait_files(n, what):
        deadline = time.monotonic() + 60
        while len(os.listdir(race)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"no {what} within 60 s")
            time.sleep(0.02)

    class Tee:  # the ranks' output, printed to sys.stdout, also kept here
        def __init__(self, out):
            self.out, self.parts = out, []
        def write(self, text):
            self.parts.append(text)
            return self.out.write(text)
        def flush(self):
            self.out.flush()

    tee = sys.stdout = Tee(sys.stdout)
    if race:
        open(os.path.join(race, f"ready{os.getpid()}"), "w").close()
        wait_files(2, "other racer")
    try:
        mesh = mnb.attach(sys.argv[1], steal=len(sys.argv) > 2, timeout=60)
    except RuntimeError as e:
        if race:
            open(os.path.join(race, "refused"), "w").close()
        print("REFUSED", e)
    else:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            f"[rank {r}] step 8 loss" in "".join(tee.parts) for r in (0, 1)
        ):
            time.sleep(0.02)
        if race:
            wait_files(3, "refusal of the other racer")
        mesh.detach()
        print("GOT")
    """
)


def _first(tmp_path, name: str, keep: str, env=None):
    """The first controller (a process of its own) and its two relays (one rank each),
    once its mesh trains; the relays' process trees."""
    script, train, conn = tmp_path / "first.py", tmp_path / "train.py", tmp_path / "mesh.json"
    script.write_text(FIRST)
    (tmp_path / "marks").mkdir()
    train.write_text(TRAIN + MARKED.format(marks=str(tmp_path / "marks")))
    p = subprocess.Popen(
        [sys.executable, str(script), name, keep, str(train), str(conn)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    weakref.finalize(p, p.kill)
    wait_file(conn, timeout=60)
    # a heartbeat timeout of 10 s: under -n 4 a starting controller was starved past 5 s
    # and a relay gave up, its rank never joining
    relays = [relay(conn, "--local-ranks", "1", "--node-rank", str(i), heartbeat=10) for i in (0, 1)]
    for r in relays:
        weakref.finalize(r, r.kill)
    for line in p.stdout:
        if line.strip() == "READY":
            break
    else:
        raise AssertionError(f"the controller ended ({p.wait()}) before its mesh trained")
    trees = [tree(r) for r in relays]
    assert [len(t) for t in trees] == [3, 3], trees  # relay, agent, rank
    return p, relays, [pid for t in trees for pid in t]


def _steps(tmp_path) -> list:
    """Each rank's count of steps so far (its file), "" before its first."""
    marks = tmp_path / "marks"
    return [(marks / f"rank{r}").read_text() if (marks / f"rank{r}").exists() else "" for r in (0, 1)]


@pytest.mark.parametrize("fanout", ["1", "0"])
def test_relays_keep_their_ranks_for_a_process_that_attaches(
    tmp_path, mesh_dir, capfd, monkeypatch, fanout
):
    name = f"rk{fanout}"
    # with the fan-out, the ranks meet through the controller's store (a file elsewhere)
    env = {"MONARCH_NB_RELAY_FANOUT": fanout, "MONARCH_NB_RENDEZVOUS": ("file", "controller")[int(fanout)]}
    for k, v in env.items():  # the attaching controller's too
        monkeypatch.setenv(k, v)
    p, relays, pids = _first(tmp_path, name, "60s", env)
    os.kill(p.pid, signal.SIGKILL)  # mid-training: 5 steps in flight
    p.wait(10)
    # the winner below lets go once it has what the ranks printed before it attached,
    # so the orphaned command ends first (its output goes with its end)
    wait_for(lambda: _steps(tmp_path) == ["8", "8"], 60, "the orphaned command's end")
    row = [line for line in cli("list").stdout.splitlines() if line.startswith(name)]
    assert row and "(gone)" in row[0], row
    # two processes attach at once: one gets the mesh (and lets go), the other is refused
    race = tmp_path / "race"
    race.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, name], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "RACE_DIR": str(race)}) for _ in range(2)]  # fmt: skip
    outs = sorted((r.communicate(timeout=120)[0] for r in racers), key=lambda o: "GOT" not in o)
    said = [o.strip().splitlines()[-1] for o in outs]
    assert said[0] == "GOT" and said[1].startswith("REFUSED"), said
    assert "another process attaches" in said[1] or "attached to the controller" in said[1]
    for r in (0, 1):  # what the ranks printed while no controller listened came to the winner
        assert f"[rank {r}] step 8 loss" in outs[0], outs[0]
    mesh = mnb.attach(name, timeout=60)
    try:
        assert mesh.size == 2 and sorted(mesh.streams) == ["default", "side"]
        entry = keepalive.read_entry(name)
        assert entry["controller_pid"] == os.getpid() and keepalive.orphaned_at(entry) is None
        busy = subprocess.run(
            [sys.executable, "-c", RACER, name, "steal"], capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert f"attached to the controller of pid {os.getpid()}: steal is for" in busy.stdout
        killed = cli("kill", name)
        assert killed.returncode == 1 and "mesh.shutdown() there" in killed.stderr
        mesh.exec("for _ in range(4): step()").fetch(timeout=60)
        losses = mesh.exec("losses").fetch(timeout=30)
        out = capfd.readouterr().out
        assert "[rank 0] step 12 loss" in out and "step 8 loss" not in out  # shown once
        assert losses == _reference(12)  # the same numbers as a run never interrupted
        assert mesh.exec("x = 5\nx * rank", stream=mesh.streams["side"]).fetch() == [0, 5]
        # a process group made now meets through the store this controller serves them
        group = "t = torch.ones(1)\ndist.all_reduce(t, group=dist.new_group([0, 1]))\nt.item()"
        assert mesh.exec(group).fetch(timeout=60) == [2.0, 2.0]
        mesh.restart()  # fresh ranks, forked by the same relays' agents
        assert mesh.exec("'losses' in globals()").fetch(timeout=60) == [False, False]
        assert [len(tree(r)) for r in relays] == [3, 3]
        mesh.detach()  # the relays wait again ...
        wait_for(lambda: keepalive.orphaned_at(keepalive.read_entry(name)), 10, "let go of")
        assert all(r.poll() is None for r in relays)
    finally:
        if mesh.alive:
            mesh.detach()
    # ... until monarch-nb kill tells them to end: 0 processes
    done = cli("kill", name)
    assert done.returncode == 0 and "2 of its 2 rank(s) told to end" in done.stdout, done
    for r in relays:
        assert r.wait(30) == 0
    assert pids_gone([pid for r in relays for pid in tree(r)] + pids, timeout=30) == []
    assert keepalive.read_entry(name) is None


def test_relays_end_when_no_process_attaches_within_the_keep_alive(tmp_path, mesh_dir):
    p, relays, pids = _first(tmp_path, "rkx", "3s")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    for r in relays:
        assert r.wait(60) == 0
        assert "no controller attached within the keep-alive (3 s)" in r.stderr.read()
    assert pids_gone(pids, timeout=30) == []
    wait_for(lambda: keepalive.read_entry("rkx") is None, 30, "the entry to expire")
    with pytest.raises(LookupError, match="no live kept-alive mesh named 'rkx'"):
        mnb.attach("rkx")


def test_connect_mesh_keep_alive_bad_input(mesh_dir):
    for bad in (0, "soon", -3):
        with pytest.raises(ValueError, match="keep_alive="):
            mnb.connect_mesh(2, keep_alive=bad, dp=2, timeout=1)
