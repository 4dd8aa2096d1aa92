"""Ops whose result depends on the values: ``nonzero``, ``masked_select``,
``unique``, ``x[mask]``, ``torch.equal``, a ``narrow`` whose start is a tensor.

FakeTensor cannot give their layout (or value) on the controller. Such an op
runs on the workers as any other; then every rank says what it made (the
layouts of its tensors, or its Python value), and when the ranks agree that is
the result: mesh tensors of that layout, or the value. Ranks that disagree get
an error naming them (a mesh tensor has one layout on every rank). The op's
key is remembered, so it is not propagated again.
"""

from __future__ import annotations

from ...protocol import aten
from ..context import resolve_target
from ..remote import remote
from . import borrows
from .agreed import agreed, leave_recording
from .propagate import needs_values_error, op_name
from .send import call_of
from .values import outputs

_outcome = remote(aten.outcome)
_run_op = remote(aten.run_op)
_keys: set = set()  # the plan keys of ops that depend on the data
_KEYS_MAX = 4096


def known(key) -> bool:
    """Whether the op of plan key ``key`` is known to depend on the data."""
    try:
        return key in _keys
    except TypeError:  # an unhashable argument
        return False


def remember(key) -> None:
    try:
        if len(_keys) >= _KEYS_MAX:
            _keys.clear()
        _keys.add(key)
    except TypeError:
        pass


def _comparable(outcome):
    """An outcome less the device (each rank's own GPU on a CUDA mesh)."""
    if outcome[0] == "one":
        return ("one", outcome[1][:4])
    if outcome[0] == "many":
        return ("many", outcome[1], [x if x is None else x[:4] for x in outcome[2]])
    return outcome


def run(func, args, kwargs, tensors: list, mesh, grad: bool = False):
    """Run ``func`` (which depends on the data) on the shards of ``tensors`` (with
    autograd when ``grad``: grad mode is on); its result as every rank of ``mesh``
    (or the tensors' mesh) made it."""
    name = op_name(func)
    if func._schema.is_mutable:  # what it writes would need renaming by a layout unknown
        raise needs_values_error(f"{name} (it writes a tensor, and its result depends on the data)")
    leave_recording(name)
    mesh, stream = resolve_target(mesh, None)
    if borrows.live[0]:
        borrows.check(name, tensors, ())
    function, call = call_of(aten.wire_name(func), args, kwargs, grad)
    ref = _run_op._send(call, kwargs, mesh, stream, function._replace(name=name))
    try:
        made = _outcome._send((ref,), {}, mesh, stream).fetch()
        ranks = list(mesh.targets)
        if made[0][0] == "value":
            value = agreed([o[1] for o in made], ranks, name, _HINT)
            ref.delete()
            return value
        layouts = [_comparable(o) for o in made]
        differ = [(r, o) for r, o, lay in zip(ranks, made, layouts) if lay != layouts[0]]
        if differ:
            shown = "; ".join(f"rank {r}: {aten.shown(o)}" for r, o in [(ranks[0], made[0]), *differ[:3]])
            raise ValueError(f"{name}: the ranks made results of other layouts ({shown}): {_HINT}")
    except BaseException:
        ref.delete()
        raise
    return outputs(ref, made[0], mesh, stream)


_HINT = (
    "its result depends on each rank's data, and a mesh tensor has one layout (a "
    "value one value) on every rank; run it inside a remote function (mnb.remote), "
    "or on one rank's shard (mnb.inspect(t, dp=0))"
)
