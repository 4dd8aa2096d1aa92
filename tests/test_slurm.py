"""``mnb.slurm_mesh`` on a real Slurm: slurmctld and four slurmd, each node a
network namespace (``slurm_helpers.slurm_cluster``), munge authenticating.

The host agents are a real sbatch job (srun inside it starts one per node), the
ranks real forked workers joined over the bridge, gloo between namespaces. One
cluster for the module; skipped (with the reason) without Slurm, munge or root."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
from dap_helpers import start as dap_start
from kernel_helpers import Kernel, errors, errors_text, plain, stream
from slurm_helpers import slurm_cluster
from wait_helpers import wait_for
from worker_probes import rank_pids

import monarch_nb as mnb
from monarch_nb.controller.errors import WorkerCrashed
from monarch_nb.launchers.slurm import SlurmError

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(nodes=4, subnet="10.213.31", cpus=2) as c:
        yield c


@pytest.fixture
def job_env(cluster, monkeypatch, tmp_path):
    """What sbatch passes on to the agents (its default --export=ALL): this
    checkout and the tests on sys.path, gloo on the namespaces' eth0."""
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in path if p))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    return {"advertise": cluster.net.controller, "connection_file": str(tmp_path / "mesh.json")}


def where():
    import os

    return int(os.environ["RANK"]), os.environ["SLURMD_NODENAME"], os.environ["SLURM_JOB_ID"]


def task():
    import os

    return mnb.current_rank(), int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"]


def test_quickstart_on_four_nodes_of_two_ranks(cluster, job_env):
    mesh = mnb.slurm_mesh(nodes=4, ranks_per_node=2, time="10:00", name="slurm4", **job_env)
    try:
        job = mesh.slurm_job
        assert cluster.queue() == [f"{job} RUNNING"]
        seen = mnb.remote(where)(mesh=mesh).fetch(timeout=60)
        assert [s[:2] for s in seen] == [(r, f"n{r // 2}") for r in range(8)]
        assert {s[2] for s in seen} == {job}
        # a collective across the four namespaces (gloo on eth0)
        ones = mnb.remote(torch.ones)(2, mesh=mesh)
        total = ones.reduce(("hosts", "ranks"), "sum").fetch(timeout=60)
        assert [t.tolist() for t in total] == [[8.0, 8.0]] * 8
        # the tensor engine
        with mesh.activate():
            a = torch.arange(6.0).reshape(2, 3)
            s = (a @ a.T).reduce("hosts", "sum")
        expect = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(mnb.inspect(s, hosts=3, ranks=1), 4 * (expect @ expect.T))
        # restart: the same job's agents fork the ranks again
        before = rank_pids(mesh)
        mesh.restart()
        after = rank_pids(mesh)
        assert set(before.values()).isdisjoint(after.values())
        assert [s[1:] for s in mnb.remote(where)(mesh=mesh).fetch(timeout=60)] == [
            (f"n{r // 2}", job) for r in range(8)
        ]
        assert cluster.queue() == [f"{job} RUNNING"]
        # a lost node fails its ranks, naming the node
        busy = mesh.exec("import time\ntime.sleep(120)")
        relay = next(
            p for p in psutil.process_iter(["cmdline", "environ"])
            if "monarch_nb.host" in " ".join(p.info["cmdline"] or [])
            and (p.info["environ"] or {}).get("SLURMD_NODENAME") == "n2"
            and (p.info["environ"] or {}).get("SLURM_JOB_ID") == job
        )  # fmt: skip
        relay.kill()
        with pytest.raises(WorkerCrashed, match="host n2"):
            busy.fetch(timeout=60)
    finally:
        mesh.shutdown()
    wait_for(lambda: cluster.queue() == [], 30, "the job gone from squeue", show=cluster.queue)


def test_a_bad_partition_shows_slurms_own_message(cluster, job_env):
    with pytest.raises(SlurmError, match="sbatch refused.*[Ii]nvalid partition"):
        mnb.slurm_mesh(nodes=1, ranks_per_node=1, partition="nosuch", **job_env)
    assert cluster.queue() == []


