"""Making a mesh: ``local_mesh`` spawns workers here, ``connect_mesh`` waits for
workers another launcher started. Both register the mesh by name (``context.py``)."""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import sys
from pathlib import Path

from .. import config
from ..controller import Controller
from ..launchers import default_launcher
from ..launchers.host_agent import warm_local_agent
from ..launchers.kubernetes import k8s_manifest  # noqa: F401 - the API's name for it
from ..protocol import keepalive
from ..protocol.ndslice import NDSlice
from . import context
from .attach import attach, register_kept  # noqa: F401 - attach: the API's name for it
from .mesh import DeviceMesh


def _default_backend(world: int) -> str:
    """nccl when every rank gets a GPU of its own (NCCL refuses two ranks on one
    GPU), else gloo. A torch built without CUDA or ROCm has no GPU to count: gloo,
    without importing torch here (~1.3 s of CPU the ranks' host agent spends anyway)."""
    if "torch" not in sys.modules and not _torch_has_gpu_build():
        return "gloo"
    try:
        import torch

        return (
            "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
        )
    except Exception:
        return "gloo"


@functools.cache  # the installed torch does not change under a running process
def _torch_has_gpu_build() -> bool:
    """Whether the installed torch may see a GPU (True where its ``version.py``
    cannot be read: torch then decides)."""
    try:
        folder = importlib.util.find_spec("torch").submodule_search_locations[0]
        return names_gpu_build(Path(folder, "version.py").read_text())
    except Exception:
        return True


def names_gpu_build(version_py: str) -> bool:
    """Whether torch's ``version.py`` (its text) names a CUDA or ROCm build: False
    only where it says ``cuda`` and ``hip`` are None."""
    builds = {}
    for node in ast.parse(version_py).body:
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id in ("cuda", "hip"):
            try:
                builds[target.id] = ast.literal_eval(node.value)
            except ValueError:
                return True
    return set(builds) != {"cuda", "hip"} or any(v is not None for v in builds.values())


def _check_dims(dims: dict) -> None:
    for k, v in dims.items():
        if not k.isidentifier():
            raise ValueError(f"dim name {k!r} is not an identifier")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"dim {k!r} must be a positive int, got {v!r}")


def _check_backend(backend) -> None:
    if backend is not None and backend not in ("gloo", "nccl", "mpi", "ucc"):
        raise ValueError(f"unknown backend {backend!r}: expected 'gloo' or 'nccl'")


def local_mesh(
    name: str | None = None,
    backend: str | None = None,
    interface: str = "127.0.0.1",
    heartbeat_timeout: float | None = None,
    liveness_timeout: float | None = None,
    simulate: bool | int = False,
    keep_alive: str | float | None = None,
    **dims: int,
) -> DeviceMesh:
    """Spawn ``prod(dims)`` local workers (one per GPU when there are GPUs) on the
    named dims, in the order given: ``local_mesh(dp=2)``, ``local_mesh(hosts=1, gpus=4)``.

    A worker silent for ``heartbeat_timeout`` s is ``unresponsive`` in
    ``status()`` (announced in the notebook, and again when it answers); after
    ``liveness_timeout`` s (None: never, the default for local workers) it is
    presumed lost and pending calls raise WorkerUnresponsive. ``name``,
    ``backend``, ``interface``, ``simulate`` and the two timeouts are reserved
    words, not dims. The new mesh becomes the active one.

    ``simulate=True`` gives light ranks instead (no torch: the control path
    only, to measure the controller at scale), as many per simulated host (a
    process each) as the last dim's size: ``local_mesh(host=32, gpu=32,
    simulate=True)`` is 32 hosts of 32 ranks; ``simulate=K``: K per host.

    ``keep_alive="30m"`` (s, m, h, d, or seconds as a number): the mesh gets a host
    agent of its own that, with its ranks, outlives this process by that long (its
    death or a restart; ``mesh.shutdown()`` still ends it), listed by ``monarch-nb
    list`` and ended by ``monarch-nb kill NAME`` (see api.md, Keep-alive)."""
    if not dims:
        raise ValueError("local_mesh() needs at least one named dim, e.g. local_mesh(dp=2)")
    _check_dims(dims)
    _check_backend(backend)
    if keep_alive is not None:
        keep_alive = keepalive.parse_keep_alive(keep_alive)
        if simulate is not False:
            raise ValueError("keep_alive is for real ranks: leave out simulate")
    name = context.new_name(name)
    if keep_alive is not None:
        _check_free(name)
    world = math.prod(dims.values())
    launcher = None
    if simulate is not False:
        from ..launchers.simulated import SimLauncher

        per_host = list(dims.values())[-1] if simulate is True else simulate
        launcher = SimLauncher(name, world, per_host)  # refuses a mesh beyond the slots
        backend = backend or "simulated"
    elif keep_alive is not None:
        from ..launchers.host_agent import HostAgent, HostLauncher

        agent = HostAgent(wait=False, keep_alive=keep_alive, mesh_name=name)
        launcher = HostLauncher(agent, keep_alive=keep_alive)
        backend = backend or _default_backend(world)
    else:
        warm_local_agent()  # it imports torch meanwhile
        backend = backend or _default_backend(world)
    mesh = _mesh(
        name, dims, backend, launcher, interface=interface,
        heartbeat_timeout=heartbeat_timeout, liveness_timeout=liveness_timeout,
    )  # fmt: skip
    if keep_alive is not None:
        register_kept(mesh, launcher.agent, keep_alive, dims)
    return mesh


