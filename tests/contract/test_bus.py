"""The contract bus enforces the route table and isolates receivers."""

import pytest

from services.contract import Module, data_pb2, engine_pb2
from services.contract.bus import BOUNDARY_VIOLATIONS, BoundaryViolation, Bus, Reply, RouteError


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
