"""The soak's quick variant in CI: ``python -m benchmarks.soak --quick`` in a process
of its own (its RSS is the controller's), 60,000 small commands and 1,000 fetches
over dp=2; RSS of the controller and each worker within 5 % of the post-warm-up
baseline, env sizes back to the baseline. The full run (1,000,000 commands and
10,000 fetches) is ``python -m benchmarks.soak``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_soak_keeps_memory_flat(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["commands"] == 60_000 and r["fetches"] == 1_000 and r["errors"] == 0, r
    assert r["env_size_final"] == r["env_size_base"], r
    for proc, ratio in r["rss_ratio"].items():
        assert ratio <= 1.05, f"{proc} grew {100 * (ratio - 1):.1f} % during the soak: {r}"
    assert r["ok"] and p.returncode == 0, p.stderr[-3000:]
