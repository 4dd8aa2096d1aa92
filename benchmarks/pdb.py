"""``pdb``: one debugger command round trip as the user sees it, through a real kernel.

Ours: a ``%%monarch`` cell ``x = 5; breakpoint()`` on ``local_mesh(dp=1)``; the cell
becomes the ``(Pdb r0)`` prompt (an input_request on the kernel's stdin channel).
Baseline: local pdb in a plain cell of the same kernel, ``import pdb;
pdb.set_trace()`` (in ipykernel ``breakpoint()`` is a no-op, debugpy owns
``sys.breakpointhook``; ``pdb.set_trace()`` prompts over stdin as ``ipdb>``).

Both sides are driven the same way through jupyter_client: each input_request is
answered with ``p x`` (N times), then ``c``. One round trip is the interval from
an input_request to the next one: we answer, the kernel (for ours: the
controller, the worker's pdb and back) evaluates ``p x``, sends its output and the
next prompt. The two cells alternate (after a warm-up); the numbers are medians
over the repetitions of the median interval of each cell.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time

from ._report import Entry, interleaved

OURS_CELL = "%%monarch\nx = 5\nbreakpoint()\npass"
BASELINE_CELL = "import pdb\nx = 5\npdb.set_trace()\npass"
CELL_TIMEOUT = 60.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Kernel:
    """An ipykernel started by jupyter_client in a temporary directory."""

    def __init__(self):
        from monarch_nb.headless import start_kernel

        self._tmp = tempfile.TemporaryDirectory(prefix="monarch-bench-pdb-")
        env = dict(os.environ)
        env.update(
            IPYTHONDIR=os.path.join(self._tmp.name, "ipython"),
            JUPYTER_PLATFORM_DIRS="1",
            PYDEVD_DISABLE_FILE_VALIDATION="1",
        )
        self.km, self.kc = start_kernel("python3", timeout=60, env=env, cwd=self._tmp.name)

    def run(self, code: str, timeout: float = 120, stdin_hook=None) -> list:
        """Execute ``code``; its IOPub messages. Raises unless the cell succeeded."""
        msgs: list = []
        reply = self.kc.execute_interactive(
            code,
            timeout=timeout,
            output_hook=msgs.append,
            allow_stdin=stdin_hook is not None,
            stdin_hook=stdin_hook,
        )
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"{code!r} failed in the kernel: {reply['content']}")
        return msgs

    def close(self) -> None:
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        finally:
            self._tmp.cleanup()


class _Typist:
    """The stdin hook: answers ``p x`` ``n`` times, then ``c``; stamps each prompt."""

    def __init__(self, kc, n: int):
        self.kc = kc
        self.n = n
        self.stamps: list[float] = []
        self.prompts: list[str] = []

    def __call__(self, msg) -> None:
        self.stamps.append(time.perf_counter())
        self.prompts.append(msg["content"]["prompt"])
        self.kc.input("p x" if len(self.stamps) <= self.n else "c")


def _stdout(msgs) -> str:
    return _ANSI.sub(
        "",
        "".join(
            m["content"]["text"]
            for m in msgs
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        ),
    )


def _round_trip(k: _Kernel, code: str, n: int, prompt: str) -> float:
    """Run ``code`` answering its prompts; the median seconds from one prompt to the next."""
    typist = _Typist(k.kc, n)
    msgs = k.run(code, timeout=CELL_TIMEOUT, stdin_hook=typist)
    # what was measured really was n answers of `p x` at the expected prompt
    if typist.prompts != [prompt] * (n + 1):
        raise RuntimeError(f"{code!r}: expected {n + 1} prompts {prompt!r}, got {typist.prompts}")
    answers = [ln for ln in _stdout(msgs).splitlines() if ln.strip() == "5"]
    if len(answers) != n:
        raise RuntimeError(f"{code!r}: expected {n} answers '5', got:\n{_stdout(msgs)}")
    intervals = [b - a for a, b in zip(typist.stamps, typist.stamps[1:])]
    return statistics.median(intervals)


def bench_pdb(quick: bool) -> list[Entry]:
    n, reps = (5, 5) if quick else (20, 11)
    k = _Kernel()
    try:
        k.run("%load_ext monarch_nb")
        k.run("%monarch_mesh dp=1")
        try:
            ours, base, _, _ = interleaved(
                lambda: _round_trip(k, OURS_CELL, n, "(Pdb r0) "),
                lambda: _round_trip(k, BASELINE_CELL, n, "ipdb> "),
                reps,
            )
        finally:
            k.run("%monarch_mesh --shutdown")
    finally:
        k.close()
    return [
        Entry(
            "pdb",
            ours * 1e3,
            base * 1e3,
            "ms",
            "<= 3",
            "local pdb in the same kernel: `import pdb; pdb.set_trace()` in a plain cell "
            "(prompt ipdb>), `p x` answered over the kernel's stdin channel",
            note=(
                f"`%%monarch` cell `x = 5; breakpoint()` on local_mesh(dp=1), prompt (Pdb r0): "
                f"input_request -> answer `p x` -> next input_request (controller -> worker pdb "
                f"-> controller -> output + prompt); {n} commands per cell, median interval "
                f"per cell, median over {reps} alternating reps"
            ),
        )
    ]


BENCHMARKS = [("pdb", bench_pdb)]
