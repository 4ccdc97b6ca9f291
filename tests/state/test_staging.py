"""Host staging (services/state/staging.py): a slot's buffers are reused from one save to the
next, never while anything still refers to them, and the slot's digest still finds a change."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from services.contract import Module
from services.state import staging
from services.state.snapshot import Slot, SlotDigestMismatch, Snapshot


@pytest.fixture(autouse=True)
def fresh_pool():
    previous = staging.use_pool(staging.HostStaging())  # each test starts from an empty pool
    yield
    staging.use_pool(previous)


def live_state() -> dict:
    """A model-and-optimizer-like state: a strided (transposed) weight, bf16, a 0-dim count."""
    return {
        "w": torch.randn(6, 4).t(),
        "emb": torch.randn(5, 3, dtype=torch.bfloat16),
        "state": {"w": {"exp_avg": torch.randn(4, 6), "step": torch.tensor(3.0)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }


def slot_of(state: dict, step: int) -> Slot:
    return Slot.copy_of("optim", Module.L2_OPTIMIZER, step, f"j@{step}#1", state)


def pointers(slot: Slot) -> dict[str, int]:
    s = slot.state
    return {
        "w": s["w"].data_ptr(),
        "emb": s["emb"].data_ptr(),
        "exp_avg": s["state"]["w"]["exp_avg"].data_ptr(),
        "step": s["state"]["w"]["step"].data_ptr(),
    }


def assert_holds(slot: Slot, state: dict) -> None:
    assert torch.equal(slot.state["w"], state["w"])
    assert slot.state["emb"].dtype == torch.bfloat16 and torch.equal(slot.state["emb"], state["emb"])
    assert torch.equal(slot.state["state"]["w"]["exp_avg"], state["state"]["w"]["exp_avg"])
    assert float(slot.state["state"]["w"]["step"]) == float(state["state"]["w"]["step"])
    slot.verify()


def test_a_slot_taken_again_after_the_last_save_let_go_reuses_its_buffers_with_the_new_content():
    state = live_state()
    first = slot_of(state, 1)
    was = pointers(first)
    assert all(p != state["w"].data_ptr() for p in was.values())  # a copy, not the live tensors
    del first  # the save is written and dropped
    state["w"].add_(1.0)
    state["state"]["w"]["exp_avg"].mul_(2.0)
    state["state"]["w"]["step"].add_(1.0)
    second = slot_of(state, 2)
    assert pointers(second) == was
    assert_holds(second, state)
    stats = staging.pool().stats()
    assert stats["reused"] == stats["allocated"] == stats["held"]  # the second save allocated nothing
    state["w"].add_(1.0)  # the live state moves on; the slot does not
    second.verify()


def test_a_buffer_a_background_writer_still_reads_is_never_handed_to_the_next_save(tmp_path):
    state = live_state()
    first = slot_of(state, 1)
    expected = {k: v.clone() for k, v in first.state_dict()["state"]["w"].items()}
    was = pointers(first)
    reading, go_on = threading.Event(), threading.Event()

    def write(payload: dict) -> None:  # a real DCP write, still in flight while the next snapshot is taken
        reading.set()
        go_on.wait(10)
        dcp.save(payload, checkpoint_id=str(tmp_path / "v1"), no_dist=True)

    # What the store relay's writer thread holds (Snapshot.to_write); the loop forgets the snapshot.
    writer = threading.Thread(target=write, args=(Snapshot.of([first]).to_write(),))
    del first
    writer.start()
    reading.wait(10)
    state["state"]["w"]["exp_avg"].fill_(-7.0)
    second = slot_of(state, 2)
    assert set(pointers(second).values()).isdisjoint(was.values())  # double buffered
    go_on.set()
    writer.join(10)
    back = {"optim": {"state": {"w": {k: torch.zeros_like(v) for k, v in expected.items()}}}}
    dcp.load(back, checkpoint_id=str(tmp_path / "v1"), no_dist=True)
    for name, value in expected.items():  # the first save's bytes, not the second's
        assert torch.equal(back["optim"]["state"]["w"][name], value), name
    del writer  # the writer let go (a finished thread drops its arguments): its buffers are free again
    third = slot_of(state, 3)
    assert pointers(third) == was
    assert_holds(third, state)
    second.verify()  # (second still held: untouched by the third)


def test_a_changed_staged_slot_fails_its_digest_check_and_a_resize_drops_the_old_buffers():
    state = live_state()
    slot = slot_of(state, 1)
    slot.state["state"]["w"]["exp_avg"][0, 0] += 1.0  # a reader wrote into the snapshot
    with pytest.raises(SlotDigestMismatch, match="does not match its digest"):
        slot.verify()
    del slot
    held = staging.pool().held_bytes()
    state["state"]["w"]["exp_avg"] = torch.randn(8, 6)  # the layout changed (a resize)
    resized = slot_of(state, 2)
    assert_holds(resized, state)
    assert staging.pool().held_bytes() == held + 8 * 6 * 4 - 4 * 6 * 4  # the old shape's buffer is gone


def test_a_dtensor_is_staged_as_a_dtensor_over_a_reused_host_copy_of_its_shard(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
        first = Slot.copy_of("model", Module.L3_SHARD_LOADER, 1, "j@1#1", {"w": weight})
        copy = first.state["w"]
        assert copy.placements == weight.placements and copy.shape == weight.shape
        assert copy.to_local().data_ptr() != weight.to_local().data_ptr()
        was = copy.to_local().data_ptr()
        del first, copy
        weight.to_local().add_(1.0)
        second = Slot.copy_of("model", Module.L3_SHARD_LOADER, 2, "j@2#1", {"w": weight})
        assert second.state["w"].to_local().data_ptr() == was
        assert torch.equal(second.state["w"].full_tensor(), weight.full_tensor())
        second.verify()
    finally:
        dist.destroy_process_group()


def test_a_strided_tensor_crosses_in_chunks_of_rows_and_arrives_whole(monkeypatch):
    monkeypatch.setattr(staging, "CHUNK_BYTES", 2 * 6 * 4)  # two rows of the 4 x 6 (transposed) weight: two chunks
    state = live_state()
    assert not state["w"].is_contiguous()
    slot = slot_of(state, 1)
    assert slot.state["w"].is_contiguous()
    assert_holds(slot, state)


def test_without_reuse_every_save_gets_fresh_buffers():
    staging.use_pool(staging.HostStaging(reuse=False))
    state = live_state()
    first = slot_of(state, 1)
    second = slot_of(state, 2)  # (first still held: the allocator cannot hand its pages back)
    assert set(pointers(first).values()).isdisjoint(pointers(second).values())
    assert staging.pool().held_bytes() == 0
