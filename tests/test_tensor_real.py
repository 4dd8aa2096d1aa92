"""The tensor engine on a real program: the small transformer LM of
``benchmarks/lm.py`` (LayerNorm, causal attention, GELU MLP, dropout, AdamW,
clip_grad_norm_, LambdaLR, 2 accumulated micro-batches) trained unmodified under
``mesh.activate()`` on a real dp=2 mesh gives local torch's numbers bit for bit."""

from __future__ import annotations

import pytest
import torch

import monarch_nb as mnb
from benchmarks import lm

STEPS = 3


@pytest.fixture(scope="module")
def mesh():
    m = mnb.local_mesh(dp=2, name="tensor-real")
    try:
        yield m
    finally:
        m.shutdown()


def _eval_loss(model, data):
    model.eval()
    with torch.no_grad():
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, lm.VOCAB), data[:, 1:].reshape(-1)
        )
    with torch.inference_mode():
        again = model(data[:, :-1])
    model.train()
    return loss, again


def _local_run():
    """The reference, on one thread as each rank of a dp=2 mesh here (another count
    splits reductions otherwise and changes the last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, sched, data = lm.make()
        losses = [lm.step(model, opt, sched, data).detach().clone() for _ in range(STEPS)]
        return losses, model, _eval_loss(model, data)
    finally:
        torch.set_num_threads(threads)


def test_the_lm_trains_on_the_mesh_exactly_as_locally(mesh):
    local_losses, local_model, (local_eval, local_logits) = _local_run()
    with mesh.activate():
        model, opt, sched, data = lm.make()
        losses = [lm.step(model, opt, sched, data) for _ in range(STEPS)]
        eval_loss, logits = _eval_loss(model, data)
    for rank in (0, 1):
        for ours, theirs in zip(losses, local_losses):
            assert torch.equal(mnb.inspect(ours, dp=rank), theirs)
        assert torch.equal(mnb.inspect(eval_loss, dp=rank), local_eval)
        assert torch.equal(mnb.inspect(logits, dp=rank), local_logits)
    for (name, p), q in zip(model.named_parameters(), local_model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q.detach()), name
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_last_lr()[0])
