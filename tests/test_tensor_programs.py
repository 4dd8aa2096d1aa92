"""Programs as users write them, run under ``mesh.activate()`` on a real dp=2 mesh: a
module's parameters are mesh tensors however it makes them, a loop over a DataLoader
of local data moves each batch as it would onto a GPU, and what cannot run is refused
by name."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensor_helpers import as_locally

import monarch_nb as mnb
from benchmarks.lm import one_thread


class _Clip(torch.nn.Module):
    """CLIP's learnable temperature and learnable scalars of a number (torch.tensor of
    a number stays a local host scalar under the mesh), a buffer of one too."""

    def __init__(self):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.proj = torch.nn.Linear(8, 8)
        self.gates = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.tensor(1.5))]
        )
        self.register_buffer("shift", torch.tensor(2.0))

    def forward(self, a, b):
        logits = self.logit_scale.exp() * self.proj(a) @ b.T
        return logits * self.gates[0] + self.gates[1] * self.shift


def _train_clip():
    torch.manual_seed(0)
    model = _Clip()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(model(torch.randn(4, 8), torch.randn(4, 8)), torch.arange(4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        losses.append(loss.detach())
    return model, losses


def test_a_modules_parameters_of_numbers_are_on_the_mesh_and_train_as_locally(mesh):
    """nn.Parameter(torch.tensor(x)) in a module built under the mesh stayed a local
    tensor (torch.tensor of a number is a local host scalar there), and the first op
    mixing it with mesh tensors was refused. A local parameter registered on a module
    under the mesh now goes to the mesh with its value: the model trains as locally."""
    with one_thread():
        local, local_losses = _train_clip()
    with one_thread(), mesh.activate():
        ours, losses = _train_clip()
        assert all(isinstance(p, mnb.Tensor) for p in ours.parameters())
        assert all(isinstance(p, torch.nn.Parameter) for p in ours.parameters())
        assert not isinstance(ours.shift, mnb.Tensor)  # a buffer of a number stays local
        with mnb.no_mesh():
            kept = torch.nn.Linear(2, 2)  # a module built in no_mesh() stays local
        assert not isinstance(kept.weight, mnb.Tensor)
    for a, b in zip(losses, local_losses):
        assert torch.equal(mnb.inspect(a, dp=1), b)
    for (name, a), b in zip(ours.named_parameters(), local.parameters()):
        assert torch.equal(mnb.inspect(a.detach(), dp=1), b.detach()), name


def test_what_cannot_be_a_mesh_parameter_is_refused_by_name(mesh):
    """A lazy module failed inside torch with "Creating a new Tensor subclass
    UninitializedParameter but the raw Tensor object is already associated to a python
    object"; a standalone parameter of a number failed naming only a "local tensor".
    Each now names the cause and what works, and the mesh goes on."""
    with mesh.activate():
        with pytest.raises(NotImplementedError, match=r"lazy modules.*nn\.Linear\(in, out\)"):
            torch.nn.LazyLinear(3)
        scale = torch.nn.Parameter(torch.tensor(0.5))
        with pytest.raises(mnb.RefUseError, match=r"requires grad.*torch\.full\(\(\), x"):
            scale * torch.ones(3)
        fixed = torch.full((), 0.5, requires_grad=True)
        out = (fixed * torch.ones(3)).sum()
        out.backward()
    assert mnb.inspect(out).item() == 1.5
    assert mnb.inspect(fixed.grad).item() == 3.0


def _fit(loader, model, opt, move):
    losses = []
    for xb, yb in loader:
        xb, yb = move(xb), move(yb)
        loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def test_a_dataloader_of_local_data_trains_with_each_batch_moved_by_mesh_tensor(mesh):
    """Data loaded here stays local under the mesh (a DataLoader's batches too), and an
    op mixing a local batch with the model's mesh parameters is refused: the message
    named only factories, and no call moved a local tensor as x.to(device) does.
    mesh.tensor(x) does (a tensor, array or list), and the loop trains as locally."""
    data = torch.utils.data.TensorDataset(torch.randn(12, 3), torch.randn(12, 1))

    def run(move):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        return _fit(loader, model, torch.optim.SGD(model.parameters(), 0.1), move), model

    with one_thread():
        local, local_model = run(lambda t: t)
    with one_thread(), mesh.activate():
        ours, model = run(mesh.tensor)
        with pytest.raises(mnb.RefUseError, match=r"mesh\.tensor\(x\)"):
            model(data[0][0])
        with pytest.raises(mnb.RefUseError, match=r"mesh\.tensor\(x\)"):
            data.tensors[0][torch.tensor([0, 1])]  # a local table indexed on the mesh
        from_array = mesh.tensor(np.arange(6.0).reshape(2, 3))
        from_list = mesh.tensor([[1, 2], [3, 4]])
        assert mesh.tensor(from_list) is from_list
        with pytest.raises(TypeError, match=r"mesh\.tensor\(\) takes .* not object"):
            mesh.tensor(object())
    for a, b in zip(ours, local):
        assert torch.equal(mnb.inspect(a, dp=1), b)
    assert torch.equal(mnb.inspect(model.weight.detach(), dp=1), local_model.weight.detach())
    assert mnb.inspect(from_array, dp=1).dtype == torch.float64
    assert mnb.inspect(from_list, dp=1).tolist() == [[1, 2], [3, 4]]


def test_random_split_and_a_dataloaders_worker_processes_train_as_locally(mesh):
    """random_split draws with generator=torch.default_generator, named: it drew here,
    so the ranks' generators did not advance and the model made after it had other
    weights than locally. A DataLoader with num_workers forks processes that inherit
    the mesh's mode: they failed collating ("set the storage of a tensor on device
    meta"); they now run torch locally."""
    data = torch.utils.data.TensorDataset(torch.randn(20, 3), torch.randn(20, 1))

    def run(move, workers):
        torch.manual_seed(0)
        train, _ = torch.utils.data.random_split(data, [16, 4])
        model = torch.nn.Linear(3, 1)
        loader = torch.utils.data.DataLoader(
            train, batch_size=4, shuffle=True, num_workers=workers
        )
        return _fit(loader, model, torch.optim.SGD(model.parameters(), 0.1), move), model

    for workers in (0, 2):
        with one_thread():
            local, local_model = run(lambda t: t, workers)
        with one_thread(), mesh.activate():
            ours, model = run(mesh.tensor, workers)
        for a, b in zip(ours, local, strict=True):
            assert torch.equal(mnb.inspect(a, dp=1), b), workers
        assert torch.equal(mnb.inspect(model.weight.detach(), dp=1), local_model.weight.detach())


def _float64_fit():
    torch.ones(2)  # planned under float32 (on the mesh)
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        x = torch.linspace(0, 1, 16)[:, None]
        y = torch.sin(torch.arange(16)[:, None] / 3)  # an integer tensor / a Python number
        losses = []
        for _ in range(3):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses + [model[0].weight.detach(), torch.randn(3), y]
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_default_dtype_set_here_holds_on_the_ranks(mesh):
    """torch.set_default_dtype(torch.float64) under the mesh: the controller planned
    float64 results while the ranks (processes of their own) made float32 ones, and a
    factory planned before the change stayed float32 here. The ranks now take this
    process's default before an op reaches them: a float64 fit gives local torch's
    numbers, and float32 again once the default is back."""
    ours, _ = as_locally(mesh, _float64_fit)  # torch.equal: of the same dtype too
    assert all(t.dtype == torch.float64 for t in ours)
    with mesh.activate():
        back = torch.ones(2) / 3
    assert back.dtype == torch.float32 and mnb.inspect(back, dp=1).dtype == torch.float32


def _ranks_settings():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.benchmark,
    )


