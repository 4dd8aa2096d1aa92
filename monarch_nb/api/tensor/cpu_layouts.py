"""Where torch's meta kernels and its CPU kernels disagree about a result.

The controller learns an op's result layout from FakeTensor propagation, that is
from the op's meta kernel; the ranks run its real kernel. For most ops the two
agree. For the ops below, on the CPU, they do not: the meta kernel refuses what
the CPU kernel runs (``_grouped_mm`` in float32), or lays the result out otherwise
(``native_batch_norm`` of a transposed input: the CPU kernel's result is
contiguous, the meta kernel's takes the input's strides). A layout the controller
gets wrong makes a later ``view`` fail on the ranks where it runs locally, or the
reverse. For these ops, given inputs that are not all contiguous (for contiguous
ones the kernels agree), the controller asks the CPU kernel itself, once per plan:
it runs it on zeros of the inputs' layouts (a random op with a generator of its own)
and takes its results' strides.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

# ops whose CPU kernel lays its result out otherwise than its meta kernel, for inputs
# that are not contiguous (for contiguous ones the two agree): found by running every
# sample of torch's OpInfo database, forward and backward, on transposed, sliced,
# permuted and channels_last inputs and comparing the two (strides of size-1 dims aside)
STRIDES_FROM_CPU_KERNEL = frozenset(
    {
        aten._batch_norm_with_update.default,
        aten._fft_r2c.default,
        aten._log_softmax_backward_data.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_no_training.default,
        aten.batch_norm_backward.default,
        aten.channel_shuffle.default,
        aten.copysign.Tensor,
        aten.div.Tensor_mode,
        aten.floor_divide.default,
        aten.glu_backward.default,
        aten.heaviside.default,
        aten.huber_loss_backward.default,
        aten.ldexp.Tensor,
        aten.log_sigmoid_forward.default,
        aten.logaddexp.default,
        aten.logical_and.default,
        aten.logical_or.default,
        aten.logical_xor.default,
        aten.max_pool1d.default,
        aten.max_unpool2d.default,
        aten.mse_loss_backward.default,
        aten.native_batch_norm.default,
        aten.native_batch_norm_backward.default,
        aten.native_dropout_backward.default,
        aten.native_layer_norm_backward.default,
        aten.normal.Tensor_Tensor,
        aten.pow.Scalar,
        aten.reflection_pad2d_backward.default,
        aten.reflection_pad3d.default,
        aten.reflection_pad3d_backward.default,
        aten.replication_pad2d_backward.default,
        aten.replication_pad3d.default,
        aten.replication_pad3d_backward.default,
        aten.smooth_l1_loss_backward.default,
        aten.special_xlog1py.default,
        aten.xlogy.Tensor,
    }
)


def _grouped_mm_on_cpu(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm``'s result on the CPU, whose kernel takes float32 and
    float16 too (torch's meta kernel, written for CUDA's, takes only bfloat16): the
    experts of a MoE layer (``transformers``' Mixtral, Qwen-MoE). None: the meta
    kernel speaks."""
    if mat_a.device.type != "cpu" or mat_a.dtype == torch.bfloat16:
        return None
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a2 and b2) and mat_a.size(-1) != mat_b.size(-2):
        raise RuntimeError(
            f"contraction dimension of mat_a and mat_b must match (mat_a {tuple(mat_a.shape)}, "
            f"mat_b {tuple(mat_b.shape)})"
        )
    if a2 and b2:
        size = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif a2:
        size = (mat_a.size(0), mat_b.size(-1))
    elif b2:
        size = (mat_a.size(1), mat_b.size(1))
    else:
        size = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


# ops whose meta kernel refuses what their CPU kernel runs: the layout of the CPU
# kernel's result, asked before the meta kernel (whose refusal torch logs as an error)
_STAND_INS = {aten._grouped_mm.default: _grouped_mm_on_cpu}


def _cpu_not_contiguous(flat: list) -> bool:
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    return all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors) and not all(
        t.is_contiguous() for t in tensors
    )


def _cpu_strides(func, fargs, fkwargs, out):
    """``out`` (the meta kernel's fakes) with each tensor's strides those of the CPU
    kernel's result; ``out`` itself where the CPU kernel fails on zeros."""
    flat, spec = tree_flatten((fargs, fkwargs))
    with unset_fake_temporarily():
        # zeros of each input's size and strides (a kernel's result strides follow its
        # inputs' strides, not where they start in their storage)
        real_flat = [
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).zero_()
            if isinstance(x, torch.Tensor) else x
            for x in flat
        ]
        rargs, rkwargs = tree_unflatten(real_flat, spec)
        if any(a.name == "generator" for a in func._schema.arguments):
            # a random op draws from a generator of its own: the default one (under a
            # mesh, the ranks') is not touched
            rkwargs = {**rkwargs, "generator": torch.Generator()}
        try:
            real = func(*rargs, **rkwargs)
        except Exception:  # a kernel that checks the values (the meta one spoke)
            return out

    def restride(fake, r):
        if not (isinstance(fake, torch.Tensor) and isinstance(r, torch.Tensor)):
            return fake
        if fake.shape != r.shape or fake.stride() == r.stride():
            return fake
        return torch.empty_strided(fake.shape, r.stride(), dtype=fake.dtype, device=fake.device)

    if isinstance(out, torch.Tensor):
        return restride(out, real)
    if isinstance(out, (tuple, list)) and isinstance(real, (tuple, list)):
        return type(out)(restride(f, r) for f, r in zip(out, real))
    return out


def run_fake(func, fargs, fkwargs):
    """``func`` on FakeTensors (under the fake mode), its results laid out as the CPU
    kernel lays them out where the inputs are CPU tensors."""
    stand_in = _STAND_INS.get(func)
    out = None if stand_in is None else stand_in(*fargs, **fkwargs)
    if out is None:
        out = func(*fargs, **fkwargs)
    if func in STRIDES_FROM_CPU_KERNEL and _cpu_not_contiguous(tree_flatten((fargs, fkwargs))[0]):
        out = _cpu_strides(func, fargs, fkwargs, out)
    return out
