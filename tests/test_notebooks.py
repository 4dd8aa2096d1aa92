"""Notebook tier: every notebook in notebooks/ executed in a real kernel: by nbclient,
or, for 03_remote_pdb (whose cells wait at the debugger prompt), cell by cell through
jupyter_client, answering each input request with the line scripted in the cell's
metadata ``{"monarch_nb": {"answers": [...]}}``, as a person would type it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from kernel_helpers import (
    ANSI,
    Kernel,
    errors_text,
    kernel_env,
    notebook_client,
    plain,
    stream,
    text,
    wait_gone,
)

pytestmark = pytest.mark.notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def outputs_text(cell) -> str:
    parts = []
    last = None
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            # a print's pieces may arrive in two messages (the kernel flushed between
            # them): one text, as a front end shows them
            if last is not None and last.output_type == "stream" and last.name == out.name:
                parts[-1] += out.text
            else:
                parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(str(out.data.get("text/plain", "")))
        elif out.output_type == "error":
            parts.append(ANSI.sub("", "\n".join(out.traceback)))
        last = out
    return "\n".join(parts)


def mesh_pids(nb) -> list[int]:
    for cell in nb.cells:
        m = re.search(r"\(pids ([\d, ]+)\)", outputs_text(cell))
        if m:
            return [int(p) for p in m.group(1).split(",")]
    raise AssertionError("no mesh status in the notebook")


def transcript_lines(path) -> list[str]:
    """What the quickstart transcript shows, in order, for the notebook at ``path``: the
    headings and the start of the text above each code cell, the cell's first line."""
    want = []
    n = 0
    for cell in nbformat.read(path, as_version=4).cells:
        lines = [ln.strip() for ln in cell.source.splitlines() if ln.strip()]
        if cell.cell_type == "markdown":
            want += [ln for ln in lines if ln.startswith("#")]
            prose = [ln for ln in lines if not ln.startswith("#")]
            if prose:
                want.append("\n" + prose[0][:30])  # the lead starts a line
        elif lines:
            n += 1
            want.append(f"\nIn [{n}]: {lines[0]}")
    return want


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [
        "01_quickstart.ipynb",
        "02_errors_and_interrupts.ipynb",
        "03_remote_pdb.ipynb",
        "04_recordings_pipes_groups.ipynb",
        "05_tensor_engine.ipynb",
        "06_training.ipynb",
    ]


def test_quickstart_runs_headless_from_the_command_line(tmp_path):
    """``python -m monarch_nb quickstart`` (the README's main command) executes
    notebooks/01_quickstart.ipynb and prints the losses it computed."""
    executed = tmp_path / "quickstart.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_nb", "quickstart", "--output", str(executed)],
        capture_output=True,
        text=True,
        timeout=300,
        env=kernel_env(tmp_path),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "without encryption" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr
    out = proc.stdout
    # each code cell under the headings of its section and the lead of the text above
    # it, then its first lines, then its output: the transcript reads on its own
    at = 0
    for want in transcript_lines(NOTEBOOKS / "01_quickstart.ipynb"):
        found = out.find(want, at)
        assert found >= 0, f"{want!r} missing after offset {at}:\n{out}"
        at = found + len(want)
    head = out[: out.index("\n    [ranks 0-1] step  0  mean loss")]
    cell = head[head.rindex("\nIn [") :]  # the losses come right under the training cell
    assert "%%monarch" in cell and "losses = []" in cell, cell
    # a start-up bar drawn (start-up over 0.5 s) shows as it ended
    bars = re.findall(r"\n    starting mesh 'default':.*", out)
    assert all(re.match(r"\n    starting mesh 'default': 100%\|#+\| 2/2 ", b) for b in bars), bars
    losses = [float(x) for x in re.findall(r"\[ranks 0-1\] step +\d+ +mean loss ([0-9.]+)", out)]
    assert len(losses) == 7, out
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] / 100
    assert "[ranks 0-1] (3.0, 1.0)" in out  # the model learned y = 3x + 1, the same on both ranks
    assert "[rank 0] hello from rank 0 of 2 (dp=0)" in out
    assert "[ranks 0-1] the same line on every rank" in out
    assert "[1000.0, 2000.0]" in out

    nb = nbformat.read(executed, as_version=4)
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}
    figure = [o for o in cells["cell-15"].outputs if "image/png" in o.get("data", {})]
    assert len(figure) == 1  # drawn on rank 0, shown in the notebook
    assert "application/vnd.jupyter.widget-view+json" in cells["cell-03"].outputs[0].data
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", outputs_text(cell)
            if o.output_type == "stream":
                assert o.name == "stdout", o.text
    assert wait_gone(mesh_pids(nb)) == []


