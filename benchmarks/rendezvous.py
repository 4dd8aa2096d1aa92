"""Process-group creation through each rendezvous store, on a dp=2 joined mesh.

``python -m benchmarks.rendezvous [--quick]``. Two workers join a loopback
``connect_mesh`` whose rendezvous is forced to the controller's store
(``MONARCH_NB_RENDEZVOUS=controller``, the default beyond loopback). On the
workers, one gloo process group of the two ranks is created per repetition
through each store in turn (interleaved): the controller's store (reached
through the signed channel), a FileStore in a private directory (one host's
meshes) and a torch TCPStore that rank 0 serves on 127.0.0.1 (what joined meshes
used before). ``pg_create``: ours = the controller's store, baseline = the
TCPStore, medians in ms; ``new_group`` (the call the mesh makes, through the
default group's store) is in ``extra``.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from ._report import Entry


def _pg_times(path: str, reps: int) -> dict:
    """On each rank: ms per gloo group creation through each store."""
    import torch.distributed as dist

    from monarch_nb.worker.store import current_store

    rank, ctrl = dist.get_rank(), current_store()
    timeout = datetime.timedelta(seconds=60)
    stores = {"controller": ctrl, "file": dist.FileStore(path, 2)}
    if rank == 0:
        stores["tcp"] = dist.TCPStore("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)
        ctrl.set("bench/tcp-port", str(stores["tcp"].port).encode())
    else:
        port = int(ctrl.get("bench/tcp-port"))
        stores["tcp"] = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
    times: dict = {k: [] for k in (*stores, "new_group")}
    kept = []  # a group dropped on one rank while the other still connects breaks it
    for i in range(reps):
        for kind, store in stores.items():
            dist.barrier()
            t0 = time.perf_counter()
            prefixed = dist.PrefixStore(f"bench/{kind}/{i}", store)
            kept.append(dist.ProcessGroupGloo(prefixed, rank, 2, timeout))
            times[kind].append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        t0 = time.perf_counter()
        kept.append(dist.new_group([0, 1]))
        times["new_group"].append((time.perf_counter() - t0) * 1e3)
    dist.barrier()
    return {k: statistics.median(v) for k, v in times.items()}


def bench_pg_create(quick: bool) -> list[Entry]:
    import monarch_nb as mnb

    reps = 5 if quick else 20
    tmp = tempfile.mkdtemp(prefix="mnb-bench-rdzv-")
    conn = os.path.join(tmp, "mesh.json")
    old = os.environ.get("MONARCH_NB_RENDEZVOUS")
    os.environ["MONARCH_NB_RENDEZVOUS"] = "controller"
    result: dict = {}

    def join():
        result["mesh"] = mnb.connect_mesh(
            world=2, dp=2, connection_file=conn, timeout=120, name="bench-rdzv"
        )

    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    deadline = time.monotonic() + 60
    while not os.path.exists(conn) and time.monotonic() < deadline:
        time.sleep(0.02)
    argv = [sys.executable, "-m", "monarch_nb.worker", "--connection-file", conn]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    workers = [
        subprocess.Popen([*argv, "--rank", str(r), "--world", "2"], env=env) for r in range(2)
    ]
    try:
        t0 = time.perf_counter()
        joining.join(120)
        mesh = result["mesh"]
        joined = time.perf_counter() - t0
        times = mnb.remote(_pg_times)(os.path.join(tmp, "file"), reps, mesh=mesh).fetch(timeout=600)
        mesh.shutdown()
    finally:
        if old is None:
            os.environ.pop("MONARCH_NB_RENDEZVOUS", None)
        else:
            os.environ["MONARCH_NB_RENDEZVOUS"] = old
        for w in workers:
            w.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    worst = {k: max(t[k] for t in times) for k in times[0]}  # the slower rank's median
    return [
        Entry(
            "pg_create",
            worst["controller"],
            worst["tcp"],
            "ms",
            "<= 3.0",
            "a torch TCPStore on 127.0.0.1 (the joined meshes' rendezvous before)",
            note=f"FileStore {worst['file']:.2f} ms; new_group {worst['new_group']:.2f} ms",
            extra={
                "file_ms": worst["file"],
                "new_group_ms": worst["new_group"],
                "joined_s": joined,
                "reps": reps,
            },  # fmt: skip
        )
    ]


BENCHMARKS = [("pg_create", bench_pg_create)]


if __name__ == "__main__":
    for e in bench_pg_create("--quick" in sys.argv):
        print(f"{e.name}: ours {e.ours:.2f} {e.unit}, baseline {e.baseline:.2f} {e.unit}, {e.note}")
        print(e.extra)
