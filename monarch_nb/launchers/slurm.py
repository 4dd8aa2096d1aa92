"""Host agents as a Slurm job: ``SlurmLauncher`` is the ``ExternalLauncher`` that
starts its own agents, one per node, with ``sbatch`` (or with ``srun`` inside an
allocation: SLURM_JOB_ID set), and cancels them at shutdown.

The agents join through the connection file like any others (``remote_hosts.py``);
``mesh.restart()`` forks their ranks again in the same job. While the job waits,
a bar shows its id, state and reason ("pending (Resources), 35 s"); a job that
ends before its agents joined, or is granted fewer nodes than asked, fails the
start with Slurm's state and reason; an agent lost while its job ended says how
the job ended (TIMEOUT, NODE_FAIL, ...). More ranks per node than a node of the
partition has CPUs (or GPUs) is refused before anything is submitted (sinfo).
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import threading
import time

from ..controller.transfers import bar
from .local import ExternalLauncher

logger = logging.getLogger("monarch_nb.controller")

POLL_S = 1.0  # how often the job's state is read while it waits
CMD_TIMEOUT_S = 30.0  # a Slurm client that does not answer (slurmctld down)
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")  # fmt: skip
# reasons a pending job keeps until someone changes the cluster: waiting is no use
NEVER = {
    "PartitionNodeLimit": "it asks more nodes than the partition has (fewer would be granted)",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "BadConstraints": "no node has what it asks",
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "AccountNotAllowed": "the account may not use the partition",
    "QOSNotAllowed": "the QOS may not use the partition",
}


class SlurmError(RuntimeError):
    """Slurm refused or ended the job (its own message included)."""


def _run(args: list) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: is Slurm's client installed here?") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(args[:2])} did not answer in {CMD_TIMEOUT_S:g} s") from None


def job_fields(job: str) -> dict:
    """Slurm job ``job`` as ``scontrol -o show job`` says (JobState, Reason,
    NumNodes, ...); ``{"JobState": "GONE"}`` when Slurm no longer knows it."""
    r = _run(["scontrol", "-o", "show", "job", job])
    if r.returncode != 0:
        return {"JobState": "GONE", "Reason": r.stderr.strip()}
    return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)


def job_state(job: str) -> tuple[str, str]:
    """``(STATE, reason)`` of Slurm job ``job`` (scontrol), ("GONE", "") when Slurm
    no longer knows it."""
    fields = job_fields(job)
    return fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None")


def slurm_seconds(text: str) -> int | None:
    """Slurm's ``[D-]HH:MM:SS`` / ``MM:SS`` in seconds; None for UNLIMITED or not a time."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not (days.isdigit() or not days) or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    if len(parts) == 2 and not days:
        return seconds  # MM:SS
    return seconds + (int(days) * 86400 if days else 0)


def _gpus(gres: str) -> int:
    """GPUs in a node's Gres (``gpu:8``, ``gpu:a100:4(S:0-1),gpu:h100:2``, ``(null)``)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


# options in ``extra`` that change where the job may run: then only sbatch can tell
PLACING = ("-p", "--partition", "-C", "--constraint", "-w", "--nodelist", "-c",
           "--cpus-per-task", "--gres", "--gpus-per-node", "-M", "--clusters")  # fmt: skip


def check_fits(name, ranks_per_node, gpus, partition, extra) -> None:
    """Refuse, before anything is submitted, ``ranks_per_node`` above the CPUs (or
    ``gpus`` above the GPUs) of every node of the partition (``sinfo``), naming both
    numbers; where sinfo cannot tell, sbatch's own message says it later."""
    if any(str(x).split("=")[0] in PLACING for x in extra):
        return
    args = ["sinfo", "-h", "-N", "-o", "%N %c %G %P"]
    try:
        r = _run(args + (["-p", str(partition)] if partition is not None else []))
    except SlurmError:
        return
    rows = [line.split() for line in r.stdout.splitlines() if len(line.split()) == 4]
    if partition is None:  # the default partition: sinfo marks it with a *
        rows = [row for row in rows if row[3].endswith("*")]
    if r.returncode != 0 or not rows:
        return
    part = rows[0][3].rstrip("*")
    cpus = max((int(row[1]) for row in rows if row[1].isdigit()), default=0)
    if cpus and ranks_per_node > cpus:
        raise SlurmError(
            f"mesh {name!r}: ranks_per_node={ranks_per_node} asks {ranks_per_node} CPUs per "
            f"node (one a rank), but the nodes of partition {part!r} have at most {cpus} "
            f"CPUs (sinfo): ask ranks_per_node <= {cpus} or another partition"
        )
    most = max(_gpus(row[2]) for row in rows)
    if gpus and gpus > most:
        has = f"at most {most} GPUs" if most else "no GPUs"
        raise SlurmError(
            f"mesh {name!r}: gpus={gpus} per node, but the nodes of partition {part!r} have "
            f"{has} (sinfo): ask " + (f"gpus <= {most}" if most else "no gpus") + " or another partition"
        )


