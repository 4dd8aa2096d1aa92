"""Who receives each message. Every record declares it (``@sent_to(WORKER)``), and
every receiver builds its handler table with ``handler_table`` when it starts: a
message it can receive without a handler fails there, naming the message, not as a
silent drop at run time."""

from __future__ import annotations

from collections.abc import Callable

WORKER = "worker"  # a rank: worker/worker.py, and a simulated light rank (host/light.py)
CONTROLLER = "controller"  # the controller's replies (controller/replies.py)
HOST_LINKS = "host links"  # the controller's end of a fanning-out host (controller/hosts.py)
RELAY = "relay"  # a host agent's fan-out of the controller's messages (host/fanout.py)
STORE_CLIENT = "store client"  # a worker's store channel (worker/store.py)
# the host agents' JSON lines (host_messages.py)
AGENT = "host agent"  # an agent's commands (host/control.py)
AGENT_RELAY = "agent relay"  # a remote agent's relay, from the controller (host/relay.py)
AGENT_LINK = "agent link"  # the controller's end of this host's agent (launchers/host_agent.py)
AGENT_CHANNEL = "agent channel"  # the controller's end of remote agents (remote_hosts.py)
AGENT_RANKS = "agent ranks"  # a rank's records, kept by the controller (agent_ranks.py)
AGENT_DOOR = "agent door"  # a kept-alive mesh's agent, to a controller that attaches (host/door.py)

_BY_RECEIVER: dict[str, list[type]] = {}


def sent_to(*receivers: str):
    """Declare a record's receivers (class decorator)."""

    def declare(cls: type) -> type:
        cls.receivers = receivers
        for r in receivers:
            _BY_RECEIVER.setdefault(r, []).append(cls)
        return cls

    return declare


def received_by(receiver: str) -> tuple[type, ...]:
    """The records ``receiver`` can receive (their modules imported: ``messages``)."""
    return tuple(_BY_RECEIVER.get(receiver, ()))


class MissingHandler(TypeError):
    """A receiver has no handler for a message it can receive."""


def handler_table(
    obj, receiver: str, prefix: str = "", refused=(), refuse: Callable | None = None
) -> dict[type, Callable]:
    """``obj``'s handler of each message ``receiver`` receives: its method named
    ``prefix`` + the message's class name, or ``refuse`` for the names in ``refused``;
    MissingHandler names every message with neither."""
    table, missing = {}, []
    for cls in received_by(receiver):
        handler = getattr(obj, prefix + cls.__name__, None)
        if handler is None and cls.__name__ in refused:
            handler = refuse
        if handler is None:
            missing.append(cls.__name__)
        else:
            table[cls] = handler
    if missing:
        raise MissingHandler(
            f"{type(obj).__name__} receives {', '.join(missing)} as a {receiver} but has "
            f"no handler: add {prefix}<Message> methods"
        )
    return table
