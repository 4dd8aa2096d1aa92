"""Hosts on a network: 4 simulated hosts, each in its own network namespace (a
veth pair into a bridge), 4 light ranks each, joining a controller that binds
the bridge's address. One host is cut off (its link down) in the middle of a
command: its ranks fail with the host named, within the liveness bound, and
the other hosts keep serving. Needs root (CAP_NET_ADMIN); skips otherwise."""

from __future__ import annotations

import os

import pytest
from netns_helpers import bridged, ip
from wait_helpers import wait_for

from monarch_nb.api.mesh import DeviceMesh
from monarch_nb.controller.controller import Controller
from monarch_nb.controller.errors import WorkerCrashed, WorkerUnresponsive
from monarch_nb.launchers.simulated import SimLauncher
from monarch_nb.protocol.ndslice import NDSlice

HOSTS, PER_HOST = 4, 4
SUBNET = "10.231.0"


@pytest.fixture
def net():
    """A bridge with the controller's address and HOSTS namespaces on it."""
    with bridged(HOSTS, SUBNET) as n:
        yield n


def _mesh(net, name: str) -> DeviceMesh:
    dims = {"host": HOSTS, "gpu": PER_HOST}
    launcher = SimLauncher(
        name, HOSTS * PER_HOST, PER_HOST, wrap=lambda i: tuple(net.run_in(i, []))
    )
    ctrl = Controller(
        name,
        dims,
        "simulated",
        interface=net.controller,
        launcher=launcher,
        heartbeat_timeout=2.0,
        liveness_timeout=4.0,
    )
    return DeviceMesh(ctrl, 0, tuple(dims), NDSlice.contiguous(tuple(dims.values())), name)


def test_a_host_cut_off_mid_command_fails_its_ranks_and_the_others_serve(net, tmp_path):
    spaces, links = net.spaces, net.links
    mesh = _mesh(net, "netns")
    try:
        # every host is in its own namespace, reaching the controller over the bridge
        assert mesh.exec("rank").fetch(timeout=60) == list(range(HOSTS * PER_HOST))
        pids = mesh._controller.workers.launcher.pids()
        for pid, ns in zip(pids, spaces):
            out = ip("netns", "identify", str(pid)).stdout.strip()
            assert out == ns, (pid, out, ns)
        go = tmp_path / "go"
        waiting = mesh.exec(
            f"import os, time\n"
            f"open(os.path.join({str(tmp_path)!r}, f'started-{{rank}}'), 'w').close()\n"
            f"while not os.path.exists({str(go)!r}):\n"
            f"    time.sleep(0.01)\n"
            f"rank"
        ).fetch_async()
        cut = 2  # ranks 8-11
        wait_for(lambda: (tmp_path / f"started-{cut * PER_HOST}").exists(), 30, "host 2 running it")
        ip("link", "set", links[cut], "down")
        go.touch()
        with pytest.raises(WorkerUnresponsive) as ei:
            waiting.result(timeout=60)
        e = ei.value
        assert cut * PER_HOST <= e.rank < (cut + 1) * PER_HOST, e
        assert f"sim-{cut}" in str(e), str(e)
        # the other hosts serve on; a call that involves the lost host says restart
        for h in (0, 1, 3):
            sub = mesh.slice(host=h)
            assert sub.exec("rank").fetch(timeout=30) == list(
                range(h * PER_HOST, (h + 1) * PER_HOST)
            )
        with pytest.raises(WorkerCrashed, match="needs a restart"):
            mesh.exec("rank")
        lost = {r for r, w in mesh.status()["ranks"].items() if not w["alive"]}
        assert lost == set(range(cut * PER_HOST, (cut + 1) * PER_HOST)), lost
        assert all(os.path.exists(f"/proc/{p}") for p in pids)  # every host process lives
    finally:
        mesh.shutdown()