@pytest.mark.parametrize(
    "ask, error, said",
    [
        ({"nodes": 5, "ranks_per_node": 1}, RuntimeError,
         r"cannot start: pending \(PartitionNodeLimit\): it asks more nodes than the partition"),
        ({"nodes": 1, "ranks_per_node": 3}, SlurmError,
         r"ranks_per_node=3 asks 3 CPUs per node \(one a rank\), but the nodes of partition "
         r"'debug' have at most 2 CPUs \(sinfo\)"),
        ({"nodes": 1, "ranks_per_node": 1, "gpus": 1}, SlurmError,
         r"gpus=1 per node, but the nodes of partition 'debug' have no GPUs \(sinfo\)"),
        # where sinfo cannot tell (extra places the job), sbatch's own message
        ({"nodes": 1, "ranks_per_node": 1, "extra": ["--cpus-per-task=3"]}, SlurmError,
         "(?s)sbatch refused.*CPU count per node can not be satisfied.*Requested node configuration"),
    ],
    ids=["more-nodes-than-the-partition", "more-ranks-than-cpus", "more-gpus-than-the-nodes",
         "sbatch-says-it"],
)  # fmt: skip
def test_a_job_slurm_cannot_place_is_refused_with_its_reason(cluster, job_env, ask, error, said):
    with pytest.raises(error, match=said):
        mnb.slurm_mesh(**ask, **job_env)
    wait_for(lambda: cluster.queue() == [], 30, "the job gone from squeue", show=cluster.queue)
    # the cluster serves on: a one-node mesh starts right after
    with mnb.slurm_mesh(nodes=1, ranks_per_node=1, **job_env) as mesh:
        assert mnb.remote(where)(mesh=mesh).fetch(timeout=60)[0][0] == 0


def test_fewer_nodes_granted_than_asked_is_refused_naming_both(cluster, job_env):
    """Two of the four nodes held by another job, a mesh of 4 nodes that would
    take 2 (``--nodes=2-4`` in extra): Slurm grants 2 and the start fails naming
    both numbers; the job is cancelled, squeue empty after."""
    held = cluster.run("sbatch", "--parsable", "-N", "2", "--exclusive", "--output=/dev/null",
                       "--wrap", "sleep 300").stdout.strip()  # fmt: skip
    try:
        wait_for(lambda: cluster.queue() == [f"{held} RUNNING"], 30, "the other job running",
                 show=cluster.queue)  # fmt: skip
        with pytest.raises(RuntimeError, match=r"Slurm job \d+ was granted 2 nodes, 4 asked"):
            mnb.slurm_mesh(nodes=4, ranks_per_node=1, extra=["--nodes=2-4"], **job_env)
        wait_for(lambda: cluster.queue() == [f"{held} RUNNING"], 30, "the mesh's job cancelled",
                 show=cluster.queue)  # fmt: skip
    finally:
        cluster.run("scancel", held)
    wait_for(lambda: cluster.queue() == [], 30, "the jobs gone from squeue", show=cluster.queue)


def test_a_lost_node_fails_its_ranks_and_the_other_meshes_serve_on(cluster, job_env, tmp_path):
    """A node lost as a machine is (its slurmd, slurmstepd and tasks killed at
    once): the ranks it held fail naming it; a mesh of another job (on another
    node) serves on. The node's slurmd started again, Slurm has it idle."""
    other = mnb.slurm_mesh(nodes=1, ranks_per_node=2, name="bystander",
                           **{**job_env, "connection_file": str(tmp_path / "other.json")})  # fmt: skip
    lost = None
    try:
        mesh = mnb.slurm_mesh(nodes=2, ranks_per_node=2, name="pair", **job_env)
        try:
            nodes = [s[1] for s in mnb.remote(where)(mesh=mesh).fetch(timeout=60)]
            mine = mnb.remote(where)(mesh=other).fetch(timeout=60)[0][1]
            assert mine not in nodes and nodes[0] == nodes[1] != nodes[2] == nodes[3]
            busy = mesh.exec("import time\ntime.sleep(120)")
            lost = cluster.nodes.index(nodes[2])
            cluster.power_off(lost)
            with pytest.raises(WorkerCrashed, match=f"(?s)rank [23].*host {nodes[2]}"):
                busy.fetch(timeout=60)
            # the other job's mesh serves on
            assert [s[:2] for s in mnb.remote(where)(mesh=other).fetch(timeout=60)] == [
                (0, mine), (1, mine)
            ]
            assert mnb.remote(torch.ones)(2, mesh=other).reduce("ranks").fetch(timeout=60)[
                0
            ].tolist() == [2.0, 2.0]
        finally:
            mesh.shutdown()
    finally:
        other.shutdown()
        if lost is not None:
            cluster.power_on(lost)
    wait_for(lambda: cluster.queue() == [], 60, "the jobs gone from squeue", show=cluster.queue)
    # "planned" (a backfill cycle's mark for a job that was pending) clears on the next cycle
    wait_for(lambda: set(cluster.node_states().values()) == {"idle"}, 60,
             "every node idle", show=cluster.node_states)  # fmt: skip


