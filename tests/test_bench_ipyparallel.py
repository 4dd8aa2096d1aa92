"""The ``broadcast_vs_ipyparallel`` row without ipyparallel's side venv: skipped (not a miss)
when the venv is absent, its peer script's argument errors and missing-module error, and a
peer that cannot start named. No test needs the venv or starts a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._report import exit_code, missed
from benchmarks.scale import BENCHMARKS, _ipyparallel_note
from benchmarks.scale_ipp import ROW, bench_broadcast_vs_ipyparallel, engines

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "benchmarks" / "peer_ipyparallel.py"


def _peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PEER), *args], capture_output=True, text=True, timeout=120
    )


def test_peer_script_without_ipyparallel_prints_error_json_naming_the_module():
    proc = _peer("--quick", "--engines", "2")
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert set(reply) == {"error"}
    assert "No module named 'ipyparallel'" in reply["error"]
    assert "scripts/peer_ipyparallel_venv.sh" in reply["error"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engines", "0"], "argument --engines: must be at least 1, not 0"),
        (["--engines", "many"], "argument --engines: not a whole number: 'many'"),
        (["--engines", "10000000"], "MiB available: at most"),
        (["--quick", "--serve"], "not allowed with argument"),
    ],
)
def test_peer_script_rejects_a_bad_argument_naming_it(args, message):
    proc = _peer(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_row_is_skipped_not_missed_without_the_side_venv(monkeypatch, tmp_path):
    monkeypatch.setenv("MNB_IPP_VENV", str(tmp_path / "absent"))
    results = {e.name: e.to_dict() for e in bench_broadcast_vs_ipyparallel(quick=True)}
    assert list(results) == [ROW]
    assert results[ROW]["ok"] is None
    assert "run scripts/peer_ipyparallel_venv.sh" in results[ROW]["skipped"]
    assert str(tmp_path / "absent") in results[ROW]["skipped"]
    assert missed(results) == [] and exit_code(results, check=True) == 0
    assert _ipyparallel_note().startswith("not run: peer not installed")


def test_the_row_runs_with_the_scale_benchmarks_and_reports_skipped(tmp_path):
    """``python -m benchmarks --only broadcast_vs_ipyparallel --check`` without the venv: the
    table names the reason, the JSON holds the skipped row, and --check still exits 0."""
    assert (ROW, bench_broadcast_vs_ipyparallel) in BENCHMARKS
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--check", "--only", ROW]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "MNB_IPP_VENV": str(tmp_path / "absent")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{ROW}: skipped: peer not installed" in proc.stdout
    row = json.loads(out.read_text())[ROW]
    assert row["ok"] is None and "peer_ipyparallel_venv.sh" in row["skipped"]


@pytest.mark.parametrize("value", ["0", "40", "-32", "lots"])
def test_a_bad_engine_count_is_named(monkeypatch, value):
    monkeypatch.setenv("MNB_IPP_ENGINES", value)
    with pytest.raises(ValueError, match=f"MNB_IPP_ENGINES='{value}': expected a whole"):
        engines(quick=True)
    monkeypatch.setenv("MNB_IPP_ENGINES", "96")
    assert engines(quick=True) == 96


def test_a_peer_without_ipyparallel_fails_the_benchmark_naming_it(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("MNB_IPP_VENV", str(tmp_path))
    with pytest.raises(RuntimeError, match="ipyparallel is not importable here: No module"):
        bench_broadcast_vs_ipyparallel(quick=True)
