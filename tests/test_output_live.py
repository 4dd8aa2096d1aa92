"""Unit tier: carriage returns, lines in progress and the per-cell cap, as a cell's
sink publishes them to a kernel (a publisher that records what a kernel would send:
stream text, displays and their updates by display id)."""

from __future__ import annotations

import time

import pytest

from monarch_nb.notebook import sink as sink_mod
from monarch_nb.notebook.live import LIVE_AFTER, TAIL_LINES, compact, finished, overwrite
from monarch_nb.notebook.sink import CELL_CAP, HOLD, CellSink

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser


class KernelPublisher:
    """Records what would go to IOPub, and what a front end would then show."""

    in_kernel = True

    def __init__(self):
        self.sent = []  # (kind, name or display id, text)
        self.shown: dict[str, str] = {}  # display id -> its text now

    def stream(self, parent, name, text):
        self.sent.append(("stream", name, text))

    def display(self, parent, data, metadata=None, display_id=None):
        self.sent.append(("display", display_id, data["text/plain"]))
        self.shown[display_id] = data["text/plain"]

    def update_display(self, parent, data, display_id):
        assert display_id in self.shown, "an update of a display never shown"
        self.sent.append(("update", display_id, data["text/plain"]))
        self.shown[display_id] = data["text/plain"]

    def stream_lines(self):
        return "".join(t for k, _, t in self.sent if k == "stream").splitlines()

    def kinds(self):
        return [k for k, _, _ in self.sent]


def make(ranks=(0, 1)):
    pub = KernelPublisher()
    return CellSink(pub, "cell", ranks), pub


def later(seconds: float) -> float:
    return time.monotonic() + seconds


def test_overwrite_is_terminal_semantics():
    assert overwrite("abcdef\rXY") == "XYcdef"
    assert overwrite(" 10%|#  |\r 20%|## |") == " 20%|## |"
    assert overwrite("done\r") == "done\r"  # the next text overwrites it
    assert finished("done\r") == "done" and finished("abc\r") == "abc"
    assert overwrite("no return") == "no return"
    assert overwrite("\r\r\rlast") == "last"


def test_a_line_cut_between_two_writes_continues_where_it_was():
    first = compact("#" * 99 + "\r" + "-" * 40)  # cut in the middle of an update
    assert finished(compact(first + "-" * 59 + "\r" + "=" * 10)) == "=" * 10 + "-" * 89
    assert len(compact("\r".join(["x" * 80] * 10_000))) <= 161


def test_a_progress_bar_is_one_updating_row_per_rank_and_ends_as_its_last_line():
    s, pub = make()
    for i in range(0, 101, 10):
        for r in (0, 1):
            s.add(r, "stderr", f"\r{i:3d}%|{'#' * (i // 10):10s}| {i}/100")
        s.tick(later(LIVE_AFTER + 0.01), 1 << 20)
    shown = [t for k, _, t in pub.sent if k in ("display", "update")]
    assert shown, pub.sent
    assert shown[-1] == "[ranks 0-1] 100%|##########| 100/100"
    assert len({i for k, i, _ in pub.sent if k != "stream"}) == 1  # one display
    assert pub.stream_lines() == []  # nothing printed line by line
    for r in (0, 1):
        s.add(r, "stderr", "\n")
    s.finish()
    # nothing was printed below the bar: its last state takes the display's place
    (display_id,) = pub.shown
    assert pub.shown[display_id] == "[ranks 0-1] 100%|##########| 100/100\n"


def test_ranks_out_of_step_have_a_row_each():
    s, pub = make()
    s.add(0, "stderr", "\r 30%|###")
    s.add(1, "stderr", "\r 70%|#######")
    s.tick(later(LIVE_AFTER + 0.01), 1 << 20)
    (text,) = pub.shown.values()
    assert text == "[rank 0]  30%|###\n[rank 1]  70%|#######"


def test_progress_dots_stay_one_line():
    s, pub = make((0,))
    for i in range(16):
        s.add(0, "stdout", ".")
        s.tick(later(LIVE_AFTER + 0.01 + i * HOLD), 1 << 20)
    assert pub.stream_lines() == []  # not one line per tick
    assert list(pub.shown.values()) == ["[rank 0] " + "." * 16]
    s.add(0, "stdout", " done\n")
    s.finish()
    assert list(pub.shown.values()) == ["[rank 0] ................ done\n"]