def test_torchs_process_settings_set_here_hold_on_the_ranks(mesh):
    """torch.use_deterministic_algorithms(True), torch.set_float32_matmul_precision
    ("high") (TF32 on a GPU) and torch.backends.cudnn.benchmark set in the notebook did
    not reach the ranks, processes of their own: torch.empty gave uninitialised memory
    where local torch fills NaN, an op without a deterministic kernel ran, and a GPU
    mesh would have kept full-precision float32 matmuls. Each now holds on the ranks
    before the next op, and torch's defaults again once set back."""
    read = mnb.remote(_ranks_settings)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("high")
    cudnn = torch.backends.cudnn  # flags(): its attributes refuse a write once torch's
    benchmark = cudnn.flags(  # test utilities are imported (the OpInfo tests import them)
        enabled=cudnn.enabled, benchmark=True, deterministic=cudnn.deterministic
    )
    try:
        with benchmark, mesh.activate():
            empty = torch.empty(64)
            duplicates = torch.zeros(4).put_(torch.tensor([1, 1]), torch.ones(2))
        assert torch.isnan(mnb.inspect(empty, dp=1)).all()
        with pytest.raises(Exception, match="does not have a deterministic implementation"):
            mnb.inspect(duplicates, dp=0)
        assert read(mesh=mesh).fetch() == [(True, "high", True)] * 2
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
    with mesh.activate():
        again = torch.zeros(4).put_(torch.tensor([1, 1]), torch.ones(2))
    assert mnb.inspect(again, dp=0).tolist() == [0, 1, 0, 0]
    assert read(mesh=mesh).fetch() == [(False, "highest", False)] * 2


