"""Unit tier: every message declares who receives it, and every receiver's handler
table, built when it starts, covers what it can receive."""

from __future__ import annotations

import pytest

from monarch_nb.controller.replies import Replies
from monarch_nb.host.light import REFUSED, LightRank
from monarch_nb.protocol import messages as m
from monarch_nb.protocol import receivers
from monarch_nb.protocol.receivers import MissingHandler, handler_table, received_by
from monarch_nb.protocol.values import Args, DependentOn, Function, RemoteFailure
from monarch_nb.worker.worker import Worker

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser

FIELDS = {Args, DependentOn, Function, RemoteFailure, m.NDSlice}  # carried, never sent alone


def _records():
    return [
        c
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, tuple) and hasattr(c, "_fields")
    ]


def test_every_message_declares_its_receivers():
    undeclared = [c.__name__ for c in _records() if c not in FIELDS and not hasattr(c, "receivers")]
    assert not undeclared, f"messages without @sent_to: {undeclared}"
    known = {v for k, v in vars(receivers).items() if k.isupper() and not k.startswith("_")}
    for c in _records():
        assert set(getattr(c, "receivers", ())) <= known, c


def test_each_receiver_class_handles_all_it_receives():
    """The classes themselves (not instances: a Worker needs a socket): the same
    lookup the start-up check does, so a message added without its handler fails here
    as well as at start-up."""
    for cls, receiver, prefix, refused in (
        (Worker, receivers.WORKER, "", ()),
        (Replies, receivers.CONTROLLER, "", ()),
        (
            LightRank,
            receivers.WORKER,
            "on_",
            REFUSED,
        ),
    ):
        table = handler_table(cls, receiver, prefix, refused, refuse=lambda msg: None)
        assert set(table) == set(received_by(receiver)), cls
    assert m.DebuggerMessage in received_by(receivers.WORKER)
    assert m.DebuggerMessage in received_by(receivers.CONTROLLER)


def test_the_host_agents_records_and_their_receivers():
    from monarch_nb.host.agent import Agent
    from monarch_nb.host.relay import Relay
    from monarch_nb.host.sim_agent import SimAgent
    from monarch_nb.launchers.agent_ranks import RankBook
    from monarch_nb.launchers.host_agent import HostAgent
    from monarch_nb.launchers.remote_hosts import AgentChannel
    from monarch_nb.protocol import host_messages as hm

    assert all(getattr(c, "receivers", ()) for c in hm.TYPES.values())
    for cls, receiver, prefix in (
        (Agent, receivers.AGENT, "_on_"),
        (SimAgent, receivers.AGENT, "_on_"),
        (Relay, receivers.AGENT_RELAY, "_on_"),
        (HostAgent, receivers.AGENT_LINK, ""),
        (AgentChannel, receivers.AGENT_CHANNEL, "_on_"),
        (RankBook, receivers.AGENT_RANKS, "_rank_"),
    ):
        assert set(handler_table(cls, receiver, prefix)) == set(received_by(receiver)), cls


def test_a_missing_handler_fails_at_start_naming_the_messages():
    class HalfWorker:
        def RunOps(self, msg):
            pass

    with pytest.raises(MissingHandler) as e:
        handler_table(HalfWorker(), receivers.WORKER)
    text = str(e.value)
    assert text.startswith("HalfWorker receives ") and "CallFunction" in text
    assert "RunOps" not in text.split("but has")[0]
    refused = {c.__name__ for c in received_by(receivers.WORKER)} - {"RunOps"}
    table = handler_table(HalfWorker(), receivers.WORKER, refused=refused, refuse=print)
    assert table[m.CallFunction] is print and table[m.RunOps].__name__ == "RunOps"
