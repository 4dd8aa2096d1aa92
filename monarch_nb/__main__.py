"""``python -m monarch_nb demo``: a headless tour of a local mesh.
``python -m monarch_nb quickstart``: notebooks/01_quickstart.ipynb executed in a real
kernel, each cell printed under the heading of its section, with its output.
``monarch-nb list`` / ``monarch-nb kill NAME``: the kept-alive meshes of this user
(``local_mesh(..., keep_alive="30m")``), shown or ended."""

from __future__ import annotations

import argparse
import os
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


def list_meshes() -> int:
    """Print the live kept-alive meshes: name, ranks, age, idle time, last controller."""
    from .protocol import keepalive as ka

    rows = [ka.describe(e) for e in ka.live_entries()]
    if not rows:
        print("no kept-alive mesh is live")
        return 0
    head = ("NAME", "RANKS", "AGE", "IDLE", "CONTROLLER", "EXPIRES IN")
    lines = [head]
    for r in rows:
        ctl = f"{r['controller']}" + ("" if r["attached"] else " (gone)")
        left = ka.fmt_seconds(r["expires_in"]) + ("" if not r["attached"] else " after it ends")
        lines.append(
            (r["name"], str(r["ranks"]), ka.fmt_seconds(r["age"]), ka.fmt_seconds(r["idle"]),
             ctl, left)
        )  # fmt: skip
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def kill_mesh(name: str, timeout: float = 10.0) -> int:
    """End the kept-alive mesh ``name``: its agent kills its ranks and exits."""
    import signal

    from .protocol import keepalive as ka

    entry = ka.read_entry(name)
    if entry is None:
        names = [e["name"] for e in ka.live_entries()]
        print(
            f"monarch-nb: no live kept-alive mesh named {name!r} (live: "
            f"{', '.join(names) or 'none'})",
            file=sys.stderr,
        )
        return 1
    if entry.get("remote"):
        return _kill_remote(entry, timeout)
    pid = entry["agent_pid"]
    for sig, grace in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + grace
        while ka.agent_alive(entry) and time.monotonic() < end:
            time.sleep(0.02)
        if not ka.agent_alive(entry):
            break
    ka.remove_entry(name)
    print(f"killed mesh {name!r} ({entry['world']} rank(s), agent pid {pid})")
    return 0


def _kill_remote(entry: dict, timeout: float) -> int:
    """A connect_mesh mesh's agents are on other hosts: told Quit where they wait."""
    from .launchers.remote_agent import quit_kept
    from .protocol import keepalive as ka

    name = entry["name"]
    if ka.orphaned_at(entry) is None:
        print(
            f"monarch-nb: mesh {name!r} is driven by the process of pid "
            f"{entry['controller_pid']}: mesh.shutdown() there ends it",
            file=sys.stderr,
        )
        return 1
    told = quit_kept(entry, entry.get("heartbeat_timeout", 10.0) + timeout)
    ka.remove_entry(name)
    print(f"killed mesh {name!r}: {told} of its {entry['world']} rank(s) told to end")
    return 0 if told == entry["world"] else 1


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="monarch-nb")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a demo on a local mesh")
    d.add_argument("--ranks", type=int, default=2)
    q = sub.add_parser(
        "quickstart",
        help="execute notebooks/01_quickstart.ipynb headlessly; print each cell (under its "
        "section's heading) and its output",
    )
    q.add_argument("--output", metavar="PATH", help="also save the executed notebook here")
    sub.add_parser("list", help="the live kept-alive meshes: name, ranks, age, idle, controller")
    k = sub.add_parser("kill", help="end a kept-alive mesh (its agent and ranks)")
    k.add_argument("name")
    a = p.parse_args(argv)
    if a.cmd == "list":
        return list_meshes()
    if a.cmd == "kill":
        return kill_mesh(a.name)
    if a.cmd == "demo":
        demo(a.ranks)
    elif a.cmd == "quickstart":
        from .headless import quickstart

        return quickstart(a.output)


if __name__ == "__main__":
    sys.exit(main())
