"""Conformance with torch's OpInfo database, as DTensor's ``test_dtensor_ops``: every
``op_db`` entry that supports float32 on the CPU runs its sample inputs on a real dp=2
mesh and locally, forward (the outputs) and backward (the inputs' grads), compared
exactly (``tests/opinfo_conformance.py``). What cannot run on mesh tensors is listed
below with its reason, and must fail with that clear error; nothing may give other
numbers. Random ops are compared by ``test_random_ops_with_a_seed_give_local_numbers``."""

from __future__ import annotations

import collections
import re

import pytest
import torch

import monarch_nb as mnb

pytest.importorskip("expecttest")  # torch.testing._internal imports it
import opinfo_conformance as conformance  # noqa: E402

_DATA = r"depends on the data|needs the values of a mesh tensor"
# (name|variant, "fwd" / "bwd" / "both") -> (the error it must raise, why)
EXPECTED_FAILURES = {
    ("sparse.sampled_addmm|", "both"): (r"mixes a local tensor", "sparse layouts stay local"),
    ("sparse.mm|reduce", "both"): (r"mixes a local tensor", "sparse layouts stay local"),
    ("tensor_split|", "both"): (
        _DATA + r"|data is not allocated",
        "torch reads a tensor of indices' values (pass a list)",
    ),
    ("nn.functional.linear_cross_entropy|chunked", "both"): (
        r"not registered in this worker",
        "torch registers its chunked custom op on the first call, on the controller only",
    ),
    ("nn.functional.linear_cross_entropy|chunked_none", "both"): (
        r"not registered in this worker",
        "torch registers its chunked custom op on the first call, on the controller only",
    ),
    ("fft.hfft|", "bwd"): (
        r"unresolved conjugated",
        "the lazy conjugate bit of a complex view is not tracked on the controller",
    ),
    ("signal.windows.kaiser|", "fwd"): (
        r"LocalResult",
        "built from torch.tensor(beta), a 0-dim host scalar: computed on the controller",
    ),
}
TOTALS: collections.Counter = collections.Counter()
KEYS = conformance.float32_op_keys()  # (key, supports autograd); the OpInfos when run


@pytest.fixture(scope="module")
def mesh():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank: the same kernels split the same way
    m = mnb.local_mesh(dp=2, name="opinfo")
    try:
        yield m
    finally:
        m.shutdown()
        torch.set_num_threads(threads)


_key = conformance.key


def _expected(op, direction: str):
    for d in (direction, "both"):
        if (_key(op), d) in EXPECTED_FAILURES:
            return EXPECTED_FAILURES[(_key(op), d)]
    return None


def _check(mesh, op, backward: bool) -> None:
    direction = "bwd" if backward else "fwd"
    expected = _expected(op, direction)
    outcomes = conformance.run_op(mesh, op, backward)
    for outcome, detail in outcomes:
        TOTALS[(direction, outcome)] += 1
        assert outcome != "wrong", f"{_key(op)} {direction}: other numbers than local torch"
        if outcome == "error":
            assert expected is not None, f"{_key(op)} {direction}: {detail}"
            assert re.search(expected[0], detail), f"{_key(op)} {direction}: {detail}"


@pytest.mark.parametrize("key", [k for k, _ in KEYS])
def test_forward(mesh, key):
    _check(mesh, conformance.op_named(key), backward=False)


@pytest.mark.parametrize("key", [k for k, grad in KEYS if grad])
def test_backward(mesh, key):
    _check(mesh, conformance.op_named(key), backward=True)


def test_conformance_totals():
    """Run last: the share of samples equal to local torch (``close``: the listed ops
    for which torch itself takes another formula for a tensor subclass)."""
    if not TOTALS:
        pytest.skip("run with the per-op tests")
    for direction, target in (("fwd", 0.98), ("bwd", 0.95)):
        ran = sum(v for (d, o), v in TOTALS.items() if d == direction and o != "skip")
        good = TOTALS[(direction, "equal")] + TOTALS[(direction, "close")]
        assert TOTALS[(direction, "wrong")] == 0
        print(f"{direction}: {good} of {ran} samples equal to local torch ({good / ran:.1%})")
        assert good / ran >= target, (direction, dict(TOTALS))


def test_random_ops_with_a_seed_give_local_numbers(mesh):
    """Dropout, bernoulli, normal_, uniform_, randperm, randint, multinomial: the same
    seed under the mesh (which seeds every rank) gives local torch's numbers."""

    def draws():
        torch.manual_seed(7)
        x = torch.ones(64)
        return [
            torch.nn.functional.dropout(x, 0.3),
            torch.bernoulli(torch.full((32,), 0.4)),
            torch.empty(16).normal_(),
            torch.empty(16).uniform_(-1, 1),
            torch.randperm(20),
            torch.randint(0, 9, (12,)),
            torch.multinomial(torch.ones(10), 5),
            torch.randn(3, 4),
        ]

    local = draws()
    with mesh.activate():
        ours = draws()
    for rank in (0, 1):
        for a, b in zip(ours, local):
            assert torch.equal(mnb.inspect(a, dp=rank), b)
