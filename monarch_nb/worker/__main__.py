"""``python -m monarch_nb.worker`` / ``monarch-nb-worker``: a worker process."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

from ..config import process_settings


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def set_parent_death_signal(parent_pid: int) -> None:
    """Die with the controller: SIGKILL when the parent goes, checked once now."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="monarch-nb-worker", description=__doc__)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="controller address, tcp://HOST:PORT")
    where.add_argument(
        "--connection-file",
        help="the JSON file mnb.connect_mesh / %%monarch_mesh --connect wrote (address and secret)",
    )
    p.add_argument("--key-file", help="file holding the mesh secret (hex)")
    p.add_argument("--key-stdin", action="store_true", help="read the secret (hex) from stdin")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--local-rank", type=int)
    p.add_argument("--parent-pid", type=int, help="exit when this process (the controller) is gone")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        help="exit when the controller has not been heard of for this long (s; joined "
        "workers; default: the setting heartbeat_timeout)",
    )
    a = p.parse_args(argv)
    key_hex = ""
    if a.connection_file:
        import json

        try:
            with open(a.connection_file) as f:
                info = json.load(f)
            a.connect, key_hex = info["address"], info["key"]
        except (OSError, ValueError, KeyError) as e:
            p.error(f"cannot read the connection file {a.connection_file}: {e}")
        if a.world is None and _env_int("WORLD_SIZE", "SLURM_NTASKS") is None:
            a.world = int(info["world"])

    if a.parent_pid:
        set_parent_death_signal(a.parent_pid)
    rank = a.rank if a.rank is not None else _env_int("RANK", "SLURM_PROCID")
    world = a.world if a.world is not None else _env_int("WORLD_SIZE", "SLURM_NTASKS")
    local_rank = (
        a.local_rank if a.local_rank is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID")
    )
    if rank is None or world is None:
        p.error("rank and world size: pass --rank/--world or set RANK/WORLD_SIZE")
    if key_hex:
        pass
    elif a.key_file:
        with open(a.key_file) as f:
            key_hex = f.read().strip()
    elif a.key_stdin:
        key_hex = sys.stdin.readline().strip()
    else:
        key_hex = os.environ.pop("MONARCH_NB_KEY", "")
    if not key_hex:
        p.error("no mesh secret: use --key-file, --key-stdin or MONARCH_NB_KEY")

    if a.heartbeat_timeout is None:
        a.heartbeat_timeout = process_settings()["heartbeat_timeout"]
    heartbeat = None if a.parent_pid else a.heartbeat_timeout
    run_worker(
        a.connect, bytes.fromhex(key_hex), rank, world, local_rank or 0, a.parent_pid, heartbeat
    )


def run_worker(
    address: str,
    key: bytes,
    rank: int,
    world: int,
    local_rank: int,
    parent_pid: int | None,
    heartbeat: float | None,
) -> None:
    """Be rank ``rank`` until the controller says Exit, then end the process. The
    CLI above and a host agent's forked child (monarch_nb.host) both end here."""
    # the worker's own log goes to its real stderr (the launcher keeps its tail); the
    # root logger stays unconfigured, so user code's logging reaches the cell as in a kernel
    own = logging.getLogger("monarch_nb")
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(
        logging.Formatter(f"[monarch worker {rank}] %(levelname)s %(name)s: %(message)s")
    )
    own.addHandler(handler)
    own.setLevel(process_settings()["log"])
    own.propagate = False
    # headless: matplotlib renders with Agg; %%monarch cells send figures home
    os.environ["MPLBACKEND"] = "module://monarch_nb.worker.mpl_backend"
    import torch  # noqa: F401 - import before any thread starts (and before CUDA init)

    if torch.cuda.is_available():
        # one visible GPU (the local launcher's way) or the LOCAL_RANK-th (torchrun's, srun's)
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        torch.ones(1, device="cuda")

    from . import synced_code
    from .worker import Worker

    worker = Worker(address, key, rank, world, local_rank, parent_pid, heartbeat)
    # what start-up made (torch, the worker's own modules: ~190k objects) lives as long
    # as the process: left to the collector, each full collection walks it (~0.1 s
    # here), and a tensor op's cells and closures trigger one every few thousand ops
    gc.freeze()
    worker.serve()
    sys.stdout.flush()
    synced_code.leave()  # os._exit runs no atexit handler
    os._exit(0)


if __name__ == "__main__":
    main()
