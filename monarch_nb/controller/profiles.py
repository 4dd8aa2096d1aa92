"""Per-rank torch.profiler reports made one: a Chrome trace with a process row per
rank on the controller's clock, and a summary of where the time went."""

from __future__ import annotations

import statistics

from ..protocol.insight_messages import PROFILE_CLOCK_MARK

_PROCESS_META = ("process_name", "process_labels", "process_sort_index")


def merge_traces(reports: dict, offsets: dict) -> dict:
    """One Chrome trace of ``reports`` (rank -> what a rank's StopProfile sent): every
    event's pid is its rank (a row named "rank N"), its ts (us) on the controller's
    wall clock: the rank's clock-mark event gives the trace's clock against the
    rank's wall clock, ``offsets`` (rank -> (worker clock - ours, round trip)) the
    rank's wall clock against ours."""
    events: list = []
    aligned = {}
    for rank in sorted(reports):
        report = reports[rank]
        trace_events = report["trace"].get("traceEvents", [])
        shift, aligned[rank] = _shift_us(trace_events, report["mark"], offsets.get(rank))
        for e in trace_events:
            if e.get("ph") == "M" and e.get("name") in _PROCESS_META:
                continue
            e = dict(e)
            e["pid"] = rank
            if "ts" in e:
                e["ts"] = e["ts"] + shift
            if "id" in e:  # flow ids are per process: keep ranks' apart
                e["id"] = f"{rank}:{e['id']}"
            events.append(e)
        events.append(_meta(rank, "process_name", {"name": f"rank {rank}"}))
        events.append(_meta(rank, "process_sort_index", {"sort_index": rank}))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"monarch_nb": {"clock": "controller wall clock, us", "aligned": aligned}},
    }


def _shift_us(events: list, mark: float, offset) -> tuple[float, bool]:
    """What to add to a rank's ts to get the controller's wall clock in us, and whether
    its clock mark was found (without it the trace keeps the rank's own clock)."""
    for e in events:
        if e.get("name") == PROFILE_CLOCK_MARK and e.get("ph") == "X":
            middle = e["ts"] + e.get("dur", 0) / 2
            worker_minus_ours = offset[0] if offset is not None else 0.0
            return (mark - worker_minus_ours) * 1e6 - middle, True
    return 0.0, False


def _meta(rank: int, name: str, args: dict) -> dict:
    return {"ph": "M", "name": name, "pid": rank, "tid": 0, "args": args}


def summarize(reports: dict, path: str | None = None) -> dict:
    """Plain data: per rank its top ops by self time and its total (every op's self
    time, CPU and device, us) and wall time profiled; the slowest rank (by total) and
    how much more it took than the median of the others."""
    ranks = {
        r: {"total_us": rep["total_us"], "wall_s": rep["wall"], "top_ops": rep["ops"]}
        for r, rep in sorted(reports.items())
    }
    out = {"trace": path, "ranks": ranks, "slowest": None}
    if ranks:
        slowest = max(ranks, key=lambda r: ranks[r]["total_us"])
        others = [v["total_us"] for r, v in ranks.items() if r != slowest]
        median = statistics.median(others) if others else ranks[slowest]["total_us"]
        total = ranks[slowest]["total_us"]
        out["slowest"] = {
            "rank": slowest,
            "total_us": total,
            "over_median_us": total - median,
            "ratio_to_median": (total / median) if median else None,
        }
    return out


def summary_text(summary: dict, top: int = 5) -> str:
    """The summary as a few lines of text."""
    lines = [f"profile: {summary['trace']}"]
    for r, info in summary["ranks"].items():
        lines.append(
            f"rank {r}: ops {info['total_us'] / 1e3:.1f} ms in {info['wall_s']:.3f} s profiled"
        )
        for op in info["top_ops"][:top]:
            lines.append(f"    {op['self_us'] / 1e3:9.3f} ms  {op['count']:6d} x  {op['name']}")
    s = summary["slowest"]
    if s is not None and len(summary["ranks"]) > 1:
        ratio = s["ratio_to_median"]
        by = f" ({ratio:.2f}x)" if ratio is not None else ""
        lines.append(
            f"slowest: rank {s['rank']}, {s['over_median_us'] / 1e3:.1f} ms over the "
            f"others' median{by}"
        )
    return "\n".join(lines)
