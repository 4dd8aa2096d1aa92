"""Pickling for the wire: protocol 5 with out-of-band buffers, Refs as placeholders.

* Tensors and other large contiguous buffers are out-of-band: each becomes a
  frame of its own, sent and received without being copied into the pickle. A
  tensor of up to ``IN_BAND`` bytes goes inside the pickle (its message stays
  two frames, batched with its neighbours').
* Functions, classes and lambdas defined in ``__main__`` (a script or a
  notebook) or in a local scope are pickled by value with cloudpickle (keeping
  their real file names, and the source lines of notebook cells); everything
  importable goes by reference.
* A Ref in call arguments pickles as its id and unpickles, on a worker, as the
  value it names (``pack_args`` / ``unpack_args``).
"""

from __future__ import annotations

import collections
import contextlib
import io
import linecache
import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from ..hooks import Hook
from .messages import Args, Function
from .wrapped_names import reduce_wrapped


class RefUseError(ValueError):
    """A Ref that cannot be used where it was passed (deleted, another mesh...)."""


_ref_types: dict[type, Callable[[Any], int]] = {}


def register_ref_type(cls: type, get_id: Callable[[Any], int]) -> None:
    """Make instances of ``cls`` pickle as a reference to a worker-side value."""
    _ref_types[cls] = get_id


_special_types: dict[type, Callable[[Any], tuple]] = {}
GROUP_RESOLVER = Hook("group_resolver", "a process group key -> its torch.distributed group, the worker's")


def register_special_type(cls: type, reduce: Callable[[Any], tuple]) -> None:
    """Instances of ``cls`` in call arguments pickle as ``reduce(obj)`` and are
    reported among the call's Refs (e.g. process group handles)."""
    _special_types[cls] = reduce


def load_group(key: int):
    """Unpickling a process group handle on a worker yields the real group."""
    return GROUP_RESOLVER.require("a process group can only be used inside worker code")(key)


_tls = threading.local()
IN_BAND = 4096  # bytes: a tensor up to this size travels inside the pickle


def _load_ref(ref_id: int):
    """Unpickling a Ref argument on a worker yields the value it names."""
    resolve = getattr(_tls, "resolve", None)
    if resolve is None:
        raise RuntimeError(f"Ref {ref_id} can only be resolved inside a worker command")
    return resolve(ref_id)


def is_by_value(obj) -> bool:
    module = getattr(obj, "__module__", None)
    if module is None or module == "__main__" or module.startswith("__ipython"):
        return True
    qualname = getattr(obj, "__qualname__", "")
    return "<locals>" in qualname or "<lambda>" in qualname


