"""Kernel tier: what a ``%%monarch`` cell shows is what the workers wrote. Output of
forked children (DataLoader workers), of user threads and of worker-side logging
lands under the cell that started them, tagged with the rank, even after the cell
ended; progress bars update in place; past the cell's cap the latest lines of
every rank stay visible. One kernel and one dp=2 mesh for the module."""

from __future__ import annotations

import re

import pytest
from kernel_helpers import idle, live, mesh_kernel, stream, text

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("fidelity")) as kern:
        yield kern


def monarch(k, body: str, args: str = "", timeout: float = 120):
    reply, msgs = k.run(f"%%monarch {args}\n{body}".replace("%%monarch \n", "%%monarch\n"), timeout)
    assert reply["content"]["status"] == "ok", text(msgs)
    return msgs


def ranks_saying(out: str, line: str) -> set:
    """The ranks whose output has ``line`` (labelled ``[rank r]`` or folded ``[ranks 0-1]``)."""
    found: set = set()
    for label in re.findall(r"^\[(ranks? [\d,-]+)\] " + re.escape(line) + "$", out, re.M):
        for part in label.split(" ", 1)[1].split(","):
            lo, _, hi = part.partition("-")
            found.update(range(int(lo), int(hi or lo) + 1))
    return found


def serves(k) -> None:
    msgs = monarch(k, "rank * 10")
    assert "[rank 1] 10" in str([m["content"].get("data") for m in msgs])


def test_dataloader_workers_print_warn_and_write_under_the_cell(k):
    msgs = monarch(
        k,
        """
import sys, warnings
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        print(f"item {i} loaded in a child", flush=True)
        warnings.warn(f"careful with item {i}")
        sys.stdout.write(("z" * 99 + "\\n") * 256)  # 25 KB a item, 100 KB a rank
        return i

total = sum(int(b.sum()) for b in DataLoader(Items(), num_workers=2, batch_size=2))
print("total", total)
""",
    )
    out, err = stream(msgs, "stdout"), stream(msgs, "stderr")
    for i in range(4):
        assert ranks_saying(out, f"item {i} loaded in a child") == {0, 1}, out[-2000:]
    assert ranks_saying(out, "total 6") == {0, 1}
    assert "UserWarning: careful with item 3" in err
    zs = sum(line.count("z") for line in out.splitlines() if line.endswith("z" * 99))
    assert zs >= 2 * 4 * 256 * 99 // 2  # every rank's 100 KB (folded lines count once)
    serves(k)


def test_worker_logging_reaches_the_cell(k):
    msgs = monarch(k, "import logging\nlogging.getLogger('trainer').warning('lr is %s', 0.1)")
    assert ranks_saying(stream(msgs, "stderr"), "lr is 0.1") == {0, 1}


def test_a_user_thread_prints_under_its_cell_during_and_after_it(k):
    reply, msgs = k.run(
        """%%monarch
import threading
go = threading.Event()
def chatter():
    print(f"thread says hi from {rank}", flush=True)
    go.wait(60)
    print(f"thread says bye from {rank}", flush=True)
t = threading.Thread(target=chatter)
t.start()
""",
    )
    assert reply["content"]["status"] == "ok"
    first = reply["parent_header"]["msg_id"]
    second = k.kc.execute("%%monarch\ngo.set(); t.join(30)")
    # the late line comes under the first cell, which started the thread
    groups = k.collect(
        lambda g: "bye" in stream(g.get(first, [])) and idle(g.get(second, [])), timeout=30
    )
    late = stream(groups[first])
    assert re.search(r"\[ranks? [0-1-]+\] thread says bye from", late), late
    assert "thread says hi from" in stream(msgs) + late
    serves(k)


def test_a_forked_child_that_outlives_its_cell_still_prints_under_it(k):
    reply, _ = k.run(
        """%%monarch
import multiprocessing as mp, os, time
ready = mp.get_context("fork").Event()
def late_child():
    ready.wait(60)
    print(f"child {os.getpid()} of rank {rank} done", flush=True)
child = mp.get_context("fork").Process(target=late_child)
child.start()
""",
    )
    assert reply["content"]["status"] == "ok"
    first = reply["parent_header"]["msg_id"]
    second = k.kc.execute("%%monarch\nready.set(); child.join(30); child.exitcode")
    groups = k.collect(
        lambda g: stream(g.get(first, [])).count("done") >= 2 and idle(g.get(second, [])),
        timeout=30,
    )
    assert re.findall(r"\[rank ([01])\] child \d+ of rank \1 done", stream(groups[first]))
    serves(k)


