"""The simulated rank's parts that need no stack: its collective (real sockets on loopback),
the job spec's ``simulate:`` section, and the node agent's choice of the rank program."""

from __future__ import annotations

import json
import threading

import pytest

from services.contract import engine_pb2
from services.jobspec import JobSpecError, parse_job_spec
from services.rank.simulated.collective import Collective, CollectiveBroken
from services.worker.rank_process import SIMULATED_RANK_MODULE, rank_module_for
from tests.ports import free_port

SPEC = """\
name: sim
steps: 4
model: {n_layers: 2, d_model: 32, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1}
parallel: {dp: 4}
simulate: {step_time_s: 0.25, shard_bytes: 1024}
"""


def run_world(world: int, body, timeout_s: float = 20.0) -> list:
    """``body(collective, rank)`` on ``world`` threads, each rank with its own Collective."""
    port, out, errors = free_port(), [None] * world, []

    def one(rank: int) -> None:
        try:
            c = Collective(rank, world, ("127.0.0.1", port), timeout_s)
            try:
                out[rank] = body(c, rank)
            finally:
                c.close()
        except Exception as e:  # noqa: BLE001 - shown by the assert below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return out


def test_every_rank_gets_the_reduction_of_every_ranks_value_in_rank_order():
    def body(c: Collective, rank: int):
        return c.exchange(rank + 1, sum), c.exchange(rank * 3, max), c.exchange(f"r{rank}", lambda every: every)

    out = run_world(5, body)
    assert out == [(15, 12, ["r0", "r1", "r2", "r3", "r4"])] * 5


def test_a_peer_that_leaves_breaks_the_round_for_rank_0_and_then_for_the_others():
    def body(c: Collective, rank: int):
        if rank == 2:
            return None  # leaves without taking part (its connection closes)
        try:
            c.exchange(rank, max)
        except CollectiveBroken as e:
            return str(e)
        finally:
            c.close()  # (rank 0 leaving is what its other peers see)

    out = run_world(3, body)
    assert out[0] == "collective: rank 2 closed the connection"
    assert out[1] == "collective: rank 0 closed the connection"


def test_a_world_that_never_forms_is_refused_naming_the_missing_ranks():
    with pytest.raises(CollectiveBroken, match=r"2 rank\(s\) never connected"):
        Collective(0, 3, ("127.0.0.1", free_port()), timeout_s=0.5)


def test_the_simulate_section_is_read_and_refuses_tensor_parallelism_in_one_line():
    spec = parse_job_spec(SPEC)
    assert (spec.simulate.step_time_s, spec.simulate.shard_bytes) == (0.25, 1024)
    assert parse_job_spec(SPEC.replace("simulate: {step_time_s: 0.25, shard_bytes: 1024}\n", "")).simulate is None
    with pytest.raises(JobSpecError, match=r"simulate: simulated ranks take data parallelism only \(tp 1, pp 2"):
        pipelined = SPEC.replace("parallel: {dp: 4}", "parallel: {dp: 2, pp: 2}")
        parse_job_spec(pipelined.replace("vocab_size: 256}", "vocab_size: 256, tie_embeddings: false}"))
    with pytest.raises(JobSpecError, match="simulate.shard_bytes"):
        parse_job_spec(SPEC.replace("shard_bytes: 1024", "shard_bytes: 0"))


def test_the_node_agent_starts_the_simulated_rank_only_for_a_simulate_job():
    from services.jobspec import spec_to_json

    simulated = engine_pb2.InitJob(spec_json=spec_to_json(parse_job_spec(SPEC)))
    ordinary = engine_pb2.InitJob(spec_json=json.dumps({**json.loads(simulated.spec_json), "simulate": None}))
    assert rank_module_for(simulated, "services.rank") == SIMULATED_RANK_MODULE
    assert rank_module_for(ordinary, "services.rank") == "services.rank"
    assert rank_module_for(engine_pb2.InitJob(spec_json='{"fake": "train"}'), "tests.worker.fake_rank") == (
        "tests.worker.fake_rank"
    )
    assert rank_module_for(engine_pb2.InitJob(spec_json="not json"), "services.rank") == "services.rank"
