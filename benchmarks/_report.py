"""Benchmark results: one entry (our number, the baseline's, whether the target holds)
and the report of a run (the table, its legend, the rows that missed)."""

from __future__ import annotations

import math
import operator
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_OPS = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*$")


def parse_target(target: str) -> tuple[Callable[[float, float], bool], float]:
    """``"<= 1.5"`` -> (operator.le, 1.5). The target applies to the ratio ours / baseline."""
    match = _TARGET.match(target)
    if match is None:
        raise ValueError(f"bad target {target!r}: expected e.g. '<= 1.5' or '>= 0.7'")
    return _OPS[match.group(1)], float(match.group(2))


def check_target(ratio: float | None, target: str) -> bool:
    op, bound = parse_target(target)
    if ratio is None or ratio != ratio:  # None or NaN
        return False
    return bool(op(ratio, bound))


@dataclass
class Entry:
    """A row of the table / one key of the JSON. ``ratio`` is always ours / baseline."""

    name: str
    ours: float
    baseline: float
    unit: str
    target: str
    baseline_is: str
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        parse_target(self.target)  # fail early on a malformed target

    @property
    def ratio(self) -> float | None:
        if not self.baseline:
            return None
        return self.ours / self.baseline

    @property
    def ok(self) -> bool:
        return check_target(self.ratio, self.target)

    def to_dict(self) -> dict:
        ratio = self.ratio
        d = {
            "ours": _round(self.ours),
            "baseline": _round(self.baseline),
            "unit": self.unit,
            "ratio": None if ratio is None else _round(ratio),
            "target": self.target,
            "baseline_is": self.baseline_is,
            "ok": self.ok,
        }
        if self.note:
            d["note"] = self.note
        d.update(self.extra)
        return d


@dataclass
class Skipped:
    """A row that could not be measured here for a reason outside monarch_nb (a peer that is
    not installed): reported with ``"skipped"`` and ``ok`` null, and not counted as a miss."""

    name: str
    reason: str

    def to_dict(self) -> dict:
        return {
            "ours": None,
            "baseline": None,
            "unit": "",
            "ratio": None,
            "target": "",
            "baseline_is": "",
            "ok": None,
            "skipped": self.reason,
        }


def failed_entry(name: str, error: BaseException) -> dict:
    """What the JSON holds for a benchmark that raised instead of measuring."""
    return {
        "ours": None,
        "baseline": None,
        "unit": "",
        "ratio": None,
        "target": "",
        "baseline_is": "",
        "ok": False,
        "error": f"{type(error).__name__}: {error}",
    }


def _round(x: float) -> float:
    """Four significant digits are plenty for timings."""
    if x == 0 or x != x:
        return x
    return float(f"{x:.4g}")


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    ours: Callable[[], float], baseline: Callable[[], float], reps: int, warmup: int = 1
) -> tuple[float, float, list[float], list[float]]:
    """Run ``ours`` and ``baseline`` alternately ``reps`` times after ``warmup``
    unrecorded rounds; each returns one measurement. Returns the medians and
    the raw samples. Alternating keeps slow drift of a noisy machine from
    favouring either side."""
    for _ in range(warmup):
        ours()
        baseline()
    a: list[float] = []
    b: list[float] = []
    for i in range(reps):
        if i % 2 == 0:
            a.append(ours())
            b.append(baseline())
        else:
            b.append(baseline())
            a.append(ours())
    return statistics.median(a), statistics.median(b), a, b


# ------------------------------------------------------------------ the report of a run

COLUMNS = ("name", "ours", "baseline", "unit", "ratio", "target", "ok")

LEGEND = """\
ours      monarch_nb's number, in unit (ms: lower is better; calls/s, GB/s, steps/s: higher)
baseline  the same work done without monarch_nb (what exactly: baseline_is in the JSON)
ratio     ours / baseline
target    the bound ratio must meet ("<= baseline + N": the bound on ours itself)
ok        yes: the target holds; NO: the row missed it (or the benchmark failed); -: skipped"""


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
    """The results (name -> entry dict) as an aligned text table, then one line per
    benchmark that raised."""
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
        elif d.get("skipped"):
            lines.append(f"{name}: skipped: {d['skipped']}")
    return "\n".join(lines)


def missed(results: dict) -> list[str]:
    """The rows whose target did not hold (a benchmark that raised is one of them; a skipped
    row is not)."""
    return [name for name, d in results.items() if d.get("ok") is not True and not d.get("skipped")]


def verdict(results: dict) -> str:
    """One line: which rows missed their target, or that all met it."""
    bad = missed(results)
    skipped = [name for name, d in results.items() if d.get("skipped")]
    n = len(results) - len(skipped)
    tail = f" ({len(skipped)} skipped: {', '.join(skipped)})" if skipped else ""
    if not results:
        return "no benchmark ran"
    if not n:
        return "no row was measured" + tail
    if not bad:
        met = "the one row met its target" if n == 1 else f"all {n} rows met their target"
        return met + tail
    rows = "row" if n == 1 else "rows"
    return f"{len(bad)} of {n} {rows} missed their target: {', '.join(bad)}" + tail


def exit_code(results: dict, check: bool) -> int:
    """0, unless ``check`` and a row missed its target (or nothing ran): 1."""
    return 1 if check and (missed(results) or not results) else 0
