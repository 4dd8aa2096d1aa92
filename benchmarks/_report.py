"""One benchmark result: our number, the baseline's, and whether the target holds."""

from __future__ import annotations

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
