"""The tensor engine on a real program: the small transformer LM of
``benchmarks/lm.py`` (LayerNorm, causal attention, GELU MLP, dropout, AdamW,
clip_grad_norm_, LambdaLR, 2 accumulated micro-batches) trained unmodified under
``mesh.activate()`` on a real dp=2 mesh gives local torch's numbers bit for bit."""

from __future__ import annotations

import pickle

import pytest
import torch
from tensor_helpers import as_locally

import monarch_nb as mnb
from benchmarks import cnn, lm
from benchmarks.lm import one_thread

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
    with one_thread():
        model, opt, sched, data = lm.make()
        losses = [lm.step(model, opt, sched, data).detach().clone() for _ in range(STEPS)]
        return losses, model, _eval_loss(model, data)


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


def _commands_done(mesh) -> int:
    mesh.wait()
    return mesh.status()["ranks"][0]["streams"]["default"]["done"]


def test_the_lm_step_compiled_replays_and_gives_local_numbers(mesh):
    """AdamW's bias corrections and the scheduler's learning rate change every step:
    lifted into the recording's floats, each call is one replay with its own."""
    steps = 6
    with one_thread():
        model, opt, sched, data = lm.make()
        local = [lm.step(model, opt, sched, data).detach().clone() for _ in range(steps)]
    with mesh.activate():
        state = lm.make()
    step = mnb.compile(lambda: lm.step(*state))
    losses = [step() for _ in range(3)]  # recorded twice, then checked and replayed
    before = _commands_done(mesh)
    losses += [step() for _ in range(steps - 3)]
    assert _commands_done(mesh) - before == steps - 3  # one command a step
    for rank in (0, 1):
        for ours, theirs in zip(losses, local):
            assert torch.equal(mnb.inspect(ours, dp=rank), theirs)
    for p, q in zip(state[0].parameters(), model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q.detach())
        assert torch.equal(mnb.inspect(p.grad, dp=0), q.grad)
    assert state[1].param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_the_constant_lm_step_replays_pure_without_its_python(mesh):
    """The benchmark's replay ceiling (``pure_replay_vs_local_eager``): SGD at a constant
    rate reads nothing that changes, so ``pure=True`` replays it without running the
    step's Python (no op reaches the controller's dispatch), with local torch's numbers."""
    steps = 6
    with one_thread():
        model, opt, data = lm.make_constant()
        local = [lm.constant_step(model, opt, data).detach().clone() for _ in range(steps)]
    with mesh.activate():
        state = lm.make_constant()
    ran = []
    step = mnb.compile(lambda: ran.append(1) or lm.constant_step(*state), pure=True)
    losses = [step() for _ in range(3)]  # the momentum buffers' first step differs
    before, python = _commands_done(mesh), len(ran)
    losses += [step() for _ in range(steps - 3)]
    assert _commands_done(mesh) - before == steps - 3  # one command a step
    assert len(ran) == python  # replayed, its Python not run
    for rank in (0, 1):
        for ours, theirs in zip(losses, local):
            assert torch.equal(mnb.inspect(ours, dp=rank), theirs)
    for p, q in zip(state[0].parameters(), model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q.detach())


