"""``torch.compile(fn, backend=mnb.mesh_backend)``: the graphs of ``fn`` run on the
ranks, one command a graph a call.

dynamo traces ``fn`` over mesh tensors and AOTAutograd splits each graph into a
forward and a backward over their shards (``traced``): each rank's own program.
Each becomes a tensor op whose function is the graph (sent once to every
generation of workers, ``send.define``), and a call of it is one RunOps entry
with the inputs' values and this call's Python numbers (an unspecialized float,
a SymInt) in its slots. Its outputs are shards naming values on the ranks, which
AOTAutograd makes mesh tensors again (or keeps, saved for the backward).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

from ...protocol import messages as m
from ...protocol.aten import OpSlot
from ...protocol.graph_program import GraphProgram
from ...protocol.wire import function_ref
from ..context import RecordingError
from .graph_copies import drop_layout_copies
from .graph_parts import local_part
from .plans import next_op_id
from .propagate import layout_of
from .send import define
from .traced import ON_THE_MESH, owned, value_of

__all__ = ["mesh_backend"]

_names = itertools.count(1)


class MeshGraph:
    """One graph AOTAutograd made (a forward or a backward), run on the mesh of its
    inputs: a boxed callable, as AOTAutograd calls its compilers' results."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str):
        drop_layout_copies(gm)
        self.what = f"compiled {kind} graph {next(_names)}"
        self.gm, self.inputs = gm, len(example_inputs)
        self.tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        self.scalars = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)]
        self.program = function_ref(GraphProgram.of(gm, self.what))
        # per set of the tensor inputs that are local: (template, local outputs, module)
        self._variants: dict = {}
        out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        self.outputs = [self._output_of(n) for n in out]
        # dynamic shapes: the symbols (SymInt inputs) output layouts are written in
        self.symbols = [
            (i, x.node.expr) for i, x in enumerate(example_inputs) if isinstance(x, torch.SymInt)
        ]
        self.symbolic = any(_symbolic(spec) for spec in self.outputs)
        self._layouts: dict = {}  # the symbols' values -> the outputs' layouts

    def _variant(self, local: tuple) -> tuple:
        """``(template, the inputs sent by value, local output indices, their module)``
        for a call whose tensor inputs at ``local`` are local tensors (sent by value,
        after the mesh tensors, with the Python numbers)."""
        found = self._variants.get(local)
        if found is None:
            on_mesh = [i for i in self.tensors if i not in local]
            by_value = sorted(set(self.scalars) | set(local))
            slot = {i: OpSlot(k) for k, i in enumerate(on_mesh + by_value)}
            skeleton = tuple(slot[i] for i in range(self.inputs))
            op = next_op_id()
            template = (op, m.DefineOp(op, self.program, skeleton, {}, self.what))
            indices, module = local_part(self.gm, set(on_mesh)) if local else ([], None)
            found = self._variants[local] = (template, by_value, indices, module)
        return found

    @staticmethod
    def _output_of(node):
        """An output's layout, or ``("value", v)`` for one that is no tensor."""
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
        if isinstance(val, torch.Tensor):
            return layout_of(val)
        return ("value", val)

    def _outputs_for(self, args: list) -> list:
        """The outputs' layouts (and values) for this call's values of the symbols."""
        if not self.symbolic:
            return self.outputs
        key = tuple(args[i] for i, _ in self.symbols)
        found = self._layouts.get(key)
        if found is None:
            env = {expr: value for (_, expr), value in zip(self.symbols, key)}
            found = [_concrete(spec, env) for spec in self.outputs]
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[key] = found
        return found

    def __call__(self, args: list) -> list:
        refs, where, keep, local = [], None, [], []
        for i in self.tensors:
            named = value_of(args[i], keep)
            if named is None:
                t = args[i]
                if _host(t) and t.dim() == 0:  # a host scalar: sent by value
                    local.append(i)
                    continue
                what = "a local tensor" if _host(t) else "no mesh tensor's shard"
                raise RecordingError(
                    f"{self.what}: input {i} is {what} ({tuple(t.shape)}, {t.dtype}); a "
                    f"graph on the mesh takes mesh tensors and 0-dim local ones: create "
                    f"it on the mesh (under mesh.activate()), or pass it as a number"
                )
            ref_id, _ident, mesh, stream = named
            if where is None:
                where = (mesh, stream)
            elif (mesh, stream) != where:
                raise RecordingError(
                    f"{self.what}: its inputs are on different meshes or streams "
                    f"({where[0].name!r}/{where[1].name!r} and {mesh.name!r}/{stream.name!r})"
                )
            refs.append(ref_id)
        if where is None:
            raise RecordingError(f"{self.what}: no mesh tensor among its inputs")
        mesh, stream = where
        ctrl = mesh._controller
        ctrl.check_usable(mesh.targets)
        template, by_value, indices, module = self._variant(tuple(local))
        # by value as they are now: the IO thread encodes the command later, and a host
        # scalar (an optimizer's step count) is written in place right after this call
        scalars = tuple(_now(args[i]) for i in by_value)
        outputs = self._outputs_for(args)
        here = dict(zip(indices, module(*args))) if module is not None else {}
        op = define(ctrl, template)
        ident = ctrl.next_ident()
        ids = tuple(ctrl.next_id() for _ in self.outputs)
        ctrl.send_op((ident, ids, op, tuple(refs), stream.id, scalars), mesh.targets, self.what)
        # boxed: AOTAutograd lets the callee free its inputs; a value freed now is
        # deleted on the ranks after this command, which reads it
        args.clear()
        del keep
        results = []
        for k, (spec, rid) in enumerate(zip(outputs, ids)):
            if k in here:  # computed here from local inputs alone: a local tensor
                ctrl.delete_ref(rid)
                results.append(here[k])
            elif spec[0] == "value":
                ctrl.delete_ref(rid)
                results.append(spec[1])
            else:
                results.append(owned(spec, rid, ident, mesh, stream))
        return results