def test_torchs_newer_fp32_precision_api_is_named_and_the_ops_go_on(mesh, monkeypatch):
    """torch's per-backend fp32_precision API keeps a state that the getters of the
    older one refuse to read once it is used: a warning names it and what to use, the
    other settings still reach the ranks, and the ops go on."""
    from monarch_nb.api.tensor import defaults

    monkeypatch.setattr(defaults, "_warned", [False])  # once a process: this test's
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.warns(UserWarning, match="fp32_precision settings"):
            with mesh.activate():
                empty = torch.empty(8)
        assert torch.isnan(mnb.inspect(empty, dp=0)).all()
    finally:
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.use_deterministic_algorithms(False)
    with mesh.activate():
        assert mnb.inspect(torch.ones(2) * 3, dp=1).tolist() == [3, 3]
    assert mnb.remote(torch.are_deterministic_algorithms_enabled)(mesh=mesh).fetch() == [False] * 2


class _SumOverRanks(torch.autograd.Function):
    """Megatron's row-parallel output: all-reduce forward, the same gradient on
    every rank backward (what follows is replicated)."""

    @staticmethod
    def forward(ctx, t):
        return t.reduce("dp", "sum")

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_tensor_parallel_mlp_trains_with_local_torchs_gradients(mesh):
    """A tensor-parallel MLP written as users write one (Megatron): each rank holds
    rows of the first weight and columns of the second, and an autograd.Function
    all-reduces the output. reduce() itself is not differentiable (as torch's
    collectives): a backward through it fails with torch's "does not require grad".
    The output and each rank's gradient shard are local torch's, to float rounding
    (the sum over ranks adds in another order)."""
    torch.manual_seed(0)
    w1, w2, x = torch.randn(8, 4), torch.randn(3, 8), torch.randn(5, 4)
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    local = F.gelu(x @ a.T) @ b.T
    local.sum().backward()
    with mesh.activate():
        rows = mesh.tensor(w1, split="dp").requires_grad_()
        cols = mesh.tensor(w2.T.contiguous(), split="dp").requires_grad_()
        partial = F.gelu(mesh.tensor(x) @ rows.T) @ cols
        with pytest.raises(RuntimeError, match="does not require grad"):
            partial.reduce("dp", "sum").sum().backward()
        out = _SumOverRanks.apply(partial)
        out.sum().backward()
    for r in (0, 1):
        assert torch.allclose(mnb.inspect(out, dp=r), local.detach(), atol=1e-5)
        assert torch.allclose(mnb.inspect(rows.grad, dp=r), a.grad[4 * r :][:4], atol=1e-5)
        assert torch.allclose(mnb.inspect(cols.grad, dp=r), b.grad[:, 4 * r :][:, :4].T, atol=1e-5)


def _fails():
    raise ValueError("no value")


def test_a_write_through_a_detached_copy_that_fails_fails_its_base(mesh):
    """p.detach().copy_(v) (an EMA update; torch.compile writing a compiled
    optimizer step's results back into the parameters) writes p on the ranks, but when
    the write failed p kept its old values without a word: a detached copy joins no
    alias group here. The ranks now fail every value of the storages an op writes
    when it fails; a write that works still reaches the base."""
    with mesh.activate():
        bad = mnb.remote(_fails, propagate=lambda: torch.ones(3))()
        p = torch.nn.Parameter(torch.ones(3))
        with torch.no_grad():
            p.detach().copy_(bad)
        plain = torch.ones(3)
        plain.detach().mul_(bad)
        good = torch.ones(3)
        good.detach().mul_(2)
    for t in (p, plain):
        with pytest.raises(mnb.RemoteError, match="'_fails', which failed"):
            mnb.inspect(t, dp=1)
    assert mnb.inspect(good, dp=1).tolist() == [2, 2, 2]


