"""Starting a generation: launch, wait for every worker to join, create the root
mesh, and start torch.distributed on every rank (or fail with a rank's own error)."""

from __future__ import annotations

import time

from ..protocol import messages as m
from ..protocol.ndslice import NDSlice
from .errors import RemoteError, WorkerCrashed, format_ranks
from .transfers import bar


def start_generation(ctrl, secret: bytes, startup_timeout: float) -> None:
    """Start ``ctrl``'s workers for its current generation (raises when they do not
    all join and start their backend within ``startup_timeout`` s)."""
    workers = ctrl.workers
    procs = ctrl.io.call(lambda: workers.launcher.launch(ctrl.address, secret, ctrl.world)).result(
        timeout=60
    )
    workers.procs = procs
    for p in procs.values():
        if p.fd is not None:
            ctrl.io.watch(p)
    progress = bar(total=ctrl.world, desc=f"starting mesh {ctrl.name!r}", unit="worker")
    deadline = time.monotonic() + startup_timeout
    failure = workers.launcher.startup_failure
    while not workers.ready.wait(0.1) and time.monotonic() < deadline:
        why = failure()  # a launcher's job that ended (Slurm) before its workers joined
        if why is not None:
            if progress is not None:
                progress.close()
            raise RuntimeError(why)
        if progress is not None and len(workers.identities) != progress.n:
            progress.update(len(workers.identities) - progress.n)
    if progress is not None:
        progress.update(len(workers.identities) - progress.n)
        progress.close()
    if not workers.ready.is_set() or workers.startup_error is not None:
        missing = workers.missing()
        raise workers.startup_error or TimeoutError(
            f"mesh {ctrl.name!r}: {len(missing)} of {ctrl.world} workers did not join within "
            f"{startup_timeout:.0f} s: missing ranks {missing}"
        )
    if ctrl.state.backend is None:  # joined workers: nccl if every one has a GPU
        ctrl.state.backend = "nccl" if workers.all_cuda() else "gloo"
    sizes = tuple(ctrl.dims.values())
    ctrl.send(m.CreateDeviceMesh(0, tuple(ctrl.dims), NDSlice.contiguous(sizes)), None)
    _start_backend(ctrl, startup_timeout)


def _start_backend(ctrl, startup_timeout: float) -> None:
    """Every worker joins the default process group through this generation's
    rendezvous (on its default stream, before user commands)."""
    address = ctrl.rendezvous.address(ctrl.generation)
    backend = ctrl.state.backend
    started = ctrl.request(
        m.InitBackend(address, backend, ctrl.next_ident()),
        range(ctrl.world),
        what="torch.distributed start",
        timeout=startup_timeout,
    )
    try:
        started.result()
    except TimeoutError:
        raise TimeoutError(
            f"mesh {ctrl.name!r}: torch.distributed ({backend}) did not start "
            f"within {startup_timeout:.0f} s"
        ) from None
    except RemoteError as e:
        if isinstance(e, WorkerCrashed):
            raise
        raise RemoteError(
            e.failures,
            None,
            f"mesh {ctrl.name!r}: torch.distributed ({backend}) failed to start "
            f"on {format_ranks(e.failures)}",
        ) from None
