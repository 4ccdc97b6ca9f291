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

from services.compute.inference import SafeFileSystemReader, safe_load
from services.contract import data_pb2, engine_pb2
from services.engine.rng_streams import capture, restore, seed
from services.engine.training_loop import LoopState
from services.jobspec import parse_job_spec


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
    spec = SimpleNamespace(data=SimpleNamespace(shuffle_seed=kw.get("seed", 1234), shuffle=True))
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
    saved = LoopState(loop_stub(step=42, skipped=3, position=data_pb2.DataPosition(epoch=2, document=17, offset=5)))
    dcp.save({"train": saved}, checkpoint_id=str(tmp_path / "ckpt"))
    expected = draws()

    seed(99, 0)  # another process, other streams
    draws()
    fresh = loop_stub()
    safe_load({"train": LoopState(fresh)}, str(tmp_path / "ckpt"), no_dist=True)
    assert draws() == expected
    assert (fresh._step, fresh._skipped, fresh._consecutive_skips, fresh._resume_scaler) == (42, 3, 0, None)
    assert fresh._position == data_pb2.DataPosition(epoch=2, document=17, offset=5)
    assert fresh._loaded_order == (1234, 1, 2)


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
    )


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