def test_errors_and_interrupts_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "02_errors_and_interrupts.ipynb", as_version=4)
    client = notebook_client(nb, tmp_path, timeout=120)
    client.execute(env=kernel_env(tmp_path))
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}

    def text(cid: str) -> str:
        return outputs_text(cells[cid])

    def failed(cid: str) -> bool:
        return any(o.output_type == "error" for o in cells[cid].outputs)

    # one rank fails: its traceback with the cell's lines; the other rank's value
    t = text("cell-04")
    assert failed("cell-04") and "[rank 0] 'c'" in t
    assert (
        "[rank 1] IndexError: list index out of range" in t and "rank 0]" not in t.split("'c'")[1]
    )
    assert "line 7, in <module>" in t and "load_batch(rank + 2)" in t
    assert "line 4, in load_batch" in t and "return batches[i]" in t
    # the same failure on both ranks: shown once
    t = text("cell-06")
    assert t.count("[ranks 0-1] RuntimeError") == 1 and t.count("Traceback") == 1
    assert not failed("cell-08") and "'rank 1 still here'" in text("cell-08")
    assert "failed on ranks [1]" in text("cell-10") and "over the limit" in text("cell-10")
    assert "an mnb.RemoteError too: True" in text("cell-10")  # caught by except ValueError
    # interrupts: every rank stopped where it was, the mesh serves on
    t = text("cell-13")
    assert failed("cell-13") and "[ranks 0-1] KeyboardInterrupt" in t and "while True:" in t
    t = text("cell-16")
    assert failed("cell-16") and "[ranks 0-1] KeyboardInterrupt" in t
    assert "time.sleep(1000)" in t
    assert not failed("cell-18") and "'rank 0 ready'" in text("cell-18")
    assert "mesh 'default' shut down" in text("cell-22")
    expected_failures = {"cell-04", "cell-06", "cell-13", "cell-16"}
    assert {c.id for c in nb.cells if c.cell_type == "code" and failed(c.id)} == expected_failures
    assert wait_gone(mesh_pids(nb)) == []


# ------------------------------------------------------------ 03: the remote debugger


class Typist:
    """Answers each input request with the next scripted line and records the prompts.
    Past the script it answers ``continue`` (so nothing hangs); the test then fails
    on the number of prompts."""

    def __init__(self, k: Kernel, answers):
        self.k = k
        self.answers = list(answers)
        self.prompts: list[str] = []

    def __call__(self, msg):
        self.prompts.append(msg["content"]["prompt"])
        self.k.kc.input(self.answers.pop(0) if self.answers else "continue")


def scripted_answers(cell) -> list[str] | None:
    """The lines to type at the cell's prompts (``metadata.monarch_nb.answers``)."""
    return cell.metadata.get("monarch_nb", {}).get("answers")


