"""The contract bus enforces the route table and isolates receivers."""

import pytest
from prometheus_client import REGISTRY, generate_latest

from services.contract import Module, data_pb2, engine_pb2
from services.contract.bus import (
    BOUNDARY_VIOLATIONS,
    TRAFFIC,
    BoundaryViolation,
    Bus,
    Reply,
    RouteError,
    Traffic,
)
from services.contract.route_table import default_table, message_class


def test_send_outside_the_route_table_raises_and_is_counted():
    reported = []
    bus = Bus(on_violation=reported.append)
    bus.subscribe(Module.L4_FILTER, data_pb2.FilterRules, lambda m, p: None)
    before = BOUNDARY_VIOLATIONS.labels("L4_SHUFFLER", "surge.v1.FilterRules")._value.get()
    # Only the training loop may push filter rules; the shuffler may not set them.
    with pytest.raises(BoundaryViolation, match="L4_SHUFFLER may not send surge.v1.FilterRules to L4_FILTER"):
        bus.command(Module.L4_SHUFFLER, Module.L4_FILTER, data_pb2.FilterRules(min_tokens=1))
    after = BOUNDARY_VIOLATIONS.labels("L4_SHUFFLER", "surge.v1.FilterRules")._value.get()
    assert after == before + 1
    assert len(reported) == 1 and reported[0].receiver == Module.L4_FILTER


def test_allowed_command_reaches_its_executor_and_returns_the_reply():
    bus = Bus()
    seen = []

    def apply_update(msg, payload):
        seen.append((msg.step, msg.learning_rate, payload))
        return Reply(engine_pb2.UpdateApplied(step=msg.step, learning_rate=msg.learning_rate))

    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, apply_update)
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)
    reply = port(engine_pb2.ApplyUpdate(step=7, learning_rate=1e-3), payload="grads")
    assert seen == [(7, 1e-3, "grads")]
    assert reply.message.step == 7


def test_an_executor_cannot_reply_with_a_message_not_routed_back():
    bus = Bus()
    # The optimizer answering with a forward event would impersonate the forward unit.
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, lambda m, p: engine_pb2.ForwardDone())
    with pytest.raises(BoundaryViolation, match="L2_OPTIMIZER may not send surge.v1.ForwardDone"):
        bus.command(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate(step=1))


def test_a_receiver_mutating_its_copy_does_not_change_what_another_receiver_sees():
    bus = Bus()
    seen = {}

    def vandal(msg, payload):
        msg.loss = -1.0
        msg.job_id = "tampered"
        seen["orchestrator"] = msg.loss

    def logger(msg, payload):
        seen["logger"] = (msg.loss, msg.job_id)

    bus.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.StepCompleted, vandal)
    bus.subscribe(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, logger)
    original = engine_pb2.StepCompleted(job_id="j", loss=2.5)
    assert bus.publish(Module.L2_TRAINING_LOOP, original) == 2
    assert seen["logger"] == (2.5, "j")
    assert original.loss == 2.5 and original.job_id == "j"


def test_an_event_reaches_its_receivers_in_the_order_the_route_lists_them_not_the_order_they_subscribed():
    bus = Bus()
    heard = []
    # TrainingLoopFailed's route lists L1_ORCHESTRATOR before L1_FAULT_DETECTOR: the failure is
    # on the job's record before the detector grades it.
    assert bus.table.route(engine_pb2.TrainingLoopFailed).delivery == (Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR)
    bus.subscribe(Module.L1_FAULT_DETECTOR, engine_pb2.TrainingLoopFailed, lambda m, p: heard.append("detector"))
    bus.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.TrainingLoopFailed, lambda m, p: heard.append("orchestrator"))
    assert bus.publish(Module.L2_TRAINING_LOOP, engine_pb2.TrainingLoopFailed(job_id="j")) == 2
    assert heard == ["orchestrator", "detector"]


