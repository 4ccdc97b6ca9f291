"""A metric record as the dict of its JSON line, without ``json_format.MessageToDict``'s
per-field walk when the record's message is flat (issue 28 item 3: the stack's CPU per step).

L5-2 writes each record as one JSON line (metrics_logger.py): what ``json_format.MessageToDict``
gives with ``preserving_proto_field_name``, ``always_print_fields_with_no_presence`` and
``unquote_int64_if_possible``. That call walks the descriptor in Python for every record: about
0.1 ms of the store's CPU per StepCompleted (26 fields), two records a step at dp 2, the most of
the store's cost per step. Here a message type whose fields are all plain scalars (strings,
bools, integers, doubles, enums; none repeated, none with presence, no bytes, no 32-bit
floats, no sub-messages) is converted from a plan built once per type: the set fields as
``ListFields`` gives them (field-number order), then every other field's JSON default in
declaration order -- the same keys, values and order as ``MessageToDict``, so the line and
its resend key are byte for byte what they were. Any other type goes to ``MessageToDict``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_F = FieldDescriptor
_INT32 = {_F.CPPTYPE_INT32, _F.CPPTYPE_UINT32}
_INT64 = {_F.CPPTYPE_INT64, _F.CPPTYPE_UINT64}


def to_dict(msg: Message) -> dict[str, Any]:
    """``msg`` as ``json_format.MessageToDict(msg, preserving_proto_field_name=True,
    always_print_fields_with_no_presence=True, unquote_int64_if_possible=True)`` returns it."""
    plan = _PLANS.get(msg.DESCRIPTOR, _UNPLANNED)
    if plan is _UNPLANNED:
        plan = _PLANS[msg.DESCRIPTOR] = _plan(msg.DESCRIPTOR)
    if plan is None:
        return _slow(msg)
    by_number, defaults = plan
    js: dict[str, Any] = {}
    try:
        for name, convert, default, double in by_number:  # (the fields ListFields would give, in its order)
            value = getattr(msg, name)
            if value != default or (double and value == 0.0 and math.copysign(1.0, value) < 0.0):  # (-0.0 is set)
                js[name] = value if convert is None else convert(value)
    except _Unusual:
        return _slow(msg)
    for name, default in defaults:
        if name not in js:
            js[name] = default
    return js


def _slow(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True, unquote_int64_if_possible=True
    )


_UNPLANNED = object()
_Plan = tuple[list[tuple[str, Any, Any, bool]], list[tuple[str, Any]]]
_PLANS: dict[Descriptor, _Plan | None] = {}


def _plan(desc: Descriptor) -> _Plan | None:
    """Per field, in field-number order: (name, its value's converter or None when the value
    is its JSON value, its default, whether a double); and each field's JSON default in
    declaration order. None when a field is not a plain scalar (the type takes MessageToDict)."""
    convert: dict[str, Any] = {}
    for f in desc.fields:
        if f.is_repeated or f.has_presence or f.is_extension:
            return None
        if (f.cpp_type == _F.CPPTYPE_STRING and f.type == _F.TYPE_STRING) or f.cpp_type == _F.CPPTYPE_BOOL:
            convert[f.name] = None  # (a str, a bool)
        elif f.cpp_type in _INT32:
            convert[f.name] = None
        elif f.cpp_type in _INT64:
            convert[f.name] = _int64
        elif f.cpp_type == _F.CPPTYPE_DOUBLE:
            convert[f.name] = _double
        elif (
            f.cpp_type == _F.CPPTYPE_ENUM
            and f.enum_type.full_name != "google.protobuf.NullValue"
            and not any(v.GetOptions().ListFields() for v in f.enum_type.values)  # (no JSON name options)
        ):
            convert[f.name] = _enum(f)
        else:
            return None  # bytes, 32-bit floats, sub-messages
    by_number = [
        (f.name, convert[f.name], f.default_value, f.cpp_type == _F.CPPTYPE_DOUBLE)
        for f in sorted(desc.fields, key=lambda f: f.number)
    ]
    defaults = [
        (f.name, f.default_value if convert[f.name] is None else convert[f.name](f.default_value)) for f in desc.fields
    ]
    return by_number, defaults


def _int64(value: int) -> int | str:
    return value if float(value) == value else str(value)  # (unquote_int64_if_possible)


def _double(value: float) -> float | str:
    if math.isinf(value):
        return "-Infinity" if value < 0.0 else "Infinity"
    if math.isnan(value):
        return "NaN"
    return value


class _Unusual(Exception):
    """A value the plan does not convert (an enum number without a name): the record takes
    MessageToDict, which gives it as json_format does (the number, or its error)."""


def _enum(f: FieldDescriptor) -> Callable[[int], str]:
    names = {v.number: v.name for v in f.enum_type.values}

    def name(value: int) -> str:
        try:
            return names[value]
        except KeyError:
            raise _Unusual from None

    return name
