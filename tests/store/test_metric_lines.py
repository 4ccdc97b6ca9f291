"""A record's JSON line from metric_lines.to_dict is MessageToDict's, keys, values and order
(services/store/metric_lines.py): the line, and the resend key hashed from it, stay as they were."""

from __future__ import annotations

import json
import math
import random

import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor as F

from services.contract import engine_pb2, store_pb2
from services.store import metric_lines

# Every record type L5-2 writes, and one that is not flat (it takes MessageToDict).
TYPES = [
    engine_pb2.StepCompleted,
    engine_pb2.EvalCompleted,
    engine_pb2.SampleGenerated,
    engine_pb2.EvaluationScores,
    store_pb2.MetricRecord,
]
DOUBLES = [0.0, -0.0, 1.5, -2.25, 1e-300, 3e300, math.inf, -math.inf, math.nan, 0.1 + 0.2]
INTS = {
    F.CPPTYPE_INT32: [0, 1, -1, 2**31 - 1, -(2**31)],
    F.CPPTYPE_UINT32: [0, 1, 2**32 - 1],
    F.CPPTYPE_INT64: [0, -1, 2**53, 2**53 + 1, -(2**63), 2**63 - 1],
    F.CPPTYPE_UINT64: [0, 7, 2**53 + 1, 2**64 - 1],
}


def _reference(msg) -> dict:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True, unquote_int64_if_possible=True
    )


def _random(cls, rng: random.Random):
    msg = cls()
    for f in cls.DESCRIPTOR.fields:
        if f.is_repeated or f.cpp_type == F.CPPTYPE_MESSAGE or rng.random() < 0.3:
            continue  # (left at its default: written as the default)
        if f.cpp_type == F.CPPTYPE_STRING:
            value = rng.choice(["", "job-1", 'ünï "code"\n', "0"]) if f.type == F.TYPE_STRING else b"\x00\xff"
        elif f.cpp_type == F.CPPTYPE_BOOL:
            value = rng.random() < 0.5
        elif f.cpp_type in INTS:
            value = rng.choice(INTS[f.cpp_type])
        elif f.cpp_type in (F.CPPTYPE_DOUBLE, F.CPPTYPE_FLOAT):
            value = rng.choice(DOUBLES)
        elif f.cpp_type == F.CPPTYPE_ENUM:
            value = rng.choice([v.number for v in f.enum_type.values] + ([] if f.enum_type.is_closed else [999]))
        else:
            continue
        setattr(msg, f.name, value)
    return msg


@pytest.mark.parametrize("cls", TYPES, ids=lambda c: c.DESCRIPTOR.name)
def test_a_records_dict_is_message_to_dicts_keys_values_and_order(cls):
    rng = random.Random(cls.DESCRIPTOR.name)
    for _ in range(300):
        msg = _random(cls, rng)
        got, want = metric_lines.to_dict(msg), _reference(msg)
        # (json.dumps: NaN == NaN as text; the line is what is written and hashed)
        assert json.dumps(got) == json.dumps(want), msg
        assert list(got) == list(want)


def test_a_step_record_takes_the_plan_and_a_message_with_sub_messages_does_not():
    metric_lines.to_dict(engine_pb2.StepCompleted())
    metric_lines.to_dict(store_pb2.MetricRecord())
    assert metric_lines._PLANS[engine_pb2.StepCompleted.DESCRIPTOR] is not None
    assert metric_lines._PLANS[store_pb2.MetricRecord.DESCRIPTOR] is None