class SlurmJob:
    """The agents' job: submitted by ``sbatch``, or a step ``srun`` runs in the
    allocation this process is in; ``cancel()`` ends it."""

    def __init__(self, name: str, agent_cmd: list, opts: list, log: str):
        self.name, self.log = name, log
        self.inside = os.environ.get("SLURM_JOB_ID")  # an allocation (salloc, sbatch)
        self.step: subprocess.Popen | None = None
        if self.inside:
            args = ["srun", *opts, "--output", log, *agent_cmd]
            self.id = self.inside
            self.step = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, text=True, start_new_session=True,
            )  # fmt: skip
            self.submitted = shlex.join(args)
        else:
            args = ["sbatch", "--parsable", *opts, "--output", log, "--wrap",
                    shlex.join(["srun", *opts_for_step(opts), *agent_cmd])]  # fmt: skip
            r = _run(args)
            if r.returncode != 0:
                said = (r.stderr or r.stdout).strip()
                raise SlurmError(f"mesh {name!r}: sbatch refused the agents' job: {said}")
            self.id = r.stdout.strip().split(";")[0]
            self.submitted = shlex.join(args)
        self.started = time.monotonic()
        self.granted: int | None = None  # nodes Slurm gave the job (NumNodes), once known

    def state(self) -> tuple[str, str]:
        """``(STATE, reason)``; a step of an allocation is RUNNING until srun ends
        (then FAILED, with srun's own message)."""
        if self.step is None:
            fields = job_fields(self.id)
            state = fields.get("JobState", "UNKNOWN")
            if state != "PENDING" and fields.get("NumNodes", "").isdigit():
                self.granted = int(fields["NumNodes"])
            return state, fields.get("Reason", "None")
        if self.step.poll() is None:
            return "RUNNING", "None"
        said = self.step.stderr.read().strip() if self.step.stderr else ""
        return "FAILED", said or f"srun exited with {self.step.returncode}"

    def cancel(self) -> None:
        """End the agents: scancel the job (or end the srun step)."""
        if self.step is not None:
            if self.step.poll() is None:
                self.step.terminate()  # srun passes it on to the step's tasks
                try:
                    self.step.wait(10)
                except subprocess.TimeoutExpired:
                    self.step.kill()
                    self.step.wait(5)
            return
        r = _run(["scancel", self.id])
        if r.returncode != 0:
            logger.warning("mesh %r: scancel %s: %s", self.name, self.id, r.stderr.strip())


def opts_for_step(opts: list) -> list:
    """The options srun needs inside the batch job (the layout; not the job's)."""
    keep, i = [], 0
    while i < len(opts):
        if opts[i] in ("--nodes", "--ntasks-per-node", "--cpus-per-task", "--gpus-per-node"):
            keep += opts[i : i + 2]
        i += 2 if opts[i].startswith("--") and "=" not in opts[i] else 1
    return keep


def job_options(nodes, ranks_per_node, gpus, partition, time_limit, account, name) -> list:
    """sbatch / srun options for one agent per node of ``ranks_per_node`` CPUs."""
    for what, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"slurm_mesh: {what} must be a positive int, got {v!r}")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise ValueError(f"slurm_mesh: gpus must be a non-negative int, got {gpus!r}")
    opts = ["--job-name", f"mnb-{name}", "--nodes", str(nodes), "--ntasks-per-node", "1",
            "--cpus-per-task", str(ranks_per_node)]  # fmt: skip
    if gpus:
        opts += ["--gpus-per-node", str(gpus)]
    if time_limit is not None:
        opts += ["--time", str(time_limit)]
    if partition is not None:
        opts += ["--partition", str(partition)]
    if account is not None:
        opts += ["--account", str(account)]
    return opts


