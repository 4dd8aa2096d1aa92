"""The controller's side of the workers' torch.distributed store: a dict of keys
per generation, served to StoreRequests that came through the signed ROUTER.

``handle`` runs on the lease holder (as every reply handler) and never blocks:
a get or wait of keys not there yet is parked, and answered by the set that
completes it. A parked request past its bound is forgotten (the worker has
given up: its own bound raised there). A restart begins a fresh, empty
generation; requests of any other generation get no answer.
"""

from __future__ import annotations

import logging
import threading
import time

from ..protocol import messages as m

logger = logging.getLogger("monarch_nb.controller")

_WAITING_OPS = ("get", "wait", "multi_get")


class StoreServer:
    """The keys of the current generation and the requests waiting for keys."""

    def __init__(self):
        self.generation: int | None = None
        self.keys: dict[str, bytes] = {}
        self._parked: list = []  # [deadline, identity, request, keys]
        self._lock = threading.Lock()  # begin() comes from the thread starting a generation
        self._ops = {
            "set": self._set,
            "add": self._add,
            "compare_set": self._compare_set,
            "check": lambda keys: all(k in self.keys for k in _keys(keys)),
            "delete_key": lambda key: self.keys.pop(_key(key), None) is not None,
            "num_keys": lambda: len(self.keys),
            "multi_set": self._multi_set,
        }

    def begin(self, generation: int) -> None:
        """Serve ``generation`` from now on, with no keys."""
        with self._lock:
            self.generation = generation
            self.keys = {}
            self._parked = []

    def handle(self, req: m.StoreRequest, identity: bytes) -> list:
        """The (identity, StoreReply) pairs to send for ``req``: its own answer
        (unless parked) and those of parked requests it completes."""
        with self._lock:
            if req.generation != self.generation:
                logger.warning(
                    "store: a request of generation %s from rank %s (now %s): dropped",
                    req.generation, req.rank, self.generation,
                )  # fmt: skip
                return []
            now = time.monotonic()
            self._parked = [p for p in self._parked if p[0] > now]
            if req.op in _WAITING_OPS:
                return self._waiting(req, identity, now)
            op = self._ops.get(req.op)
            if op is None:
                return [(identity, self._error(req, f"unknown store operation {req.op!r}"))]
            try:
                value = op(*req.args)
            except (TypeError, ValueError) as e:
                return [(identity, self._error(req, f"bad arguments {req.args!r}: {e}"))]
            return [(identity, self._reply(req, value)), *self._complete()]

    # ------------------------------------------------------------ operations

    def _set(self, key, value) -> None:
        self.keys[_key(key)] = _value(value)

    def _multi_set(self, keys, values) -> None:
        keys, values = _keys(keys), [_value(v) for v in values]
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        self.keys.update(zip(keys, values))

    def _add(self, key, amount) -> int:
        key = _key(key)
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"add needs an int, got {type(amount).__name__}")
        try:
            total = int(self.keys.get(key, b"0")) + amount
        except ValueError:
            raise ValueError(f"key {key!r} does not hold a number") from None
        self.keys[key] = str(total).encode()
        return total

    def _compare_set(self, key, expected, desired) -> bytes:
        # TCPStore's rule: a missing key is set only when ``expected`` is empty
        key, expected, desired = _key(key), _value(expected), _value(desired)
        current = self.keys.get(key)
        if current is None:
            if expected:
                return expected
            self.keys[key] = desired
            return desired
        if current == expected:
            self.keys[key] = desired
            return desired
        return current

    # ------------------------------------------------------------ waiting for keys

    def _waiting(self, req, identity: bytes, now: float) -> list:
        try:
            keys = [_key(req.args[0])] if req.op == "get" else _keys(req.args[0])
            bound = float(req.timeout)
        except (TypeError, ValueError, IndexError) as e:
            return [(identity, self._error(req, f"bad arguments {req.args!r}: {e}"))]
        if all(k in self.keys for k in keys):
            return [(identity, self._reply(req, self._answer(req.op, keys)))]
        self._parked.append([now + bound, identity, req, keys])
        return []

    def _answer(self, op: str, keys: list):
        if op == "get":
            return self.keys[keys[0]]
        if op == "multi_get":
            return [self.keys[k] for k in keys]
        return None

    def _complete(self) -> list:
        done, kept = [], []
        for p in self._parked:
            _, identity, req, keys = p
            if all(k in self.keys for k in keys):
                done.append((identity, self._reply(req, self._answer(req.op, keys))))
            else:
                kept.append(p)
        self._parked = kept
        return done

    @property
    def parked(self) -> int:
        """Requests waiting for keys."""
        return len(self._parked)

    def _reply(self, req, value) -> m.StoreReply:
        return m.StoreReply(self.generation, req.request, value, None)

    def _error(self, req, why: str) -> m.StoreReply:
        return m.StoreReply(self.generation, req.request, None, why)


def _key(key) -> str:
    if not isinstance(key, str):
        raise TypeError(f"a key must be a str, got {type(key).__name__}")
    return key


def _keys(keys) -> list:
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list, got {type(keys).__name__}")
    return [_key(k) for k in keys]


def _value(value) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"a value must be bytes, got {type(value).__name__}")
    return bytes(value)
