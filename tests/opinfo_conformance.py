"""Running torch's OpInfo database (``op_db``) on a mesh against local torch, as
DTensor's ``test_dtensor_ops`` does: the samples of every op that supports float32 on
the CPU, forward (the outputs) and backward (the input's grad), compared exactly.

Used by ``tests/test_tensor_opinfo.py``; ``python tests/opinfo_conformance.py``
prints the outcome of every op (what builds the expected-failure table).
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import tempfile
import time
import warnings
from unittest import mock

import torch
from torch.utils._pytree import tree_flatten, tree_map

import monarch_nb as mnb

warnings.filterwarnings("ignore", message="To copy construct from a tensor")

# torch picks another formula for a tensor subclass (isTensorSubclassLike: the SVD or
# eigendecomposition with vectors where local torch skips them, composite-compliant
# backward formulas): the same math, other last bits; compared to 1e-5 (rel.)
SUBCLASS_FORMULA = {
    "linalg.svdvals": "svdvals computes the vectors too for a subclass (_may_require_fw_or_bw_grad)",
    "linalg.cond": "through svdvals (its vectors computed for a subclass)",
    "linalg.matrix_norm": "the nuclear and 2-norms through svdvals (vectors computed for a subclass)",
    "norm": "the nuclear norm through svdvals (vectors computed for a subclass)",
    "linalg.norm": "the nuclear and 2-norms through svdvals (vectors computed for a subclass)",
    "linalg.pinv": "through the SVD (vectors computed for a subclass)",
    "linalg.matrix_rank": "through svdvals (vectors computed for a subclass)",
    "linalg.eigvalsh": "eigvalsh computes the vectors too for a subclass",
    "prod": "prod's backward takes the composite-compliant formula for a subclass",
}
# ops whose local result itself differs in the last bits from one call to the next on
# the same values: compared to 1e-5 (rel.) as well
NOT_REPEATABLE = {
    "linalg.lstsq": "LAPACK's gelsy driver gives other last bits on a clone of the same inputs, locally too",
}
CLOSE_ENOUGH = {**SUBCLASS_FORMULA, **NOT_REPEATABLE}
FORWARD_SAMPLES = 6  # per op, at most (the database has ~19,000 in all)
BACKWARD_SAMPLES = 3
# random ops: compared by their own test (a seed on the mesh gives local numbers)
RANDOM = ("normal", "bernoulli", "rand", "randn", "randint", "randperm", "dropout", "multinomial", "uniform", "exponential", "geometric", "cauchy", "log_normal", "empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided", "empty_permuted")


def key(op) -> str:
    """An OpInfo's name and variant: what the tests and the expected failures name."""
    return f"{op.name}|{op.variant_test_name}"


def float32_op_keys() -> list[tuple[str, bool]]:
    """(key, supports autograd) of each of ``float32_ops()``, cached in this user's temp
    directory by torch's version and the database's file: importing the database costs
    ~4 s of CPU, paid once, not by every process that collects the tests (pytest-xdist's)."""
    spec = importlib.util.find_spec("torch.testing._internal.common_methods_invocations")
    here = os.stat(__file__)
    st = os.stat(spec.origin)
    tag = (torch.__version__, spec.origin, st.st_mtime_ns, here.st_mtime_ns, here.st_size)
    digest = hashlib.sha256(repr(tag).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"monarch-nb-tests-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, f"opinfo-{digest}.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds it; the others read it
        try:
            with open(path) as f:
                return [(k, grad) for k, grad in json.load(f)]
        except (OSError, ValueError):
            pass
        keys = [(key(op), op.supports_autograd) for op in float32_ops()]
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(keys, f)
        os.replace(f"{path}.{os.getpid()}", path)
        _prune(folder, keep=os.path.basename(path))
        return keys


def _prune(folder: str, keep: str, age: float = 2 * 86400.0) -> None:
    """Remove other checkouts' (or torch versions') key files unused for ``age`` s (each
    clone of the repository makes its own; relatime updates a read file's atime daily).
    One still in use is rebuilt if need be."""
    now = time.time()
    for name in os.listdir(folder):
        if name.startswith("opinfo-") and not name.startswith(keep):
            try:
                st = os.stat(os.path.join(folder, name))
                if now - max(st.st_atime, st.st_mtime) > age:
                    os.unlink(os.path.join(folder, name))
            except OSError:
                pass


_BY_KEY: dict = {}


def op_named(k: str):
    """The OpInfo of key ``k`` (the database imported on first use)."""
    if not _BY_KEY:
        _BY_KEY.update((key(op), op) for op in float32_ops())
    return _BY_KEY[k]


def float32_ops():
    """The OpInfos that support float32 on the CPU, less the random and empty ones."""
    from torch.testing._internal.common_methods_invocations import op_db

    out = []
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        if any(r in op.name for r in RANDOM):
            continue
        out.append(op)
    return out


def _samples(op, requires_grad: bool, limit: int) -> list:
    # torch's sample iterator looks for a unittest.TestCase up the stack (inspect.stack(),
    # which reads the source of every frame: a third of this suite's time under pytest);
    # under pytest it finds none, so naming that outcome gives the same samples and seed
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    with (
        warnings.catch_warnings(),
        mock.patch.object(core, "extract_test_fn", _no_test_fn),
        mock.patch.object(common_utils, "extract_test_fn", _no_test_fn),
    ):
        warnings.simplefilter("ignore")
        out = []
        for s in op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad):
            out.append(s)
            if len(out) >= limit:
                break
    return out


