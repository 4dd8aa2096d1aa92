"""``python -m benchmarks [--quick] [--json PATH] [--only NAME[,NAME]]``

Runs every benchmark side by side with its baseline in one run, prints a table
(name, ours, baseline, unit, ratio, target, ok) and writes the results as JSON
to PATH, ``bench.json`` in the current directory when ``--json`` is not given
(``--json -`` writes none). Each entry::

    {"rtt": {"ours": 0.31, "baseline": 0.25, "unit": "ms", "ratio": 1.24,
             "target": "<= 1.5", "baseline_is": "...", "ok": true, "note": "..."}}

``ratio`` is always ours / baseline and ``ok`` says whether the target holds
for it. A missed target is data, not a failure: the exit code is 0 whenever
the benchmarks ran (a benchmark that raised is reported with ``"error"`` and
``ok: false``). ``--quick`` uses fewer calls and repetitions (under 2 minutes
on a 2-core machine); ``--only rtt,fetch`` runs just those.

Benchmarks live in the modules of ``MODULES``; each exposes
``BENCHMARKS = [(name, fn)]`` with ``fn(quick: bool) -> list[Entry]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback

from ._report import Entry, failed_entry

MODULES = (
    "benchmarks.core",
    "benchmarks.collectives",
    "benchmarks.recording",
    "benchmarks.cell",
    "benchmarks.pdb",
    "benchmarks.dashboard",
    "benchmarks.soak",
)

PEERS_FOOTER = (
    "measured here earlier: Ray actor call 1.0 ms; ipyparallel 6.6–9.4 ms; "
    "ipyparallel pipelined 130–200 calls/s\n"
    "(reference only: Ray and ipyparallel are not run by this suite, even when installed)"
)

COLUMNS = ("name", "ours", "baseline", "unit", "ratio", "target", "ok")


def registry() -> list[tuple[str, object]]:
    benches: list[tuple[str, object]] = []
    for name in MODULES:
        benches.extend(importlib.import_module(name).BENCHMARKS)
    return benches


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.4g}"
    return str(x)


def format_table(results: dict) -> str:
    rows = [COLUMNS]
    for name, d in results.items():
        rows.append((name, *(_fmt(d.get(c)) for c in COLUMNS[1:])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for i, r in enumerate(rows):
        cells = [
            c.ljust(w) if j in (0, 3, 5, 6) else c.rjust(w)
            for j, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for name, d in results.items():
        if d.get("error"):
            lines.append(f"{name}: ERROR {d['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer calls and repetitions (< 2 min)")
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
    print(PEERS_FOOTER)
    print(f"total {time.monotonic() - t_start:.0f} s{' (quick)' if args.quick else ''}")
    if args.json != "-":
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
