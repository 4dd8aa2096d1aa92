"""Soak: many small commands and fetches over ``local_mesh(dp=2)``; memory must not creep.

``python -m benchmarks.soak [--quick] [--json PATH]``

Full: 1,000,000 small commands and 10,000 fetches (about 2 minutes on a 2-core
machine); ``--quick`` (CI): 60,000 commands and 1,000 fetches. The commands
cycle through the kinds a long session issues: a no-op remote call, a remote
call with arguments, ``mesh.exec`` of a statement, ``mesh.push``, a value
reduced over ``dp`` (its Ref dropped at once, as every command's here), with a
fetch of a checked value every 100 commands and ``mesh.wait()`` every 5,000
(which bounds the pipeline, as a real loop's fetches do).

After a warm-up (a tenth of the run), the resident memory of the controller and
of each worker is taken as the baseline; at the end it must be at most 5 %
higher, and the workers' env sizes (``mesh.status()["ranks"][r]["env_size"]``,
values held for Refs) must be back to the baseline. Exit code 1 when a check
fails. ``python -m benchmarks`` runs the quick variant as the ``soak_*`` rows
(ratio = final / baseline RSS, target <= 1.05).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

from ._report import Entry

RSS_LIMIT = 1.05
FETCH_EVERY = 100
WAIT_EVERY = 5_000


def noop():
    return None


def add(a, b):
    return a + b


def _rss(pids) -> dict:
    import psutil

    return {p: psutil.Process(p).memory_info().rss for p in pids}


def _settled(mesh) -> tuple[dict, list]:
    """RSS of the controller and the workers, and the workers' env sizes, once the
    mesh is idle and a fresh health sample (once a second) has arrived."""
    mesh.wait(timeout=120)
    gc.collect()
    mesh.wait(timeout=120)
    time.sleep(1.3)
    sizes = [mesh.status()["ranks"][r]["env_size"] for r in mesh.ranks]
    pids = [os.getpid(), *_rank_pids(mesh)]
    return _rss(pids), sizes


def _rank_pids(mesh) -> list[int]:
    """The ranks' processes, as ``mesh.status()`` has them."""
    ranks = mesh.status()["ranks"]
    return [ranks[r]["pid"] for r in mesh.ranks]


def soak(commands: int, fetches: int, progress=None) -> dict:
    import torch

    import monarch_nb as mnb

    small = torch.ones(4)
    fetch_every = max(1, commands // fetches)
    warm = commands // 10
    result: dict = {"commands": commands, "fetches": fetches}
    with mnb.local_mesh(dp=2, name="soak") as mesh:
        f_noop, f_add = mnb.remote(noop), mnb.remote(add)
        worker_pids = _rank_pids(mesh)
        done_fetches = 0
        base = base_sizes = None
        t0 = time.perf_counter()
        for i in range(commands):
            if i == warm:
                base, base_sizes = _settled(mesh)
                t0 = time.perf_counter()
            kind = i % 10
            if kind < 5:
                f_noop(mesh=mesh)
            elif kind < 7:
                f_add(small, i, mesh=mesh)
            elif kind == 7:
                mesh.exec("y = rank + 1")
            elif kind == 8:
                mesh.push(step=i)
            elif i % 1000 == 9:
                f_add(small, 0, mesh=mesh).reduce("dp")
            else:
                f_noop(mesh=mesh)
            if i % fetch_every == fetch_every - 1 and done_fetches < fetches:
                got = f_add(i, 1, mesh=mesh).fetch(timeout=120)
                assert got == [i + 1, i + 1], got
                done_fetches += 1
            if i % WAIT_EVERY == WAIT_EVERY - 1:
                mesh.wait(timeout=120)
                if progress is not None:
                    progress(i + 1)
        elapsed = time.perf_counter() - t0
        final, final_sizes = _settled(mesh)
        errors = mesh.status()["errors"]
    measured = commands - warm
    result.update(
        fetches=done_fetches,
        seconds=round(elapsed, 1),
        commands_per_s=round(measured / elapsed),
        rss_base={
            "controller": base[os.getpid()],
            **{f"worker{k}": base[p] for k, p in enumerate(worker_pids)},
        },
        rss_final={
            "controller": final[os.getpid()],
            **{f"worker{k}": final[p] for k, p in enumerate(worker_pids)},
        },
        env_size_base=base_sizes,
        env_size_final=final_sizes,
        errors=len(errors),
    )
    result["rss_ratio"] = {
        k: round(result["rss_final"][k] / result["rss_base"][k], 4) for k in result["rss_base"]
    }
    result["ok"] = (
        all(r <= RSS_LIMIT for r in result["rss_ratio"].values())
        and final_sizes == base_sizes
        and not errors
        and done_fetches == fetches
    )
    return result


def sizes(quick: bool) -> tuple[int, int]:
    return (60_000, 1_000) if quick else (1_000_000, 10_000)


def bench_soak(quick: bool) -> list[Entry]:
    """The ``python -m benchmarks`` rows: final / baseline RSS per process kind."""
    r = soak(*sizes(quick))
    note = (
        f"{r['commands']} small commands + {r['fetches']} fetches on local_mesh(dp=2) "
        f"({r['commands_per_s']} commands/s); env sizes {r['env_size_base']} -> "
        f"{r['env_size_final']}; baseline taken after a 10 % warm-up"
    )
    workers = [k for k in r["rss_base"] if k != "controller"]
    worst = max(workers, key=lambda k: r["rss_ratio"][k])
    return [
        Entry(
            "soak_rss_controller",
            r["rss_final"]["controller"] / 2**20,
            r["rss_base"]["controller"] / 2**20,
            "MiB",
            f"<= {RSS_LIMIT}",
            "the controller's RSS after the warm-up",
            note=note,
        ),
        Entry(
            "soak_rss_worker",
            r["rss_final"][worst] / 2**20,
            r["rss_base"][worst] / 2**20,
            "MiB",
            f"<= {RSS_LIMIT}",
            f"the RSS of the worker that grew most ({worst}) after the warm-up",
            note=note,
        ),
    ]


BENCHMARKS = [("soak", bench_soak)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="60,000 commands and 1,000 fetches (CI)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    a = p.parse_args(argv)
    commands, fetches = sizes(a.quick)

    def progress(n: int) -> None:
        if n % 100_000 == 0 or a.quick and n % 20_000 == 0:
            print(f"  {n:,} commands", file=sys.stderr, flush=True)

    r = soak(commands, fetches, progress)
    print(json.dumps(r, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
            f.write("\n")
    print("soak:", "ok" if r["ok"] else "FAILED", file=sys.stderr)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
