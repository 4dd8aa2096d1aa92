"""The fork server of local host agents: one process of this user's, with torch
imported, forks the agent of every controller that starts a local mesh.

Real controllers (scripts), a real fork server, real agents and ranks. Each test
runs its controllers with a TMPDIR of its own, so that it starts (and ends) a
server of its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from agent_helpers import forkserver_pid
from wait_helpers import alive, pids_gone

from monarch_nb.launchers.agent_forkserver import server_digest, server_path
from monarch_nb.protocol import forkserver as fs

ROOT = Path(__file__).resolve().parents[1]

CONTROLLER = """
import json, os, sys
import monarch_nb as mnb
from monarch_nb.launchers.host_agent import local_agent
m = mnb.local_mesh(dp=2, name="fs")
m.exec("import os\\nr = int(os.environ['RANK']) + 1").fetch(timeout=60)
print(json.dumps({"agent": local_agent().pid, "ranks": [i["pid"] for i in m.status()["ranks"].values()],
                  "sum": sum(m.pull("r")), "pid": os.getpid()}), flush=True)
sys.stdin.read()
m.shutdown()
"""


@pytest.fixture()
def tmpdir_short():
    """A short TMPDIR (a Unix socket's path has room for ~100 bytes); the servers
    started under it are killed at the end."""
    d = tempfile.mkdtemp(prefix="mnbfs", dir="/tmp")
    yield d
    sock_dir = os.path.join(d, f"monarch-nb-{os.getuid()}")
    for p in psutil.process_iter(["cmdline"]):
        if sock_dir in " ".join(p.info["cmdline"] or ()):
            p.kill()
    shutil.rmtree(d, ignore_errors=True)


def _env(tmp: str, **extra) -> dict:
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "TMPDIR": tmp, **extra}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    return env


def _controller(env: dict) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    line = p.stdout.readline()
    assert line, f"the controller ended ({p.wait()}) before its mesh was ready"
    return p, json.loads(line)


def _end(p: subprocess.Popen) -> None:
    p.stdin.close()
    assert p.wait(60) == 0


def _sockets(tmp: str) -> list[Path]:
    return list(Path(tmp, f"monarch-nb-{os.getuid()}").glob("agents-*.sock"))


def test_two_controllers_get_agents_forked_by_one_server(tmpdir_short):
    env = _env(tmpdir_short)
    a, first = _controller(env)
    b, second = _controller(env)
    try:
        assert first["sum"] == second["sum"] == 3  # ranks 0 and 1 ran
        server = forkserver_pid(first["agent"])
        assert server is not None and forkserver_pid(second["agent"]) == server
        assert first["agent"] != second["agent"]
        for info in (first, second):  # its agent's ranks; not a descendant of a controller
            assert all(psutil.Process(r).ppid() == info["agent"] for r in info["ranks"])
            kids = {c.pid for c in psutil.Process(info["pid"]).children(recursive=True)}
            assert server not in kids and info["agent"] not in kids
        (sock,) = _sockets(tmpdir_short)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        # a controller killed: its agent (watching it by pid) and ranks go; the other runs on
        a.kill()
        a.wait(30)
        assert pids_gone([first["agent"], *first["ranks"]], timeout=15) == []
        assert alive(second["agent"]) and alive(server)
        _end(b)
        assert pids_gone([second["agent"], *second["ranks"]], timeout=15) == []
    finally:
        for p in (a, b):
            p.kill()
            p.wait(30)


def _words(proc: psutil.Process) -> list[str]:
    """The words ps shows of ``proc``'s command line (a title set in place of the
    original one is one string, NUL-padded to the original's length)."""
    return " ".join(proc.cmdline()).split()


def test_forked_agents_and_ranks_show_their_own_command_lines(tmpdir_short):
    """ps shows a forked agent and rank as the command that would have started it, and
    top their short names, not the fork server's command line."""
    p, info = _controller(_env(tmpdir_short))
    try:
        assert forkserver_pid(info["agent"]) is not None
        agent = psutil.Process(info["agent"])
        assert _words(agent)[:3] == ["python", "-m", "monarch_nb.host"]
        assert agent.name() == "mnb-agent"
        for rank, pid in enumerate(info["ranks"]):
            proc = psutil.Process(pid)
            assert _words(proc) == ["python", "-m", "monarch_nb.worker", f"--rank={rank}", "--world=2"]
            assert proc.name() == f"mnb-rank{rank}"
    finally:
        _end(p)


def test_an_idle_server_exits_and_the_next_controller_starts_another(tmpdir_short):
    env = _env(tmpdir_short, MONARCH_NB_AGENT_FORKSERVER_IDLE="1")
    p, info = _controller(env)
    server = forkserver_pid(info["agent"])
    assert server is not None
    _end(p)
    assert pids_gone([server], timeout=30) == [], "the idle server did not exit"
    assert _sockets(tmpdir_short) == []  # it took its socket with it
    p, info = _controller(env)
    try:
        assert info["sum"] == 3 and forkserver_pid(info["agent"]) not in (None, server)
    finally:
        _end(p)


def test_without_the_server_the_agent_is_the_controllers_child(tmpdir_short):
    p, info = _controller(_env(tmpdir_short, MONARCH_NB_AGENT_FORKSERVER_IDLE="0"))
    try:
        assert info["sum"] == 3 and psutil.Process(info["agent"]).ppid() == info["pid"]
        assert _sockets(tmpdir_short) == []
        for rank, pid in enumerate(info["ranks"]):  # an agent started as a process: titled too
            assert _words(psutil.Process(pid))[2:4] == ["monarch_nb.worker", f"--rank={rank}"]
    finally:
        _end(p)


def test_bad_requests_are_refused_and_the_server_serves_on(tmpdir_short):
    p, info = _controller(_env(tmpdir_short))
    try:
        (path,) = _sockets(tmpdir_short)

        def ask(data: bytes, fds: list[int]) -> dict:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.connect(str(path))
                s.settimeout(30)
                socket.send_fds(s, [data], fds)
                return fs.decode_reply(s.recv(4096))

        null = os.open(os.devnull, os.O_RDWR)
        try:
            assert "JSON" in ask(b"{not json", [null, null, null])["error"]
            got = ask(fs.encode_request(["--stdio"], {}, "/"), [null])
            assert got["error"] == "a fork request carries 3 file descriptors (got 1)"
            got = ask(json.dumps({"argv": "x", "env": {}, "cwd": "/"}).encode(), [null] * 3)
            assert got["error"] == "a fork request's argv is a list of strings"
        finally:
            os.close(null)
        assert alive(forkserver_pid(info["agent"]))
        q, second = _controller(_env(tmpdir_short))  # served as before
        assert second["sum"] == 3
        assert forkserver_pid(second["agent"]) == forkserver_pid(info["agent"])
        _end(q)
    finally:
        _end(p)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_server(tmpdir_short):
    p, _ = _controller(_env(tmpdir_short))
    try:
        (path,) = _sockets(tmpdir_short)
        pid = os.fork()
        if pid == 0:  # another user (nobody) tries the server's socket
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(str(path))
                code = 0
            except PermissionError:
                code = 7
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
    finally:
        _end(p)


def test_the_servers_name_changes_with_the_sources(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 1\n")
    key = (("PYTHONHASHSEED", "0"),)
    first = server_digest(key, str(pkg))
    assert server_digest(key, str(pkg)) == first
    (pkg / "sub" / "b.py").write_text("B = 22\n")  # an edit
    edited = server_digest(key, str(pkg))
    assert edited != first
    assert server_digest((("PYTHONHASHSEED", "1"),), str(pkg)) != edited


def test_a_temp_directory_too_long_for_a_socket_falls_back_to_tmp(monkeypatch, tmp_path, tmpdir_short):
    monkeypatch.setattr(tempfile, "tempdir", tmpdir_short)
    here = server_path(())
    assert here.startswith(f"{tmpdir_short}/monarch-nb-{os.getuid()}/agents-"), here
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = server_path(())
    assert path == f"/tmp/monarch-nb-{os.getuid()}/{os.path.basename(here)}"
    assert len(path.encode()) <= 100
    assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700


def test_the_server_takes_no_idle_of_zero():
    r = subprocess.run(
        [sys.executable, "-m", "monarch_nb.host.forkserver", "--socket", "/nonexistent", "--idle", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(tempfile.gettempdir()),
    )
    assert r.returncode == 2 and "--idle must be > 0 (got 0.0)" in r.stderr


def test_a_killed_server_takes_its_agents_and_their_ranks_with_it(tmpdir_short):
    p, info = _controller(_env(tmpdir_short))
    try:
        server = forkserver_pid(info["agent"])
        os.kill(server, signal.SIGKILL)
        # its agents die with it (their parent-death signal), and their ranks with them
        assert pids_gone([info["agent"], *info["ranks"]], timeout=15) == []
    finally:
        p.kill()
        p.wait(30)
