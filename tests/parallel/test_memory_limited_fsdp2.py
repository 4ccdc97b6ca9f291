"""Models larger than one rank (issue 26): a 2-rank FSDP2 job trains, saves and resumes with
each rank under a memory limit below what the whole model's training state needs, and the
same job unsharded is killed under that limit.

Each rank is a real rank process (tests/parallel/harness.py: the rank's composition root,
gloo) in a memory cgroup of its own (``harness.MemoryLimit``, which says why a cgroup and
not RLIMIT_AS). The model: 16 blocks of width 512, N = 50.4 M parameters, so its fp32
weights, gradients and AdamW moments (16 bytes a parameter) are 769 MiB.

The limit, from what the cgroup was charged on this machine (2026-12-03, glibc's mmap
threshold at 64 KiB, cgroup v1):
    * the unsharded job (dp 1) needs 1020 MiB at its first step, the process (about
      250 MiB with its start-up and activations) + 16 N, and 12 N more at its save (the
      snapshot's copy of the weights and moments);
    * a rank of the FSDP2 job runs at 965 MiB and is OOM-killed at 930: the process + its
      half of the state (8 N) + 6 N at a save (the snapshot's copy of its shard of the
      weights and moments, taken while its gradients are alive; a CPU rank keeps no staging
      buffers between saves: services/state/staging.py keep_buffers); its resume needs
      less (the load's template and the state);
so LIMIT_MIB (1010) is below the whole model's state plus the process and 45 MiB above the
FSDP2 rank's need, and the unsharded job, given the same schedule, is killed at its first
step or at the latest at its save (28 N). Before the meta-device load every rank also
built the whole model first (4 N), and a resume held a third copy of its shard of the
weights and moments (16 N in all, as much as the unsharded job): the FSDP2 rank then did not
fit under any limit the unsharded job fails.
"""

from __future__ import annotations

import pytest
from harness import MemoryLimit, parity_spec, run_config, tensor_digest

from services.compute.model import build_model, count_parameters

MODEL = {"n_layers": 16, "d_model": 512, "n_heads": 8}
LIMIT_MIB = 1010
FSDP2 = {"dp": 2, "data_parallel": "fsdp2", "model": MODEL, "final_state": False}

pytestmark = pytest.mark.skipif(bool(MemoryLimit.unavailable()), reason=MemoryLimit.unavailable() or "-")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The FSDP2 job (2 steps, saved at step 2), its resume (step 3), and the unsharded job,
    each rank under LIMIT_MIB; every rank reports the digests of the whole weights it
    started from (gathered one tensor at a time)."""
    out = tmp_path_factory.mktemp("limited")
    limit = LIMIT_MIB << 20
    trained = run_config(
        {**FSDP2, "steps": 2, "ckpt_every": 2, "start_digests": True, "end_digests": True},
        out / "fsdp2",
        memory_limit=limit,
    )
    resumed = run_config(
        {**FSDP2, "steps": 3, "ckpt_root": str(out / "fsdp2" / "ckpt"), "resume": "step2", "start_digests": True},
        out / "resumed",
        memory_limit=limit,
    )
    unsharded = run_config(
        {"steps": 2, "ckpt_every": 2, "model": MODEL, "start_digests": True, "final_state": False},
        out / "dp1",
        memory_limit=limit,
        expect_failure=True,
    )
    return {"trained": trained, "resumed": resumed, "unsharded": unsharded}


def test_the_limit_is_below_the_whole_models_training_state_plus_the_process():
    n = count_parameters(build_model(parity_spec(model=MODEL).model, 0, "meta"))
    assert n > 50_000_000
    # Below 16 bytes a parameter plus 250 MiB of process; above half of it plus the same.
    assert (250 << 20) + 8 * n < LIMIT_MIB << 20 < (250 << 20) + 16 * n


@pytest.mark.timeout(420)
def test_a_two_rank_fsdp2_job_trains_saves_and_resumes_under_the_limit(runs):
    trained, resumed = runs["trained"], runs["resumed"]
    for r in trained + resumed:
        assert (r["exit_code"], r["oom_killed"]) == (0, False)
        assert r["charged_peak"] <= LIMIT_MIB << 20
    assert [r["steps"] for r in trained] == [[1, 2], [1, 2]]
    assert trained[0]["committed"] == [2]
    assert [r["steps"] for r in resumed] == [[3], [3]]
    # The resume loaded the sharded checkpoint into this rank's shards, bit for bit.
    assert resumed[0]["started_digests"] == trained[0]["end_digests"]
    assert resumed[1]["started_digests"] == trained[1]["end_digests"]


@pytest.mark.timeout(420)
def test_the_same_job_unsharded_is_killed_under_the_same_limit(runs):
    (r,) = runs["unsharded"]
    assert r["exit_code"] == -9 and r["oom_killed"]  # the kernel's OOM killer, at the limit
    assert "steps" not in r  # killed before it finished (it had started: it wrote its weights' digests)
    assert r["started_digests"]


@pytest.mark.timeout(420)
def test_dp1_and_fsdp2_dp2_start_from_the_same_weights_as_one_process(runs):
    spec = parity_spec(model=MODEL)
    one_process = {k: tensor_digest(v) for k, v in sorted(build_model(spec.model, spec.seed).state_dict().items())}
    (dp1,) = runs["unsharded"]
    assert dp1["started_digests"] == one_process
    for r in runs["trained"]:
        assert r["started_digests"] == one_process
