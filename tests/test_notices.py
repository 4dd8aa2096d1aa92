"""Kernel tier: what a cell says about pauses and interrupts is true.

A pause notice shows once, under the cell that was current when the pause began
(or the ``--noblock`` cell that paused), only while the pause is still on: never
under a later cell, never for a pause an inline prompt serves or a post-mortem
someone asked for. An interrupt that does not stop a cell names only the ranks
that did not stop.
"""

from __future__ import annotations

import threading

import pytest
from kernel_helpers import errors, errors_text, idle, mesh_kernel, text

pytestmark = pytest.mark.kernel

NOTICE = "paused in the debugger"
HUB = "get_ipython().find_cell_magic('monarch').__self__.hub"
# wait (bounded) until the ticker has run once more and no sink holds output
DRAINED = (
    "import threading, time\n"
    f"_hub = {HUB}\n"
    "_ev = threading.Event()\n"
    "_hub.ticker.call_soon(_ev.set)\n"
    "assert _ev.wait(20), 'the ticker did not tick'\n"
    "_t = time.monotonic() + 20\n"
    "while any(s.has_pending for s in list(_hub.live)) and time.monotonic() < _t:\n"
    "    _hub.ticker.call_soon(lambda: None)  # a tick now\n"
    "    time.sleep(0.05)\n"
    "assert not any(s.has_pending for s in list(_hub.live)), 'output still pending'\n"
)
PAUSER = (
    "from monarch_nb.api.mesh import get_mesh\n"
    "M = get_mesh()\n"
    "def pauser(a):\n"
    "    b = a + 1\n"
    "    breakpoint()\n"
    "    return b\n"
)


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("notices")) as kern:
        kern.ok(PAUSER)
        yield kern


@pytest.fixture()
def slow_ticker(k):
    """The notebook's publishing runs late (a busy kernel): ticks 5 s apart unless woken."""
    k.ok(f"{HUB}.ticker.period = 5.0")
    yield
    k.ok(f"from monarch_nb.notebook.publish import TICK\n{HUB}.ticker.period = TICK")


def back_to_back(k, cells, answers=(), timeout=60) -> list[str]:
    """Execute ``cells`` as a notebook's run-all does (each sent before the previous
    one ends); stdin requests get ``answers`` (then "c"). The text of every cell,
    from every IOPub message whose parent is that cell's request."""
    ids = [k.kc.execute(c, allow_stdin=True) for c in cells]
    answers = list(answers)
    stop = threading.Event()

    def typist():
        while not stop.is_set():
            try:
                k.kc.get_stdin_msg(timeout=0.2)
            except Exception:
                continue
            k.kc.input(answers.pop(0) if answers else "c")

    t = threading.Thread(target=typist, daemon=True)
    t.start()
    try:
        groups = k.collect(lambda g: all(idle(g.get(i, [])) for i in ids), timeout)
    finally:
        stop.set()
        t.join()
    replies = [k.kc.get_shell_msg(timeout=10) for _ in ids]
    for r in replies:
        got = text(groups.get(r["parent_header"]["msg_id"], []))
        assert r["content"]["status"] == "ok", (r["content"], got)
    return [text(groups.get(i, [])) for i in ids]


def test_pause_over_within_its_cell_is_never_announced_later(k, slow_ticker):
    # a remote function pauses and is continued through the API, all in one cell
    cell = (
        "f = mnb.remote(pauser)(1, mesh=M.slice(dp=1))\n"
        "assert M.debugger.wait_any(30)\n"
        "M.debugger.run(1, 'c')\n"
        "print('fetched', f.fetch(rank=1, timeout=30))"
    )
    first, later = back_to_back(k, [cell, DRAINED])
    assert "fetched 2" in first
    assert NOTICE not in later, later
    assert first.count(NOTICE) <= 1, first


def test_pause_still_on_is_announced_under_the_cell_where_it_began(k, slow_ticker):
    cell = "f = mnb.remote(pauser)(1, mesh=M.slice(dp=1))\nassert M.debugger.wait_any(30)"
    first, later = back_to_back(k, [cell, DRAINED])
    try:
        assert first.count(NOTICE) == 1, first
        assert "[rank 1] paused in the debugger (default)" in first and "in pauser" in first
        assert NOTICE not in later, later
    finally:
        k.ok("M.debugger.continue_all()\nprint(f.fetch(rank=1, timeout=30))")


