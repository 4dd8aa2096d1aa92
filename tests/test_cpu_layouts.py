"""The controller's layouts of op results are the CPU kernels' (``cpu_layouts.py``):
every sample of torch's OpInfo database, forward and backward, on inputs that are
not contiguous (transposed, permuted, channels_last), run for real and through
``run_fake`` on FakeTensors; each result's strides must agree (size-1 dims and empty
results aside).
An op whose meta kernel lays results out otherwise and that the table lacks fails
here, naming it."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from monarch_nb.api.tensor.cpu_layouts import run_fake

pytest.importorskip("expecttest")  # torch.testing._internal imports it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

SAMPLES = 4  # per op and variant: the table was found with 16


def _differ(real: torch.Tensor, fake: torch.Tensor) -> bool:
    return real.shape == fake.shape and real.numel() > 1 and any(
        n > 1 and a != b for n, a, b in zip(real.shape, real.stride(), fake.stride())
    )


class _Compare(TorchDispatchMode):
    """Runs each op for real and through ``run_fake``; notes the ops whose results'
    strides differ."""

    def __init__(self, found: dict, where: str, mode: FakeTensorMode):
        super().__init__()
        self.found, self.where, self.mode = found, where, mode

    def __torch_dispatch__(self, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func.is_view or torch.Tag.inplace_view in func.tags:
            return out  # a view's layout is torch's own rule
        if all(t.is_contiguous() for t in tensors if t.layout == torch.strided):
            return out  # the kernels agree (and cpu_layouts.py asks only otherwise)
        try:
            with self.mode as mode:
                fargs, fkwargs = tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
                    (args, kwargs),
                )
                fake = run_fake(func, fargs, fkwargs)
        except Exception:  # an op FakeTensor cannot run: the dispatcher's errors, not ours
            return out
        for r, f in zip(tree_flatten(out)[0], tree_flatten(fake)[0]):
            if isinstance(r, torch.Tensor) and isinstance(f, torch.Tensor) and _differ(r, f):
                self.found.setdefault(str(func), self.where)
        return out


def _variant(t, how: str):
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.layout == torch.strided):
        return t
    grad, t = t.requires_grad, t.detach()
    if how == "transposed" and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    elif how == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    elif how == "permuted" and t.dim() >= 3:
        t = t.movedim(-1, -3).contiguous().movedim(-3, -1)
    return t.requires_grad_(grad)


def test_every_opinfo_sample_is_laid_out_as_the_cpu_kernel_lays_it_out():
    found: dict = {}
    mode = FakeTensorMode()
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            # the generator itself: OpInfo's tracking wrapper reads the stack (~50 ms a call)
            samples = op.sample_inputs_func(op, "cpu", torch.float32, op.supports_autograd)
            samples = list(itertools.islice(samples, SAMPLES))
        except Exception:
            continue
        for how in ("transposed", "channels_last", "permuted"):
            for s in samples:
                inp, args = _variant(s.input, how), tuple(_variant(a, how) for a in s.args)
                try:
                    with _Compare(found, f"{op.name} ({how})", mode):
                        _forward_backward(op, inp, args, s.kwargs)
                except Exception:  # a sample the variant breaks: torch's own error
                    continue
    assert not found, f"laid out otherwise than by the CPU kernel (add to cpu_layouts.py): {found}"


def _forward_backward(op, inp, args: tuple, kwargs: dict) -> None:
    out = op(inp, *args, **kwargs)
    outs, leaves = _requiring_grad(out), _requiring_grad((inp, args))
    if outs and leaves:
        torch.autograd.grad(sum(o.sum() for o in outs), leaves, allow_unused=True)


def _requiring_grad(x) -> list:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