def test_the_lm_step_split_replays_its_gradients_pure_with_local_numbers(mesh):
    """The step at replay speed with AdamW and a scheduler: its gradients compiled pure
    (one command), the optimizer and scheduler stepping after it op by op; local
    torch's numbers, the scheduler's rate included."""
    steps = 6
    with one_thread():
        model, opt, sched, data = lm.make()
        local = [lm.step(model, opt, sched, data).detach().clone() for _ in range(steps)]
    with mesh.activate():
        net, adamw, lr, batch = lm.make()
    ran = []
    grads = mnb.compile(lambda: ran.append(1) or lm.grads_step(net, adamw, batch), pure=True)
    losses = [lm.split_step(grads, adamw, lr) for _ in range(3)]
    python = len(ran)
    losses += [lm.split_step(grads, adamw, lr) for _ in range(steps - 3)]
    assert len(ran) == python  # the gradients replayed, their Python not run
    for rank in (0, 1):
        for ours, theirs in zip(losses, local):
            assert torch.equal(mnb.inspect(ours, dp=rank), theirs)
    for p, q in zip(net.parameters(), model.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q.detach())
    assert adamw.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _cnn_step(net, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return loss


def test_a_cnn_with_batchnorm_trains_and_its_weights_travel_both_ways(mesh):
    with one_thread():
        local = cnn.make()
        local_losses = [_cnn_step(*local).item() for _ in range(3)]
        local[0].eval()
        local_eval = local[0](local[2]).detach()
    with mesh.activate():
        state = cnn.make()
        losses = [_cnn_step(*state) for _ in range(3)]
        state[0].eval()
        ours = state[0](state[2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = state[0](state[2])
    assert [mnb.inspect(t, dp=1).item() for t in losses] == local_losses
    assert torch.equal(mnb.inspect(ours, dp=1), local_eval)  # running stats in eval
    assert low.dtype == mnb.inspect(low).dtype == torch.bfloat16
    # the mesh's weights into a local model, and local weights onto the mesh
    fetched = {k: mnb.inspect(v) for k, v in state[0].state_dict().items()}
    fresh = cnn.make()[0]
    fresh.load_state_dict(fetched)
    fresh.eval()
    assert torch.equal(fresh(local[2]).detach(), local_eval)
    with mesh.activate():
        other = cnn.make()[0]
        other.load_state_dict(local[0].state_dict())
        other.eval()
        again = other(state[2])
    assert torch.equal(mnb.inspect(again, dp=1), local_eval)


def test_a_transformers_model_from_a_config_trains_as_locally(mesh, monkeypatch):
    """GPT-2 of the transformers package, built from a config (random weights, nothing
    downloaded), unmodified: op by op and compiled, local torch's numbers."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )

    def make():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randint(0, 64, (4, 16))

    def step(model, opt, ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    with one_thread():
        local = make()
        expect = [step(*local).item() for _ in range(5)]
    with mesh.activate():
        eager = make()
        assert [mnb.inspect(step(*eager)).item() for _ in range(5)] == expect
        state = make()
        compiled = mnb.compile(lambda: step(*state))
        losses = [compiled() for _ in range(4)]
        before = _commands_done(mesh)
        losses.append(compiled())
        assert _commands_done(mesh) - before == 1  # replayed
    assert [mnb.inspect(t, dp=1).item() for t in losses] == expect


def test_a_transformers_llama_trains_and_generates_as_locally(mesh, monkeypatch):
    """Llama of the transformers package from a config, with grouped-query attention
    and a padding mask: a training step, then greedy ``generate``, which failed with
    "aten.isin mixes a local tensor": its end-of-sequence id, a host scalar, became a
    local tensor of one dim (``unsqueeze``) that then met the mesh's tokens."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
    )

    def run():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(2, 50, (2, 8))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, :3] = 0
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        torch.optim.AdamW(model.parameters(), lr=1e-3).step()
        model.eval()
        made = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        return out.loss.detach(), model.lm_head.weight.detach(), made

    as_locally(mesh, run)


def _casts_and_a_step(model, x):
    """``to(device)``, ``float()``, ``double()`` and an SGD step, then a bfloat16 copy's
    forward: what a training script does to a model before it trains."""
    model.to("cpu").float()
    view = model[0].weight[0]  # a view, gone before the next cast
    del view
    model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    model.to(torch.bfloat16)
    return loss, model(x.to(torch.bfloat16))


def test_module_to_and_dtype_casts_swap_mesh_parameters_as_locally(mesh):
    """``Module.to()`` swaps each parameter of a tensor subclass with its converted
    copy (``torch.utils.swap_tensors``), which torch refuses for a tensor something
    references weakly: a mesh parameter (made by detaching, once viewed) is not."""
    with one_thread():
        torch.manual_seed(0)
        local = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        x = torch.randn(5, 4, dtype=torch.float64)
        local_loss, local_half = _casts_and_a_step(local, x)
    with mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        x = torch.randn(5, 4, dtype=torch.float64)
        weight = model[0].weight
        loss, half = _casts_and_a_step(model, x)
    assert type(weight) is mnb.Tensor and weight.dtype == torch.bfloat16
    assert weight is model[0].weight  # swapped in place: the module keeps its object
    for rank in (0, 1):
        assert torch.equal(mnb.inspect(loss, dp=rank), local_loss)
        assert torch.equal(mnb.inspect(half, dp=rank), local_half)
    for p, q in zip(model.parameters(), local.parameters()):
        assert torch.equal(mnb.inspect(p, dp=1), q.detach())


def test_torch_save_of_mesh_tensors_is_refused_naming_the_ways_that_work(mesh, tmp_path):
    """``torch.save(model.state_dict(), path)`` under a mesh wrote a file of worker
    references that failed only when loaded; now it fails at once, naming how to save
    them, and the fetched state dict saves and loads as locally."""
    with mesh.activate():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
    with pytest.raises(pickle.PicklingError, match=r"mnb\.inspect.*mesh\.save\(path, model="):
        torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(pickle.PicklingError, match="holds no values here"):
        pickle.dumps(model.weight)
    fetched = {k: mnb.inspect(v) for k, v in model.state_dict().items()}
    torch.save(fetched, tmp_path / "model.pt")
    torch.manual_seed(0)
    local = torch.nn.Linear(4, 2)
    loaded = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(loaded[k], v) for k, v in local.state_dict().items())
    # a function sent by value that refers to a mesh tensor: refused when sent (the
    # worker failed, "Ref 7 can only be resolved inside a worker command"); as an
    # argument it is the rank's shard
    bias = model.bias
    with pytest.raises(TypeError, match="refers to a mesh tensor.*pass the tensor as an arg"):
        mnb.remote(lambda: bias.sum().item())(mesh=mesh)
    total = mnb.remote(lambda b: b.sum().item())(bias, mesh=mesh).fetch(rank=1)
    assert total == pytest.approx(local.bias.sum().item())
    assert torch.equal(mnb.inspect(model.bias, dp=0), local.bias.detach())  # the mesh goes on