def test_remote_pdb_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "03_remote_pdb.ipynb", as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    scripted = {c.id: scripted_answers(c) for c in code if scripted_answers(c) is not None}
    assert sorted(scripted) == ["cell-04", "cell-08", "cell-13"]
    k = Kernel(tmp_path)
    ran: dict = {}
    try:
        for cell in code:
            answers = scripted.get(cell.id)
            typist = Typist(k, answers or [])
            reply, msgs = k.run(
                cell.source, timeout=120, allow_stdin=answers is not None, stdin_hook=typist
            )
            expected = "error" if "raises-exception" in cell.metadata.get("tags", []) else "ok"
            status = reply["content"]["status"]
            assert status == expected, f"{cell.id}: {status}\n{text(msgs)}\n{errors_text(msgs)}"
            if answers is None:
                assert typist.prompts == [], cell.id
            else:
                assert len(typist.prompts) == len(answers), (cell.id, typist.prompts)
            ran[cell.id] = (typist.prompts, msgs)
    finally:
        k.shutdown()

    # both ranks paused: (monarch-dbg); list, cast * p x, attach 1 -> (Pdb r1); back; continue
    prompts, msgs = ran["cell-04"]
    assert prompts == ["(monarch-dbg) "] * 3 + ["(Pdb r1) "] * 3 + ["(monarch-dbg) "]
    out = stream(msgs)
    assert re.search(r"rank 0 +default +<monarch In\[\d+\]>:4", out)  # list
    assert re.search(r"rank 1 +default +<monarch In\[\d+\]>:4", out)
    assert "[rank 0] 5\n" in out and "[rank 1] 15\n" in out  # cast * p x, per rank
    assert "[15, 15, 15]" in out  # p y on rank 1
    assert "[rank 1] rank 1 goes on with x = 100" in out  # !x = 100 took effect on rank 1 only
    assert "[rank 0] rank 0 goes on with x = 5" in out

    # a breakpoint in a remote function on rank 1 only, served by %monarch_debug
    paused = ast.literal_eval(plain(ran["cell-06"][1])[0])
    assert [(p["rank"], p["function"]) for p in paused] == [(1, "normalize")]
    prompts, msgs = ran["cell-08"]
    assert prompts == ["(Pdb r1) "] * 4
    out = stream(msgs)
    assert "normalize" in out and "-> return t - mean" in out
    assert "tensor([0., 2., 4., 6.])" in out and "tensor(3.)" in out
    assert "tensor([-3., -1.,  1.,  3.])" in out
    fetched = plain(ran["cell-09"][1])[0]
    assert "tensor([-1.5000, -0.5000,  0.5000,  1.5000])" in fetched
    assert "tensor([-3., -1.,  1.,  3.])" in fetched

    # post-mortem on the rank that raised
    msgs = ran["cell-11"][1]
    assert "[rank 0] 2.0" in plain(msgs)
    assert "[rank 1] ZeroDivisionError" in errors_text(msgs)
    prompts, msgs = ran["cell-13"]
    assert prompts == ["(Pdb r1) "] * 5
    out = stream(msgs)
    assert "-> return total / count" in out and "def mean_of(values, count):" in out  # ll
    assert "(6.0, 0)" in out  # p total, count
    assert "-> mean_of([1.0, 2.0, 3.0], count=3 - 3 * rank)" in out  # u
    assert "\n1\n" in out  # p rank

    assert "mesh 'default' shut down" in stream(ran["cell-14"][1])
    pids = re.search(r"\(pids ([\d, ]+)\)", "\n".join(plain(ran["cell-02"][1])))
    assert pids, plain(ran["cell-02"][1])
    assert wait_gone([int(p) for p in pids.group(1).split(",")]) == []


# ------------------------------------------------------------ 04: recordings, pipes, groups


def widget_states(nb) -> dict:
    return nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]


