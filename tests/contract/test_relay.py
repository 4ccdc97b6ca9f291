"""The cross-process envelope (services/contract/relay.py): any routed message crosses by
its name, and the route table is checked on both sides of the link."""

from __future__ import annotations

import pytest

from services.contract import Module, audit_pb2, data_pb2, engine_pb2, route_pb2
from services.contract.bus import BoundaryViolation, Bus, RouteError, Traffic
from services.contract.relay import L1, Link, RelayError, pack, unpack
from services.contract.route_table import Route, RouteTable

RANK = {Module.L2_TRAINING_LOOP, Module.L2_PARALLEL_STRATEGY, Module.L3_FORWARD_UNIT, Module.L4_DATASET_VERSIONS}


def wired() -> tuple[Bus, Bus, Link, Link, list]:
    """A 'rank' bus and a 'control' bus joined by a link each way (the wire: direct calls)."""
    rank, control = Bus(traffic=Traffic()), Bus(traffic=Traffic())
    wire: list = []
    up = Link(
        rank,
        name="rank",
        near=RANK,
        beyond=L1,
        send=lambda routed, msg, payload: (wire.append(routed), down.deliver(routed)),
    )
    down = Link(
        control,
        name="control",
        near=L1,
        beyond=RANK,
        send=lambda routed, msg, payload: (wire.append(routed), up.deliver(routed)),
    )
    return rank, control, up, down, wire


def test_any_routed_message_round_trips_by_its_full_name():
    step = engine_pb2.StepCompleted(job_id="j", rank=1, step=7, loss=2.5)
    routed = pack(step, Module.L2_TRAINING_LOOP)
    assert (routed.type, routed.sender, routed.receiver) == ("surge.v1.StepCompleted", Module.L2_TRAINING_LOOP, 0)
    back = unpack(routed)
    assert type(back) is engine_pb2.StepCompleted and back == step


def test_pack_refuses_a_sender_or_receiver_the_route_does_not_name():
    with pytest.raises(BoundaryViolation):
        pack(engine_pb2.StepCompleted(), Module.L3_FORWARD_UNIT)
    with pytest.raises(BoundaryViolation):
        pack(engine_pb2.StartTraining(), Module.L1_ORCHESTRATOR, Module.L2_OPTIMIZER)


def test_an_unknown_type_or_a_body_that_does_not_parse_is_a_relay_error():
    with pytest.raises(RelayError):
        unpack(route_pb2.Routed(type="surge.v1.NoSuchEvent", sender=Module.L2_TRAINING_LOOP))
    with pytest.raises(RelayError):
        unpack(route_pb2.Routed(type="surge.v1.StepCompleted", body=b"\xff\xff\xff", sender=Module.L2_TRAINING_LOOP))


def test_an_event_routed_beyond_the_link_reaches_every_receiver_there_in_route_order_without_a_field_map():
    rank, control, up, down, wire = wired()
    up.stand_in()
    got: list[tuple[str, int]] = []
    control.subscribe(
        Module.L1_FAULT_DETECTOR, engine_pb2.TrainingLoopFailed, lambda m, p: got.append(("detector", m.rank))
    )
    control.subscribe(
        Module.L1_ORCHESTRATOR, engine_pb2.TrainingLoopFailed, lambda m, p: got.append(("orchestrator", m.rank))
    )
    control.subscribe(Module.L1_FAULT_DETECTOR, data_pb2.DatasetUnavailable, lambda m, p: got.append(("data", 0)))
    rank.publish(Module.L2_TRAINING_LOOP, engine_pb2.TrainingLoopFailed(job_id="j", rank=3, fault_class="x"))
    rank.publish(Module.L4_DATASET_VERSIONS, data_pb2.DatasetUnavailable(name="d", reason="gone"))
    assert got == [("orchestrator", 3), ("detector", 3), ("data", 0)]  # the route's receivers order
    assert [(r.type, r.sender, r.receiver) for r in wire] == [
        ("surge.v1.TrainingLoopFailed", Module.L2_TRAINING_LOOP, 0),
        ("surge.v1.DatasetUnavailable", Module.L4_DATASET_VERSIONS, 0),
    ]
    sent = control.snapshot().sent
    assert sent[(Module.L2_TRAINING_LOOP, "surge.v1.TrainingLoopFailed", Module.L1_FAULT_DETECTOR)] == 1


def test_a_command_crosses_to_its_one_receiver_and_runs_there():
    rank, control, up, down, wire = wired()
    made = down.stand_in(kinds=(route_pb2.COMMAND,))
    assert ("surge.v1.StartTraining", Module.L2_TRAINING_LOOP) in made
    started: list[str] = []
    rank.subscribe(Module.L2_TRAINING_LOOP, engine_pb2.StartTraining, lambda m, p: started.append(m.job_id))
    control.command(Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP, engine_pb2.StartTraining(job_id="j"))
    assert started == ["j"]
    assert (wire[0].sender, wire[0].receiver) == (Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP)


def test_an_envelope_claiming_a_module_the_far_side_does_not_speak_for_is_refused_and_reported():
    reported: list[BoundaryViolation] = []
    control = Bus(traffic=Traffic(), on_violation=reported.append)
    link = Link(control, name="control", near=L1, beyond=RANK)
    got: list = []
    control.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.StepCompleted, lambda m, p: got.append(m))
    # The route lets EXT_CONTRACT send it, but this link's far side may not speak for it.
    forged = route_pb2.Routed(
        type="surge.v1.BoundaryViolationReported",
        sender=Module.EXT_CONTRACT,
        body=audit_pb2.BoundaryViolationReported().SerializeToString(),
    )
    with pytest.raises(BoundaryViolation):
        link.deliver(forged)
    # Routed to a receiver the route does not name.
    with pytest.raises(BoundaryViolation):
        link.deliver(
            route_pb2.Routed(
                type="surge.v1.StepCompleted", sender=Module.L2_TRAINING_LOOP, receiver=Module.L1_FAULT_DETECTOR
            )
        )
    assert got == [] and len(reported) == 2
    assert control.snapshot().refused[(Module.EXT_CONTRACT, "surge.v1.BoundaryViolationReported", 0)] == 1
    link.deliver(pack(engine_pb2.StepCompleted(step=4), Module.L2_TRAINING_LOOP))
    assert [m.step for m in got] == [4]


def test_a_route_with_several_senders_on_the_near_side_cannot_be_stood_in_for():
    name = "surge.v1.RebuildParallelGroup"
    table = RouteTable(
        {
            name: Route(
                name,
                frozenset(L1),
                frozenset({Module.L2_PARALLEL_STRATEGY}),
                route_pb2.COMMAND,
                "test",
                status=route_pb2.IMPLEMENTED,
            )
        }
    )
    link = Link(Bus(table, traffic=Traffic()), name="control", near=L1, beyond={Module.L2_PARALLEL_STRATEGY})
    with pytest.raises(RouteError, match="RebuildParallelGroup"):  # an envelope could not say who sent it
        link.stand_in()
