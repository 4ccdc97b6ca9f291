"""``init_from``: a new job starts from a checkpoint's weights (optionally its optimizer
state) or a Hugging Face directory, at step 0; the real composition root, fake relays (the
Hugging Face reader is the real relay's)."""

from __future__ import annotations

import pytest
import torch
from rank_fakes import LocalRank, tiny_spec, torch_threads
from safetensors.torch import load_file

from services.compute import hf_format
from services.compute.model import build_model
from services.contract import Module, engine_pb2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def started_only(spec, root, **kw) -> LocalRank:
    """A rank that loads, starts and stops before its first step: what it loaded is its state."""
    rank = LocalRank(spec, root, **kw)
    rank.command(engine_pb2.StopTraining(job_id="job", seq=1))
    rank.run()
    assert rank.error is None, rank.error
    return rank


def optimizer_state(rank: LocalRank) -> dict:
    port = rank.bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)
    return port(engine_pb2.ExportState()).payload.state_dict()["state"]


def optimizer_groups(rank: LocalRank) -> list:
    port = rank.bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)
    return [
        {k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "params"}
        for g in port(engine_pb2.ExportState()).payload.state_dict()["param_groups"]
    ]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoints_weights_start_a_new_job_at_step_0_with_a_fresh_or_the_saved_optimizer(tmp_path):
    source = LocalRank(tiny_spec(steps=3, checkpoint={"every_steps": 3, "at_end": False}), tmp_path)
    source.command(engine_pb2.StartTraining(job_id="job"))
    source.run()
    trained, moments = source.model_state(), optimizer_state(source)

    weights = started_only(tiny_spec(steps=5, seed=9, init_from={"checkpoint": "src:3"}), tmp_path)
    (start,) = weights.up.of(engine_pb2.TrainingLoopStarted)
    assert start.start_step == 0
    assert same(weights.model_state(), trained)
    fresh = optimizer_state(weights)
    assert all(not v["exp_avg"].any() for v in fresh.values())  # no moments: a fresh AdamW

    new_settings = {"lr": 1e-3, "weight_decay": 0.05, "beta2": 0.99}
    both = started_only(
        tiny_spec(
            steps=5, seed=9, optimizer=new_settings, init_from={"checkpoint": "src:3", "load": "weights+optimizer"}
        ),
        tmp_path,
    )
    assert same(both.model_state(), trained)
    loaded = optimizer_state(both)
    assert loaded.keys() == moments.keys()
    assert all(same(loaded[k], moments[k]) for k in moments)
    # the moments are the source's, the hyperparameters this job's spec
    groups = optimizer_groups(both)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0] and {g["betas"] for g in groups} == {(0.9, 0.99)}
    assert [g["weight_decay"] for g in optimizer_groups(source)] == [0.1, 0.0]