def test_a_transformer_encoders_padding_mask_in_inference_is_refused_or_runs_unnested(mesh):
    """nn.TransformerEncoder in eval under no_grad takes torch's fast path, which makes
    a nested tensor of a padding mask: on the mesh that failed with torch's "Internal
    error: NestedTensorImpl doesn't support sizes". It is refused naming the switch;
    with it, the encoder gives local torch's numbers (with the same switch)."""

    def run(nested: bool):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()
        x = torch.randn(2, 5, 16)
        mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
        with torch.inference_mode():
            return model(x, src_key_padding_mask=mask)

    with one_thread(), mesh.activate():
        with pytest.raises(NotImplementedError, match=r"enable_nested_tensor=False"):
            run(True)
        ours = run(False)
    with one_thread():
        local = run(False)
    assert torch.equal(mnb.inspect(ours, dp=1), local)


def _packed_lstm(sort: bool, batch_first: bool):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first)
    x = torch.randn(3, 6, 4) if batch_first else torch.randn(6, 3, 4)
    lengths = [6, 4, 2] if sort else [4, 6, 2]
    packed = torch.nn.utils.rnn.pack_padded_sequence(
        x, torch.tensor(lengths), batch_first=batch_first, enforce_sorted=sort
    )
    out, (h, _) = lstm(packed)
    padded, got_lengths = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first)
    (padded.sum() + h.sum()).backward()
    return [padded, h, lstm.weight_ih_l1.grad, out.data, got_lengths, out.batch_sizes]


@pytest.mark.parametrize("sort,batch_first", [(True, True), (True, False), (False, True)])
def test_a_packed_sequence_runs_as_local_torch(mesh, sort, batch_first):
    """An LSTM over pack_padded_sequence's result failed inside torch's C++ with "The
    tensor has a non-zero number of elements, but its data is not allocated yet" (the
    RNN reads batch_sizes here); then it was refused. Now batch_sizes are made here
    from the lengths the ranks agree on, and pack, the RNN, pad_packed_sequence and the
    backward give local torch's numbers; lengths the ranks disagree on are named."""
    ours, _ = as_locally(mesh, lambda: _packed_lstm(sort, batch_first))
    assert not any(isinstance(t, mnb.Tensor) for t in ours[-2:])  # local, as torch's
    with mesh.activate():
        x = torch.randn(2, 3, 4)
        differs = mnb.remote(_rank_value, propagate=lambda: torch.empty(()))()
        lengths = torch.stack([torch.tensor(3), differs.long() + 1])
        with pytest.raises(ValueError, match="ranks"):
            torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)


def _rank_value():
    return torch.tensor(float(mnb.current_rank()))


