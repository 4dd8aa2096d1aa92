"""Progress bars (tqdm.auto: a widget in notebooks, text elsewhere) for mesh
start-up and for fetches and pushes over 64 MB.

ZeroMQ delivers a message whole, so a transfer's bar shows its size, fills
when the transfer completes and reports the rate; splitting values into
chunks for finer steps would cost a copy of every byte.
"""

from __future__ import annotations

import logging
import threading

from .. import config
from ..protocol.constants import PROGRESS_BYTES

logger = logging.getLogger("monarch_nb.progress")


def bar(**kwargs):
    """A tqdm.auto bar, or None when tqdm is not installed or cannot draw here.

    In a notebook the finished bar (a widget) goes away; on a terminal or in a log
    it stays as one finished line, so what is printed next starts on a line of its
    own. A bar never drawn (done within the setting ``progress_delay``) prints nothing."""
    try:
        from tqdm.auto import tqdm

        # every update redraws (ours are few: a worker joined, a transfer ended), so a
        # closed bar shows its last state: a notebook widget keeps its last redraw's text
        return tqdm(delay=config.setting("progress_delay"), leave=not _widget(tqdm), mininterval=0, miniters=1, **kwargs)
    except Exception:
        logger.debug("no progress bar", exc_info=True)
        return None


def _widget(cls) -> bool:
    """Whether tqdm.auto chose its notebook (ipywidgets) flavour."""
    return any(c.__name__ == "tqdm_notebook" for c in cls.__mro__)


class Transfers:
    """Bars of the large transfers in flight, keyed by (ident, rank)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bars: dict = {}

    def begin(self, ident: int, rank: int, nbytes: int, what: str) -> None:
        b = bar(
            total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"{what} (rank {rank})"
        )
        if b is not None:
            with self._lock:
                self._bars[(ident, rank)] = b

    def end(self, ident: int, rank: int) -> None:
        with self._lock:
            b = self._bars.pop((ident, rank), None)
        if b is not None:
            b.update(b.total - b.n)
            b.close()


def wait_sent(done, nbytes: int, what: str) -> None:
    """Block until ZeroMQ has sent a big zero-copy message (``done``: the Future of
    its tracker), with a bar when it is over PROGRESS_BYTES."""
    progress = None
    if nbytes > PROGRESS_BYTES:
        progress = bar(
            total=nbytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"sending {what}"
        )
    tracker = done.result()
    if tracker is not None:
        tracker.wait()
    if progress is not None:
        progress.update(nbytes)
        progress.close()
