"""Snapshot types (services/state/snapshot.py): copies, read-only containers, digests."""

from __future__ import annotations

import pytest
import torch

from services.contract import Module
from services.state.snapshot import Slot, SlotDigestMismatch, Snapshot, digest_of, freeze, thaw


def optimizer_like() -> dict:
    return {
        "state": {"w": {"exp_avg": torch.ones(3), "step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}],
    }


def test_a_frozen_state_thaws_back_to_the_same_types_and_values_as_a_copy():
    state = optimizer_like()
    frozen = freeze(state)
    with pytest.raises(TypeError):
        frozen["state"]["w"]["exp_avg"] = torch.zeros(3)
    assert isinstance(frozen["param_groups"], tuple)
    back = thaw(frozen)
    assert type(back["param_groups"]) is list and type(back["param_groups"][0]["betas"]) is tuple
    assert back["param_groups"] == state["param_groups"]
    assert torch.equal(back["state"]["w"]["exp_avg"], state["state"]["w"]["exp_avg"])
    state["state"]["w"]["exp_avg"].add_(1)  # the original changes; neither copy does
    back["state"]["w"]["exp_avg"].mul_(5)
    assert torch.equal(frozen["state"]["w"]["exp_avg"], torch.ones(3))


def test_a_digest_covers_every_byte_key_dtype_and_plain_value():
    base = digest_of(freeze(optimizer_like()))
    assert digest_of(freeze(optimizer_like())) == base
    changed = [optimizer_like() for _ in range(4)]
    changed[0]["state"]["w"]["exp_avg"][1] = 1.0000001
    changed[1]["state"]["w"]["step"] = torch.tensor(2.0, dtype=torch.float64)
    changed[2]["param_groups"][0]["lr"] = 0.2
    changed[3]["state"]["v"] = changed[3]["state"].pop("w")
    assert len({base, *(digest_of(freeze(c)) for c in changed)}) == 5


def test_a_slot_taken_without_a_digest_cannot_be_verified_and_a_snapshot_keeps_its_slots_apart():
    slot = Slot.copy_of("optim", Module.L2_OPTIMIZER, 4, "j@4#1", optimizer_like(), digest=False)
    with pytest.raises(SlotDigestMismatch, match="has no digest to check"):
        slot.verify()
    other = Slot.copy_of("model", Module.L3_SHARD_LOADER, 4, "j@4#1", {"w": torch.ones(2)})
    snapshot = Snapshot.of([slot, other])
    written = snapshot.to_write()
    assert set(written) == {"optim", "model"} and int(written["model"]["_slot"][0]) == 4
    assert written["model"]["w"].data_ptr() == other.state["w"].data_ptr()  # written as it is: no copy
    blank = snapshot.blank()
    blank["model"]["w"].fill_(7)  # a load writes into the blank copy, never into the snapshot
    assert torch.equal(other.state["w"], torch.ones(2))
