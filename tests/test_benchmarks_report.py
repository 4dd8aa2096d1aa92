"""``python -m benchmarks``: its table, the legend, the rows that missed, ``--check``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._report import (
    COLUMNS,
    LEGEND,
    Entry,
    exit_code,
    failed_entry,
    format_table,
    missed,
    verdict,
)

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"ours", "baseline", "unit", "ratio", "target", "baseline_is", "ok"}


def _results() -> dict:
    met = Entry("rtt", 0.3, 0.25, "ms", "<= 1.5", "raw pyzmq ping-pong")
    slow = Entry("fetch", 1.0, 2.0, "GB/s", ">= 0.8", "raw pyzmq send of the bytes")
    return {
        "rtt": met.to_dict(),
        "fetch": slow.to_dict(),
        "pdb": failed_entry("pdb", RuntimeError("kernel died")),
    }


@pytest.mark.unit
def test_entries_keep_the_json_contract():
    for d in _results().values():
        assert KEYS <= set(d)
    d = _results()["rtt"]
    assert d["ratio"] == pytest.approx(0.3 / 0.25) and d["ok"] is True
    assert _results()["fetch"]["ratio"] == 0.5 and _results()["fetch"]["ok"] is False


@pytest.mark.unit
def test_table_rows_and_legend_of_every_column():
    table = format_table(_results())
    lines = table.splitlines()
    assert lines[0].split() == list(COLUMNS)
    assert lines[2].split() == ["rtt", "0.3", "0.25", "ms", "1.2", "<=", "1.5", "yes"]
    assert lines[3].split()[-1] == "NO" and lines[4].split()[-1] == "NO"
    assert lines[-1] == "pdb: ERROR RuntimeError: kernel died"
    legend = {ln.split()[0]: ln for ln in LEGEND.splitlines()}
    assert set(legend) == set(COLUMNS) - {"name", "unit"}
    assert "ours / baseline" in legend["ratio"]
    assert "baseline_is" in legend["baseline"]


@pytest.mark.unit
def test_the_rows_that_missed_and_the_exit_code():
    results = _results()
    assert missed(results) == ["fetch", "pdb"]
    assert verdict(results) == "2 of 3 rows missed their target: fetch, pdb"
    assert exit_code(results, check=True) == 1
    assert exit_code(results, check=False) == 0  # without --check a miss is data
    met = {"rtt": results["rtt"]}
    assert missed(met) == [] and verdict(met) == "the one row met its target"
    assert exit_code(met, check=True) == 0
    assert verdict({**met, "x": results["rtt"]}) == "all 2 rows met their target"
    assert verdict({"pdb": results["pdb"]}) == "1 of 1 row missed their target: pdb"
    assert exit_code({}, check=True) == 1 and verdict({}) == "no benchmark ran"


def test_a_real_quick_run_reports_and_checks(tmp_path):
    """One real benchmark (rtt, quick): the table, the legend and the verdict printed, the
    JSON written, and ``--check``'s exit code agrees with the JSON's ``ok``."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "rtt", "--check"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    results = json.loads(out.read_text())
    assert set(results) == {"rtt"} and KEYS <= set(results["rtt"])
    assert proc.returncode == (0 if results["rtt"]["ok"] else 1), proc.stdout + proc.stderr
    assert LEGEND in proc.stdout and verdict(results) in proc.stdout
    assert proc.stdout.index("ratio     ours / baseline") > proc.stdout.index("rtt ")
