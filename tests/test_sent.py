"""Unit tests of ``controller/sent.py``: a rank's queued and running commands,
found by binary search in groups of commands with the same ranks, agree with a
walk of every command."""

import random

import pytest

from monarch_nb.controller.sent import SentGroups

pytestmark = pytest.mark.unit  # in-process: no worker, kernel or browser


def walk(entries, rank: int, started: int, finished: int) -> tuple:
    """The plain definition: every command of ``rank`` after both, and the one it runs."""
    queued, running = 0, None
    for e in entries:
        ident, ranks = e[0], e[1]
        if ident <= finished or rank not in ranks:
            continue
        if ident == started and started > finished:
            running = e
        elif ident > started:
            queued += 1
    return queued, running


def test_groups_agree_with_a_walk_of_every_command():
    rng = random.Random(7)
    meshes = [(0, 1, 2, 3), (0, 1), (2, 3), (1,)]
    for trial in range(200):
        entries, ident = [], 0
        for _ in range(rng.randrange(0, 60)):
            ident += rng.randrange(1, 3)
            ranks = rng.choice(meshes)
            if rng.random() < 0.3:
                ranks = tuple(list(ranks))  # an equal tuple that is another object
            entries.append((ident, ranks, f"c{ident}", float(ident)))
        if trial % 5 == 0 and len(entries) > 2:  # two threads sent out of ident order
            i = rng.randrange(len(entries) - 1)
            entries[i], entries[i + 1] = entries[i + 1], entries[i]
        groups = SentGroups(entries)
        for rank in range(4):
            for _ in range(5):
                finished = rng.randrange(0, ident + 2)
                started = rng.choice([finished, finished + rng.randrange(0, 6)])
                assert groups.of(rank, started, finished) == walk(
                    entries, rank, started, finished
                ), (entries, rank, started, finished)


def test_a_running_command_and_the_queue_behind_it():
    everyone, first = (0, 1), (0,)
    entries = [(1, everyone, "a", 0.0), (2, first, "b", 0.0), (3, everyone, "c", 0.0)]
    groups = SentGroups(entries)
    assert groups.of(0, 2, 1) == (1, entries[1])  # runs b, c waits
    assert groups.of(1, 2, 1) == (1, None)  # b is not rank 1's
    assert groups.of(0, 3, 3) == (0, None)
    assert SentGroups(()).of(0, 5, 4) == (0, None)
