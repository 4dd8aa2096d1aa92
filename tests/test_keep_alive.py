"""Kept-alive local meshes: ``local_mesh(..., keep_alive=D)`` outlives its controller
by D (work in flight goes on), ``monarch-nb list`` shows it, ``monarch-nb kill NAME``
ends it, expiry leaves 0 processes; bad durations are refused before anything starts."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import weakref

import psutil
import pytest
from keepalive_helpers import cli, start_controller
from kernel_helpers import Kernel, errors_text, text
from wait_helpers import alive, pids_gone, wait_for
from worker_probes import rank_pids

import monarch_nb as mnb
from monarch_nb.protocol import keepalive

CONTROLLER = textwrap.dedent(
    """
    import os, sys, time
    import monarch_nb as mnb
    name, keep, counts = sys.argv[1], sys.argv[2], sys.argv[3]
    m = mnb.local_mesh(dp=2, keep_alive=keep, name=name)
    m.exec("x = 41")
    m.exec(
        "import os, time, threading\\n"
        f"def count(path={counts!r} + '/rank' + str(rank)):\\n"
        "    for i in range(100000):\\n"
        "        with open(path + '.tmp', 'w') as f: f.write(str(i))\\n"
        "        os.replace(path + '.tmp', path)\\n"
        "        print('tick', i, flush=True)\\n"
        "        time.sleep(0.02)\\n"
        "threading.Thread(target=count, daemon=True).start()\\n"
    )
    m.wait()
    sys.stdout.write("READY\\n"); sys.stdout.flush()  # one write (see test_attach.SAY)
    time.sleep(600)
    """
)


FLOOD = textwrap.dedent(
    """
    import sys, time
    import monarch_nb as mnb
    name, counts = sys.argv[1], sys.argv[2]
    m = mnb.local_mesh(dp=1, keep_alive="60s", name=name)
    m.exec(
        "import os, threading, time\\n"
        f"def flood(path={counts!r} + '/rank0'):\\n"
        "    line = 'x' * 65535\\n"
        "    for i in range(10**9):\\n"
        "        print(line)\\n"
        "        if i % 50 == 0:\\n"
        "            with open(path + '.tmp', 'w') as f: f.write(str(i))\\n"
        "            os.replace(path + '.tmp', path)\\n"
        "        if not os.path.exists(path + '.go'): time.sleep(0.01)\\n"
        "threading.Thread(target=flood, daemon=True).start()\\n"
    )
    m.wait()
    sys.stdout.write("READY\\n"); sys.stdout.flush()  # one write (see test_attach.SAY)
    time.sleep(600)
    """
)


def _count(path) -> int:
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def _start_controller(tmp_path, name: str, keep: str):
    """A Python process whose kept-alive mesh counts into files; its pids (agent, ranks)."""
    counts = tmp_path / "counts"
    counts.mkdir()
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    p, kids = start_controller(script, name, keep, counts)
    return p, kids, counts


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, seconds", [("30m", 1800.0), ("3s", 3.0), ("1.5h", 5400.0), ("2d", 172800.0),
                       (" 10 ", 10.0), (0.5, 0.5), (7, 7.0), ("2M", 120.0)],
)  # fmt: skip
def test_parse_keep_alive(value, seconds):
    assert keepalive.parse_keep_alive(value) == seconds


@pytest.mark.unit
@pytest.mark.parametrize("value", [0, "0", "0s", -1, "-5m", "soon", "3x", "", "m", True, [3]])
def test_parse_keep_alive_refuses(value):
    with pytest.raises(ValueError, match="keep_alive="):
        keepalive.parse_keep_alive(value)


@pytest.mark.unit
def test_registry_is_private(mesh_dir):
    path = keepalive.write_entry("m1", {"name": "m1", "agent_pid": os.getpid()})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(mesh_dir).st_mode) == 0o700
    # this process is no host agent: its entry is stale, read as absent and removed
    assert keepalive.read_entry("m1") is None and not os.path.exists(path)
    with pytest.raises(ValueError, match="not a mesh name"):
        keepalive.entry_path("../x")


@pytest.mark.unit
def test_describe_columns():
    e = {"name": "m", "world": 4, "created": 100.0, "keep_alive": 60.0, "controller_pid": 7}
    d = keepalive.describe({**e, "orphaned_at": None}, now=130.0)
    assert (d["ranks"], d["age"], d["idle"], d["attached"], d["expires_in"]) == (4, 30, 0, True, 60)
    d = keepalive.describe({**e, "orphaned_at": 120.0}, now=130.0)
    assert (d["idle"], d["attached"], d["expires_in"], d["controller"]) == (10, False, 50, 7)


def test_bad_keep_alive_starts_nothing(mesh_dir):
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    for bad in (0, "0s", "soon", -3):
        with pytest.raises(ValueError, match="keep_alive="):
            mnb.local_mesh(dp=1, keep_alive=bad, name="bad")
    with pytest.raises(ValueError, match="simulate"):
        mnb.local_mesh(dp=1, keep_alive="1m", simulate=True, name="bad")
    assert "bad" not in mnb.api.mesh.all_meshes()
    assert not mesh_dir.exists() or not list(mesh_dir.iterdir())
    after = {c.pid for c in psutil.Process().children(recursive=True)}
    assert after <= before


def test_restart_and_shutdown_of_a_kept_alive_mesh(mesh_dir):
    m = mnb.local_mesh(dp=1, keep_alive="10m", name="ka_shut")
    try:
        entry = keepalive.read_entry("ka_shut")
        assert entry["world"] == 1 and entry["controller_pid"] == os.getpid()
        assert m.exec("6 * 7").fetch(rank=0) == 42
        first = list(rank_pids(m).values())
        m.restart()  # forked again by the same agent
        assert m.exec("6 * 7").fetch(rank=0) == 42
        assert keepalive.read_entry("ka_shut")["agent_pid"] == entry["agent_pid"]
        pids = [entry["agent_pid"], *first, *rank_pids(m).values()]
        assert "ka_shut" in cli("list").stdout
    finally:
        m.shutdown()
    assert pids_gone(pids) == []
    assert keepalive.read_entry("ka_shut") is None
    assert "no kept-alive mesh is live" in cli("list").stdout


def test_outlives_a_killed_controller_then_expires(tmp_path, mesh_dir):
    p, pids, counts = _start_controller(tmp_path, "ka_exp", "4s")
    listed = cli("list").stdout.splitlines()
    assert listed[0].split()[:5] == ["NAME", "RANKS", "AGE", "IDLE", "CONTROLLER"]
    row = [line for line in listed if line.startswith("ka_exp")][0].split()
    assert row[1] == "2" and row[4] == str(p.pid)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    # work in flight goes on without a controller: the counters keep counting
    at_kill = [_count(counts / f"rank{r}") for r in range(2)]
    for r in range(2):
        wait_for(lambda r=r: _count(counts / f"rank{r}") > at_kill[r] + 10, 3, f"rank {r} counting")
    assert all(alive(pid) for pid in pids)
    row = [line for line in cli("list").stdout.splitlines() if line.startswith("ka_exp")]
    assert row and f"{p.pid} (gone)" in row[0]
    # past the keep-alive: nothing left, the entry gone
    assert pids_gone(pids, timeout=20) == []
    assert keepalive.read_entry("ka_exp") is None
    assert not list(mesh_dir.iterdir())
    frozen = [_count(counts / f"rank{r}") for r in range(2)]
    assert frozen == [_count(counts / f"rank{r}") for r in range(2)]


def test_kill_ends_one_mesh(tmp_path, mesh_dir):
    p, pids, _ = _start_controller(tmp_path, "ka_kill", "30m")
    with pytest.raises(ValueError, match="a kept-alive mesh named 'ka_kill' is live"):
        mnb.local_mesh(dp=1, keep_alive="1m", name="ka_kill")  # another process's name
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    assert all(alive(pid) for pid in pids)
    out = cli("kill", "ka_kill")
    assert out.returncode == 0 and "killed mesh 'ka_kill' (2 rank(s)" in out.stdout
    assert pids_gone(pids, timeout=5) == []
    again = cli("kill", "ka_kill")
    assert again.returncode == 1
    assert "no live kept-alive mesh named 'ka_kill' (live: none)" in again.stderr
    assert "no kept-alive mesh is live" in cli("list").stdout


@pytest.mark.kernel
def test_kernel_sigkilled_keeps_the_mesh_until_expiry(tmp_path, mesh_dir):
    counts = tmp_path / "counts"
    counts.mkdir()
    k = Kernel(tmp_path)
    try:
        k.ok("%load_ext monarch_nb\nimport monarch_nb as mnb, os")
        reply, msgs = k.run("%monarch_mesh dp=2 --keep-alive 0 --name kk")
        assert reply["content"]["status"] == "error"
        reply, msgs = k.run("%monarch_mesh dp=2 --keep-alive soon --name kk")
        assert reply["content"]["status"] == "error"
        assert "keep_alive='soon' is not a duration" in text(msgs) + errors_text(msgs)
        reply, msgs = k.run("%monarch_mesh --restart --keep-alive 3s")
        assert "--keep-alive is for a new mesh" in text(msgs) + errors_text(msgs)
        assert k.value("sorted(mnb.api.mesh.all_meshes())") == []  # nothing half-made
        k.ok("%monarch_mesh dp=2 --keep-alive 4s --name kk --dashboard none", timeout=120)
        k.ok(
            "%%monarch --noblock\nimport time\n"
            f"for i in range(100000):\n"
            f"    open({str(counts)!r} + f'/rank{{rank}}', 'w').write(str(i))\n"
            "    time.sleep(0.02)"
        )
        kernel_pid = k.value("os.getpid()")
        entry = wait_for(lambda: keepalive.read_entry("kk"), 10, "the registry entry")
        assert entry["controller_pid"] == kernel_pid and entry["world"] == 2
        pids = [c.pid for c in psutil.Process(entry["agent_pid"]).children()] + [entry["agent_pid"]]
        assert len(pids) == 3
        wait_for(lambda: _count(counts / "rank1") > 0, 10, "the cell counting")
        os.kill(kernel_pid, signal.SIGKILL)
        wait_for(lambda: not alive(kernel_pid), 10, "the kernel's death")
        at_kill = _count(counts / "rank0")
        wait_for(lambda: _count(counts / "rank0") > at_kill + 10, 3, "counting on, orphaned")
        assert all(alive(pid) for pid in pids)
        assert pids_gone(pids, timeout=20) == []
        assert keepalive.read_entry("kk") is None
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_a_rank_printing_without_end_while_orphaned_goes_on_in_bounded_memory(tmp_path, mesh_dir):
    """Issue 29: with no controller, what a rank prints beyond its socket's queue is
    dropped: the printing thread goes on (it stalled after 16 MB before) and the
    rank's memory stays flat while it prints gigabytes."""
    counts = tmp_path / "counts"
    counts.mkdir()
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    p = subprocess.Popen(
        [sys.executable, str(script), "ka_flood", str(counts)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    weakref.finalize(p, p.kill)
    for line in p.stdout:
        if line.strip() == "READY":
            break
    agent = psutil.Process(keepalive.read_entry("ka_flood")["agent_pid"])
    rank = agent.children()[0]
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    (counts / "rank0.go").touch()  # full speed: 64 KiB a line, no sleep
    start = _count(counts / "rank0")
    rss = rank.memory_info().rss
    wait_for(lambda: _count(counts / "rank0") > start + 4000, 60, "the rank to print 256 MB")
    assert rank.memory_info().rss < rss + (64 << 20)
    assert cli("kill", "ka_flood").returncode == 0