def test_without_a_seed_under_the_mesh_every_rank_draws_the_same_numbers():
    """Each rank's generator had a seed of its own: a model made under the mesh
    without torch.manual_seed was another model on every rank (data-parallel
    replicas apart from the start, without a word). The ranks a first op reaches now
    draw from one seed, this process's (a torch.manual_seed here before the mesh makes
    the run repeat local torch's); a torch.manual_seed under the mesh before any op is
    kept."""
    for seed_under_the_mesh in (False, True):
        torch.manual_seed(3 if seed_under_the_mesh else 7)
        local = [torch.nn.Linear(4, 3).weight.detach(), torch.randn(5)]
        mesh = mnb.local_mesh(dp=2)  # new: no op has reached its ranks
        try:
            torch.manual_seed(7)
            with mesh.activate():
                if seed_under_the_mesh:
                    torch.manual_seed(3)
                ours = [torch.nn.Linear(4, 3).weight.detach(), torch.randn(5)]
            for a, b in zip(ours, local):
                assert torch.equal(mnb.inspect(a, dp=0), b)
                assert torch.equal(mnb.inspect(a, dp=1), b)
        finally:
            mesh.shutdown()


def _compressed_backward():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    pack, unpack = (lambda t: t.to(torch.bfloat16)), (lambda t: t.to(torch.float32))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = torch.tanh(layer(x)) * x
    y.sum().backward()
    return [x.grad, layer.weight.grad, layer.bias.grad]


def test_saved_tensor_hooks_shape_the_backward_as_locally(mesh):
    """Tensors saved through saved_tensors_hooks (activation compression to bfloat16,
    as users write it) were ignored by the ranks' one-command backward, which used the
    exact values they saved: other gradients than local torch's, without a word. A
    graph with such a saved tensor now runs its backward here, op by op, through the
    hooks."""
    as_locally(mesh, _compressed_backward)


def test_a_batch_split_over_dp_trains_data_parallel_as_the_whole_batch_locally(mesh):
    """mesh.tensor(batch, split="dp") gives rank i the i-th of equal chunks of dim 0 (a
    data-parallel batch from a local DataLoader): with the gradients averaged over dp,
    the replicas stay equal and follow local training on the whole batch (to float
    rounding: the mean is summed in another order)."""
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))

    def run(split):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        for xb, yb in torch.utils.data.DataLoader(data, batch_size=8):
            loss = F.mse_loss(model(split(xb)), split(yb))
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                if isinstance(p, mnb.Tensor):
                    p.grad.reduce_("dp", "avg")
            opt.step()
        return model

    with one_thread():
        local = run(lambda t: t)
    with one_thread(), mesh.activate():
        ours = run(lambda t: mesh.tensor(t, split="dp"))
        chunk = mesh.tensor(torch.arange(8).view(4, 2), split="dp")
        waves = mesh.tensor(torch.tensor([1 + 2j, 3 - 4j]), split="dp")
        with pytest.raises(ValueError, match=r"size 3 does not split in 2"):
            mesh.tensor(torch.ones(3), split="dp")
        with pytest.raises(ValueError, match=r"'tp' names no dims"):
            mesh.tensor(torch.ones(4), split="tp")
    assert chunk.shape == (2, 2)
    assert [mnb.inspect(chunk, dp=r).tolist() for r in (0, 1)] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
    ]
    assert [mnb.inspect(waves, dp=r).tolist() for r in (0, 1)] == [[1 + 2j], [3 - 4j]]
    w0, w1 = ours.weight.fetch()
    assert torch.equal(w0, w1)
    assert torch.allclose(w0, local.weight.detach(), atol=1e-6)