def test_recordings_pipes_groups_notebook(tmp_path):
    nb = nbformat.read(NOTEBOOKS / "04_recordings_pipes_groups.ipynb", as_version=4)
    assert nb.metadata.kernelspec.name == "python3"
    client = notebook_client(nb, tmp_path, timeout=120)
    client.execute(env=kernel_env(tmp_path))
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}

    def text(cid: str) -> str:
        return outputs_text(cells[cid])

    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", outputs_text(cell)
            if o.output_type == "stream":
                assert o.name == "stdout", o.text

    # @mnb.compile: recorded, replayed, the same values as op by op (speed printed only)
    assert "tensor([0.7500, 0.7500, 0.7500, 0.7500])" in text("cell-04")
    assert "tensor([0.5000, 0.5000, 0.5000, 0.5000])" in text("cell-04")
    t = text("cell-06")
    assert re.search(r"op by op: [\d.]+ ms/step; compiled: [\d.]+ ms/step", t), t
    assert re.search(r"speedup: [\d.]+x", t) and "same result: True" in t
    # a pipe: one batch per rank; a process group: all_reduce over dp
    assert "[(32, 1), (32, 1)]" in text("cell-08")
    assert "[tensor([3., 3., 3.]), tensor([3., 3., 3.])]" in text("cell-10")
    # the loader feeds a data-parallel loop whose gradients are averaged over the dp group
    t = text("cell-12")
    losses = [ast.literal_eval(x) for x in re.findall(r"step +\d+  loss per rank (\[.*?\])", t)]
    assert len(losses) == 4, t
    assert max(losses[-1]) < min(losses[0]) / 100
    assert "[(3.0, 1.0), (3.0, 1.0)]" in t  # the same model on both ranks: y = 3x + 1
    # restart: fresh processes, old Refs refuse clearly, the mesh works
    t = text("cell-14")
    assert "before: ['set before the restart', 'set before the restart']" in t
    assert "fresh worker processes: True" in t
    assert re.search(
        r"RefUseError: Ref \d+ belongs to generation 0 of mesh 'default', which was restarted", t
    )
    assert "[ranks 0-1] False" in text("cell-16")
    # an 80 MiB fetch drew a progress bar that filled
    t = text("cell-18")
    assert "torch.Size([20971520]) torch.float32 80 MiB" in t and "80.0M" in t
    states = widget_states(nb)
    views = [
        o.data["application/vnd.jupyter.widget-view+json"]["model_id"]
        for o in cells["cell-18"].outputs
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert len(views) == 1
    children = [c.removeprefix("IPY_MODEL_") for c in states[views[0]]["state"]["children"]]
    parts = [(states[c]["model_name"], states[c]["state"]) for c in children]
    bars = [st for name, st in parts if name == "FloatProgressModel"]
    assert len(bars) == 1 and bars[0]["value"] == bars[0]["max"] == 80 * 2**20
    labels = " ".join(st["value"] for name, st in parts if name == "HTMLModel")
    assert re.search(r"fetch\W+of\W+Ref", labels), labels

    assert "mesh 'default' shut down" in text("cell-19")
    gens = re.search(r"worker pids \[([\d, ]+)\] -> \[([\d, ]+)\]", text("cell-14"))
    pids = [int(p) for g in gens.groups() for p in g.split(",")]
    assert wait_gone(pids) == []


def test_tensor_engine_notebook(tmp_path):
    """The tour of the tensor engine on a {host: 2, gpu: 2} CPU mesh: its cells
    assert what they show (layouts, per-rank matmuls, a failure on rank 1 and the
    mesh going on, reductions, sub-meshes, data-parallel training with and
    without a comms stream and compiled, remote functions returning mesh tensors)."""
    nb = nbformat.read(NOTEBOOKS / "05_tensor_engine.ipynb", as_version=4)
    client = notebook_client(nb, tmp_path, timeout=120)
    client.execute(env=kernel_env(tmp_path))
    nbformat.validate(nb)
    cells = {c.id: c for c in nb.cells}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", outputs_text(cell)
    assert "mnb.Tensor(shape=(2,), dtype=torch.float32, mesh='tour'" in outputs_text(
        cells["cell-03"]
    )
    assert "tensor([ 9., 27.])" in outputs_text(cells["cell-03"])
    assert "aten.index.Tensor failed on rank 1" in outputs_text(cells["cell-07"])
    assert "{'dp': 4} {'host': 2, 'tp': 2} {'gpu': 2} [2, 3] [0, 2]" in outputs_text(
        cells["cell-11"]
    )
    losses = re.search(r"loss: ([\d.]+) -> ([\d.]+)", outputs_text(cells["cell-13"]))
    assert losses and float(losses[2]) < float(losses[1]) / 2, outputs_text(cells["cell-13"])
    assert "loss after 10 more steps" in outputs_text(cells["cell-15"])
    assert "mnb.Tensor(shape=(4,), dtype=torch.float32" in outputs_text(cells["cell-17"])


def test_training_notebook(tmp_path):
    """A transformer LM (AdamW, clip_grad_norm_, a schedule, accumulation, dropout)
    trained locally, then unchanged on dp=2 op by op and compiled, and a CNN with
    BatchNorm: its cells assert bit-equality with local torch; the compiled step is
    one command on a rank; torch.compile with mnb.mesh_backend gives the same
    losses; a DataLoader's batches split over dp train data parallel."""
    nb = nbformat.read(NOTEBOOKS / "06_training.ipynb", as_version=4)
    client = notebook_client(nb, tmp_path, timeout=300)
    client.execute(env=kernel_env(tmp_path))
    cells = {c.id: c for c in nb.cells}
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            assert o.output_type != "error", outputs_text(cell)
    assert "every loss and every weight equals the local run" in outputs_text(cells["cell-07"])
    assert "commands on rank 0: 1" in outputs_text(cells["cell-09"])
    assert "torch.compile: the local run's losses" in outputs_text(cells["cell-09c"])
    assert "eval logits equal" in outputs_text(cells["cell-11"])
    assert "cnn losses equal" in outputs_text(cells["cell-13"])
    assert "data parallel follows the whole batch" in outputs_text(cells["cell-13c"])
