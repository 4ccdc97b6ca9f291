"""A job far larger than the cluster (a fresh user's `--set parallel.dp=10000000`) queues
cheaply: control builds nothing per rank before the job is placed, and a world size beyond
MAX_WORLD_SIZE is refused in one line naming the field before control works on it.

Before: the allocator estimated each try's memory per rank through the sharding plan, whose
mesh lists every rank (dp 1,000,000: 2.4 s and ~275 MB traced, on the allocator's lock, at the
submit and again at every worker registration); dp 10,000,000 held control for 37.8 s at
2.8 GB and its ranks' heartbeats went unheard. The bounds below are on memory traced, not on
time: they hold on a loaded host.
"""

from __future__ import annotations

import tracemalloc

import pytest

from services.contract import control_pb2
from services.engine.sharding_plan import plan, stage_layers
from services.jobspec import MAX_LAYERS, MAX_WORLD_SIZE, JobSpecError, ModelSpec, ParallelSpec, parse_job_spec
from services.memory_estimate import estimate_memory

from .conftest import Plane, settle, spec_yaml

JobState = control_pb2.JobState
pytestmark = pytest.mark.timeout(120)

# Far above what a queued job's own records take (a spec, a status, an event: kilobytes), far
# below one list of a million ranks (8 MB of pointers alone; the old plan built several).
BOUND_BYTES = 4 << 20


def submit(plane: Plane, dp: int) -> control_pb2.JobStatus:
    return plane.user(control_pb2.SubmitJobRequest(spec_yaml=spec_yaml(name="huge", dp=dp), spec_path="job.yaml"))


def test_a_job_of_the_largest_world_size_queues_and_is_retried_without_building_anything_per_rank(plane):
    plane.register("wa"), plane.register("wb")
    tracemalloc.start()
    try:
        big = submit(plane, MAX_WORLD_SIZE)
        waits = (
            f"queued: needs {MAX_WORLD_SIZE} ranks (parallel.dp={MAX_WORLD_SIZE}), more than the 2 registered: "
            "can never run as things stand; waits for workers to join"
        )
        assert (big.state, big.queue_position, big.message) == (JobState.STANDBY, 1, waits)
        plane.register("wc")  # a worker joins: the queue tries its head again (on the orchestrator's pool)
        # (Its message, not the retry's timer: the timer may not be armed yet when this looks.)
        settle(lambda: plane.get(big.job_id).message, waits.replace("the 2 registered", "the 3 registered"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BOUND_BYTES, f"{peak:,} bytes traced for a queued job of {MAX_WORLD_SIZE:,} ranks"


def estimate_traced(spec):
    """``spec``'s memory estimate and the peak bytes traced while it was made."""
    tracemalloc.start()
    try:
        est = estimate_memory(spec)
        return est, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_memory_estimate_of_any_world_size_is_made_without_a_per_rank_plan():
    est, peak = estimate_traced(parse_job_spec(spec_yaml(dp=MAX_WORLD_SIZE), "job.yaml"))
    assert est.total > 0 and peak < BOUND_BYTES // 16, f"{peak:,} bytes traced"
    # The stages it uses are the plan's (the plan, at a small size, is the reference).
    for n_layers, pp in ((1, 1), (4, 2), (5, 3), (7, 7)):
        model = ModelSpec(n_layers=n_layers, d_model=32, n_heads=2, tie_embeddings=False)
        parallel = ParallelSpec(dp=2, pp=pp, microbatches=pp)
        assert stage_layers(n_layers, pp) == plan(model, 2 * pp, parallel).stage_layers


@pytest.mark.parametrize(
    "parallel",
    ["dp: 2,", "dp: 2, tp: 2, data_parallel: fsdp2,", "dp: 2, pp: 2, microbatches: 2,", "dp: 2, data_parallel: fsdp2,"],
)
def test_the_memory_estimate_of_the_deepest_model_is_made_without_a_list_of_its_parameters(parallel):
    # A fresh user's `--set model.n_layers=2147483647` ran `submit --dry-run` out of memory in
    # the estimate's per-parameter list, the code control's allocator runs for every try.
    model = f"n_layers: {MAX_LAYERS}, tie_embeddings: false,"
    text = spec_yaml(dp=2).replace("n_layers: 1,", model).replace("dp: 2,", parallel)
    est, peak = estimate_traced(parse_job_spec(text, "job.yaml"))
    assert est.total_parameters > MAX_LAYERS * 32 * 32 and peak < BOUND_BYTES // 16, f"{peak:,} bytes traced"


def test_a_model_deeper_than_the_cap_is_refused_in_one_line_naming_the_field():
    with pytest.raises(JobSpecError) as refused:
        parse_job_spec(spec_yaml().replace("n_layers: 1,", f"n_layers: {2**31 - 1},"), "job.yaml")
    assert (
        str(refused.value)
        == f"job.yaml: model.n_layers: Input should be less than or equal to {MAX_LAYERS}, got {2**31 - 1}"
    )


@pytest.mark.parametrize(("dp", "tp", "pp"), [(MAX_WORLD_SIZE + 1, 1, 1), (10_000_000, 1, 1), (2**19 + 1, 2, 1)])
def test_a_world_size_beyond_the_cap_is_refused_in_one_line_naming_the_field(dp, tp, pp):
    text = spec_yaml(dp=dp).replace(f"dp: {dp},", f"dp: {dp}, tp: {tp}, pp: {pp},")
    with pytest.raises(JobSpecError) as refused:
        parse_job_spec(text, "job.yaml")
    world = dp * tp * pp
    assert str(refused.value) == (
        f"job.yaml: parallel: dp ({dp}) * tp ({tp}) * pp ({pp}) = {world} ranks, more than 1,048,576 "
        "(the largest world size Surge takes)"
    )


def test_control_refuses_a_world_size_beyond_the_cap_and_persists_nothing(plane):
    plane.register("wa")
    with pytest.raises(ValueError, match=r"^job\.yaml: parallel: dp \(4294967295\) \* tp \(1\) \* pp \(1\) = "):
        submit(plane, 2**32 - 1)  # was a MemoryError in the allocator, recorded as rank 0's out_of_memory
    assert plane.c.journal.load_jobs() == []
