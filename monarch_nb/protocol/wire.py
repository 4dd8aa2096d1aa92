"""The wire: serialization, signing and framing of messages.

A message travels as the frames ``[signature, pickle, *buffers]``:

* ``pickle`` is the message pickled with protocol 5. Tensors and other large
  contiguous buffers are out-of-band: each is a frame of its own, sent and
  received without being copied into the pickle.
* Functions, classes and lambdas defined in ``__main__`` (a script or a
  notebook) or in a local scope are pickled by value with cloudpickle;
  everything importable goes by reference.
* ``signature`` is HMAC-SHA256 with the mesh's secret over the pickle, the
  length of every buffer, and the content of every buffer up to
  ``FULL_COVER`` bytes; of larger buffers the first and last ``EDGE`` bytes are
  covered. The pickle, the only part that can make a receiver execute
  anything, is always covered whole. Full coverage of a large tensor would
  cost as much as sending it (SHA-256 runs at about 1 GB/s here, the same as
  loopback ZeroMQ); set ``MONARCH_NB_SIGN_FULL=1`` to cover every byte.

A frame set whose signature does not verify is never unpickled.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import io
import linecache
import os
import pickle
import sys
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import cloudpickle

from .messages import Args, FetchResult, Function, RemoteFailure

SIG_LEN = 32
FULL_COVER = 1 << 20
EDGE = 64 << 10
SIGN_FULL = os.environ.get("MONARCH_NB_SIGN_FULL", "") not in ("", "0")


class BadMessage(Exception):
    """A frame set that is malformed or fails authentication."""


class RefUseError(ValueError):
    """A Ref that cannot be used where it was passed (deleted, another mesh...)."""


def new_secret() -> bytes:
    return os.urandom(32)


class Signer:
    """HMAC-SHA256 over a message's frames with one mesh's secret."""

    __slots__ = ("_key", "_inner", "_outer")

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("the mesh secret must be at least 16 bytes")
        self._key = key
        # HMAC (RFC 2104) with the padded keys hashed once: each message then costs
        # two copies of a SHA-256 state (4x cheaper than hmac.digest, which sets up
        # OpenSSL's HMAC afresh for every call)
        block = key if len(key) <= 64 else hashlib.sha256(key).digest()
        block = block.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def __repr__(self) -> str:  # never show the secret
        return "Signer(<secret>)"

    def digest(self, payload, buffers: Sequence) -> bytes:
        h = self._inner.copy()
        h.update(payload)
        for b in buffers:
            mv = memoryview(b).cast("B")
            n = mv.nbytes
            h.update(n.to_bytes(8, "little"))
            if n <= FULL_COVER or SIGN_FULL:
                h.update(mv)
            else:
                h.update(mv[:EDGE])
                h.update(mv[-EDGE:])
        outer = self._outer.copy()
        outer.update(h.digest())
        return outer.digest()

    def verify(self, signature, payload, buffers: Sequence) -> bool:
        return hmac.compare_digest(bytes(signature), self.digest(payload, buffers))


# ------------------------------------------------------------------ pickling

_ref_types: dict[type, Callable[[Any], int]] = {}


def register_ref_type(cls: type, get_id: Callable[[Any], int]) -> None:
    """Make instances of ``cls`` pickle as a reference to a worker-side value."""
    _ref_types[cls] = get_id


_special_types: dict[type, Callable[[Any], tuple]] = {}
_group_resolver: list = [None]


def register_special_type(cls: type, reduce: Callable[[Any], tuple]) -> None:
    """Instances of ``cls`` in call arguments pickle as ``reduce(obj)`` and are
    reported among the call's Refs (e.g. process group handles)."""
    _special_types[cls] = reduce


def set_group_resolver(fn: Callable[[int], Any]) -> None:
    """Worker side: how a process group key becomes the torch.distributed group."""
    _group_resolver[0] = fn


def load_group(key: int):
    """Unpickling a process group handle on a worker yields the real group."""
    if _group_resolver[0] is None:
        raise RuntimeError("a process group can only be used inside worker code")
    return _group_resolver[0](key)


_tls = threading.local()


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
    _SourceKeepingPickler(f, protocol=5).dump(obj)
    return f.getvalue(), _sources_of(obj)


def _load_by_value(payload: bytes, sources: dict):
    for fname, text in sources.items():
        if fname not in linecache.cache:
            lines = text.splitlines(keepends=True)
            linecache.cache[fname] = (len(text), None, lines, fname)
    return pickle.loads(payload)


