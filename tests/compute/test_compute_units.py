"""The L3 units behind their commands (wired on a real bus, as the rank wires them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.nn import functional

from services.compute.backward_unit import BackwardUnit
from services.compute.forward_unit import ForwardUnit
from services.compute.inference import generate_text, load_model_for_inference
from services.compute.model import build_model
from services.compute.operator_adapter import OperatorAdapter, OperatorUnavailable
from services.contract import Module, engine_pb2
from services.contract.bus import Bus
from services.jobspec import JobSpec, ModelSpec, spec_to_json

SPEC = ModelSpec(n_layers=1, d_model=32, n_heads=2, vocab_size=256)


def wired(micro_steps: int = 1):
    bus = Bus()
    adapter = OperatorAdapter(bus.emitter(Module.L3_OPERATOR_ADAPTER), "cpu")
    forward = ForwardUnit(
        bus.emitter(Module.L3_FORWARD_UNIT), bus.port(Module.L3_FORWARD_UNIT, Module.L3_OPERATOR_ADAPTER)
    )
    backward = BackwardUnit(bus.emitter(Module.L3_BACKWARD_UNIT), micro_steps=micro_steps)
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SelectOperators, adapter.select_operators)
    bus.subscribe(Module.L3_OPERATOR_ADAPTER, engine_pb2.SetComputePrecision, adapter.set_compute_precision)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.ConfigureForward, forward.configure_forward)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.RunForward, forward.run_forward)
    bus.subscribe(Module.L3_FORWARD_UNIT, engine_pb2.OperatorsReady, forward.on_operators_ready)
    bus.subscribe(Module.L3_BACKWARD_UNIT, engine_pb2.RunBackward, backward.run_backward)
    model = build_model(SPEC, 0)
    forward.attach(model)
    backward.attach(model.parameters())
    loop = {
        name: bus.port(Module.L2_TRAINING_LOOP, mod)
        for name, mod in (("forward", Module.L3_FORWARD_UNIT), ("backward", Module.L3_BACKWARD_UNIT))
    }
    precision = bus.port(Module.L2_MIXED_PRECISION, Module.L3_OPERATOR_ADAPTER)
    return model, loop, precision


def step(loop, x, y, *, normalizer=1.0, scale=1.0, backward=True):
    fwd = loop["forward"](engine_pb2.RunForward(training=backward), x)
    return fwd.payload, loop["backward"](
        engine_pb2.RunBackward(normalizer=normalizer, loss_scale=scale, backward=backward), (fwd.payload, y)
    ).message


def test_the_loss_ignores_padding_labels_and_counts_only_real_tokens():
    model, loop, _ = wired()
    _configure(loop)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    y[1, 5:] = -100
    logits, done = step(loop, x, y, backward=False)
    real = y != -100
    expected = functional.cross_entropy(logits[real], y[real], reduction="sum")
    assert done.tokens == 13
    assert done.loss_sum == pytest.approx(expected.item(), rel=1e-6)
    assert all(p.grad is None for p in model.parameters())  # evaluation makes no gradients


def _configure(loop):
    loop["forward"](engine_pb2.ConfigureForward(attention="sdpa"))


def test_backward_gradients_are_those_of_loss_sum_over_normalizer_times_scale():
    model, loop, _ = wired()
    _configure(loop)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    _, done = step(loop, x, y, normalizer=16.0, scale=1.0)
    g1 = model.tok_emb.weight.grad.clone()
    ref = build_model(SPEC, 0)
    (functional.cross_entropy(ref(x).reshape(-1, 256), y.reshape(-1), reduction="sum") / 16.0).backward()
    torch.testing.assert_close(g1, ref.tok_emb.weight.grad)
    _, _ = step(loop, x, y, normalizer=16.0, scale=4.0)  # micro_steps=1: a fresh window
    torch.testing.assert_close(model.tok_emb.weight.grad, 4.0 * g1)
    assert done.tokens == 16


def test_gradients_accumulate_within_a_window_and_restart_at_the_next():
    model, loop, _ = wired(micro_steps=2)
    _configure(loop)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    step(loop, x, y)
    g = model.tok_emb.weight.grad.clone()
    step(loop, x, y)
    torch.testing.assert_close(model.tok_emb.weight.grad, 2 * g)
    step(loop, x, y)  # third pass opens a new window
    torch.testing.assert_close(model.tok_emb.weight.grad, g)


def test_the_window_length_comes_with_run_backward_and_a_changed_length_starts_a_fresh_window():
    # A resize in place changes data.grad_accum (issue 16): the loop names it in RunBackward.
    model, loop, _ = wired(micro_steps=2)
    _configure(loop)
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))

    def run(micro_steps: int) -> torch.Tensor:
        fwd = loop["forward"](engine_pb2.RunForward(training=True), x)
        msg = engine_pb2.RunBackward(normalizer=1.0, loss_scale=1.0, backward=True, micro_steps=micro_steps)
        loop["backward"](msg, (fwd.payload, y))
        return model.tok_emb.weight.grad.clone()

    g = run(0)  # 0: the constructor's count (2), its first pass
    run(3)  # another count: a fresh window of 3, though the window of 2 was half done
    torch.testing.assert_close(model.tok_emb.weight.grad, g)
    run(3)
    torch.testing.assert_close(run(3), 3 * g)
    torch.testing.assert_close(run(3), g)  # the fourth pass at 3 opens the next window
    step(loop, x, y, backward=False)  # evaluation names no count: the window stays
    torch.testing.assert_close(run(3), 2 * g)


def test_the_forward_unit_refuses_to_run_before_operators_are_selected():
    _, loop, _ = wired()
    with pytest.raises(RuntimeError, match="no attention kernel selected"):
        loop["forward"](engine_pb2.RunForward(training=True), torch.zeros(1, 4, dtype=torch.long))


def test_the_operator_adapter_refuses_kernels_and_dtypes_it_does_not_have():
    _, loop, precision = wired()
    with pytest.raises(OperatorUnavailable, match="operators.attention: 'xformers' is not available"):
        loop["forward"](engine_pb2.ConfigureForward(attention="xformers"))
    with pytest.raises(OperatorUnavailable, match="dtype 'float8' is not supported"):
        precision(engine_pb2.SetComputePrecision(dtype="float8"))


def test_bfloat16_precision_runs_the_forward_in_bf16_autocast():
    _, loop, precision = wired()
    _configure(loop)
    precision(engine_pb2.SetComputePrecision(dtype="bfloat16"))
    fwd = loop["forward"](engine_pb2.RunForward(training=False), torch.zeros(1, 4, dtype=torch.long))
    assert fwd.payload.dtype == torch.bfloat16
    precision(engine_pb2.SetComputePrecision(dtype="float32"))
    fwd = loop["forward"](engine_pb2.RunForward(training=False), torch.zeros(1, 4, dtype=torch.long))
    assert fwd.payload.dtype == torch.float32


def test_a_checkpoint_loads_for_inference_and_generates_text(tmp_path):
    spec = JobSpec.model_validate(
        {"name": "gen", "steps": 1, "seed": 3, "model": SPEC.model_dump(), "data": {"dataset": "x@v1"}}
    )
    trained = build_model(spec.model, seed=99)  # weights that differ from a fresh seed-3 model
    dcp.save(
        {"model": trained.state_dict(), "train": {"step": torch.tensor(1)}},
        checkpoint_id=str(tmp_path / "v1"),
        no_dist=True,
    )
    loaded = load_model_for_inference(str(tmp_path / "v1"), spec)
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in loaded.state_dict().items())
    text = generate_text(str(tmp_path / "v1"), spec_to_json(spec), "def ", 12, temperature=0.0, top_k=0)
    assert text.startswith("def ") and len(text.encode("utf-8", errors="surrogateescape")) >= 4


def test_a_committed_version_is_checked_against_its_manifest_as_it_loads_for_inference(tmp_path):
    from pathlib import Path

    from services.compute.inference import ShardDigestMismatch
    from services.contract import store_pb2
    from services.store.checkpoint_manager import CheckpointManager

    spec = JobSpec.model_validate(
        {"name": "gen", "steps": 1, "seed": 3, "model": SPEC.model_dump(), "data": {"dataset": "x@v1"}}
    )
    manager = CheckpointManager(tmp_path)
    staged = manager.save_checkpoint(store_pb2.SaveCheckpoint(job_id="gen", step=1, rank=0)).staging_path
    dcp.save({"model": build_model(spec.model, seed=99).state_dict()}, checkpoint_id=staged, no_dist=True)
    path = manager.commit_checkpoint(store_pb2.CommitCheckpoint(job_id="gen", step=1, world_size=1)).path
    load_model_for_inference(path, spec)  # intact: loads
    shard = next(p for p in Path(path).iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardDigestMismatch, match=f"{shard.name}: sha256 mismatch"):
        load_model_for_inference(path, spec)


def test_a_model_trained_on_a_bpe_dataset_generates_through_its_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["def f(x):\n    return x + 1\n"] * 50, trainers.BpeTrainer(vocab_size=300, show_progress=False)
    )
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    model_spec = {**SPEC.model_dump(), "vocab_size": tok.get_vocab_size()}
    spec = JobSpec.model_validate({"name": "bpe", "steps": 1, "model": model_spec, "data": {"dataset": "bpe@v1"}})
    dcp.save({"model": build_model(spec.model, seed=1).state_dict()}, checkpoint_id=str(tmp_path / "v1"), no_dist=True)
    text = generate_text(
        str(tmp_path / "v1"), spec_to_json(spec), "def ", 8, temperature=0.0, top_k=0, tokenizer=str(tok_path)
    )
    assert text.startswith("def")
    with pytest.raises(ValueError, match="tokenizer 'bytes' needs model.vocab_size 256"):
        generate_text(str(tmp_path / "v1"), spec_to_json(spec), "def ", 8, tokenizer="bytes")