class SlurmLauncher(ExternalLauncher):
    """An ExternalLauncher that submits its host agents as a Slurm job at the first
    launch (``sbatch``, or ``srun`` in an allocation), watches the job while it
    waits, and cancels it at close."""

    shares_files = True  # a cluster's nodes share the submitting host's home and work folders

    def __init__(self, name, dims, *, nodes, ranks_per_node, gpus=None, partition=None,
                 time_limit=None, account=None, extra=(), python=None, out=print,
                 **kwargs):  # fmt: skip
        super().__init__(name, dims, out=out, **kwargs)
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.opts = job_options(nodes, ranks_per_node, gpus, partition, time_limit, account, name)
        self.opts += [str(x) for x in extra]
        check_fits(name, ranks_per_node, gpus, partition, extra)
        self.python = python or sys.executable
        self.job: SlurmJob | None = None
        self._failure: str | None = None
        self._watch: threading.Thread | None = None
        self._closing = threading.Event()

    def launch(self, address: str, key: bytes, world: int) -> dict:
        procs = super().launch(address, key, world)
        if self.job is None:
            agent = [self.python, "-m", "monarch_nb.host", "--connection-file",
                     self.connection_file, "--local-ranks", str(self.ranks_per_node)]  # fmt: skip
            log = f"{os.path.splitext(self.connection_file)[0]}-slurm-%j.out"
            self.job = SlurmJob(self.name, agent, self.opts, log)
            self.agents.lost_note = self.lost_note
            self._out(f"mesh {self.name!r}: Slurm job {self.job.id} runs the host agents "
                      f"({self.nodes} nodes x {self.ranks_per_node} ranks)")  # fmt: skip
            self._watch = threading.Thread(
                target=self._watch_job, name=f"monarch-slurm-{self.name}", daemon=True
            )
            self._watch.start()
        return procs

    def lines(self, address: str, world: int) -> str:
        return f"connection file (addresses and secret): {self.connection_file}"

    def startup_failure(self) -> str | None:
        """Why the mesh cannot start (the job ended or srun failed), else None."""
        return self._failure

    def lost_note(self) -> str | None:
        """How the job stands when an agent is lost ("Slurm job 12 is TIMEOUT
        (its time limit was reached)"), or None while it runs on."""
        if self.job is None:
            return None
        try:
            state, reason = self.job.state()
        except SlurmError:
            return None
        if state == "RUNNING" and not self._past_time_limit():
            return None
        if state in ("TIMEOUT", "RUNNING") or reason == "TimeLimit":
            return f"Slurm job {self.job.id} reached its time limit ({state})"
        return f"Slurm job {self.job.id} is {state} ({reason})"

    def _past_time_limit(self) -> bool:
        """The job has run its whole time limit (Slurm signals its tasks then, and may
        say TIMEOUT only a moment later)."""
        if self.job.step is not None:
            return False
        try:
            fields = job_fields(self.job.id)
        except SlurmError:
            return False
        limit, ran = slurm_seconds(fields.get("TimeLimit", "")), slurm_seconds(fields.get("RunTime", ""))
        return limit is not None and ran is not None and ran >= limit

    def _watch_job(self) -> None:
        """Show the job's state while it waits; record why, if it ends first."""
        job = self.job
        progress = None
        try:
            while not self._closing.wait(0 if progress is None else POLL_S):
                try:
                    state, reason = job.state()
                except SlurmError as e:
                    self._failure = str(e)
                    return
                waited = time.monotonic() - job.started
                if job.granted is not None and job.granted < self.nodes:
                    self._failure = (f"mesh {self.name!r}: Slurm job {job.id} was granted "
                                     f"{job.granted} nodes, {self.nodes} asked: the mesh needs "
                                     f"all {self.nodes} (a min-max --nodes in extra?); "
                                     f"the job is cancelled")  # fmt: skip
                    return
                if state in ENDED or state == "GONE":
                    self._failure = (f"mesh {self.name!r}: Slurm job {job.id} ended before its "
                                     f"host agents joined: {state} ({reason})")  # fmt: skip
                    return
                if state == "PENDING" and reason in NEVER:
                    self._failure = (f"mesh {self.name!r}: Slurm job {job.id} cannot start: "
                                     f"pending ({reason}): {NEVER[reason]}")  # fmt: skip
                    return
                text = f"Slurm job {job.id}: {state.lower()} ({reason}), {waited:.0f} s"
                if progress is None:
                    progress = bar(total=self.nodes, desc=text, unit="node")
                if state == "RUNNING":
                    if progress is not None:
                        progress.set_description_str(f"Slurm job {job.id}: running")
                        progress.update(self.nodes - progress.n)
                    return
                if progress is not None:
                    progress.set_description_str(text)
        finally:
            if progress is not None:
                progress.close()

    def close(self) -> None:
        """Cancel the job (scancel, or end the srun step), then end as an
        ExternalLauncher does."""
        self._closing.set()
        try:
            super().close()
        finally:
            job, self.job = self.job, None
            if job is not None:
                job.cancel()
