"""A graph torch.compile traced, as each rank runs it: its Python source.

An FX GraphModule does not travel well (unpickling one traces its code again,
which needs whatever the controller's process had imported), so the controller
sends the graph's generated source, the globals it names and the constants it
reads (``GraphProgram.of``); the rank executes the source once, on first call.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType, SimpleNamespace

from .aten import defining_module, op_callable

# an op call in FX's source: torch.ops.<namespace>.<op>.<overload>(
_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


class GraphProgram:
    """A callable made of an FX graph's source: ``program(*inputs)`` is the graph's
    ``forward`` on this rank's values."""

    def __init__(self, src: str, globals_: dict, constants: dict, name: str):
        self.src, self.globals, self.constants, self.name = src, globals_, constants, name
        # the modules that define the Python-defined ops it calls (transformers' MoE op)
        ops = {f"{ns}::{op}" for ns, op, _ in _OP_CALL.findall(src)}
        self.imports = sorted({m for op in ops if (m := defining_module(op)) is not None})
        self._forward = None

    @classmethod
    def of(cls, gm, name: str) -> GraphProgram:
        """The program of GraphModule ``gm`` (on the controller)."""
        code = gm.graph.python_code(root_module="self")
        constants = {}
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = gm
                for part in node.target.split("."):
                    value = getattr(value, part)
                constants[node.target] = value
        globals_ = {
            k: _Module(v.__name__) if isinstance(v, ModuleType) else v
            for k, v in code.globals.items()
        }
        return cls(code.src, globals_, constants, name)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_forward"}

    def __setstate__(self, state):
        self.__dict__.update(state, _forward=None)

    def __call__(self, *inputs):
        forward = self._forward
        if forward is None:
            forward = self._forward = self._load()
        return forward(*inputs)

    def _load(self):
        for module in self.__dict__.get("imports", ()):  # (a program pickled before it)
            importlib.import_module(module)
        scope = {
            k: importlib.import_module(v.name) if type(v) is _Module else v
            for k, v in self.globals.items()
        }
        src = _OP_CALL.sub(lambda m: _bind(scope, *m.groups()) + "(", self.src)
        exec(compile(src, f"<{self.name}>", "exec"), scope)
        root = SimpleNamespace()
        for target, value in self.constants.items():
            *path, last = target.split(".")
            where = root
            for part in path:
                if not hasattr(where, part):
                    setattr(where, part, SimpleNamespace())
                where = getattr(where, part)
            setattr(where, last, value)
        forward = scope["forward"]
        return lambda *inputs: forward(root, *inputs)


def _bind(scope: dict, namespace: str, op: str, overload: str) -> str:
    """A name in ``scope`` for the op's C++ callable: a call of it skips the
    ``torch.ops`` lookups and OpOverload's Python ``__call__``."""
    name = f"_op_{namespace}_{op}_{overload}"
    if name not in scope:
        scope[name] = op_callable(f"{namespace}::{op}.{overload}")
    return name


class _Module:
    """A module among a program's globals, by name (modules do not pickle)."""

    def __init__(self, name: str):
        self.name = name
