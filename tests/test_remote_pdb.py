"""Kernel tier: breakpoint() on workers becomes the debugger prompt in the notebook,
driven exactly as a person typing answers input_request messages (kc.input)."""

from __future__ import annotations

import pytest
from kernel_helpers import errors, errors_text, mesh_kernel, stream, text
from wait_helpers import wait_for

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def k(tmp_path_factory):
    with mesh_kernel(tmp_path_factory.mktemp("pdbkernel")) as kern:
        yield kern


class Typist:
    """Answers each input request with the next scripted line; records the prompts."""

    def __init__(self, k, answers):
        self.k = k
        self.answers = list(answers)
        self.prompts: list[str] = []

    def __call__(self, msg):
        self.prompts.append(msg["content"]["prompt"])
        line = self.answers.pop(0) if self.answers else "continue"
        self.k.kc.input(line)


def run_typed(k, code, answers, timeout=90):
    typist = Typist(k, answers)
    reply, msgs = k.run(code, timeout=timeout, allow_stdin=True, stdin_hook=typist)
    return reply, msgs, typist


def test_one_rank_inline_prompt(k):
    reply, msgs, t = run_typed(
        k,
        "%%monarch --ranks 1\nx = rank * 10\nbreakpoint()\ny = x + 1\nprint('y is', y)",
        ["p x", "ll", "n", "p y", "c"],
    )
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    assert t.prompts[:5] == ["(Pdb r1) "] * 5
    out = stream(msgs)
    assert "10" in out and "->\ty = x + 1" in out and "breakpoint()" in out
    assert "11" in out and "[rank 1] y is 11" in out


def test_two_ranks_list_attach_cast_continue(k):
    reply, msgs, t = run_typed(
        k,
        "%%monarch\nx = rank * 10 + 5\nbreakpoint()\nprint('done', rank)",
        ["list", "cast * p x", "attach 0", "p x + 1", "detach", "help", "continue"],
    )
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    assert t.prompts[0] == "(monarch-dbg) " and "(Pdb r0) " in t.prompts
    out = stream(msgs)
    assert "rank 0" in out and "rank 1" in out and "<monarch In[" in out  # list
    assert "[rank 0] 5" in out and "[rank 1] 15" in out  # cast, per rank
    assert "6" in out  # p x + 1 on rank 0
    assert "cast RANKS CMD" in out  # help
    assert "[rank 0] done 0" in out and "[rank 1] done 1" in out


def test_cast_folds_identical_outputs(k):
    reply, msgs, _ = run_typed(
        k, "%%monarch\nsame = 42\nbreakpoint()\npass", ["cast * p same", "continue"]
    )
    assert reply["content"]["status"] == "ok"
    assert "[ranks 0-1] 42" in stream(msgs)


def test_interact_in_a_session(k):
    reply, msgs, t = run_typed(
        k,
        "%%monarch --ranks 0\nz = 7\nbreakpoint()\npass",
        ["interact", "z * 6", "exit()", "c"],
    )
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    assert ">>> " in t.prompts
    out = stream(msgs)
    assert "*interactive*" in out and "42" in out


def test_breakpoint_on_a_side_stream_while_default_works(k):
    k.ok("%%monarch --stream side --noblock\nimport time\nw = 3\nbreakpoint()\nside_done = True")
    # the default stream keeps working while the side stream is paused
    k.ok("%%monarch\nprint('default ok', rank)")
    reply, msgs, t = run_typed(k, "%monarch_debug", ["cast * p w", "continue"])
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    assert "side" in stream(msgs) and "[ranks 0-1] 3" in stream(msgs)
    k.ok("%%monarch --stream side\nassert side_done")


def test_post_mortem(k):
    reply, msgs = k.run("%%monarch\ndef f(a):\n    b = a * 2\n    raise ValueError(b)\nf(rank + 1)")
    assert reply["content"]["status"] == "error"
    reply, msgs, t = run_typed(k, "%monarch_debug --post-mortem 1", ["p b", "w", "c"])
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    out = stream(msgs)
    assert "raise ValueError(b)" in out and "4" in out
    assert t.prompts[0] == "(Pdb r1) "


def test_kernel_without_stdin(k):
    # no allow_stdin: the cell says which ranks paused and goes on in the background
    reply, msgs = k.run("%%monarch --ranks 0\nq = 99\nbreakpoint()\nprint('after', q)")
    assert reply["content"]["status"] == "ok", errors_text(msgs)
    assert "paused in the debugger" in text(msgs) and "%monarch_debug" in text(msgs)
    assert not errors(msgs)
    reply, msgs = k.run("%monarch_debug list")
    assert "rank 0" in stream(msgs)
    reply, msgs = k.run("%monarch_debug cast 0 p q")
    assert "[rank 0] 99" in stream(msgs)
    k.ok("%monarch_debug continue")

    def listed() -> str:
        return stream(k.run("%monarch_debug list")[1])

    wait_for(lambda: "no paused debugger sessions" in listed(), 30, "rank 0 to go on", 0.1, listed)


def test_interrupt_while_paused(k):
    def interrupt(msg):  # the prompt is there: the rank is paused
        k.km.interrupt_kernel()

    reply, msgs = k.run(
        "%%monarch\nbreakpoint()\npass", timeout=60, allow_stdin=True, stdin_hook=interrupt
    )
    assert reply["content"]["status"] == "error"
    k.ok("%%monarch\nprint('alive', rank)")
    reply, msgs = k.run("%monarch_debug list")
    assert "no paused debugger sessions" in stream(msgs)


def test_bad_debug_arguments(k):
    for line in (
        "%monarch_debug frobnicate",
        "%monarch_debug --bogus",
        "%monarch_debug --mesh nope",
    ):
        reply, msgs = k.run(line)
        assert reply["content"]["status"] == "error", line
        assert stream(msgs, "stderr").startswith("UsageError"), line
    k.ok("%%monarch\npass")