def test_the_srun_line_for_plain_workers_runs_as_printed(cluster, job_env, capfd, monkeypatch):
    """``srun --ntasks 4 python -m monarch_nb.worker --connection-file F`` as
    ``connect_mesh`` prints it, run inside ``salloc -N 2 -n 4``: a worker per
    task (its rank SLURM_PROCID), two per node, gloo across the nodes."""
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    with printed_line_under_salloc(
        cluster, capfd, "srun --ntasks 4 python -m monarch_nb.worker", ["-N", "2", "-n", "4"]
    ):
        mesh = mnb.connect_mesh(world=4, name="workers", interface="0.0.0.0", timeout=120, **job_env)
        try:
            seen_ranks = mnb.remote(task)(mesh=mesh).fetch(timeout=60)
            assert seen_ranks == [(r, r, f"n{r // 2}") for r in range(4)]
            total = mnb.remote(torch.ones)(2, mesh=mesh).reduce("world").fetch(timeout=60)
            assert [x.tolist() for x in total] == [[4.0, 4.0]] * 4
        finally:
            mesh.shutdown()


def test_ctrl_c_while_pending_cancels_the_job(cluster, job_env, capfd):
    """A job that cannot start for an hour (--begin): its state shows while it
    waits, and a Ctrl-C (SIGINT) cancels it; nothing is left in squeue."""
    seen: list = []

    def interrupt():
        def shown():
            seen.append(capfd.readouterr().err)
            return "pending (BeginTime)" in "".join(seen)

        try:
            wait_for(lambda: cluster.queue(), 60, "the job in squeue")
            wait_for(shown, 60, "the pending job's state", interval=0.2)
        finally:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    t = threading.Thread(target=interrupt, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        mnb.slurm_mesh(nodes=2, ranks_per_node=1, extra=["--begin=now+1hour"], **job_env)
    t.join(60)
    assert "pending (BeginTime)" in "".join(seen)
    wait_for(lambda: cluster.queue() == [], 30, "the job gone from squeue", show=cluster.queue)


def test_the_srun_line_connect_mesh_prints_runs_as_printed(cluster, job_env, capfd, monkeypatch):
    """The host agents' srun line of ``connect_mesh`` (what ``%monarch_mesh
    --connect`` prints), run exactly as printed inside an allocation of one node:
    ``salloc -N 1 sh -c LINE``; its agent forks the 8 ranks (``--local-ranks 8``)."""
    bin_dir = os.path.dirname(sys.executable)  # monarch-nb-host: the notebook's environment
    monkeypatch.setenv("PATH", os.pathsep.join([bin_dir, os.environ["PATH"]]))
    with printed_line_under_salloc(
        cluster, capfd, "srun --ntasks-per-node 1 monarch-nb-host", ["-N", "1"]
    ):
        mesh = mnb.connect_mesh(world=8, name="printed", interface="0.0.0.0", timeout=120, **job_env)
        try:
            seen_ranks = mnb.remote(where)(mesh=mesh).fetch(timeout=60)
            assert [s[:2] for s in seen_ranks] == [(r, "n0") for r in range(8)]
        finally:
            mesh.shutdown()


@contextlib.contextmanager
def printed_line_under_salloc(cluster, capfd, prefix: str, salloc_args: list):
    """Run, as ``salloc ARGS sh -c LINE``, the line starting with ``prefix`` that
    ``connect_mesh`` prints once the block calls it; at the end, the allocation
    is gone from squeue."""
    seen: list = []
    salloc: list = []

    def run_printed_line():
        def line():
            seen.append(capfd.readouterr().out)
            for text in "".join(seen).splitlines():
                if text.strip().startswith(prefix):
                    return text.strip()

        printed = wait_for(line, 60, "the printed srun line", interval=0.1)
        salloc.append(subprocess.Popen(["salloc", *salloc_args, "sh", "-c", printed],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True, env=cluster.env()))  # fmt: skip

    t = threading.Thread(target=run_printed_line, daemon=True)
    t.start()
    try:
        yield
    finally:
        t.join(60)
        for p in salloc:
            p.wait(60)
    wait_for(lambda: cluster.queue() == [], 30, "the allocation gone from squeue",
             show=cluster.queue)  # fmt: skip


def quickstart_cells() -> list[str]:
    """The code cells of notebooks/01_quickstart.ipynb from its first %%monarch
    cell to the remote call (not the mesh's start, the plot, the shutdown)."""
    import json

    nb = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    keep = [c for c in cells if not c.startswith(("%load_ext", "%monarch_mesh"))]
    keep = [c.replace("(dp={dp})", "(hosts={hosts})") for c in keep if "matplotlib" not in c]
    assert len(keep) == 7, keep
    return keep


class Typist:
    """Answers each pdb input request with the next line; records the prompts."""

    def __init__(self, kern, answers):
        self.kern, self.answers, self.prompts = kern, list(answers), []

    def __call__(self, msg):
        self.prompts.append(msg["content"]["prompt"])
        self.kern.kc.input(self.answers.pop(0) if self.answers else "continue")


@pytest.mark.kernel
def test_the_magic_runs_the_quickstart_on_slurm_and_cancels_it_at_shutdown(
    cluster, job_env, tmp_path
):
    """``%monarch_mesh --slurm nodes=4 ranks_per_node=2`` in a real kernel: the
    quickstart notebook's cells (data-parallel training over the 8 ranks of 4
    nodes, gloo across them), a ``breakpoint()`` on rank 5 (node n2) served inline
    through stdin, ``--shutdown``: nothing left in squeue; a bad word is a
    UsageError naming it."""
    kern = Kernel(tmp_path)
    try:
        kern.ok("%load_ext monarch_nb\nimport monarch_nb as mnb")
        _, msgs = kern.run("%monarch_mesh --slurm nodes=2 ranks=1")
        assert not errors(msgs)  # a UsageError: its text on stderr
        assert stream(msgs, "stderr").startswith("UsageError: %monarch_mesh --slurm: unexpected")
        assert "'ranks=1'" in stream(msgs, "stderr")
        kern.ok(
            f"%monarch_mesh --slurm nodes=4 ranks_per_node=2 time=5:00 --name s4 "
            f"--advertise {job_env['advertise']} --connection-file {job_env['connection_file']} "
            f"--dashboard none",
            timeout=180,
        )
        assert len(cluster.queue()) == 1
        msgs = kern.ok("%%monarch\nimport os\nprint(os.environ['SLURMD_NODENAME'])", timeout=60)
        assert all(f"[ranks {2 * i}-{2 * i + 1}] n{i}" in stream(msgs) for i in range(4)), stream(msgs)
        hello, shard, setup, train, pull, remote_call, ipython_cell = quickstart_cells()
        assert "hello from rank 7 of 8 (hosts=3)" in stream(kern.ok(hello, timeout=60))
        kern.ok(shard, timeout=60)
        assert "(7, 8, 256)" in "".join(plain(kern.ok(setup, timeout=60)))
        assert "(3.0, 1.0)" in "".join(plain(kern.ok(train, timeout=180)))
        assert "in 60 steps" in stream(kern.ok(pull, timeout=60))
        assert "8000.0" in "".join(plain(kern.ok(remote_call, timeout=60)))
        shown = kern.ok(ipython_cell, timeout=60)  # %timeit and display() on every rank
        assert "per loop" in stream(shown) and "y = 3.00 x + 1.00" in str(shown)
        # a breakpoint on a rank of node n2, answered at the notebook's stdin
        typist = Typist(kern, ["p node", "p rank * 10", "continue"])
        reply, msgs = kern.run(
            "%%monarch --ranks 5\nimport os\nnode = os.environ['SLURMD_NODENAME']\n"
            "breakpoint()\nprint('after the breakpoint on', node)",
            timeout=90, allow_stdin=True, stdin_hook=typist,
        )  # fmt: skip
        assert reply["content"]["status"] == "ok", errors_text(msgs)
        assert typist.prompts[:3] == ["(Pdb r5) "] * 3
        out = stream(msgs)
        assert "'n2'" in out and "50" in out and "[rank 5] after the breakpoint on n2" in out
        # the same pause through JupyterLab's debugger protocol (DAP): rank 5 is a thread
        dap = dap_start(kern)
        dap.ok("configurationDone")
        kern.ok(
            "%%monarch --noblock --ranks 5 -o held\nimport os\n"
            "node = os.environ['SLURMD_NODENAME']\nbreakpoint()\nafter = node + '!'\nafter",
            output_hook=dap.hook,
        )
        ev = dap.wait_event(
            lambda ev: ev["event"] == "stopped" and "rank 5 " in ev["body"].get("description", ""),
            timeout=60,
        )
        tid = ev["body"]["threadId"]
        names = {t["id"]: t["name"] for t in dap.ok("threads")["threads"]}
        assert names[tid] == "rank 5 · default"
        top = dap.ok("stackTrace", threadId=tid)["stackFrames"][0]
        scopes = dap.ok("scopes", frameId=top["id"])["scopes"]
        local = dap.ok("variables", variablesReference=scopes[0]["variablesReference"])
        assert {v["name"]: v["value"] for v in local["variables"]}["node"] == "'n2'"
        assert dap.ok("evaluate", expression="node * 2", frameId=top["id"])["result"] == "'n2n2'"
        dap.ok("continue", threadId=tid)
        got = kern.value("held.result(timeout=60)[0]['data']['text/plain']", output_hook=dap.hook)
        assert got == "'n2!'"
        dap.request("disconnect", restart=False, terminateDebuggee=False)
        kern.ok("%monarch_mesh --name s4 --shutdown", timeout=60)
    finally:
        kern.shutdown()
    wait_for(lambda: cluster.queue() == [], 30, "the job gone from squeue", show=cluster.queue)


def test_the_tensor_engine_tour_runs_on_slurm_nodes(cluster, job_env):
    """notebooks/05_tensor_engine.ipynb's code, unmodified but for its mesh: a
    slurm_mesh of 2 nodes x 2 ranks named as the tour's (host=2, gpu=2), so that
    host=1 is another node: mesh tensors, inspect, reductions over a node's ranks
    and across nodes, slices, a training step op by op and compiled, borrows on a
    comms stream, remote functions with propagators; every assert of the tour holds."""
    import json

    nb = json.loads((ROOT / "notebooks" / "05_tensor_engine.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    first = 'mesh = mnb.local_mesh(host=2, gpu=2, name="tour")'
    assert first in cells[0], cells[0]
    mesh = mnb.slurm_mesh(nodes=2, ranks_per_node=2, name="tour", host=2, gpu=2, **job_env)
    try:
        nodes = mnb.remote(where)(mesh=mesh).fetch(timeout=60)
        assert [n[1] for n in nodes][::2] != [nodes[0][1]] * 2  # host=1 is another node
        ns = {"__name__": "__main__", "mesh": mesh}  # as a notebook's: its functions go by value
        exec(cells[0].replace(first, ""), ns)
        for cell in cells[1:]:
            exec(cell, ns)  # the tour's own asserts
        assert mesh.closed  # its last cell shuts the mesh down
    finally:
        if not mesh.closed:
            mesh.shutdown()
    wait_for(lambda: cluster.queue() == [], 30, "the job gone from squeue", show=cluster.queue)


def test_the_time_limit_reached_mid_cell_fails_the_ranks_naming_it(cluster, job_env):
    """A job of one minute (Slurm's least), a cell that outlasts it: Slurm ends
    the agents and the cell fails naming the job and its time limit; another
    mesh serves on."""
    mesh = mnb.slurm_mesh(nodes=1, ranks_per_node=1, time="1", name="short", **job_env)
    try:
        busy = mesh.exec("import time\ntime.sleep(600)")
        with pytest.raises(WorkerCrashed, match=f"Slurm job {mesh.slurm_job} reached its time"):
            busy.fetch(timeout=240)  # Slurm checks time limits every 30 s or so
    finally:
        mesh.shutdown()
    with mnb.slurm_mesh(nodes=1, ranks_per_node=1, **job_env) as other:
        assert mnb.remote(where)(mesh=other).fetch(timeout=60)[0][0] == 0
    wait_for(lambda: cluster.queue() == [], 30, "the jobs gone from squeue", show=cluster.queue)