def _check_free(name: str) -> None:
    if keepalive.read_entry(name) is not None:
        raise ValueError(
            f"a kept-alive mesh named {name!r} is live (monarch-nb list): attach to it "
            f"(mnb.attach({name!r}), %monarch_mesh --attach {name}), pick another name, "
            f"or end it with `monarch-nb kill {name}`"
        )


def _mesh(name: str, dims: dict, backend, launcher, **controller) -> DeviceMesh:
    """The root mesh of a Controller started with ``launcher`` (closed if it fails to
    start), registered by name."""
    if launcher is None:
        settings = config.snapshot(heartbeat_timeout=controller.get("heartbeat_timeout"))
        controller["settings"] = settings
        launcher = default_launcher(settings["spawn"])
    try:
        ctrl = Controller(name, dims, backend, launcher=launcher, **controller)
    except BaseException:
        if launcher is not None:
            launcher.close()
        raise
    mesh = DeviceMesh(ctrl, 0, tuple(dims), NDSlice.contiguous(tuple(dims.values())), name)
    mesh.connection_file = ctrl.workers.launcher.connection_file
    context.register(mesh)
    return mesh


def connect_mesh(
    world: int,
    connection_file: str | None = None,
    timeout: float = 600.0,
    name: str | None = None,
    backend: str | None = None,
    interface: str = "127.0.0.1",
    advertise: str | None = None,
    heartbeat_timeout: float | None = None,
    liveness_timeout: float | str | None = "heartbeat",
    keep_alive: str | float | None = None,
    **dims: int,
) -> DeviceMesh:
    """Wait for ``world`` workers started by another launcher (torchrun, srun, ...)
    running ``monarch-nb-worker --connection-file F`` (one per rank), or host
    agents running ``monarch-nb-host --connection-file F --local-ranks N`` (one
    per host: each gets the next block of N ranks, or its ``--node-rank`` /
    SLURM_NODEID / GROUP_RANK block, forks them, and forks them again at
    ``mesh.restart()``), or both.

    Binds on ``interface`` (loopback unless you name another: "0.0.0.0" or an
    address, for workers on other hosts; ``advertise`` is the address they use
    then), writes the connection file (address and secret; at
    ``connection_file``, else in the Jupyter runtime dir; created new, mode
    0600: a symlink or another file there is a FileExistsError naming it; removed
    at shutdown), prints the torchrun and srun command lines, and waits with a
    progress bar. After ``timeout`` seconds a TimeoutError lists the missing
    ranks. ``dims`` name the ranks (default ``world=N``); their product must be
    ``world``. Late, duplicate, wrong-key and other-protocol-version workers are
    refused with a logged reason; so are host agents claiming a taken host slot
    or more ranks than are free. A joined worker silent for
    ``liveness_timeout`` s (default: the heartbeat timeout, 10 s) is presumed
    lost: pending calls raise WorkerUnresponsive. A host agent silent for
    ``heartbeat_timeout`` s, or whose connection closes, is lost with its ranks
    (WorkerCrashed naming its host).

    ``keep_alive="30m"``: the host agents keep their ranks running that long once
    this process is gone, waiting for one that attaches (``mnb.attach(name)``);
    per-rank workers (``monarch-nb-worker``) still end with it."""
    from ..launchers import ExternalLauncher

    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    dims = dims or {"world": world}
    _check_dims(dims)
    _check_backend(backend)
    product = math.prod(dims.values())
    if product != world:
        raise ValueError(f"the dims {dims} hold {product} ranks, not world={world}")
    if keep_alive is not None:
        keep_alive = keepalive.parse_keep_alive(keep_alive)
    name = context.new_name(name)
    if keep_alive is not None:
        _check_free(name)
    settings = config.snapshot(heartbeat_timeout=heartbeat_timeout)
    launcher = ExternalLauncher(
        name, dims, connection_file, interface=interface,
        agent_timeout=settings["heartbeat_timeout"], keep_alive=keep_alive,
    )  # fmt: skip
    mesh = _mesh(
        name, dims, backend, launcher, interface=interface, startup_timeout=timeout,
        advertise=advertise, liveness_timeout=liveness_timeout, settings=settings,
    )  # fmt: skip
    if keep_alive is not None:
        register_kept(
            mesh, None, keep_alive, dims, remote=True, interface=interface,
            heartbeat_timeout=settings["heartbeat_timeout"],
            connection_file=launcher.connection_file,
        )  # fmt: skip
    return mesh