def test_publishing_an_event_the_sender_does_not_own_raises():
    bus = Bus()
    with pytest.raises(BoundaryViolation):
        # The metrics logger cannot forge a step summary.
        bus.publish(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted(loss=0.1))


def test_subscribing_to_a_message_not_routed_to_the_module_fails_at_start_up():
    bus = Bus()
    with pytest.raises(RouteError, match="L4_SHUFFLER subscribes to surge.v1.FilterRules"):
        bus.subscribe(Module.L4_SHUFFLER, data_pb2.FilterRules, lambda m, p: None)


def test_a_port_exists_only_between_a_commander_and_its_executor():
    bus = Bus()
    with pytest.raises(RouteError, match="L3_FORWARD_UNIT may not command L2_OPTIMIZER"):
        bus.port(Module.L3_FORWARD_UNIT, Module.L2_OPTIMIZER)


# ---------------------------------------------------------------- per-route counts


def test_every_delivery_is_counted_per_route_and_every_refusal_per_intended_route():
    traffic = Traffic()
    bus = Bus(traffic=traffic)
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, lambda m, p: engine_pb2.UpdateApplied(step=m.step))
    bus.subscribe(Module.L1_ORCHESTRATOR, engine_pb2.StepCompleted, lambda m, p: None)
    bus.subscribe(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted, lambda m, p: None)
    port = bus.port(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER)
    for step in range(3):
        port(engine_pb2.ApplyUpdate(step=step))
    bus.publish(Module.L2_TRAINING_LOOP, engine_pb2.StepCompleted(step=1))
    with pytest.raises(BoundaryViolation):
        bus.command(Module.L4_SHUFFLER, Module.L4_FILTER, data_pb2.FilterRules())
    with pytest.raises(BoundaryViolation):
        bus.publish(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted())

    snap = bus.snapshot()
    L2, OPT = Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER
    assert snap.sent == {
        (L2, "surge.v1.ApplyUpdate", OPT): 3,
        (OPT, "surge.v1.UpdateApplied", L2): 3,  # the replies, routed back
        (L2, "surge.v1.StepCompleted", Module.L1_ORCHESTRATOR): 1,
        (L2, "surge.v1.StepCompleted", Module.L5_METRICS_LOGGER): 1,
    }
    assert snap.refused == {
        (Module.L4_SHUFFLER, "surge.v1.FilterRules", Module.L4_FILTER): 1,
        (Module.L5_METRICS_LOGGER, "surge.v1.StepCompleted", 0): 1,  # a publish: any receiver
    }


def test_a_snapshot_is_a_copy_that_later_sends_do_not_change():
    bus = Bus(traffic=Traffic())
    bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate, lambda m, p: None)
    bus.command(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate())
    before = bus.snapshot()
    bus.command(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER, engine_pb2.ApplyUpdate())
    assert sum(before.sent.values()) == 1 and sum(bus.snapshot().sent.values()) == 2


def test_buses_of_one_process_share_its_ledger_which_prometheus_exports():
    first, second = Bus(), Bus()  # e.g. two data streams
    for bus in (first, second):
        bus.subscribe(Module.L2_OPTIMIZER, engine_pb2.ExportState, lambda m, p: None)
    key = (Module.L2_TRAINING_LOOP, "surge.v1.ExportState", Module.L2_OPTIMIZER)
    before = TRAFFIC.snapshot().sent.get(key, 0)
    for bus in (first, second):
        bus.command(Module.L2_TRAINING_LOOP, Module.L2_OPTIMIZER, engine_pb2.ExportState())
    assert TRAFFIC.snapshot().sent[key] == before + 2
    text = generate_latest(REGISTRY).decode()
    line = (
        'surge_bus_messages_total{message="surge.v1.ExportState",receiver="L2_OPTIMIZER",'
        f'sender="L2_TRAINING_LOOP"}} {float(before + 2)}'
    )
    assert line in text.splitlines()


