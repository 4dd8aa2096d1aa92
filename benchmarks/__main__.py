"""``python -m benchmarks [--quick] [--check] [--json PATH] [--only NAME[,NAME]]``

Runs every benchmark side by side with its baseline in one run, prints a table
(name, ours, baseline, unit, ratio, target, ok) with a legend of its columns and
a line naming the rows that missed their target, and writes the results as JSON
to PATH, ``bench.json`` in the current directory when ``--json`` is not given
(``--json -`` writes none). Each entry::

    {"rtt": {"ours": 0.31, "baseline": 0.25, "unit": "ms", "ratio": 1.24,
             "target": "<= 1.5", "baseline_is": "...", "ok": true, "note": "..."}}

``ratio`` is always ours / baseline and ``ok`` says whether the target holds
for it (a benchmark that raised is reported with ``"error"`` and ``ok: false``).
Without ``--check`` a missed target is data: the exit code is 0 whenever the
benchmarks ran; with ``--check`` it is 1 when any row missed. ``--quick`` uses
fewer calls and repetitions (under 2 minutes on a 2-core machine); ``--only
rtt,fetch`` runs just those.

Benchmarks live in the modules of ``MODULES``; each exposes
``BENCHMARKS = [(name, fn)]`` with ``fn(quick: bool) -> list[Entry]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

from ._report import LEGEND, Entry, exit_code, failed_entry, format_table, verdict

MODULES = (
    "benchmarks.core",
    "benchmarks.timeline",
    "benchmarks.collectives",
    "benchmarks.recording",
    "benchmarks.cell",
    "benchmarks.pdb",
    "benchmarks.dap",
    "benchmarks.dashboard",
    "benchmarks.soak",
    "benchmarks.tensor",
    "benchmarks.tensor_real",
    "benchmarks.tensor_vs_monarch",
    "benchmarks.mesh_start",
    "benchmarks.mesh_attach_remote",
    "benchmarks.scale",
)

PEERS_FOOTER = (
    "measured here earlier: Ray actor call 1.0 ms; ipyparallel 6.6–9.4 ms; "
    "ipyparallel pipelined 130–200 calls/s\n"
    "(reference only; ipyparallel runs in cell_vs_px where it is importable and in\n"
    "broadcast_vs_ipyparallel from its side venv, scripts/peer_ipyparallel_venv.sh; Ray never)"
)


def registry() -> list[tuple[str, object]]:
    benches: list[tuple[str, object]] = []
    for name in MODULES:
        benches.extend(importlib.import_module(name).BENCHMARKS)
    return benches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer calls and repetitions (< 2 min)")
    p.add_argument(
        "--check", action="store_true", help="exit 1 when any row missed its target (0 otherwise)"
    )
    p.add_argument(
        "--json", default="bench.json", metavar="PATH", help="where to write results ('-': nowhere)"
    )
    p.add_argument("--only", default="", metavar="NAME[,NAME]", help="run only these benchmarks")
    args = p.parse_args(argv)

    benches = registry()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        known = [n for n, _ in benches]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            p.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}")
        benches = [(n, fn) for n, fn in benches if n in wanted]

    results: dict = {}
    t_start = time.monotonic()
    for name, fn in benches:
        t0 = time.monotonic()
        print(f"running {name}{' (quick)' if args.quick else ''} ...", file=sys.stderr, flush=True)
        try:
            entries: list[Entry] = fn(args.quick)
            for e in entries:
                results[e.name] = e.to_dict()
        except Exception as e:
            traceback.print_exc()
            results[name] = failed_entry(name, e)
        print(f"  {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)

    print()
    print(format_table(results))
    print()
    print(LEGEND)
    print()
    print(verdict(results))
    print()
    print(PEERS_FOOTER)
    print(f"total {time.monotonic() - t_start:.0f} s{' (quick)' if args.quick else ''}")
    if args.json != "-":
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {args.json}")
    return exit_code(results, args.check)


if __name__ == "__main__":
    sys.exit(main())