def _no_test_fn():
    return None


def _to_mesh(x):
    """A local tensor's copy on the active mesh: its whole storage, and the same view
    of it (size, stride, storage offset), so non-contiguous samples stay so."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.layout != torch.strided:
        return x  # a sparse input stays local: the op refuses it by name
    n = x.untyped_storage().nbytes() // x.element_size()
    flat = torch.empty(n, dtype=x.dtype)
    with torch.no_grad():
        flat.copy_(x.detach().as_strided((n,), (1,), 0))
        t = flat.as_strided(x.shape, x.stride(), x.storage_offset())
    assert isinstance(t, mnb.Tensor)
    if x.requires_grad:
        t.requires_grad_(True)
    return t


def _same(ours, theirs) -> bool:
    try:
        return _same_values(ours, theirs)
    except (NotImplementedError, RuntimeError):  # a dtype torch.equal lacks (complex32)
        return _same_values(_widened(ours), _widened(theirs))


def _widened(x):
    return tree_map(lambda t: t.to(torch.complex64) if isinstance(t, torch.Tensor) and t.is_complex() else t, x)


def _same_values(ours, theirs) -> bool:
    if isinstance(theirs, torch.Tensor) and theirs.layout != torch.strided:
        theirs = theirs.to_dense()
    if isinstance(ours, torch.Tensor) and ours.layout != torch.strided:
        ours = ours.to_dense()
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor) or ours.shape != theirs.shape:
            return False
        if ours.dtype != theirs.dtype:
            return False
        return bool(torch.equal(ours, theirs)) or bool(
            ((ours == theirs) | (ours.isnan() & theirs.isnan())).all()
            if ours.is_floating_point() or ours.is_complex()
            else False
        )
    if isinstance(theirs, (tuple, list)):
        return len(ours) == len(theirs) and all(_same_values(a, b) for a, b in zip(ours, theirs))
    if isinstance(theirs, float) and isinstance(ours, float):
        return ours == theirs or (math.isnan(ours) and math.isnan(theirs))
    return ours == theirs


def _fetch(out):
    return tree_map(lambda t: mnb.inspect(t, timeout=60) if isinstance(t, mnb.Tensor) else t, out)


def _grads(out, args):
    """The grads of the differentiable inputs ``args`` of the sum of the outputs
    (None for an input the outputs do not depend on), or None: nothing to take."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    inputs = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
    if not leaves or not inputs:
        return None
    target = sum(t.float().sum() for t in leaves)
    return list(torch.autograd.grad(target, inputs, allow_unused=True))


def run_sample(mesh, op, sample, backward: bool) -> tuple[str, str]:
    """``(outcome, detail)``: "equal", "wrong" (numbers differ), "error" (the mesh raised
    where local torch did not: detail names it) or "skip" (local torch raised)."""
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    try:
        local = op(*args, **kwargs)
        if backward:
            local = _grads(local, (args, kwargs))
            if local is None:
                return "skip", "no differentiable output"
    except Exception as e:
        return "skip", f"local: {type(e).__name__}"
    try:
        with mesh.activate():
            margs, mkwargs = tree_map(_to_mesh, (args, kwargs))
            ours = op(*margs, **mkwargs)
            if backward:
                ours = _grads(ours, (margs, mkwargs))
        flat = tree_flatten(ours)[0]
        if any(isinstance(t, torch.Tensor) and not isinstance(t, mnb.Tensor) for t in flat):
            return "error", "LocalResult: a result was computed on the controller"
        ours = _fetch(ours)
    except Exception as e:
        return "error", f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
    if _same(ours, local):
        return "equal", ""
    if op.name in CLOSE_ENOUGH and _close(ours, local):
        return "close", CLOSE_ENOUGH[op.name]
    return "wrong", ""


def _close(ours, theirs) -> bool:
    try:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
        return True
    except (AssertionError, TypeError, ValueError, RuntimeError):
        return False


def run_op(mesh, op, backward: bool) -> list[tuple[str, str]]:
    samples = _samples(op, backward, BACKWARD_SAMPLES if backward else FORWARD_SAMPLES)
    return [run_sample(mesh, op, s, backward) for s in samples]


def main() -> None:
    torch.set_num_threads(1)
    mesh = mnb.local_mesh(dp=2, name="opinfo")
    totals = collections.Counter()
    try:
        for op in float32_ops():
            for backward in (False, True):
                if backward and not op.supports_autograd:
                    continue
                outcomes = run_op(mesh, op, backward)
                kinds = collections.Counter(o for o, _ in outcomes)
                for k, v in kinds.items():
                    totals[(backward, k)] += v
                bad = [d for o, d in outcomes if o in ("error", "wrong")]
                if bad:
                    tag = "bwd" if backward else "fwd"
                    wrong = kinds.get("wrong", 0)
                    print(f"{op.name}|{op.variant_test_name}|{tag}|{kinds.get('equal', 0)} equal|{wrong} wrong|{bad[0] if kinds.get('error') else ''}", flush=True)
    finally:
        mesh.shutdown()
    print(dict(totals))


if __name__ == "__main__":
    main()
