"""``python -m monarch_nb demo``: a headless tour of a local mesh.
``python -m monarch_nb quickstart``: notebooks/01_quickstart.ipynb executed in a real
kernel, each cell printed under the heading of its section, with its output."""

from __future__ import annotations

import argparse
import sys
import time


def demo(ranks: int = 2) -> None:
    import torch

    import monarch_nb as mnb

    t0 = time.monotonic()
    with mnb.local_mesh(dp=ranks, name="demo") as mesh:
        print(
            f"mesh {mesh.name}: dims={mesh.dims} backend={mesh.backend} "
            f"started in {time.monotonic() - t0:.1f} s"
        )
        x = mnb.remote(torch.ones)(2, 2, mesh=mesh)
        y = mnb.remote(lambda t: t * (mnb.current_rank() + 1))(x, mesh=mesh)
        print("per-rank values:", [t.tolist() for t in y.fetch()])

        # a tiny data-parallel regression: each rank fits y = 3x + 1 on its own shard,
        # the controller averages the gradients (the collectives issue replaces this
        # with an all-reduce on the workers)
        mesh.exec(
            "import torch\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Linear(1, 1)  # the same initial weights on every rank\n"
            "torch.manual_seed(rank)\n"
            "xs = torch.randn(256, 1); ys = 3 * xs + 1 + 0.01 * torch.randn(256, 1)\n"
        )
        step = "loss = torch.nn.functional.mse_loss(model(xs), ys)\nmodel.zero_grad(); loss.backward()\n"
        for i in range(40):
            mesh.exec(step)
            grads = mnb.remote(_grads)(mesh=mesh).fetch()
            avg = [sum(g[k] for g in grads) / len(grads) for k in range(2)]
            mesh.push(avg=avg)
            mesh.exec(
                "with torch.no_grad():\n    for p, g in zip(model.parameters(), avg): p -= 0.3 * g"
            )
            if i % 10 == 0 or i == 39:
                losses = mesh.pull("loss")
                print(f"step {i:2d} loss per rank: {[round(v.item(), 4) for v in losses]}")
        w, b = mesh.exec("[model.weight.item(), model.bias.item()]").fetch(rank=0)
        print(f"learned y = {w:.2f} x + {b:.2f}  (true: 3x + 1)")

        bad = mnb.remote(_fail_on_one)(mesh=mesh)
        try:
            bad.fetch()
        except mnb.RemoteError as e:
            print("a failure comes back once, grouped by rank:")
            print("  " + str(e).replace("\n", "\n  "))
        mesh.wait()
    print(f"done in {time.monotonic() - t0:.1f} s; no worker left running")


def _grads():
    from monarch_nb.worker.current import namespace

    return [p.grad.clone() for p in namespace["model"].parameters()]


def _fail_on_one():
    import monarch_nb as mnb

    if mnb.current_rank() == 1:
        raise ValueError("rank 1 had bad data")
    return "ok"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m monarch_nb")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a demo on a local mesh")
    d.add_argument("--ranks", type=int, default=2)
    q = sub.add_parser(
        "quickstart",
        help="execute notebooks/01_quickstart.ipynb headlessly; print each cell (under its "
        "section's heading) and its output",
    )
    q.add_argument("--output", metavar="PATH", help="also save the executed notebook here")
    a = p.parse_args(argv)
    if a.cmd == "demo":
        demo(a.ranks)
    elif a.cmd == "quickstart":
        from .headless import quickstart

        return quickstart(a.output)


if __name__ == "__main__":
    sys.exit(main())
