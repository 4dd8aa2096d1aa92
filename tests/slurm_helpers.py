"""A real Slurm cluster for the tests: munged, slurmctld, and one slurmd per node,
each node a network namespace of its own (``netns_helpers.bridged``).

``slurm_cluster(nodes, subnet)`` writes a slurm.conf and a munge key in a temp
dir, starts a private munged (its own socket and key), slurmctld on the
bridge's address and ``slurmd -N nN`` inside namespace N, waits until every
node is idle, exports SLURM_CONF for the clients (sbatch, squeue, scancel), and
on the way out cancels every job, stops the daemons and checks that none is
left. Where Slurm, munge or namespaces cannot be had, the test skips, saying why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field

import pytest
from netns_helpers import Net, bridged
from wait_helpers import pids_gone, wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "srun")


@dataclass
class Cluster:
    net: Net
    conf: str  # the slurm.conf path (SLURM_CONF)
    dir: str
    nodes: list  # node names, node i in namespace i
    cpus: int  # CPUs per node
    procs: list = field(default_factory=list)  # the daemons (stopped on the way out)
    slurmd: dict = field(default_factory=dict)  # node index -> its slurmd's Popen

    def env(self) -> dict:
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command (squeue, scontrol, ...) against this cluster."""
        return subprocess.run(
            list(args), capture_output=True, text=True, check=check, timeout=60, env=self.env()
        )

    def queue(self) -> list[str]:
        """The jobs in squeue: ``ID STATE`` lines."""
        out = self.run("squeue", "-h", "-o", "%i %T").stdout
        return [line for line in out.splitlines() if line.strip()]

    def node_states(self) -> dict:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def start_slurmd(self, i: int) -> None:
        """slurmd of node ``i`` in namespace ``i``. nsenter, not ``ip netns exec``:
        that remounts /sys, and slurmd wants the host's /sys/fs/cgroup even with its
        cgroup plugins off."""
        n = self.nodes[i]
        os.makedirs(f"{self.dir}/spool-{n}", exist_ok=True)
        cmd = ["nsenter", f"--net=/run/netns/{self.net.spaces[i]}",
               "slurmd", "-D", "-N", n, "-f", self.conf]  # fmt: skip
        p = subprocess.Popen(cmd, env=self.env(), stdout=subprocess.DEVNULL,
                             stderr=open(f"{self.dir}/slurmd-{n}.err.log", "a"))  # fmt: skip
        self.procs.append(p)
        self.slurmd[i] = p

    def power_off(self, i: int) -> list:
        """Node ``i`` lost as a machine is lost: every process of its namespace
        (slurmd, slurmstepd, the job's tasks) killed at once. Returns their pids."""
        out = subprocess.run(["ip", "netns", "pids", self.net.spaces[i]], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        pids = [int(x) for x in out.split()]
        self.slurmd[i].kill()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.slurmd[i].wait(10)
        assert pids_gone(pids, timeout=10) == [], f"node {i}'s processes outlived SIGKILL"
        return pids

    def power_on(self, i: int, timeout: float = 60) -> None:
        """Start node ``i``'s slurmd again and wait until Slurm has it idle."""
        self.start_slurmd(i)
        wait_for(lambda: self.node_states().get(self.nodes[i]) == "idle", timeout,
                 f"node {self.nodes[i]} idle again", interval=0.5, show=self.logs)  # fmt: skip

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".log"):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text.append(f"== {name}\n{f.read()[-3000:]}")
        return "\n".join(text)


def _conf(d: str, host: str, ctl: str, port: int, net: Net, names: list, cpus: int) -> str:
    nodes = "\n".join(
        f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={cpus} State=UNKNOWN"
        for n, a in zip(names, net.hosts, strict=True)
    )
    return f"""ClusterName=mnbtest
SlurmctldHost={host}({ctl})
SlurmctldPort={port}
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=2
SchedulerType=sched/backfill
{nodes}
PartitionName=debug Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
"""


def _need_slurm() -> None:
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if not shutil.which(b)]
    if missing:
        pytest.skip(
            f"no Slurm here: {', '.join(missing)} not found (apt-get install slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of network namespaces needs root")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def slurm_cluster(nodes: int = 4, subnet: str = "10.213.31", cpus: int = 2):
    """Yield a running :class:`Cluster` of ``nodes`` nodes of ``cpus`` CPUs each."""
    _need_slurm()
    with bridged(nodes, subnet) as net:
        d = tempfile.mkdtemp(prefix="mnb-slurm-")
        os.chmod(d, 0o755)
        os.makedirs(f"{d}/state")
        names = [f"n{i}" for i in range(nodes)]
        conf = f"{d}/slurm.conf"
        with open(conf, "w") as f:
            f.write(_conf(d, socket.gethostname(), net.controller, _free_port(), net, names, cpus))
        key = f"{d}/munge.key"
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        cluster = Cluster(net, conf, d, names, cpus)
        env = cluster.env()
        procs = cluster.procs
        try:
            munge = [
                "munged", "--foreground", "--force", f"--socket={d}/munge.socket",
                f"--key-file={key}", f"--pid-file={d}/munged.pid",
                f"--log-file={d}/munged.log", f"--seed-file={d}/munge.seed",
            ]  # fmt: skip
            procs.append(subprocess.Popen(munge, env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(f"{d}/munged.err.log", "w")))  # fmt: skip
            wait_for(lambda: os.path.exists(f"{d}/munge.socket"), 30, "munged's socket",
                     show=cluster.logs)  # fmt: skip
            procs.append(subprocess.Popen(["slurmctld", "-D", "-f", conf], env=env,
                                          stdout=subprocess.DEVNULL,
                                          stderr=open(f"{d}/slurmctld.err.log", "w")))  # fmt: skip
            for i in range(nodes):
                cluster.start_slurmd(i)

            def all_idle():
                if any(p.poll() is not None for p in procs):
                    raise AssertionError(f"a Slurm daemon ended:\n{cluster.logs()}")
                r = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
                states = dict(x.split() for x in r.stdout.splitlines() if x.strip())
                return len(states) == nodes and all(s == "idle" for s in states.values())

            wait_for(all_idle, 90, "every slurmd idle", interval=0.5, show=cluster.logs)
            old = os.environ.get("SLURM_CONF")
            os.environ["SLURM_CONF"] = conf
            try:
                yield cluster
            finally:
                if old is None:
                    os.environ.pop("SLURM_CONF", None)
                else:
                    os.environ["SLURM_CONF"] = old
                cluster.run("scancel", "--user", "root", check=False)
        finally:
            for p in reversed(procs):
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            left = pids_gone([p.pid for p in procs], timeout=20)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            shutil.rmtree(d, ignore_errors=True)