def _now(v):
    """A graph's argument sent by value, copied if a tensor (a host scalar)."""
    return v.clone() if isinstance(v, torch.Tensor) else v


def _host(t) -> bool:
    """A local tensor the controller holds (not a fake or meta one of torch's)."""
    return isinstance(t, torch.Tensor) and t.device.type != "meta" and not is_fake(t)


def _is_sym(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _symbolic(spec) -> bool:
    if spec[0] == "value":
        return _is_sym(spec[1])
    size, stride, offset = spec[:3]
    return any(_is_sym(d) for d in (*size, *stride, offset))


def _concrete(spec, env: dict):
    """``spec`` with its symbolic sizes evaluated where the symbols take ``env``."""

    def value(d):
        if not _is_sym(d):
            return d
        out = d.node.expr.xreplace(env)
        if isinstance(d, torch.SymFloat):
            return float(out)
        return bool(out) if isinstance(d, torch.SymBool) else int(out)

    if spec[0] == "value":
        return ("value", value(spec[1]))
    size, stride, offset, dtype, device = spec
    return (
        tuple(value(d) for d in size),
        tuple(value(d) for d in stride),
        value(offset),
        dtype,
        device,
    )


def _compiler(kind: str):
    def compile_graph(gm, example_inputs):
        graph = MeshGraph(gm, example_inputs, kind)

        def run(args: list) -> list:
            # the call's own torch (meta outputs, host scalars) is bookkeeping here,
            # never ops for the mesh of an active mesh.activate() (MeshMode)
            with _disable_current_modes():
                return graph(args)

        run._boxed_call = True  # AOTAutograd passes one list, which it may free
        return run

    return compile_graph


@functools.cache
def _aot_backend():
    from torch._dynamo.backends.common import aot_autograd  # imports dynamo: seconds

    return aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"))


def mesh_backend(gm: torch.fx.GraphModule, example_inputs: list):
    """A ``torch.compile`` backend for functions of mesh tensors: each graph dynamo
    traces runs on the ranks as one command a call (its backward as one more)."""
    return _aot_backend()(gm, example_inputs)


setattr(mesh_backend, ON_THE_MESH, True)
