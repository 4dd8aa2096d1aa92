"""The part of a compiled graph the controller runs itself: the outputs that read
no mesh tensor.

A graph may take local tensors besides mesh tensors: a 0-dim tensor on the
controller (BatchNorm's ``num_batches_tracked``; ``torch.tensor(0)`` under a mesh
stays a host scalar). They go to the ranks by value with each call, and where the
graph updates one in place (AOTAutograd returns its new value for the caller to
copy back), the ranks' copy would never come back: the outputs computed from such
inputs alone are computed here too, by the sub-graph that makes them, and are
real tensors.
"""

from __future__ import annotations

import torch


def local_part(gm: torch.fx.GraphModule, on_mesh: set) -> tuple[list, object]:
    """``(output indices, module)``: the outputs of ``gm`` that read none of the
    inputs at positions ``on_mesh`` (mesh tensors' shards), and a GraphModule that
    computes just those from all of ``gm``'s inputs (None when there are none)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    tainted = {p for i, p in enumerate(placeholders) if i in on_mesh}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output") and any(
            a in tainted for a in node.all_input_nodes
        ):
            tainted.add(node)
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    wanted = [
        k
        for k, n in enumerate(outputs)
        if isinstance(n, torch.fx.Node)
        and n not in tainted
        and n.op != "placeholder"
        and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    if not wanted:
        return [], None
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node.op != "output" and node not in tainted:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[outputs[k]] for k in wanted))
    graph.eliminate_dead_code()
    return wanted, torch.fx.GraphModule(gm, graph)