def test_a_split_batch_goes_to_each_rank_as_its_chunk_alone():
    """mesh.tensor(batch, split=...) sent the whole batch to every rank and scattered it
    with a collective: n times the bytes, and a reduce_scatter, each step. Each group of
    ranks now gets its chunk alone, in one command and no collective; with several dims
    the chunks go in mesh order, as a scatter's members; inside mnb.compile the values
    are the same."""
    mesh = mnb.local_mesh(dp=2, tp=2)
    try:
        batch = torch.arange(16.0).view(8, 2)
        since = time.time()
        by_dp = mesh.tensor(batch, split="dp")
        both = mesh.tensor(batch, split=("tp", "dp"))
        assert by_dp.shape == (4, 2) and both.shape == (2, 2)
        ranks = {r: mesh.coords(r) for r in mesh.ranks}
        for at in ranks.values():
            assert torch.equal(mnb.inspect(by_dp, **at), batch[at["dp"] * 4 :][:4])
            i = at["dp"] * 2 + at["tp"]
            assert torch.equal(mnb.inspect(both, **at), batch[i * 2 :][:2])
        records = [t for t in mesh.timeline() if t["end"] >= since]
        assert not [t for t in records if t["kind"] == "collective"]
        for r in ranks:
            sent = [t for t in records if t["rank"] == r and t["name"] == "mesh.tensor"]
            assert len(sent) == 2

        @mnb.compile
        def doubled(x):
            return mesh.tensor(x, split="dp") * 2

        for _ in range(3):
            out = doubled(batch)
            for at in ranks.values():
                assert torch.equal(mnb.inspect(out, **at), batch[at["dp"] * 4 :][:4] * 2)
    finally:
        mesh.shutdown()


def _two_steps(model, batch, **kwargs) -> list:
    """Two AdamW steps of a transformers model on ``batch()``: the losses."""
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    losses = []
    for _ in range(2):
        loss = model(**batch(), **kwargs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _mixtral(transformers, **kwargs):
    """A one-layer Mixtral of four experts, two a token."""
    return transformers.MixtralConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, **kwargs,
    )


def test_a_transformers_clip_trains_as_locally(mesh, monkeypatch):
    """CLIP of the transformers package from a config: its learnable temperature is
    nn.Parameter(torch.tensor(number)), which stayed local under the mesh, so the
    first step failed with "aten.mul.Tensor mixes a local tensor"."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    text = dict(small, vocab_size=50, max_position_embeddings=16)
    vision = dict(small, image_size=8, patch_size=4)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)

    def run():
        torch.manual_seed(0)
        model = transformers.CLIPModel(config)
        batch = lambda: dict(  # noqa: E731
            input_ids=torch.randint(0, 50, (2, 6)), pixel_values=torch.randn(2, 3, 8, 8)
        )
        return _two_steps(model, batch, return_loss=True) + [model.logit_scale.detach()]

    as_locally(mesh, run)


def test_grouped_mm_runs_in_float32_as_torchs_cpu_kernel_does(mesh):
    """torch._grouped_mm (a MoE layer's experts): torch's meta kernel, written for
    CUDA's, takes only bfloat16, so the layout of a float32 result could not be known
    here, while the CPU kernel runs it."""

    def run():
        torch.manual_seed(0)
        tokens = torch.randn(6, 4, requires_grad=True)
        experts = torch.randn(3, 4, 8, requires_grad=True)
        offs = torch.tensor([2, 2, 6], dtype=torch.int32)
        out = torch._grouped_mm(tokens, experts, offs=offs)
        out.square().sum().backward()
        return [out, tokens.grad, experts.grad]

    as_locally(mesh, run)
    with mesh.activate():  # a contraction that does not fit is refused here, as torch does
        with pytest.raises(RuntimeError, match="aten._grouped_mm: contraction dimension"):
            torch._grouped_mm(torch.randn(6, 4), torch.randn(3, 5, 8), offs=torch.tensor([6]))


def test_a_transformers_mixture_of_experts_trains_as_locally(mesh, monkeypatch):
    """Mixtral of the transformers package from a config: its experts run as one
    torch._grouped_mm, which failed at the first step ("Expected inputs of BF16")."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = _mixtral(transformers, output_router_logits=True)

    def batch():
        ids = torch.randint(0, 50, (2, 8))
        return dict(input_ids=ids, labels=ids)

    def run():
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config)
        return _two_steps(model, batch) + [p.detach() for p in model.parameters()]

    as_locally(mesh, run)


