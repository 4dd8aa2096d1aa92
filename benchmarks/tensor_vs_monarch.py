"""monarch_nb's tensor engine against Monarch's own (torchmonarch 0.7), on dp=2 CPU, in one run.

Monarch runs in its side venv (``scripts/peer_monarch_venv.sh``; ``$MNB_PEER_VENV``,
default ``~/.cache/monarch_nb/peer-monarch``) as ``benchmarks/peer_monarch.py --serve``, a
subprocess that measures on command; each measurement alternates with ours (``interleaved``),
both meshes up at once. The same work on both sides, on a 16-float tensor:

* ``tensor_vs_monarch``       ``y = x + 1`` then an inspect of ``y`` (ms, median)
* ``tensor_vs_monarch_rate``  N x ``x = x + 1`` then one inspect (ops/s)
* ``tensor_vs_monarch_step``  N training steps of ``tensor._mlp`` then an inspect of the loss
  (steps/s)

Without the side venv the three rows are skipped (not a miss); a peer that fails or stops
answering (bounded waits) makes the benchmark fail with the tail of its stderr.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from ._peer import ServePeer
from ._report import Entry, Skipped, interleaved
from .tensor import _mlp, _train_steps

PEER_SCRIPT = Path(__file__).with_name("peer_monarch.py")
START_TIMEOUT = 180.0  # the peer's mesh start; seconds
COMMAND_TIMEOUT = 120.0  # one measurement of the peer
ROWS = ("tensor_vs_monarch", "tensor_vs_monarch_rate", "tensor_vs_monarch_step")
NOT_INSTALLED = "peer not installed: run scripts/peer_monarch_venv.sh"


def peer_python() -> Path:
    """The side venv's python (it may not exist)."""
    venv = os.environ.get("MNB_PEER_VENV") or "~/.cache/monarch_nb/peer-monarch"
    return Path(venv).expanduser() / "bin" / "python"


class MonarchPeer(ServePeer):
    """``peer_monarch.py --serve`` in the side venv: one JSON line per command, bounded waits."""

    def __init__(self, python: Path) -> None:
        cmd = [python, PEER_SCRIPT, "--serve"]
        super().__init__("Monarch peer", cmd, START_TIMEOUT, COMMAND_TIMEOUT)

    def measure(self, kind: str, n: int) -> float:
        return float(self.ask(f"{kind} {n}")[kind])


class Ours:
    """The same three measurements on ``local_mesh(dp=2)`` under ``mesh.activate()``."""

    def __init__(self) -> None:
        import torch

        import monarch_nb as mnb

        self.mnb = mnb
        self.mesh = mnb.local_mesh(dp=2, name="bench-vs-monarch")
        self.active = self.mesh.activate()
        self.active.__enter__()
        self.x = torch.ones(16)
        mnb.inspect(self.x + 1)
        torch.manual_seed(0)
        self.model = _mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = (torch.randn(64, 16), torch.randn(64, 1))
        mnb.inspect(_train_steps(self.model, self.opt, *self.data, 1))

    def op(self, k: int) -> float:
        samples = []
        for _ in range(k):
            t0 = time.perf_counter()
            self.mnb.inspect(self.x + 1)
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    def rate(self, n: int) -> float:
        x = self.x
        t0 = time.perf_counter()
        for _ in range(n):
            x = x + 1
        self.mnb.inspect(x)
        return n / (time.perf_counter() - t0)

    def step(self, n: int) -> float:
        t0 = time.perf_counter()
        self.mnb.inspect(_train_steps(self.model, self.opt, *self.data, n))
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.active.__exit__(None, None, None)
        self.mesh.shutdown()


def bench_tensor_vs_monarch(quick: bool) -> list:
    python = peer_python()
    if not python.exists():
        return [Skipped(name, f"{NOT_INSTALLED} (no {python})") for name in ROWS]
    sizes = {"op": 20, "rate": 500, "step": 10} if quick else {"op": 50, "rate": 2000, "step": 30}
    reps = 3 if quick else 7
    t0 = time.monotonic()
    peer = MonarchPeer(python)
    peer_start_s = time.monotonic() - t0
    ours = None
    try:
        ours = Ours()
        got = {}
        for kind, n in sizes.items():
            got[kind] = interleaved(
                lambda kind=kind, n=n: getattr(ours, kind)(n),
                lambda kind=kind, n=n: peer.measure(kind, n),
                reps,
            )
    finally:
        if ours is not None:
            ours.close()
        peer.close()
    info = peer.info
    where = (
        f"torchmonarch {info.get('torchmonarch')} with torch {info.get('torch')} in the side venv, "
        f"this_host().spawn_procs(per_host={{'gpus': 2}}) on CPU, its tensor engine active"
    )
    common = (
        f"median over {reps} rounds, each alternating ours and Monarch's (both meshes up); "
        f"Monarch's mesh took {peer_start_s:.1f} s to start"
    )
    extra = {"peer_setup_s": round(peer_start_s, 1)}
    op, rate, step = got["op"], got["rate"], got["step"]
    return [
        Entry(
            "tensor_vs_monarch",
            op[0],
            op[1],
            "ms",
            "<= 1",
            f"the same op and inspect in Monarch's tensor engine: {where}",
            note=(
                f"'y = x + 1' on a 16-float mesh tensor then mnb.inspect(y) under "
                f"mesh.activate() on local_mesh(dp=2), median of {sizes['op']}; {common}; "
                f"issue 16 measured Monarch here at 6.5 ms"
            ),
            extra={
                **extra,
                "ours_ops_per_s": round(rate[0]),
                "monarch_ops_per_s": round(rate[1]),
                "ours_steps_per_s": round(step[0], 1),
                "monarch_steps_per_s": round(step[1], 1),
            },
        ),
        Entry(
            "tensor_vs_monarch_rate",
            rate[0],
            rate[1],
            "ops/s",
            ">= 1",
            f"{sizes['rate']} x 'x = x + 1' then one inspect in Monarch's tensor engine: {where}",
            note=(
                f"{sizes['rate']} x 'x = x + 1' then one mnb.inspect under mesh.activate() on "
                f"local_mesh(dp=2); {common}; issue 16 measured Monarch here at 734 ops/s"
            ),
            extra=extra,
        ),
        Entry(
            "tensor_vs_monarch_step",
            step[0],
            step[1],
            "steps/s",
            ">= 1",
            f"the same {sizes['step']} MLP steps then an inspect of the loss in Monarch's "
            f"tensor engine: {where}",
            note=(
                f"{sizes['step']} training steps (Linear 16->32, ReLU, Linear 32->1, MSE, "
                f"backward, SGD) of an nn.Module built under mesh.activate() on "
                f"local_mesh(dp=2), then mnb.inspect(loss); {common}; issue 16 measured "
                f"Monarch here at 10 steps/s"
            ),
            extra=extra,
        ),
    ]


BENCHMARKS = [("tensor_vs_monarch", bench_tensor_vs_monarch)]