def slurm_mesh(
    nodes: int = 4,
    ranks_per_node: int = 2,
    partition: str | None = None,
    time: str | None = "1:00:00",
    account: str | None = None,
    extra: tuple | list = (),
    gpus: int | None = None,
    name: str | None = None,
    backend: str | None = None,
    interface: str = "0.0.0.0",
    advertise: str | None = None,
    connection_file: str | None = None,
    timeout: float = 600.0,
    heartbeat_timeout: float | None = None,
    **dims: int,
) -> DeviceMesh:
    """A mesh of ``nodes`` x ``ranks_per_node`` ranks on Slurm: one host agent per
    node, submitted with ``sbatch`` (``--nodes``, ``--ntasks-per-node 1``,
    ``--cpus-per-task ranks_per_node``, ``--gpus-per-node gpus``, ``--time``,
    ``--partition``, ``--account``, then ``extra``), or run with ``srun`` when
    this process is inside an allocation (SLURM_JOB_ID set). While the job waits
    a bar shows its id and state; Ctrl-C then cancels it. Slurm's own message is
    the error when it refuses the job. ``restart()`` forks the ranks again in the
    same job; ``shutdown()`` cancels it (scancel). ``dims`` default to
    ``hosts=nodes, ranks=ranks_per_node``; the other arguments are
    ``connect_mesh``'s (the connection file must be on a filesystem the nodes see)."""
    from ..launchers.slurm import SlurmLauncher

    dims = dims or {"hosts": nodes, "ranks": ranks_per_node}
    _check_dims(dims)
    _check_backend(backend)
    name = context.new_name(name)
    settings = config.snapshot(heartbeat_timeout=heartbeat_timeout)
    launcher = SlurmLauncher(
        name, dims, nodes=nodes, ranks_per_node=ranks_per_node, gpus=gpus,
        partition=partition, time_limit=time, account=account, extra=extra,
        connection_file=connection_file, interface=interface,
        agent_timeout=settings["heartbeat_timeout"],
    )  # fmt: skip
    world = math.prod(dims.values())
    if world != nodes * ranks_per_node:
        raise ValueError(
            f"the dims {dims} hold {world} ranks, not nodes x ranks_per_node = "
            f"{nodes * ranks_per_node}"
        )
    mesh = _mesh(
        name, dims, backend, launcher, interface=interface, startup_timeout=timeout,
        advertise=advertise, liveness_timeout="heartbeat", settings=settings,
    )  # fmt: skip
    mesh.slurm_job = launcher.job.id if launcher.job is not None else None
    return mesh
