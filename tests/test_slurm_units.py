"""Pure functions of the Slurm launcher: the GPUs of a node's Gres, and the
options the step inside the batch job keeps."""

from __future__ import annotations

import pytest

from monarch_nb.launchers.slurm import _gpus, job_options, opts_for_step

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "gres, gpus",
    [("(null)", 0), ("gpu:8", 8), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:4,gpu:h100:2", 6),
     ("mps:100,gpu:2", 2), ("gpu", 0)],
)  # fmt: skip
def test_gpus_of_a_gres(gres, gpus):
    assert _gpus(gres) == gpus


def test_the_step_keeps_the_layout_not_the_jobs_options():
    opts = job_options(4, 2, 8, "gpu", "10:00", "acct", "m") + ["--exclusive", "--mem=0"]
    assert opts_for_step(opts) == ["--nodes", "4", "--ntasks-per-node", "1",
                                   "--cpus-per-task", "2", "--gpus-per-node", "8"]  # fmt: skip


@pytest.mark.unit
def test_slurm_times_in_seconds():
    from monarch_nb.launchers.slurm import slurm_seconds

    assert slurm_seconds("00:01:00") == 60 and slurm_seconds("1:00") == 60
    assert slurm_seconds("1-02:00:00") == 93_600
    assert slurm_seconds("UNLIMITED") is None and slurm_seconds("") is None
