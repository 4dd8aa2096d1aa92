"""Hosts as network namespaces on one bridge, for the tests that cross a network.

``bridged(n, subnet)`` makes a bridge with address ``SUBNET.1`` and ``n``
namespaces, each with an ``eth0`` at ``SUBNET.(2+i)`` joined to the bridge by a
veth pair, and removes everything on the way out. Names carry a random tag, so
tests side by side never meet. Where namespaces cannot be made (not root, no
``ip``, no CAP_NET_ADMIN) the test skips, saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass

import pytest


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Net:
    bridge: str
    controller: str  # the bridge's address: what the controller binds
    spaces: list  # namespace names
    links: list  # the root ends of the veth pairs (``ip link set L down`` cuts host i off)
    hosts: list  # each namespace's address

    def run_in(self, i: int, cmd: list) -> list:
        """``cmd`` run inside namespace ``i``."""
        return ["ip", "netns", "exec", self.spaces[i], *cmd]


@contextlib.contextmanager
def bridged(n: int, subnet: str):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = uuid.uuid4().hex[:5]
    net = Net(f"mnbbr{tag}", f"{subnet}.1", [f"mnbns{tag}{i}" for i in range(n)], [], [])
    made: list = []
    try:
        try:
            ip("link", "add", net.bridge, "type", "bridge")
            made.append(("link", net.bridge))
            ip("addr", "add", f"{net.controller}/24", "dev", net.bridge)
            ip("link", "set", net.bridge, "up")
            for i, ns in enumerate(net.spaces):
                ip("netns", "add", ns)
                made.append(("netns", ns))
                link = f"mnbv{tag}{i}"
                ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
                made.append(("link", link))
                ip("link", "set", link, "master", net.bridge, "up")
                host = f"{subnet}.{2 + i}"
                ip("-n", ns, "addr", "add", f"{host}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
                net.links.append(link)
                net.hosts.append(host)
        except (OSError, subprocess.CalledProcessError) as e:
            why = (getattr(e, "stderr", "") or str(e)).strip()
            pytest.skip(f"cannot make network namespaces here (root, CAP_NET_ADMIN): {why}")
        yield net
    finally:
        for kind, name in reversed(made):
            ip(kind, "del", name, check=False)
