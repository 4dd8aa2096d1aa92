"""``python -m monarch_nb.worker`` / ``monarch-nb-worker``: a worker process."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return None


def _set_parent_death_signal(parent_pid: int) -> None:
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
    p.add_argument("--connect", required=True, help="controller address, tcp://HOST:PORT")
    p.add_argument("--key-file", help="file holding the mesh secret (hex)")
    p.add_argument("--key-stdin", action="store_true", help="read the secret (hex) from stdin")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--local-rank", type=int)
    p.add_argument("--parent-pid", type=int, help="exit when this process (the controller) is gone")
    a = p.parse_args(argv)

    if a.parent_pid:
        _set_parent_death_signal(a.parent_pid)
    rank = a.rank if a.rank is not None else _env_int("RANK", "SLURM_PROCID")
    world = a.world if a.world is not None else _env_int("WORLD_SIZE", "SLURM_NTASKS")
    local_rank = (
        a.local_rank if a.local_rank is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID")
    )
    if rank is None or world is None:
        p.error("rank and world size: pass --rank/--world or set RANK/WORLD_SIZE")
    if a.key_file:
        with open(a.key_file) as f:
            key_hex = f.read().strip()
    elif a.key_stdin:
        key_hex = sys.stdin.readline().strip()
    else:
        key_hex = os.environ.pop("MONARCH_NB_KEY", "")
    if not key_hex:
        p.error("no mesh secret: use --key-file, --key-stdin or MONARCH_NB_KEY")

    logging.basicConfig(
        level=os.environ.get("MONARCH_NB_LOG", "WARNING").upper(),
        format=f"[monarch worker {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # headless: matplotlib renders with Agg; %%monarch cells send figures home
    os.environ["MPLBACKEND"] = "module://monarch_nb.worker.mpl_backend"
    import torch  # noqa: F401 - import before any thread starts (and before CUDA init)

    if torch.cuda.is_available():
        torch.cuda.set_device(0 if "CUDA_VISIBLE_DEVICES" in os.environ else (local_rank or 0))
        torch.ones(1, device="cuda")

    from .worker import Worker

    Worker(a.connect, bytes.fromhex(key_hex), rank, world, local_rank or 0, a.parent_pid).serve()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