def test_post_mortem_asked_for_is_not_announced(k, slow_ticker):
    reply, msgs = k.run("%%monarch --ranks 1\nw = 3\nraise ValueError(w)")
    assert reply["content"]["status"] == "error"
    served, later = back_to_back(k, ["%monarch_debug --post-mortem 1", DRAINED], ["p w", "c"])
    assert "raise ValueError(w)" in served and "3" in served
    assert NOTICE not in served and NOTICE not in later, (served, later)


def test_noblock_pause_is_announced_under_its_own_cell(k, slow_ticker):
    cells = [
        "%%monarch --noblock --ranks 0\nv = 5\nbreakpoint()\nprint('went on', v)",
        "assert M.debugger.wait_any(30)\n" + DRAINED,
        "print(M.debugger.run(0, 'c'))\nM.wait(timeout=30)\n" + DRAINED,
    ]
    noblock, paused, after = back_to_back(k, cells)
    assert noblock.count(NOTICE) == 1 and "[rank 0] went on 5" in noblock, noblock
    assert NOTICE not in paused and NOTICE not in after, (paused, after)


def test_pause_before_the_wait_begins_is_served_inline_not_announced(k, slow_ticker):
    # a loaded kernel: the cell is sent, its rank pauses and a tick passes before the
    # cell's wait begins; the inline prompt serves that pause, so nothing announces it
    cell = (
        "from monarch_nb.notebook import waiting\n"
        "_run, _ = get_ipython().find_cell_magic('monarch').__self__._start_cell(\n"
        "    '--ranks 1', 'r = 7\\nbreakpoint()\\nprint(\"served\", r)')\n"
        "assert M.debugger.wait_any(30)\n" + DRAINED + "await waiting.wait(_run)\n"
    )
    served, later = back_to_back(k, [cell, DRAINED], ["p r", "c"])
    assert "[rank 1] served 7" in served, served
    assert NOTICE not in served and NOTICE not in later, (served, later)


def test_blocking_cell_without_stdin_says_it_once(k, slow_ticker):
    reply, msgs = k.run("%%monarch --ranks 0\nq = 9\nbreakpoint()\nprint('after', q)")
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    reply2, msgs2 = k.run(DRAINED)
    assert reply2["content"]["status"] == "ok", errors_text(msgs2)
    k.ok("M.debugger.continue_all()\nM.wait(timeout=30)")
    assert text(msgs).count(NOTICE) == 1, text(msgs)
    assert NOTICE not in text(msgs2), text(msgs2)


# ------------------------------------------------------------------ stuck interrupt

# on a side stream (a thread of its own) the interrupt is an asynchronous exception:
# a native call holds it until it returns: 8 s, past the wait of 2 s (the setting
# interrupt_wait, set on the running mesh) with room for a loaded machine
WAIT = 2
STUCK_CELL = (
    "%%monarch --stream side\n"
    "import ctypes, time\n"
    "print('started', flush=True)\n"
    "if rank == 1:\n"
    "    ctypes.CDLL(None).sleep(8)  # native: the interrupt lands only after it\n"
    "else:\n"
    "    time.sleep(1000)\n"
)


@pytest.mark.parametrize("awaited", [True, False], ids=["awaited", "blocking"])
def test_stuck_interrupt_names_only_the_ranks_that_did_not_stop(k, awaited):
    fired = []

    def hook(msg):
        if not fired and msg["msg_type"] == "stream" and "started" in msg["content"]["text"]:
            fired.append(True)
            k.km.interrupt_kernel()

    if not awaited:
        k.ok("%autoawait off")
    k.ok(f"%config MonarchNB.interrupt_wait = {WAIT}")
    try:
        reply, msgs = k.run(STUCK_CELL, timeout=60, output_hook=hook)
    finally:
        k.ok("%config MonarchNB.interrupt_wait = 5")
        if not awaited:
            k.ok("%autoawait on")
    assert fired, "the cell never started"
    assert reply["content"]["status"] == "error"
    (err,) = errors(msgs)
    assert err["ename"] == "KeyboardInterrupt", err
    assert err["evalue"].startswith(f"rank 1 did not stop within {WAIT} s"), err["evalue"]
    assert "rank 0" not in err["evalue"] and "ranks" not in err["evalue"], err["evalue"]
    # rank 1 comes back when its native call returns: the mesh works on
    k.ok("%%monarch --stream side\nprint('alive', rank)", timeout=60)
