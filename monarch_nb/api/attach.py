"""Kept-alive meshes from the API: their registry entries (``register_kept``) and
taking one over from another process (``attach``).

A ``local_mesh(..., keep_alive=D)`` mesh has a host agent here, reached through its
door (``launchers/attached.py``). A ``connect_mesh(..., keep_alive=D)`` mesh's agents
are relays on other hosts: the process that attaches listens where the mesh did,
with its key, and they come back to it (``host/relay_orphan.py``).
"""

from __future__ import annotations

import math
import os
import sys
import time

from ..controller import Controller
from ..controller.rejoin import Rejoin
from ..protocol import keepalive
from ..protocol.ndslice import NDSlice
from . import context
from .mesh import DeviceMesh


def register_kept(mesh: DeviceMesh, agent, keep_alive: float, dims: dict, **more) -> None:
    """The registry entry of a kept-alive mesh (0600: it holds the key); ``agent``:
    this host's agent of the mesh (None: its agents are on other hosts)."""
    ctrl = mesh._controller
    entry = {
        "name": mesh.name, "world": math.prod(dims.values()), "dims": dict(dims),
        "agent_pid": agent.pid if agent is not None else None,
        "controller_pid": os.getpid(), "created": time.time(),
        "keep_alive": keep_alive, "address": ctrl.address, "key": ctrl._secret.hex(),
        "orphaned_at": None, **more,
    }  # fmt: skip
    keepalive.write_entry(mesh.name, entry)
    if agent is not None:
        agent.on_detach = lambda pid: _taken(mesh, pid)


def attach(name: str | None = None, steal: bool = False, timeout: float = 30.0) -> DeviceMesh:
    """The kept-alive mesh ``name`` (``local_mesh(..., keep_alive=...)`` or
    ``connect_mesh(..., keep_alive=...)``, listed by ``monarch-nb list``), driven from
    this process now: its workers as they are, with their namespaces
    (``mesh.fetch(name)``, ``mesh.tensor(name)``), streams, and the output they
    printed meanwhile. Its values held through the old process's objects (Refs,
    mesh tensors not bound to a name) are freed.

    One controller at a time: while another process drives the mesh this raises
    naming it, unless ``steal`` (a local mesh's): then that process lets go (its
    calls raise MeshClosedError saying who took the mesh) and this one takes over.
    Only the user who started the mesh can attach (the registry and the agent's
    socket are that user's alone). ``timeout``: for every rank to come back.
    Without a ``name``: the only live one."""
    if name is None:
        name = _only_live_mesh()
    if not isinstance(name, str) or not name:
        raise ValueError(f"attach() needs a mesh name, got {name!r}")
    known = context.all_meshes().get(name)
    if known is not None and known.alive:
        raise ValueError(f"this process drives mesh {name!r} already")
    entry = keepalive.read_entry(name)
    if entry is None:
        raise LookupError(
            f"no live kept-alive mesh named {name!r} (of this user; `monarch-nb list` shows "
            "them): it expired, was ended, or never was"
        )
    if entry.get("remote"):
        return _attach_remote(entry, steal, timeout)
    from ..launchers.attached import LinkedAgent, held_ranks
    from ..launchers.host_agent import HostLauncher

    agent = LinkedAgent(entry, steal)
    try:
        procs = held_ranks(agent, entry["world"])
    except BaseException:
        agent.let_go()
        raise
    interface, port = entry["address"].rsplit("/", 1)[1].rsplit(":", 1)
    launcher = HostLauncher(agent, keep_alive=entry["keep_alive"])
    rejoin = Rejoin(bytes.fromhex(entry["key"]), int(port), procs)
    try:
        ctrl = Controller(
            name, entry["dims"], "gloo", launcher, interface=interface,
            startup_timeout=timeout, rejoin=rejoin,
        )  # fmt: skip
    except BaseException:
        agent.let_go()  # the agent waits for another controller
        raise
    mesh = _registered(ctrl, entry)
    agent.on_detach = lambda pid: _taken(mesh, pid)
    return mesh


def _attach_remote(entry: dict, steal: bool, timeout: float) -> DeviceMesh:
    """Listen where the mesh did: its relays, waiting, come back with their ranks."""
    from .. import config
    from ..launchers import ExternalLauncher

    name = entry["name"]
    if keepalive.orphaned_at(entry) is None:
        why = (
            "steal is for a mesh whose host agent is on this host; this one's agents are on "
            "other hosts"
            if steal
            else "attach after that process ended or let go of it (mesh.detach())"
        )
        raise RuntimeError(
            f"mesh {name!r} is attached to the controller of pid {entry['controller_pid']}: {why}"
        )
    port = int(entry["address"].rsplit(":", 1)[1])
    settings = config.snapshot(heartbeat_timeout=entry.get("heartbeat_timeout"))
    launcher = ExternalLauncher(
        name, entry["dims"], entry.get("connection_file"), interface=entry["interface"],
        agent_timeout=settings["heartbeat_timeout"], keep_alive=entry["keep_alive"],
        rejoin=bytes.fromhex(entry["key"]),
    )  # fmt: skip
    advertise = entry["address"].rsplit("/", 1)[1].rsplit(":", 1)[0]
    try:
        ctrl = Controller(
            name, entry["dims"], "gloo", launcher, interface=entry["interface"],
            startup_timeout=timeout, advertise=advertise, liveness_timeout="heartbeat",
            settings=settings, rejoin=Rejoin(bytes.fromhex(entry["key"]), port, None),
        )  # fmt: skip
    except OSError as e:  # its port is taken: by a process attaching at the same time
        if "cannot listen on" not in str(e):
            raise
        raise RuntimeError(f"{e}: another process attaches to it (monarch-nb list)") from None
    mesh = _registered(ctrl, entry)
    mesh.connection_file = entry.get("connection_file")
    return mesh


def _registered(ctrl: Controller, entry: dict) -> DeviceMesh:
    """The root mesh of an attached controller, named, and its entry naming us."""
    dims = entry["dims"]
    mesh = DeviceMesh(ctrl, 0, tuple(dims), NDSlice.contiguous(tuple(dims.values())), ctrl.name)
    context.register(mesh)
    if entry.get("remote"):
        keepalive.update_entry(ctrl.name, controller_pid=os.getpid(), orphaned_at=None)
    return mesh


def _only_live_mesh() -> str:
    names = [e["name"] for e in keepalive.live_entries()]
    if not names:
        raise LookupError("no kept-alive mesh of this user is live (`monarch-nb list`)")
    if len(names) > 1:
        raise ValueError(f"several kept-alive meshes are live: name one of {', '.join(names)}")
    return names[0]


def _taken(mesh: DeviceMesh, pid: int) -> None:
    """Another process attached with ``steal=True``: let go of ``mesh`` and say so."""
    mesh._controller.detach(f"the process of pid {pid} took it over (attach(steal=True))")
    context.forget(mesh)
    print(f"monarch_nb: mesh {mesh.name!r} was taken over by pid {pid}", file=sys.stderr)
