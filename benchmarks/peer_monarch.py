"""Monarch's own tensor engine (torchmonarch 0.7) doing the work of the ``tensor_vs_monarch``
rows; run INSIDE the side venv of ``scripts/peer_monarch_venv.sh``, never with monarch_nb.

``python benchmarks/peer_monarch.py [--quick]`` prints one JSON object: ``op_inspect_ms``
(``y = x + 1`` then ``monarch.inspect(y)``, median), ``ops_per_s`` (N x ``x = x + 1`` then one
inspect), ``steps_per_s`` (N steps of the MLP of ``benchmarks/tensor.py``, then an inspect of
the loss), or ``{"error": "..."}`` (exit 0 either way; a bad argument exits 2).

``--serve``: for ``benchmarks/tensor_vs_monarch.py``, which interleaves these with its own
measurements. One JSON line once the mesh is up (``{"ready": true, ...}``), then one JSON line
per command read from stdin: ``op K``, ``rate N``, ``step N`` (``quit`` or EOF ends it).

The mesh is ``this_host().spawn_procs(per_host={"gpus": 2})`` on CPU: Monarch 0.7's worker
derives its local rank from a ``gpus``/``gpu`` dimension (any other name divides by the CUDA
device count, 0 here), and with no CUDA its tensors live on the CPU.

Only the standard library, torch and monarch are imported: the JSON goes to a private copy of
stdout, and fd 1 is pointed at stderr so that nothing Monarch (or its workers) print can mix
into it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

SIZES = {"quick": {"op": 20, "rate": 500, "step": 10}, "full": {"op": 50, "rate": 2000, "step": 30}}


def _mlp():
    import torch

    # the model of benchmarks/tensor.py (_mlp): the same work on both sides
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train_steps(model, opt, x, y, n: int):
    import torch

    for _ in range(n):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return loss


class Peer:
    """A Monarch proc mesh of 2 with its tensor engine active, and the three measurements."""

    def __init__(self) -> None:
        import monarch
        import torch
        from monarch.actor import this_host

        self.monarch, self.torch = monarch, torch
        t0 = time.perf_counter()
        self.procs = this_host().spawn_procs(per_host={"gpus": 2})
        self.active = self.procs.activate()
        self.active.__enter__()
        self.x = torch.ones(16)
        monarch.inspect(self.x + 1)  # the tensor engine starts on first use
        torch.manual_seed(0)
        self.model = _mlp()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = (torch.randn(64, 16), torch.randn(64, 1))
        monarch.inspect(_train_steps(self.model, self.opt, *self.data, 1))
        self.setup_s = time.perf_counter() - t0

    def op(self, k: int) -> float:
        """Median ms of one op and an inspect of its result, over ``k``."""
        samples = []
        for _ in range(k):
            t0 = time.perf_counter()
            self.monarch.inspect(self.x + 1)
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    def rate(self, n: int) -> float:
        """ops/s of ``n`` pipelined ``x = x + 1`` and one inspect."""
        x = self.x
        t0 = time.perf_counter()
        for _ in range(n):
            x = x + 1
        self.monarch.inspect(x)
        return n / (time.perf_counter() - t0)

    def step(self, n: int) -> float:
        """steps/s of ``n`` training steps and an inspect of the last loss."""
        t0 = time.perf_counter()
        self.monarch.inspect(_train_steps(self.model, self.opt, *self.data, n))
        return n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.active.__exit__(None, None, None)
        self.procs.stop().get()


def _unshadow() -> None:
    """Drop this script's folder from the path: benchmarks/pdb.py would shadow the standard
    library's pdb, which Monarch imports."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def _versions() -> dict:
    from importlib import metadata

    return {"torch": metadata.version("torch"), "torchmonarch": metadata.version("torchmonarch")}


def _start(out) -> Peer | None:
    """The peer, or None after writing the error JSON (a missing module named as such)."""
    try:
        import monarch  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        _emit(
            out,
            {
                "error": f"torchmonarch is not importable here: {e} (python "
                f"{sys.executable}; run scripts/peer_monarch_venv.sh)"
            },
        )
        return None
    try:
        return Peer()
    except Exception as e:
        traceback.print_exc()
        _emit(out, {"error": f"Monarch's mesh did not start: {type(e).__name__}: {e}"})
        return None


def _emit(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _serve(peer: Peer, out) -> None:
    methods = {"op": peer.op, "rate": peer.rate, "step": peer.step}
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            return
        try:
            if words[0] not in methods or len(words) != 2:
                raise ValueError(f"unknown command {line.strip()!r}: op K | rate N | step N | quit")
            _emit(out, {words[0]: methods[words[0]](int(words[1]))})
        except Exception as e:
            traceback.print_exc()
            _emit(out, {"error": f"{words[0]}: {type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer ops and steps")
    mode.add_argument("--serve", action="store_true", help="measure on commands from stdin")
    args = p.parse_args(argv)
    _unshadow()

    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    peer = _start(out)
    if peer is None:
        return 0
    try:
        info = {"setup_s": round(peer.setup_s, 2), "mesh": "gpus=2 (CPU)", **_versions()}
        if args.serve:
            _emit(out, {"ready": True, **info})
            _serve(peer, out)
            return 0
        n = SIZES["quick" if args.quick else "full"]
        t0 = time.perf_counter()
        result = {
            "op_inspect_ms": round(peer.op(n["op"]), 3),
            "ops_per_s": round(peer.rate(n["rate"]), 1),
            "steps_per_s": round(peer.step(n["step"]), 2),
        }
        result.update(info, sizes=n, measure_s=round(time.perf_counter() - t0, 2))
        _emit(out, result)
    except Exception as e:
        traceback.print_exc()
        _emit(out, {"error": f"{type(e).__name__}: {e}"})
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
