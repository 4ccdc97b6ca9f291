"""The loop's own checkpoint state (LoopState) and safe loading, in one process."""

from __future__ import annotations

import pickle
import random
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from services.compute.inference import SafeFileSystemReader, safe_load
from services.contract import data_pb2, engine_pb2
from services.engine.rng_streams import capture, restore, seed
from services.engine.training_loop import DATA_FORMAT, LoopState, data_format, data_order, data_order_changes
from services.jobspec import parse_job_spec
from tests.conftest import REPO


def draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.standard_normal(3).tolist(),
        np.random.randint(0, 1 << 30),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def loop_stub(rank: int = 1, world: int = 2, **kw) -> SimpleNamespace:
    spec = SimpleNamespace(
        data=SimpleNamespace(
            shuffle_seed=kw.get("seed", 1234),
            shuffle=True,
            seq_len=64,
            pack="pack",
            micro_batch_size=4,
            grad_accum=2,
            mixture=None,
        )
    )
    scaler = kw.get("scaler")  # an fp16 scaler's LossScalerState, else fp32's placeholder
    return SimpleNamespace(
        _rank=rank,
        _world=world,
        _dp_size=world,
        _spec=spec,
        _step=kw.get("step", 0),
        _skipped=kw.get("skipped", 0),
        _consecutive_skips=kw.get("consecutive", 0),
        _scaler_state=scaler or engine_pb2.LossScalerState(scale=1.0),
        _dynamic_scaling=scaler is not None,
        _resume_scaler=None,
        _position=kw.get("position", data_pb2.DataPosition()),
        _loaded_order=None,
    )


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming single process"
        yield


def test_every_rng_stream_and_the_data_position_come_back_from_a_checkpoint_loaded_weights_only(tmp_path):
    seed(7, 1)
    draws()
    random.gauss(0, 1)  # a cached second gaussian in python's state ...
    np.random.standard_normal(1)  # ... and in numpy's (has_gauss = 1)
    saved = LoopState(loop_stub(step=42, skipped=3, position=data_pb2.DataPosition(epoch=2, row=17)))
    dcp.save({"train": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = draws()

    seed(99, 0)  # another process, other streams
    draws()
    fresh = loop_stub()
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "ckpt"), no_dist=True)
    assert draws() == expected
    assert (fresh._step, fresh._skipped, fresh._consecutive_skips, fresh._resume_scaler) == (42, 3, 0, None)
    assert fresh._position == data_pb2.DataPosition(epoch=2, row=17)
    # seed, shuffle, seq_len, pack, global batch, the position's format
    assert fresh._loaded_order == (1234, 1, 64, 1, 4 * 2 * 2, DATA_FORMAT, 0) and DATA_FORMAT == 2


def test_a_checkpoint_of_the_position_format_before_rows_loads_and_names_its_format(tmp_path):
    """Written before positions were rows: data_position [epoch, document, offset] and a
    data_order of five values. It loads (the sizes differ from this build's) and says format 1,
    so the loop refuses it by name; its document is never read as a row."""
    old = LoopState(loop_stub(step=6))
    state = old.state_dict()
    state["data_position"] = torch.tensor([1, 9, 3], dtype=torch.int64)
    state["data_order"] = state["data_order"][:5]
    dcp.save({"train": state}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = loop_stub()
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "ckpt"), no_dist=True)
    assert fresh._step == 6 and data_format(fresh._loaded_order) == 1
    assert fresh._position == data_pb2.DataPosition(epoch=1)


def test_the_data_positions_format_comes_back_and_a_checkpoint_written_without_it_loads_as_empty(tmp_path):
    """DataPosition.format (the sample-sequence format, services/data/sample_index.py) is
    kept after [epoch, row]; a checkpoint of [epoch, row] alone (before it was kept) loads as
    the empty format, which the data service reads as the same sequence."""
    position = data_pb2.DataPosition(epoch=3, row=40, format="rows-v1")
    dcp.save({"train": LoopState(loop_stub(step=8, position=position))}, checkpoint_id=str(tmp_path / "new"))
    fresh = loop_stub()
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "new"), no_dist=True)
    assert fresh._position == position and fresh._position.format == "rows-v1"

    before = LoopState(loop_stub(step=8, position=position)).state_dict()
    before["data_position"] = before["data_position"][:2]  # as written before the format was kept
    dcp.save({"train": before}, checkpoint_id=str(tmp_path / "old"))
    fresh = loop_stub(position=data_pb2.DataPosition(format="stale"))
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "old"), no_dist=True)
    assert fresh._position == data_pb2.DataPosition(epoch=3, row=40) and fresh._position.format == ""


def test_the_rng_state_is_plain_tensors_and_seeding_is_per_rank_and_repeatable():
    seed(5, 0)
    state = capture()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    a = draws()
    seed(5, 1)
    b = draws()
    seed(5, 0)
    assert draws() == a != b
    restore(state)
    assert draws() == a


def test_ranks_keep_their_own_keys_so_their_streams_never_collide():
    keys = [set(LoopState(loop_stub(rank=r)).state_dict()) for r in (0, 1)]
    assert (
        keys[0] - {"rank0"}
        == keys[1] - {"rank1"}
        == {"step", "skipped_steps", "consecutive_skips", "loss_scale", "loss_scaler"}
        | {"data_position", "data_order", "ranks"}  # one global data position, not one per rank
    )