def test_a_relay_refusing_a_remote_request_counts_and_reports_it_like_a_send():
    reported = []
    traffic = Traffic()
    bus = Bus(on_violation=reported.append, traffic=traffic)
    bus.check(Module.L2_TRAINING_LOOP, "surge.v1.SaveCheckpoint", Module.L5_CHECKPOINT_MANAGER)  # allowed: no-op
    with pytest.raises(BoundaryViolation, match="L3_FORWARD_UNIT may not send surge.v1.SaveCheckpoint"):
        bus.check(Module.L3_FORWARD_UNIT, "surge.v1.SaveCheckpoint", Module.L5_CHECKPOINT_MANAGER)
    assert [(e.sender, e.receiver) for e in reported] == [(Module.L3_FORWARD_UNIT, Module.L5_CHECKPOINT_MANAGER)]
    assert traffic.snapshot().refused == {
        (Module.L3_FORWARD_UNIT, "surge.v1.SaveCheckpoint", Module.L5_CHECKPOINT_MANAGER): 1
    }
    assert traffic.snapshot().sent == {}


def test_a_failing_violation_hook_does_not_hide_the_violation():
    def broken_hook(error):
        raise OSError("log disk full")

    bus = Bus(on_violation=broken_hook, traffic=Traffic())
    with pytest.raises(BoundaryViolation):
        bus.publish(Module.L5_METRICS_LOGGER, engine_pb2.StepCompleted())


def test_a_typed_port_sends_its_commands_and_refuses_any_other():
    traffic = Traffic()
    reported = []
    bus = Bus(on_violation=reported.append, traffic=traffic)
    bus.subscribe(Module.L2_TRAINING_LOOP, engine_pb2.StartTraining, lambda m, p: None)
    bus.subscribe(Module.L2_TRAINING_LOOP, engine_pb2.StopTraining, lambda m, p: None)
    port = bus.port(Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP, commands=(engine_pb2.StartTraining,))
    assert port.commands == {"surge.v1.StartTraining"}
    port(engine_pb2.StartTraining(job_id="j"))
    # The table lets L1-1 stop the loop, but this port was handed out for starting it only.
    with pytest.raises(
        BoundaryViolation, match="L1_ORCHESTRATOR may not send surge.v1.StopTraining to L2_TRAINING_LOOP"
    ):
        port(engine_pb2.StopTraining(job_id="j"))
    snap = traffic.snapshot()
    assert snap.sent == {(Module.L1_ORCHESTRATOR, "surge.v1.StartTraining", Module.L2_TRAINING_LOOP): 1}
    assert snap.refused == {(Module.L1_ORCHESTRATOR, "surge.v1.StopTraining", Module.L2_TRAINING_LOOP): 1}
    assert [r.message for r in reported] == ["surge.v1.StopTraining"]
    assert bus.port_commands() == {(Module.L1_ORCHESTRATOR, Module.L2_TRAINING_LOOP): {"surge.v1.StartTraining"}}


def test_a_port_is_typed_only_with_implemented_routes_between_its_ends():
    bus = Bus()
    with pytest.raises(
        RouteError,
        match="L2_TRAINING_LOOP's port to L4_SHUFFLER sends surge.v1.FilterRules, "
        "which is not an implemented route between them",
    ):
        bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER, commands=(data_pb2.ShufflePlan, data_pb2.FilterRules))
    unbuilt = next(r for r in default_table().routes() if not r.implemented)
    sender, receiver = min(unbuilt.senders), min(unbuilt.receivers)
    with pytest.raises(RouteError, match="not an implemented route between them"):
        bus.port(sender, receiver, commands=(message_class(unbuilt.message),))
    # By default a port may send every implemented route between its ends.
    assert bus.port(Module.L2_TRAINING_LOOP, Module.L4_SHUFFLER).commands == {"surge.v1.ShufflePlan"}