def _rebuild_tensor(buf, dtype: str, shape: tuple, requires_grad: bool):
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
    d = d.resolve_conj().resolve_neg().contiguous()
    dtype = str(d.dtype).removeprefix("torch.")
    if d.numel() == 0:
        data = pickle.PickleBuffer(b"")
    else:
        data = pickle.PickleBuffer(d.reshape(-1).view(torch.uint8).numpy())
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
            return _reduce_tensor(obj)
        if cls is types.FunctionType or isinstance(obj, type):
            if is_by_value(obj):
                return (_load_by_value, dumps_by_value(obj))
        return NotImplemented


def dumps(obj, refs: list | None = None) -> tuple[bytes, list]:
    """Pickle ``obj``; returns the pickle and its out-of-band buffers."""
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


def pack_args(args: tuple, kwargs: dict) -> tuple[Args, list]:
    """Pickle call arguments; returns the Args record and the Ref objects it names."""
    refs: list = []
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


# ------------------------------------------------------------------ framing


class _PackedFetch(NamedTuple):
    """A FetchResult on the wire: its value pickled apart (covered whole by the
    signature), so that a value the receiver cannot unpickle (a class it cannot
    import) still delivers the ident and rank, with the reason as the error."""

    ident: int
    rank: int
    error: Any
    value: bytes


def encode(msg, signer: Signer) -> list:
    """Frames ``[signature, pickle, *buffers]`` of a message.

    Records whose fields are plain data (everything but FetchResult, whose value
    is the user's) go through the C pickler alone: three times faster."""
    if type(msg) is FetchResult:
        value, buffers = dumps(msg.value)
        payload = pickle.dumps(_PackedFetch(msg.ident, msg.rank, msg.error, value), 5)
    else:
        buffers = []
        payload = pickle.dumps(msg, 5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    return [signer.digest(payload, raws), payload, *raws]


def _small(f):
    """A frame's bytes (these frames are small: copying beats a memoryview)."""
    return f.bytes if hasattr(f, "bytes") else f


def decode(frames: Sequence, signer: Signer):
    """Verify and unpickle frames received with ``copy=False`` (or as bytes)."""
    if len(frames) < 2:
        raise BadMessage(f"expected at least 2 frames, got {len(frames)}")
    sig, payload = _small(frames[0]), _small(frames[1])
    bufs = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames[2:]]
    if len(sig) != SIG_LEN:
        raise BadMessage("signature frame has the wrong length")
    if not signer.verify(sig, payload, bufs):
        raise BadMessage("signature does not verify")
    try:
        msg = pickle.loads(payload, buffers=bufs)
    except Exception as e:
        raise BadMessage(
            f"authenticated message failed to unpickle: {type(e).__name__}: {e}"
        ) from e
    if type(msg) is _PackedFetch:
        return _unpack_fetch(msg, bufs)
    return msg


def _unpack_fetch(p: _PackedFetch, bufs: list) -> FetchResult:
    try:
        value = pickle.loads(p.value, buffers=bufs)
    except Exception as e:
        failure = RemoteFailure(
            type(e).__name__, f"the value arrived but cannot be unpickled here: {e}", ""
        )
        return FetchResult(p.ident, p.rank, None, failure)
    return FetchResult(p.ident, p.rank, value, p.error)


def recv_ready(sock):
    """The next message's frames if one is waiting, else None (zero-copy).

    Checks ZMQ_EVENTS instead of catching zmq.Again: pyzmq may reuse one Again
    instance, whose traceback would then keep the caller's frame, and the last
    (possibly 100 MB) message in its locals, alive until the next Again."""
    import zmq

    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        return None
    return sock.recv_multipart(copy=False)


BATCH = b"B"  # first frame of a batch: pairs [signature, pickle] of buffer-less messages follow


def split_batch(frames: Sequence) -> list:
    """The messages in a frame set: itself, or the pairs of a batch. Each is still
    verified on its own by ``decode``."""
    first = frames[0]
    if (first.bytes if hasattr(first, "bytes") else bytes(first)) != BATCH:
        return [frames]
    if len(frames) % 2 != 1:
        raise BadMessage("a batch must hold [signature, pickle] pairs")
    return [frames[i : i + 2] for i in range(1, len(frames), 2)]


def buffers_nbytes(frames: Sequence) -> int:
    return sum(memoryview(f).nbytes for f in frames[2:])
