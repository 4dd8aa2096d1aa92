"""Ctrl-C on the controller: held back while the socket's lease holder is in the
middle of a step, and handed back when it lands in a finalizer."""

from __future__ import annotations

import _signal  # signal.signal's enum wrapping costs more than the call itself
import _thread
import sys
import threading
import time

SIGINT = int(_signal.SIGINT)


def held_interrupt(fn, *args) -> None:
    """``fn(*args)`` with a Ctrl-C on the main thread held until it returns (no
    message half-sent or half-handled); the interrupt is then raised."""
    if threading.current_thread() is not threading.main_thread():
        fn(*args)
        return
    pressed: list = []
    try:
        previous = _signal.signal(SIGINT, lambda sig, frame: pressed.append(frame))
    except ValueError:  # not the main interpreter
        fn(*args)
        return
    try:
        fn(*args)
    finally:
        _signal.signal(SIGINT, previous)
        if pressed:
            if callable(previous):
                previous(SIGINT, pressed[0])
            elif previous != _signal.SIG_IGN:
                raise KeyboardInterrupt


_previous_hook: list = []


def hand_back_interrupts() -> None:
    """A Ctrl-C that lands in a finalizer (a ``__del__``, which cannot raise: Python
    prints "Exception ignored" and drops it) or a gc callback on the main thread is
    raised again there at its next bytecode, in the user's code. A loop that makes and
    drops mesh tensors spends much of its time in their ``__del__``: without this,
    Ctrl-C was lost in about half of the tries."""
    _reraiser()  # started now, not first in the hook (where a Ctrl-C may land again)
    keep_unraisable_hook()


def keep_unraisable_hook() -> None:
    """Put the hook back in front if something replaced ``sys.unraisablehook`` since
    (pytest does, per test phase): called as finalizable objects are made."""
    if sys.unraisablehook is not _unraisable:
        _previous_hook[:] = [sys.unraisablehook]
        sys.unraisablehook = _unraisable


def _unraisable(unraisable) -> None:
    # any finalizer or gc callback on the main thread, not only ours: a library's gc
    # callback (hypothesis installs one) dropped a Ctrl-C in a loop of tensor ops
    if (
        unraisable.exc_type is not None
        and issubclass(unraisable.exc_type, KeyboardInterrupt)
        and threading.current_thread() is threading.main_thread()
    ):
        # raised in this hook it would be dropped again: the re-raiser thread signals
        # once the hook has returned (and again, should it land in a finalizer again)
        while True:
            try:
                _reraiser().set()
                return
            except KeyboardInterrupt:  # this same Ctrl-C, handed back early: ask again
                continue
    if _previous_hook:
        _previous_hook[0](unraisable)


_wanted: list = []  # [the Event the re-raiser waits on]


def _reraiser() -> threading.Event:
    if not _wanted:
        _wanted.append(threading.Event())
        threading.Thread(
            target=_reraise, args=(_wanted[0],), name="monarch-sigint", daemon=True
        ).start()
    return _wanted[0]


def _reraise(wanted: threading.Event) -> None:
    while True:
        wanted.wait()
        time.sleep(0.001)  # the hook that asked has returned by then
        wanted.clear()
        _thread.interrupt_main(SIGINT)  # the main thread's current handler runs it