def test_an_op_a_package_defines_in_python_runs_on_ranks_that_never_imported_it(mesh):
    """transformers defines its MoE fallback as torch.library.custom_op at import; a
    graph of torch.compile (Mixtral in float32) calls it, and a rank, which never
    imported that module, failed: "operator transformers::grouped_mm_fallback is not
    registered in this worker". The op now travels with the module that defines it."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401 - it defines the op here

    from monarch_nb.protocol.aten import defining_module

    def eager():
        torch.manual_seed(0)
        tokens, experts = torch.randn(6, 4), torch.randn(3, 4, 8)
        offs = torch.tensor([2, 2, 6], dtype=torch.int32)
        return [torch.ops.transformers.grouped_mm_fallback(tokens, experts, offs)]

    name = "transformers::grouped_mm_fallback"
    assert defining_module(name) == "transformers.integrations.moe"
    assert defining_module("aten::mm") is None
    as_locally(mesh, eager)
    config = _mixtral(transformers)

    def compiled():
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config)
        inside = isinstance(model.lm_head.weight, mnb.Tensor)
        forward = torch.compile(model, backend=mnb.mesh_backend if inside else "aot_eager")
        ids = torch.randint(0, 50, (2, 8))
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach(), model.lm_head.weight.grad]

    torch._dynamo.reset()
    try:
        as_locally(mesh, compiled)
    finally:
        torch._dynamo.reset()


def test_a_torchscript_module_and_a_channels_last_cnn_train_as_locally(mesh):
    """torch.jit.script: from its second call TorchScript runs a differentiable graph
    whose ops read detached inputs, so the ranks' own backward reached no parameter
    and every grad was None there. channels_last parameters: the grads' layout was
    asked of a torch function 2.13 renamed (AttributeError at the first backward)."""

    def scripted():
        torch.manual_seed(0)
        model = torch.jit.script(
            torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        )
        opt = torch.optim.SGD(model.parameters(), 0.1)
        out = []
        for _ in range(3):
            loss = model(torch.randn(4, 3)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out + [p.detach() for p in model.parameters()]

    def channels_last():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()
        ).to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
        y = model(x)
        y.square().mean().backward()
        grad = model[0].weight.grad
        assert grad.stride() == model[0].weight.stride()  # the leaf's layout, as torch's
        return [y, grad]

    with one_thread():
        scripted()  # TorchScript's first calls profile (a plain graph): its numbers differ
    as_locally(mesh, scripted)
    as_locally(mesh, channels_last)


def test_results_are_laid_out_as_torchs_cpu_kernels_lay_them_out(mesh):
    """Where torch's meta kernel lays a result out otherwise than its CPU kernel
    (batch_norm of a transposed input: contiguous on the CPU, the input's strides in
    the meta kernel), the controller took the meta kernel's layout, so a `.view` that
    runs locally failed here, and a transformers PatchTST failed on the ranks."""

    def run():
        torch.manual_seed(0)
        x = torch.randn(6, 4, 16).transpose(1, 2).requires_grad_()
        normed = F.batch_norm(x, None, None, training=True)
        floored = torch.div(torch.randn(5, 10).t(), 0.3, rounding_mode="floor")
        logits = torch.randn(3, 7).t().requires_grad_()
        loss = F.mse_loss(normed, torch.randn(6, 16, 4)) + F.cross_entropy(logits, torch.arange(7) % 3)
        grads = torch.autograd.grad(loss, [x, logits])
        return [normed, normed.view(6, 64), floored, *grads]

    # first met inside mnb.compile (a CNN's BatchNorm): asking the CPU kernel touches no
    # generator (the ranks' state was asked for, which a recording cannot)
    normed = mnb.compile(lambda x: F.batch_norm(x.transpose(1, 2), None, None, training=True))
    with mesh.activate():
        torch.manual_seed(1)  # the ranks' generators: get_rng_state here asks them
        x = torch.randn(5, 3, 7)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert normed(x).view(5, 21).shape == (5, 21)
    ours, local = as_locally(mesh, run)
    assert [t.stride() for t in ours] == [t.stride() for t in local]


def test_a_transformers_t5_with_an_attention_mask_runs_under_mnb_compile(mesh, monkeypatch):
    """transformers' mask code asks ``padding_mask.all()`` (which it skips under
    torch.compile): under mnb.compile that raised RecordingError at the first call.
    Such a call now runs op by op from there, with local torch's numbers, and says
    where it asked, once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )

    def run():
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration(config)
        ids, labels = torch.randint(1, 50, (2, 6)), torch.randint(1, 50, (2, 4))
        loss_of = lambda: model(  # noqa: E731
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels
        ).loss
        if isinstance(ids, mnb.Tensor):
            loss_of = mnb.compile(loss_of)
        losses = [loss_of() for _ in range(3)]
        losses[-1].backward()
        return losses + [model.shared.weight.grad]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        as_locally(mesh, run)
    asked = [str(w.message) for w in caught if "asks the workers" in str(w.message)]
    assert len(asked) == 1 and "bool(t), at masking_utils.py:" in asked[0], asked