def test_a_sparse_embedding_is_refused_by_name_where_it_would_make_a_sparse_grad(mesh):
    """nn.Embedding(sparse=True) trained on the mesh failed in the ranks' backward with
    "copy_() between dense and sparse Tensors is not implemented"; its forward is now
    refused naming sparse=False, and without grad it runs as locally."""
    with one_thread():
        torch.manual_seed(0)
        local = torch.nn.Embedding(10, 3, sparse=True)
        want = local(torch.tensor([[1, 2], [3, 3]])).detach()
    with one_thread(), mesh.activate():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        idx = torch.tensor([[1, 2], [3, 3]])
        with pytest.raises(NotImplementedError, match="sparse=False"):
            emb(idx)
        with torch.no_grad():
            got = emb(idx)
    assert torch.equal(mnb.inspect(got, dp=1), want)


def test_copies_and_loads_of_local_tensors_inside_a_mesh_block_stay_local(mesh, tmp_path):
    """copy.deepcopy of a model with BatchNorm (its num_batches_tracked is a local host
    scalar), torch.optim.swa_utils.AveragedModel and torch.load inside a mesh block
    failed with torch's "Attempted to set the storage of a tensor on device 'meta'":
    copying or unpickling a local tensor made a mesh tensor first. They run as local
    torch; the copies of mesh tensors stay mesh tensors."""
    import copy

    def train_averaged():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        avg = torch.optim.swa_utils.AveragedModel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            avg.update_parameters(model)
        torch.optim.swa_utils.update_bn([torch.randn(8, 4) for _ in range(2)], avg)
        return avg

    with one_thread():
        local = train_averaged()
    with one_thread(), mesh.activate():
        ours = train_averaged()
        twin = copy.deepcopy(ours)
        saved = tmp_path / "local.pt"
        torch.save(local.state_dict(), saved)
        loaded = torch.load(saved)
        ours.load_state_dict(loaded)
    for (name, a), b in zip(ours.state_dict().items(), local.state_dict().values()):
        assert torch.equal(mnb.inspect(a) if isinstance(a, mnb.Tensor) else a, b), name
    assert all(not isinstance(t, mnb.Tensor) for t in loaded.values())
    assert isinstance(twin.module[0].weight, mnb.Tensor)
    assert not isinstance(twin.module[1].num_batches_tracked, mnb.Tensor)


def test_setting_data_of_a_mesh_tensor_does_it_on_the_ranks_as_local_torch_does(mesh):
    """'p.data = x' (vector_to_parameters, nn.utils.prune.remove do it) swapped the
    layout here and nothing on the ranks; then it was refused. Now each rank's shard
    takes x's storage too: the same numbers as local torch, the parameter the same
    object (its optimizer steps it), sharing x's storage and leaving its old views."""

    def run():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), 0.1)
        vec = torch.nn.utils.parameters_to_vector(model.parameters()) * 2
        torch.nn.utils.vector_to_parameters(vec, model.parameters())
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        torch.nn.utils.prune.l1_unstructured(model, "weight", amount=0.5)
        torch.nn.utils.prune.remove(model, "weight")
        w = torch.nn.Parameter(torch.zeros(2, 3))
        old_view = w.data[0]
        x = torch.arange(6.0)
        w.data = x
        (w * 3).sum().backward()
        x.add_(1)  # w shares x's storage
        old_view.add_(5)  # and no longer its old one
        w.data = torch.tensor([7.0, 8.0])  # a local value
        return [model.weight, model.bias, w, w.grad, x, old_view, torch.tensor(w.shape)]

    import torch.nn.utils.prune  # noqa: F401

    local = run()
    with mesh.activate():
        ours = run()
    for a, b in zip(ours, local):
        assert torch.equal(mnb.inspect(a.detach(), dp=1), b.detach())
    with mesh.activate():
        w = torch.zeros(3)
        with pytest.raises(TypeError, match="must be a tensor"):
            w.data = 3
        w.add_(1)
    _, borrow = mesh.stream("data-lend").borrow(w)
    with mesh.activate():
        with pytest.raises(mnb.RefUseError, match="borrowed by stream 'data-lend'"):
            w.data = torch.zeros(3)  # it writes w: its stream may not while lent
    borrow.drop()
    assert mnb.inspect(w).tolist() == [1.0] * 3
