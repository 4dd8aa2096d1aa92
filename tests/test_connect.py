"""Workers started by another launcher (torchrun, a shell, another "host") join a mesh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
from connect_helpers import TESTS_ENV, Waiting, wait_file, worker
from netns_helpers import bridged

import monarch_nb as mnb


def ones_times_rank():
    return torch.ones(2) * (mnb.current_rank() + 1)


def test_torchrun_workers_join_and_run_a_collective(tmp_path):
    conn = tmp_path / "mesh.json"
    w = Waiting(world=2, dp=2, connection_file=str(conn), timeout=120, name="torchrun")
    wait_file(conn)
    assert oct(os.stat(conn).st_mode & 0o777) == "0o600"
    info = json.loads(conn.read_text())
    assert info["world"] == 2 and info["address"].startswith("tcp://127.0.0.1:")
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    p = subprocess.Popen(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "monarch_nb.worker",
            "--connection-file",
            str(conn),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=TESTS_ENV,
    )
    try:
        mesh = w.mesh()
        assert mesh.dims == {"dp": 2} and mesh.backend == "gloo"
        x = mnb.remote(ones_times_rank)(mesh=mesh)
        assert [t.tolist() for t in x.reduce("dp").fetch()] == [[3.0, 3.0]] * 2
        assert mnb.remote(mnb.current_rank)(mesh=mesh).fetch() == [0, 1]
        mesh.shutdown()
        assert p.wait(30) == 0  # the workers exit; torchrun with them
    finally:
        p.kill()


def test_timeout_names_the_missing_ranks(tmp_path):
    conn = tmp_path / "mesh.json"
    # rank 0 must join within it: a fresh worker process imports torch, which under a
    # loaded -n 4 run took over 8 s (the message then named both ranks)
    w = Waiting(world=2, connection_file=str(conn), timeout=20, name="half")
    wait_file(conn)
    p = worker(conn, "--rank", "0", "--world", "2")
    try:
        with pytest.raises(TimeoutError, match=r"missing ranks \[1\]"):
            w.mesh()
        p.wait(20)  # the controller gave up and told it to leave (or went quiet): no orphan
    finally:
        p.kill()


def test_duplicate_late_and_wrong_key_workers_are_refused(tmp_path, caplog):
    conn = tmp_path / "mesh.json"
    w = Waiting(world=1, connection_file=str(conn), timeout=60, name="refusing")
    wait_file(conn)
    first = worker(conn, "--rank", "0", "--world", "1")
    mesh = w.mesh()
    try:
        dup = worker(conn, "--rank", "0", "--world", "1")
        assert dup.wait(60) == 2
        err = dup.stderr.read()
        assert "refused" in err and "rank 0 has joined already" in err
        outside = worker(conn, "--rank", "3", "--world", "1")
        assert outside.wait(60) == 2 and "outside the mesh" in outside.stderr.read()
        bad = dict(json.loads(conn.read_text()), key=os.urandom(32).hex())
        bad_conn = tmp_path / "bad.json"
        bad_conn.write_text(json.dumps(bad))
        before = mesh.status()["bad_messages"]
        wrong = worker(bad_conn, "--rank", "0", "--world", "1", "--heartbeat-timeout", "3")
        assert wrong.wait(60) == 1  # never accepted, hears nothing valid, leaves
        assert mesh.status()["bad_messages"] > before
        assert mnb.remote(ones_times_rank)(mesh=mesh).fetch(rank=0).tolist() == [1.0, 1.0]
    finally:
        mesh.shutdown()
        first.kill()


def test_joined_workers_leave_when_the_controller_dies(tmp_path):
    conn = tmp_path / "mesh.json"
    script = tmp_path / "ctl.py"
    script.write_text(
        textwrap.dedent(f"""
        import time, monarch_nb as mnb
        mesh = mnb.connect_mesh(world=2, connection_file={str(conn)!r}, timeout=120)
        print("ready", flush=True)
        time.sleep(600)
    """)
    )
    ctl = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = []
    try:
        wait_file(conn)
        workers = [worker(conn, "--rank", str(r), "--world", "2") for r in range(2)]
        lines = iter(ctl.stdout.readline, "")
        assert any(line.strip() == "ready" for line in lines)  # after the printed instructions
        ctl.kill()
        ctl.wait()
        gone, alive = psutil.wait_procs([psutil.Process(p.pid) for p in workers], timeout=15)
        assert not alive
    finally:
        ctl.kill()
        for p in workers:
            p.kill()


def test_two_hosts_in_network_namespaces_all_reduce(tmp_path):
    with bridged(2, "10.213.7") as net:
        nss, hosts = net.spaces, net.hosts
        conn = tmp_path / "mesh.json"
        w = Waiting(
            world=2,
            dp=2,
            connection_file=str(conn),
            timeout=120,
            name="twohosts",
            interface="10.213.7.1",
        )
        wait_file(conn)
        assert json.loads(conn.read_text())["address"].startswith("tcp://10.213.7.1:")
        procs = [
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "monarch_nb.worker",
                    "--connection-file",
                    str(conn),
                    "--rank",
                    str(r),
                    "--world",
                    "2",
                ],
                env={**TESTS_ENV, "GLOO_SOCKET_IFNAME": "eth0"},
                stderr=subprocess.PIPE,
                text=True,
            )
            for r, ns in enumerate(nss)
        ]
        try:
            mesh = w.mesh()
            hosts_seen = mnb.remote(
                lambda: __import__("socket").gethostbyname(__import__("socket").gethostname())
            )(mesh=mesh)
            x = mnb.remote(ones_times_rank)(mesh=mesh)
            assert [t.tolist() for t in x.reduce("dp").fetch(timeout=60)] == [[3.0, 3.0]] * 2
            addrs = mnb.remote(_eth0_addr)(mesh=mesh).fetch()
            assert addrs == hosts, addrs  # two "hosts", each in its own namespace
            del hosts_seen
            mesh.shutdown()
            for p in procs:
                assert p.wait(30) == 0
        finally:
            for p in procs:
                p.kill()


def _eth0_addr():
    import subprocess

    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True, text=True
    ).stdout
    return out.split()[3].split("/")[0]


@pytest.mark.kernel
def test_monarch_mesh_connect_magic(tmp_path):
    from kernel_helpers import Kernel, idle, stream

    k = Kernel(tmp_path)
    conn = tmp_path / "magic.json"
    p = None
    try:
        k.ok("%load_ext monarch_nb")
        msg_id = k.kc.execute(
            f"%monarch_mesh --connect --world 1 --name joined --dashboard none "
            f"--connection-file {conn} --timeout 60"
        )
        wait_file(conn)
        p = worker(conn, "--rank", "0")
        msgs = k.drain(msg_id, idle, timeout=90)
        out = stream(msgs)
        assert "waits for 1 workers" in out and "torchrun" in out and "srun" in out
        k.ok("import monarch_nb as mnb\nassert mnb.get_mesh('joined').dims == {'world': 1}")
        k.ok("%%monarch --mesh joined\nprint('hello from', rank)")
        k.ok("%monarch_mesh --shutdown --name joined")
        assert p.wait(30) == 0
    finally:
        k.shutdown()
        if p is not None:
            p.kill()


@pytest.mark.kernel
def test_the_torchrun_line_the_magic_prints_runs_as_printed(tmp_path):
    """``%monarch_mesh --connect --world 2`` prints ``torchrun --standalone
    --nproc-per-node 2 -m monarch_nb.worker --connection-file F``; that line, run
    by a shell exactly as printed (torchrun and python from the notebook's
    environment on PATH), forms the mesh: a cell runs on both ranks, and torchrun
    exits 0 at the mesh's shutdown."""
    from kernel_helpers import Kernel, idle, stream

    k = Kernel(tmp_path)
    conn = tmp_path / "printed.json"
    p = None
    try:
        k.ok("%load_ext monarch_nb")
        msg_id = k.kc.execute(
            f"%monarch_mesh --connect --world 2 --name printed --dashboard none "
            f"--connection-file {conn} --timeout 120"
        )

        def printed(msgs):
            for line in stream(msgs).splitlines():
                if "(one host: torchrun --standalone" in line:
                    return True
            return idle(msgs)

        msgs = k.drain(msg_id, printed, timeout=60)
        line = next(x for x in stream(msgs).splitlines() if "(one host: torchrun" in x)
        command = line.strip().removeprefix("(one host: ").removesuffix(")")
        assert command == (
            f"torchrun --standalone --nproc-per-node 2 -m monarch_nb.worker --connection-file {conn}"
        )
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
        p = subprocess.Popen(["sh", "-c", command], env={**TESTS_ENV, "PATH": path},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        msgs += k.drain(msg_id, idle, timeout=120)
        assert "waits for 2 workers" in stream(msgs)
        out = stream(k.ok("%%monarch --mesh printed\nimport os\nprint('local', os.environ['LOCAL_RANK'])"))
        assert "[rank 0] local 0" in out and "[rank 1] local 1" in out
        k.ok("%monarch_mesh --shutdown --name printed")
        assert p.wait(30) == 0, p.stderr.read()
    finally:
        k.shutdown()
        if p is not None and p.poll() is None:
            p.kill()