class _SourceKeepingPickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects keep their real file name (cloudpickle
    3.1 writes "<dynamic-code>"), so that worker tracebacks and pdb show real lines."""

    dispatch_table = collections.ChainMap(
        {types.CodeType: lambda code: _keep_filename(code)}, cloudpickle.Pickler.dispatch_table
    )


def _keep_filename(code):
    rv = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    if isinstance(rv, tuple) and len(rv) >= 2 and isinstance(rv[1], tuple):
        args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in rv[1])
        return (rv[0], args, *rv[2:])
    return rv


def _sources_of(obj) -> dict:
    """Source text of the files that ``obj``'s code comes from when the workers
    cannot read them (notebook cells live only in the kernel's linecache)."""
    codes = []
    if isinstance(obj, types.FunctionType):
        codes.append(obj.__code__)
    elif isinstance(obj, type):
        codes.extend(v.__code__ for v in vars(obj).values() if isinstance(v, types.FunctionType))
    out = {}
    for code in codes:
        fname = code.co_filename
        if fname in out or os.path.exists(fname):
            continue
        lines = linecache.getlines(fname)
        if lines:
            out[fname] = "".join(lines)
    return out


def dumps_by_value(obj) -> tuple:
    f = io.BytesIO()
    with _packing("by_value"):  # a Ref met on the way refuses (ref_placeholder)
        _SourceKeepingPickler(f, protocol=5).dump(obj)
    return f.getvalue(), _sources_of(obj)


def _load_by_value(payload: bytes, sources: dict):
    for fname, text in sources.items():
        if fname not in linecache.cache:
            lines = text.splitlines(keepends=True)
            linecache.cache[fname] = (len(text), None, lines, fname)
    return pickle.loads(payload)


def _local_torch(build):
    """``build`` with no torch dispatch mode active: a received or sent tensor is
    plain local torch even inside ``mesh.activate()`` (the tensor engine's mode)."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

    if _get_current_dispatch_mode() is None:
        return build

    def run(*args):
        with _disable_current_modes():
            return build(*args)

    return run


def _rebuild_tensor(buf, dtype: str, shape: tuple, requires_grad: bool):
    return _local_torch(_build_tensor)(buf, dtype, shape, requires_grad)


def _build_tensor(buf, dtype: str, shape: tuple, requires_grad: bool):
    import torch

    dt = getattr(torch, dtype)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        if mv.readonly and isinstance(buf, bytes):
            mv = memoryview(bytearray(mv))
        with warnings.catch_warnings():
            # zero-copy: the tensor keeps the received frame alive and owns its memory
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mv, dtype=torch.uint8)
        t = t.view(dt).reshape(shape)
    if requires_grad:
        t.requires_grad_()
    return t


def _reduce_tensor(t):
    torch = sys.modules["torch"]
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
        return NotImplemented
    d = t.detach()
    if d.device.type != "cpu":
        d = d.cpu()
    if d._is_zerotensor():  # autograd's zero gradient holds no memory
        d = torch.zeros(d.shape, dtype=d.dtype)
    d = d.resolve_conj().resolve_neg().contiguous()
    dtype = str(d.dtype).removeprefix("torch.")
    if d.numel() == 0:
        data = pickle.PickleBuffer(b"")
    else:
        flat = d.reshape(-1)
        if flat.stride(0) != 1:  # size-1 dims broadcast by stride 0 count as contiguous
            flat = flat.clone(memory_format=torch.contiguous_format)
        raw = flat.view(torch.uint8).numpy()
        # a small one inside the pickle: its message stays two frames and goes in one
        # batch with its neighbours; a large one out of band, never copied
        data = raw.tobytes() if raw.nbytes <= IN_BAND else pickle.PickleBuffer(raw)
    return (_rebuild_tensor, (data, dtype, tuple(d.shape), t.requires_grad))


class _Pickler(pickle.Pickler):
    """Protocol 5 pickler: out-of-band tensors, Refs as placeholders, and
    ``__main__`` / local functions and classes by value."""

    def __init__(self, file, buffers: list | None, refs: list | None):
        callback = buffers.append if buffers is not None else None
        super().__init__(file, protocol=5, buffer_callback=callback)
        self._refs = refs

    def reducer_override(self, obj):
        cls = type(obj)
        special = _special_types.get(cls)
        if special is not None:
            if self._refs is None:
                raise pickle.PicklingError(f"{cls.__name__} cannot be sent here")
            self._refs.append(obj)
            return special(obj)
        get_id = _ref_types.get(cls)
        if get_id is not None:
            if self._refs is None:
                raise pickle.PicklingError(f"{cls.__name__} cannot be sent here")
            ref_id = get_id(obj)
            self._refs.append(obj)
            return (_load_ref, (ref_id,))
        torch = sys.modules.get("torch")
        if torch is not None and cls is torch.Tensor:
            return _local_torch(_reduce_tensor)(obj)
        if cls is types.FunctionType or isinstance(obj, type):
            if is_by_value(obj):
                return (_load_by_value, dumps_by_value(obj))
            if cls is types.FunctionType:
                return reduce_wrapped(obj)
        return NotImplemented


def dumps(obj, refs: list | None = None) -> tuple[bytes, list]:
    """Pickle ``obj``; returns the pickle and its out-of-band buffers."""
    if type(obj) in _PLAIN:  # the same bytes: a pickler's hooks never see these
        return pickle.dumps(obj, 5), []
    buffers: list = []
    f = io.BytesIO()
    try:
        _Pickler(f, buffers, refs).dump(obj)
    except RefUseError:
        raise
    except Exception as e:
        raise TypeError(f"cannot send {_describe(obj)}: {type(e).__name__}: {e}") from e
    return f.getvalue(), buffers


def _describe(obj) -> str:
    try:
        s = repr(obj)
    except BaseException:  # noqa: B036 - a broken or too deep repr must not hide the real error
        s = f"<{type(obj).__name__} object>"
    return s if len(s) < 120 else s[:117] + "..."


def loads(payload, buffers: Sequence = ()):
    return pickle.loads(payload, buffers=buffers)


_PLAIN = frozenset({int, float, str, bool, type(None), bytes})


class _RefToken:
    """A Ref among arguments the C pickler pickles: unpickles as ``_load_ref``."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i

    def __reduce__(self):
        return (_load_ref, (self.i,))


def _plain_or_ref(v, refs: list, ids: list):
    t = type(v)
    if t in _PLAIN:
        return v
    get_id = _ref_types.get(t)
    if get_id is None:
        raise LookupError  # not plain: the full pickler's
    i = get_id(v)
    refs.append(v)
    ids.append(i)
    return _RefToken(i)


def pack_args(args: tuple, kwargs: dict) -> tuple[Args, list]:
    """Pickle call arguments; returns the Args record and the Ref objects it names.
    Plain scalars and Refs alone go through the C pickler (~3 us a call less)."""
    refs: list = []
    ids: list = []
    try:
        a = tuple([_plain_or_ref(v, refs, ids) for v in args])
        kw = {k: _plain_or_ref(v, refs, ids) for k, v in kwargs.items()} if kwargs else kwargs
        return Args(pickle.dumps((a, kw), 5), (), tuple(dict.fromkeys(ids))), refs
    except LookupError:  # something else: the full pickler's
        refs = []
    try:
        payload, buffers = dumps((args, kwargs), refs)
    except TypeError as e:
        raise TypeError(f"cannot send the arguments: {e}") from None
    ids = tuple(dict.fromkeys(_ref_types[type(r)](r) for r in refs if type(r) in _ref_types))
    return Args(payload, tuple(buffers), ids), refs


def unpack_args(args: Args | None, resolve: Callable[[int], Any]) -> tuple[tuple, dict]:
    """Unpickle call arguments, turning every Ref into ``resolve(ref_id)``."""
    if args is None:
        return (), {}
    _tls.resolve = resolve
    try:
        return pickle.loads(args.payload, buffers=args.buffers)
    finally:
        _tls.resolve = None


def function_ref(fn: Callable) -> Function:
    """Describe ``fn`` for the workers: by reference if importable, else by value."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if name.startswith("_") and "." in name:  # torch.ones is "_VariableFunctionsClass.ones"
        name = getattr(fn, "__name__", name)
    if not callable(fn):
        raise TypeError(f"remote() needs a callable, got {type(fn).__name__}")
    f = io.BytesIO()
    try:
        _Pickler(f, None, None).dump(fn)  # by value or by reference, per object
    except Exception as e:
        raise TypeError(f"cannot send function {name!r}: {type(e).__name__}: {e}") from e
    return Function(f.getvalue(), name)


_function_cache: dict[bytes, Callable] = {}


def resolve_function(f: Function) -> Callable:
    fn = _function_cache.get(f.payload)
    if fn is None:
        fn = pickle.loads(f.payload)
        if len(_function_cache) > 4096:
            _function_cache.clear()
        _function_cache[f.payload] = fn
    return fn


def ref_placeholder(ref_id: int, refusals: tuple[str, str]) -> tuple:
    """A Ref class's ``__reduce_ex__``: in ``pack_ref_args``, a placeholder a worker
    resolves inside the command. In a function sent by value (resolved nowhere):
    PicklingError(``refusals[1]``); in any other pickle (torch.save, pickle.dumps),
    whose file would fail only when loaded: PicklingError(``refusals[0]``)."""
    packing = getattr(_tls, "packing", None)
    if packing == "refs":
        return (_load_ref, (ref_id,))
    raise pickle.PicklingError(refusals[1] if packing == "by_value" else refusals[0])


@contextlib.contextmanager
def _packing(kind: str):
    before, _tls.packing = getattr(_tls, "packing", None), kind
    try:
        yield
    finally:
        _tls.packing = before


def pack_ref_args(args: tuple, kwargs: dict, ref_ids: tuple) -> Args:
    """``pack_args`` for plain data and objects that reduce themselves to
    ``ref_placeholder`` (no tensors, no functions by value): the C pickler alone.
    ``ref_ids``: the ids of the Refs inside."""
    try:
        with _packing("refs"):
            payload = pickle.dumps((args, kwargs), 5)
    except RefUseError:
        raise
    except Exception as e:
        raise TypeError(f"cannot send the arguments: {type(e).__name__}: {e}") from None
    return Args(payload, (), ref_ids)
