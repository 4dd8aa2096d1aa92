"""A kept-alive mesh expires without a trace: 20 trials over 5 phases (idle, a busy
command, a rank printing without end, a mesh attached to and abandoned again, a
rank stuck in a collective), two runners side by side; after each SIGKILLed
controller the agent and every rank are gone within the keep-alive and a few
seconds, and the registry entry with them."""

from __future__ import annotations

import os

from reliability_helpers import alive, run_trials

TRIALS = 20


def test_kept_alive_meshes_expire_leaving_nothing(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path), MONARCH_NB_MESH_DIR=str(tmp_path / "meshes"))
    results = run_trials("expiry_trials.py", TRIALS, env)
    for t in results:
        assert len(t["ranks"]) == (2 if t["phase"] == "collective" else 1), t
        assert t["forked"], t  # the agent is the fork server's, as by default
        assert t["left"] == [], f"processes left after the keep-alive: {t}"
        assert not t["entry_left"], f"a registry entry outlived its mesh: {t}"
    everyone = [p for t in results for p in [t["agent"], *t["ranks"]]]
    assert not [p for p in everyone if alive(p)]
    assert {t["phase"] for t in results} == {"idle", "busy", "printing", "attached", "collective"}
    assert not os.listdir(tmp_path / "meshes")