def test_a_job_started_from_weights_trains_from_step_1_on_its_own_schedule(tmp_path):
    source = LocalRank(tiny_spec(steps=3, checkpoint={"every_steps": 3, "at_end": False}), tmp_path)
    source.command(engine_pb2.StartTraining(job_id="job"))
    source.run()
    rank = LocalRank(tiny_spec(steps=2, init_from={"checkpoint": "src:3"}), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.run()
    assert rank.error is None
    steps = rank.steps()
    assert [s.step for s in steps] == [1, 2]
    assert steps[0].learning_rate == pytest.approx(3e-3)  # its own warmup (1 step), not the source's step 4
    assert steps[0].loss < source.steps()[0].loss  # it starts where the source ended, not at random


def test_hugging_face_weights_round_trip_bit_exact(tmp_path):
    spec = tiny_spec(steps=2, model={"tie_embeddings": False})
    original = build_model(spec.model, seed=5)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_format.save_hf(hf_dir, original.state_dict(), spec)

    rank = started_only(tiny_spec(steps=2, model={"tie_embeddings": False}, init_from={"hf": str(hf_dir)}), tmp_path)
    assert rank.up.of(engine_pb2.TrainingLoopStarted)[0].start_step == 0
    again = tmp_path / "again"
    again.mkdir()
    hf_format.save_hf(again, rank.model_state(), spec)  # what export writes from the loaded model
    a, b = load_file(hf_dir / hf_format.WEIGHTS), load_file(again / hf_format.WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_hugging_face_weights_of_another_shape_fail_the_start_as_a_config_error_naming_the_tensor(tmp_path):
    small = tiny_spec(steps=2, model={"d_model": 32})
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf_format.save_hf(hf_dir, build_model(small.model, seed=5).state_dict(), small)

    rank = LocalRank(tiny_spec(steps=2, init_from={"hf": str(hf_dir)}), tmp_path)
    rank.run()
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "config_error", failed
    assert "tensor model.embed_tokens.weight has shape [256, 32], this job's tok_emb.weight needs [256, 64]" in (
        failed.detail
    )
    assert not rank.steps()


def test_the_ranks_relay_reads_hugging_face_weights_without_asking_the_store_and_refuses_a_mismatch(tmp_path):
    from services.contract import route_pb2, store_pb2
    from services.contract.bus import Bus
    from services.rank.store_client import StoreClient, WeightsMismatch

    spec = tiny_spec(steps=2, model={"d_model": 32})
    hf_format.save_hf(tmp_path, build_model(spec.model, seed=5).state_dict(), spec)
    bus, up = Bus(), []
    client = StoreClient("127.0.0.1:1", bus.emitter(Module.L5_CHECKPOINT_MANAGER))  # nothing listens there
    bus.subscribe(Module.L5_CHECKPOINT_MANAGER, store_pb2.LoadCheckpoint, client.load_checkpoint)
    bus.subscribe(Module.L1_ORCHESTRATOR, store_pb2.SnapshotFailed, lambda m, p=None: up.append(m))
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L5_CHECKPOINT_MANAGER)
    try:
        into = {"model": {k: torch.zeros_like(v) for k, v in build_model(spec.model, seed=0).state_dict().items()}}
        into["model"]["_slot"] = torch.tensor([-1])
        loaded = port(store_pb2.LoadCheckpoint(hf_directory=str(tmp_path)), into).message
        assert (loaded.info.version, loaded.info.step) == (f"hf:{tmp_path}", 0)
        assert torch.equal(
            into["model"]["blocks.1.mlp.down.weight"], build_model(spec.model, seed=5).blocks[1].mlp.down.weight
        )
        assert into["model"]["_slot"].tolist() == [0] and up == []

        wrong = {"model": {"tok_emb.weight": torch.zeros(256, 64), "_slot": torch.tensor([-1])}}
        # refused as asked (the loop fails with it: config_error, fatal), no SnapshotFailed: the
        # orchestrator acts on those itself (a recovery's load), and a start's would wait
        with pytest.raises(WeightsMismatch, match=r"tok_emb.weight needs \[256, 64\]") as e:
            port(store_pb2.LoadCheckpoint(hf_directory=str(tmp_path)), wrong)
        assert e.value.fault_class == "config_error" and e.value.failure_cause == route_pb2.FAILURE_INVALID_INPUT
        assert not wrong["model"]["tok_emb.weight"].any()  # nothing copied
        assert up == []
    finally:
        client.close(timeout=1)


def test_a_version_the_store_refuses_fails_the_start_as_a_config_error_not_a_wait(tmp_path):
    """The store's answer to a version that is not there (typed INVALID_INPUT, published as
    L5-1's SnapshotFailed): the loop fails as config_error (graded fatal: the job stops)
    instead of leaving it to a SnapshotFailed that L1-1 acts on for a recovery's load only."""
    from services.contract import route_pb2

    class Refused(RuntimeError):  # what the store relay raises for NOT_FOUND
        failure_cause = route_pb2.FAILURE_INVALID_INPUT
        fault_class = "checkpoint_error"

    rank = LocalRank(tiny_spec(steps=2, init_from={"checkpoint": "gone-1:3"}), tmp_path)

    def refuse(msg, payload):
        raise Refused(f"checkpoint {msg.version} not found (have: src-1:1)")

    rank.store.load_checkpoint = refuse
    rank.run()
    (failed,) = rank.up.of(engine_pb2.TrainingLoopFailed)
    assert failed.fault_class == "config_error"
    assert failed.detail.endswith("init_from.checkpoint: gone-1:3: checkpoint gone-1:3 not found (have: src-1:1)")
    assert not rank.steps()
