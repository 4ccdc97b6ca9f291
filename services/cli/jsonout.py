"""Protobuf messages as plain JSON for scripts: numbers stay numbers (int64 included, which
protobuf's JSON mapping turns into strings), NaN becomes null, enums become their names."""

from __future__ import annotations

import json
import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def to_plain(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]  # a map: an object (keys are str or int)
            out[field.name] = {k: _scalar(entry, v) for k, v in value.items()}
        elif field.is_repeated:  # protobuf 7: FieldDescriptor.label is gone
            out[field.name] = [_scalar(field, v) for v in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            out[field.name] = to_plain(value) if msg.HasField(field.name) else None
        else:
            out[field.name] = _scalar(field, value)
    return out


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_plain(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(messages: list[Message]) -> str:
    """A JSON array of the messages (one document, parseable as a whole)."""
    return json.dumps([to_plain(m) for m in messages], indent=2)


def dumps_line(msg: Message) -> str:
    """One message as one JSON line (for streams: JSON Lines)."""
    return json.dumps(to_plain(msg))