def test_forking_while_another_thread_prints_never_deadlocks(k):
    msgs = monarch(
        k,
        """
import multiprocessing as mp, threading, time
stop = threading.Event()
def spam():
    while not stop.is_set():
        print("spam", end="", flush=True)
        time.sleep(0.001)
s = threading.Thread(target=spam)
s.start()
def kid(i):
    print(f"kid {i} ok")
ctx = mp.get_context("fork")
kids = [ctx.Process(target=kid, args=(i,)) for i in range(20)]
for p in kids:
    p.start()
for p in kids:
    p.join(30)
stop.set(); s.join()
print("\\nexit codes", sorted({p.exitcode for p in kids}))
""",
    )
    # what the cell shows: a rank's lines that end a line in progress (the spam) with
    # nothing printed below take the live display's place (a rank 0.2 s behind: load)
    out = stream(msgs) + "\n" + "\n".join(live(msgs).values())
    assert ranks_saying(out, "exit codes [0]") == {0, 1}, out[-3000:]
    for i in range(20):
        assert out.count(f"kid {i} ok") >= 1


def test_a_tqdm_bar_updates_in_place_one_row_per_rank(k):
    msgs = monarch(
        k,
        """
import time
from tqdm import tqdm
for i in tqdm(range(40), mininterval=0, ncols=60):
    time.sleep(0.02)
print("after the bar")
""",
    )
    err = stream(msgs, "stderr")
    assert err.count("it/s]") + err.count("s/it]") <= 2, err  # only the bar's last state
    assert "40/40" in err or any("40/40" in t for t in live(msgs).values())
    updates = [m for m in msgs if m["msg_type"] == "update_display_data"]
    assert len(updates) >= 2, [m["msg_type"] for m in msgs]
    rows = [t for m in updates for t in m["content"]["data"]["text/plain"].splitlines()]
    assert all(re.match(r"\[(rank [01]|ranks 0-1)\] ", r) for r in rows if r), rows
    assert ranks_saying(stream(msgs), "after the bar") == {0, 1}


def test_print_dots_make_one_line(k):
    msgs = monarch(
        k,
        "import time\nfor i in range(12):\n    print('.', end='', flush=True); time.sleep(0.05)\nprint(' done')",
    )
    shown = "".join(live(msgs).values()) + stream(msgs)
    assert ranks_saying(shown, "............ done") == {0, 1}, shown
    dotted = [line for line in stream(msgs).splitlines() if "." in line]
    assert all(line.endswith("............ done") for line in dotted), dotted  # no line a tick


def test_a_long_log_past_the_cap_ends_with_its_last_lines(k):
    msgs = monarch(
        k,
        """
for step in range(60_000):
    print(f"step {step} loss {1 / (step + 1):.6f}")
print("final metrics: accuracy 0.99")
""",
        timeout=240,
    )
    published = sum(len(m["content"]["text"]) for m in msgs if m["msg_type"] == "stream")
    from monarch_nb.notebook.output import CELL_CAP

    assert published <= CELL_CAP + 4096
    (final,) = live(msgs).values()
    rows = final.splitlines()
    assert re.search(r"\d+ lines \([\d.]+ [KM]B\) elided", rows[0]), rows[0]
    assert rows[-1] == "[ranks 0-1] final metrics: accuracy 0.99", rows[-3:]
    assert rows[-2] == "[ranks 0-1] step 59999 loss 0.000017"
    assert idle(msgs)


def test_ten_megabytes_of_carriage_returns_then_the_final_line(k):
    msgs = monarch(
        k,
        """
import sys
update = "\\r" + "#" * 99
for i in range(50):
    sys.stderr.write(update * 1000)  # 100 KB a write, 10 MB a rank in all
sys.stderr.write("\\rbar finished\\n")
print("metrics after the bar")
""",
        timeout=240,
    )
    err, out = stream(msgs, "stderr"), stream(msgs, "stdout")
    published = sum(len(m["content"]["text"]) for m in msgs if m["msg_type"] == "stream")
    assert published < 8192, published  # superseded updates are never published
    shown = err + "".join(live(msgs).values())
    assert ranks_saying(shown, "bar finished" + "#" * 87) == {0, 1}, shown[-500:]
    assert ranks_saying(out, "metrics after the bar") == {0, 1}
    serves(k)


def test_a_silent_worker_is_announced_once_and_its_return_too(k):
    import os
    import signal

    k.ok("lv = mnb.local_mesh(dp=2, name='lv', heartbeat_timeout=1.5)", timeout=120)
    try:
        monarch(k, "rank", "--mesh lv")
        pid = k.value("lv.status()['ranks'][1]['pid']")
        everything = lambda g: "".join(stream(v, "stderr") for v in g.values())  # noqa: E731
        os.kill(pid, signal.SIGSTOP)
        try:
            got = k.collect(lambda g: "has not been heard of" in everything(g), timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        more = k.collect(lambda g: "answers again" in everything(g), timeout=30)
        said = everything(got) + everything(more)
        assert said.count("has not been heard of") == 1, said
        assert re.search(
            rf"\[rank 1\] monarch_nb: worker rank 1 of mesh 'lv' \(pid {pid} on [^)]+\) "
            r"has not been heard of for \d+ s: unresponsive",
            said,
        ), said
        assert "[rank 1] monarch_nb: worker rank 1 of mesh 'lv'" in said.split("unresponsive")[-1]
        assert k.value("lv.status()['ranks'][1]['unresponsive']") is False
    finally:
        k.ok("lv.shutdown()")