def test_a_rank_new_at_a_larger_size_loads_the_global_state_and_keeps_its_seeded_streams(tmp_path):
    """Written by rank 1 of 2, loaded by rank 1 and rank 3 of 4: both get the step and the
    global data position; rank 1 its streams back, rank 3 (no key of its own in the
    checkpoint: a partial load of per-rank keys only) the streams seeded from (seed, 3)."""
    seed(7, 1)
    position = data_pb2.DataPosition(epoch=1, row=9)
    dcp.save({"train": LoopState(loop_stub(step=6, position=position))}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = draws()
    for rank in (1, 3):
        seed(7, rank)
        fresh_draws = draws() if rank == 3 else None
        seed(7, rank)  # what a fresh rank's _initialise does before the load
        fresh = loop_stub(rank=rank, world=4)
        safe_load({"train": LoopState(fresh)}, str(tmp_path / "ckpt"), no_dist=True)
        assert (fresh._step, fresh._position) == (6, position)
        assert draws() == (expected if rank == 1 else fresh_draws)
    dcp.save({"train": {"x": torch.zeros(1)}}, checkpoint_id=str(tmp_path / "other"))
    with pytest.raises(CheckpointException) as refused:  # any other missing key still fails the load
        safe_load({"train": LoopState(loop_stub())}, str(tmp_path / "other"), no_dist=True)
    (error, _), *_ = refused.value.failures.values()
    assert "Missing key in checkpoint state_dict: train.step" in str(error)


def test_an_fp16_scaler_state_comes_back_exactly_and_is_handed_to_initprecision(tmp_path):
    # A scale no float32 holds exactly (growth factor 3, backoff 0.7 are allowed).
    scaler = engine_pb2.LossScalerState(scale=65536 * 3 * 0.7**5, growth_tracker=1234, hysteresis_left=1)
    dcp.save({"train": LoopState(loop_stub(scaler=scaler, consecutive=2))}, checkpoint_id=str(tmp_path / "ckpt"))
    fresh = loop_stub()
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "ckpt"), no_dist=True)
    assert fresh._resume_scaler == scaler and fresh._consecutive_skips == 2


def test_a_metadata_pickle_naming_anything_but_dcp_classes_is_refused_unrun(tmp_path):
    dcp.save({"w": torch.arange(3.0)}, checkpoint_id=str(tmp_path / "ok"))
    SafeFileSystemReader(str(tmp_path / "ok")).read_metadata()  # the real index passes

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load (posix|os)\.system"):
        SafeFileSystemReader(str(tmp_path / "ok")).read_metadata()
    with pytest.raises(BaseException, match=r"refusing to load (posix|os)\.system"):  # DCP wraps it
        safe_load({"w": torch.zeros(3)}, str(tmp_path / "ok"), no_dist=True)
    assert not marker.exists()


def test_checkpoint_async_is_on_by_default_and_spelled_async_in_a_job_file():
    base = "name: a\nsteps: 10\noptimizer: {warmup_steps: 1}\ndata: {dataset: d@v1}\n"
    assert parse_job_spec(base).checkpoint.async_ is True
    spec = parse_job_spec(base + "checkpoint: {async: false, keep_every: 50}\n")
    assert (spec.checkpoint.async_, spec.checkpoint.keep_every) == (False, 50)


def test_a_changed_data_order_is_named_field_by_field_in_one_line_and_the_dp_size_alone_may_change():
    spec = SimpleNamespace(
        data=SimpleNamespace(
            shuffle_seed=5, shuffle=True, seq_len=64, pack="pack", micro_batch_size=4, grad_accum=1, mixture=None
        )
    )
    at_dp2 = data_order(spec, 2)
    spec.data.micro_batch_size, spec.data.grad_accum = 2, 2  # dp 2 x 4 -> dp 2 x 2 x accum 2: the same 8 rows
    assert data_order_changes(at_dp2, data_order(spec, 2)) == ""
    spec.data.micro_batch_size, spec.data.grad_accum = 8, 1  # dp 1 x 8
    assert data_order_changes(at_dp2, data_order(spec, 1)) == ""
    spec.data.shuffle, spec.data.seq_len, spec.data.pack = False, 128, "pad"
    changed = data_order_changes(at_dp2, data_order(spec, 2))  # dp 2 x 8: 16 rows
    assert changed == (
        "data.shuffle True (this job: False); data.seq_len 64 (this job: 128); data.pack pack (this job: pad); "
        "global batch rows (data.micro_batch_size x data.grad_accum x parallel.dp) 8 (this job: 16)"
    )
    assert "\n" not in changed


def test_a_mixture_checkpoint_resumes_only_the_same_mixture_and_an_older_one_reads_as_one_dataset():
    from services.jobspec import parse_job_spec

    text = (REPO / "examples" / "jobs" / "demo.yaml").read_text()
    plain = parse_job_spec(text)
    mixed = parse_job_spec(
        text.replace("dataset: stdlib@v1", "mixture: [{dataset: a@v1, weight: 3}, {dataset: b@v1, weight: 1}]")
    )
    same = parse_job_spec(
        text.replace("dataset: stdlib@v1", "mixture: [{dataset: a@v1, weight: 6}, {dataset: b@v1, weight: 2}]")
    )
    other = parse_job_spec(
        text.replace("dataset: stdlib@v1", "mixture: [{dataset: a@v1, weight: 1}, {dataset: b@v1, weight: 1}]")
    )
    assert data_order_changes(data_order(mixed, 2), data_order(same, 2)) == ""  # weights are normalised
    assert data_order_changes(data_order(mixed, 2), data_order(other, 2)).startswith("data.mixture mixture ")
    changed = data_order_changes(data_order(mixed, 2), data_order(plain, 2))
    assert changed.startswith("data.mixture mixture ") and changed.endswith("(this job: one dataset)"), changed
    # A checkpoint written before data.mixture (six values) read a single dataset.
    assert data_order_changes(data_order(plain, 2)[:-1], data_order(plain, 2)) == ""
    assert data_format(data_order(mixed, 2)) == DATA_FORMAT
