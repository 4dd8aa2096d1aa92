"""Ctrl-C on the controller: held back while the socket's lease holder is in the
middle of a step, and handed back when it lands in a finalizer."""

from __future__ import annotations

import _signal  # signal.signal's enum wrapping costs more than the call itself
import _thread
import queue
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
    raised again in the user's code: at the start of the next mesh op or remote call
    (``raise_pending_interrupt``), else by a signal HAND_BACK_S later. A loop that
    makes and drops mesh tensors spends much of its time in their ``__del__``: without
    this, Ctrl-C was lost in about half of the tries; with the signal alone, a loop
    whose gc callbacks took most of its time (as hypothesis's do) kept dropping it
    for seconds."""
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
        # raised in this hook it would be dropped again: it waits as PENDING_INTERRUPT
        # for the next mesh op or remote call, or the re-raiser's signal (and again,
        # should that land in a finalizer again)
        while True:
            try:
                if not PENDING_INTERRUPT:  # (one waiting already: the same Ctrl-C, or two)
                    PENDING_INTERRUPT.append(object())
                _reraiser().put(PENDING_INTERRUPT[0])  # (twice is harmless: removed once)
                return
            except (KeyboardInterrupt, IndexError):  # handed back early, or taken: again
                continue
    if _previous_hook:
        _previous_hook[0](unraisable)


_wanted: list = []  # [the queue of tokens the re-raiser hands back]
PENDING_INTERRUPT: list = []  # [a token] while a Ctrl-C a finalizer dropped waits to be raised
HAND_BACK_S = 0.02  # a loop of mesh ops raises it at its next op first, in its own code


def raise_pending_interrupt() -> None:
    """Raise the Ctrl-C a finalizer dropped, if one waits and this is the main
    thread (exactly once: the re-raiser takes the same token). Where a mesh op or a
    remote call starts."""
    if not PENDING_INTERRUPT or threading.current_thread() is not threading.main_thread():
        return
    try:
        PENDING_INTERRUPT.pop()
    except IndexError:  # none, or the re-raiser took it
        return
    raise KeyboardInterrupt


def _reraiser() -> queue.SimpleQueue:
    if not _wanted:
        _wanted.append(queue.SimpleQueue())
        threading.Thread(
            target=_reraise, args=(_wanted[0],), name="monarch-sigint", daemon=True
        ).start()
    return _wanted[0]


def _reraise(tokens: queue.SimpleQueue) -> None:
    while True:
        token = tokens.get()
        time.sleep(HAND_BACK_S)  # the hook has returned; a mesh op may take it first
        try:
            PENDING_INTERRUPT.remove(token)  # only the one it was given: raised once
        except ValueError:
            continue
        _thread.interrupt_main(SIGINT)  # the main thread's current handler runs it
