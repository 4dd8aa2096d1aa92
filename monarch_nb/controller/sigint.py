"""A Ctrl-C held back while the socket's lease holder is in the middle of a step."""

from __future__ import annotations

import _signal  # signal.signal's enum wrapping costs more than the call itself
import threading

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