def test_lines_printed_below_a_bar_keep_their_place():
    s, pub = make((0,))
    s.add(0, "stderr", "\r 50%|#####")
    s.tick(later(LIVE_AFTER + 0.01), 1 << 20)
    s.add(0, "stdout", "a message\n")
    s.tick(later(LIVE_AFTER + 0.02), 1 << 20)
    s.add(0, "stderr", "\r100%|##########\n")
    s.finish()
    # the bar, then the message below it, then the bar's last line below that
    assert pub.stream_lines() == ["[rank 0] a message", "[rank 0] 100%|##########"]
    assert list(pub.shown.values()) == [""]  # the display empties once its row ended
    assert pub.kinds()[0] == "display"


def test_a_new_bar_after_printed_lines_gets_a_new_display_below_them():
    s, pub = make((0,))
    for epoch in range(3):
        s.add(0, "stderr", f"\repoch {epoch}: 50%")
        s.tick(later(epoch + LIVE_AFTER + 0.01), 1 << 20)
        s.add(0, "stderr", f"\repoch {epoch}: 100%\n")
        s.add(0, "stdout", f"loss {epoch}\n")
        s.tick(later(epoch + LIVE_AFTER + 0.02), 1 << 20)
    s.finish()
    assert list(pub.shown.values()) == [f"[rank 0] epoch {e}: 100%\n" for e in range(3)]
    assert pub.stream_lines() == [f"[rank 0] loss {e}" for e in range(3)]


def test_ten_megabytes_of_carriage_returns_cost_nothing_against_the_cap():
    s, pub = make()
    update = "\r" + "x" * 1023
    for _ in range(10):
        for r in (0, 1):
            s.add(r, "stderr", update * 1024)  # 1 MB of \r updates, per call and rank
        s.tick(later(LIVE_AFTER + 0.01), 1 << 20)
    for r in (0, 1):
        s.add(r, "stdout", f"final metrics of rank {r}\n")
    s.finish()
    assert s.published < 4096
    assert "[rank 0] final metrics of rank 0" in pub.stream_lines()
    assert all(len(t) < 5000 for _, _, t in pub.sent)


def test_past_the_cap_the_latest_lines_of_every_rank_show_to_the_end():
    s, pub = make()
    step = 0
    while s.published < CELL_CAP + (256 << 10):  # well past the cap
        for r in (0, 1):
            s.add(
                r,
                "stdout",
                "".join(f"step {step + i} rank {r} " + "y" * 80 + "\n" for i in range(50)),
            )
        step += 50
        s.tick(later(1 + step), sink_mod.PENDING_CAP)
        if step > 40_000:
            break
    for r in (0, 1):
        s.add(r, "stdout", f"final metrics rank {r}\n")
    s.finish()
    assert sum(len(t) for k, _, t in pub.sent if k == "stream") <= CELL_CAP + 4096
    assert any("passed 512 KB" in line for line in pub.stream_lines())
    (text,) = pub.shown.values()
    rows = text.splitlines()
    assert "lines" in rows[0] and "elided" in rows[0]
    for r in (0, 1):
        mine = [row for row in rows if row.startswith(f"[rank {r}] ")]
        assert len(mine) == TAIL_LINES
        assert mine[-1] == f"[rank {r}] final metrics rank {r}"
        assert mine[-2].startswith(f"[rank {r}] step {step - 1} ")


def test_outside_a_kernel_lines_in_progress_come_out_at_the_end():
    class Plain:
        def __init__(self):
            self.sent = []

        def stream(self, parent, name, text):
            self.sent.append(text)

    pub = Plain()
    s = CellSink(pub, None, (0,))
    s.add(0, "stderr", "\r 10%\r 20%\r 30%")
    s.tick(later(LIVE_AFTER + 0.01), 1 << 20)
    assert pub.sent == []
    s.finish()
    assert pub.sent == ["[rank 0]  30%\n"]
