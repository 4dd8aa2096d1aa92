"""The ``tensor_vs_monarch`` rows without Monarch's side venv: its peer script's error JSON,
the rows skipped (not missed) when the venv is absent, and a peer that cannot start named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._report import Entry, exit_code, format_table, missed, verdict
from benchmarks.tensor_vs_monarch import ROWS, bench_tensor_vs_monarch

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "benchmarks" / "peer_monarch.py"


def test_peer_script_without_monarch_prints_error_json_naming_the_module():
    proc = subprocess.run(
        [sys.executable, str(PEER), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert set(reply) == {"error"}
    assert "No module named 'monarch'" in reply["error"]
    assert "scripts/peer_monarch_venv.sh" in reply["error"]


def test_peer_script_rejects_a_bad_argument():
    proc = subprocess.run(
        [sys.executable, str(PEER), "--quick", "--serve"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr
    assert proc.stdout == ""


def test_rows_are_skipped_not_missed_without_the_side_venv(monkeypatch, tmp_path):
    monkeypatch.setenv("MNB_PEER_VENV", str(tmp_path / "absent"))
    results = {e.name: e.to_dict() for e in bench_tensor_vs_monarch(quick=True)}
    assert tuple(results) == ROWS
    for d in results.values():
        assert d["ok"] is None and "run scripts/peer_monarch_venv.sh" in d["skipped"]
    assert missed(results) == [] and exit_code(results, check=True) == 0
    assert verdict(results) == f"no row was measured (3 skipped: {', '.join(ROWS)})"
    assert "tensor_vs_monarch: skipped: peer not installed" in format_table(results)
    met = {"rtt": Entry("rtt", 0.3, 0.25, "ms", "<= 1.5", "raw pyzmq").to_dict(), **results}
    assert verdict(met) == f"the one row met its target (3 skipped: {', '.join(ROWS)})"
    assert exit_code(met, check=True) == 0


def test_a_peer_that_cannot_import_monarch_fails_the_benchmark_naming_it(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("MNB_PEER_VENV", str(tmp_path))
    with pytest.raises(RuntimeError, match="torchmonarch is not importable here: No module"):
        bench_tensor_vs_monarch(quick=True)
