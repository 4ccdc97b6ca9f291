"""A job spec's validation failure as one line for people (services/jobspec/).

An unknown key is most often a misspelt one: it is named first, with the nearest key its
section does have (``optimiser: unknown key (did you mean optimizer?)``), and the required
fields it left missing; any other failure names its dotted field and what was wrong.
"""

from __future__ import annotations

import difflib
import re
import types
import typing

from pydantic import BaseModel, ValidationError

# Top-level keys people write into a spec that are options of the command that submits it
# (a job's queue priority is the submitter's call, not the job's: the same spec runs at any).
COMMAND_OPTIONS = {("priority",): "give it to `surgectl submit --priority N`"}


def spec_error_text(e: ValidationError, source: str, root: type[BaseModel]) -> str:
    """One pydantic failure of a whole spec (of model ``root``) as one line naming ``source``
    and the field."""
    errors = e.errors()
    # The unknown keys first, with the required fields they left missing (`stepz: unknown
    # key; steps: Field required`), not only the missing field pydantic lists first.
    unknown = [err for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        missing = [err for err in errors if err["type"] == "missing"]
        return f"{source}: " + "; ".join(field_error(err, root) for err in unknown + missing)
    err = errors[0]
    if not err["loc"] and err["type"] == "value_error":  # a cross-section rule: its message names the fields
        return f"{source}: {err['msg'].removeprefix('Value error, ')}"
    return f"{source}: {field_error(err, root)}"


def field_error(err: dict, root: type[BaseModel] | None = None) -> str:
    """One pydantic error as ``<dotted.path>: <message>[, got <input>]``; an unknown key with
    the nearest key of its section (``root``: the spec's model) when one is close."""
    path = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        if tuple(err["loc"]) in COMMAND_OPTIONS:  # a submit's option written into the spec
            return f"{path}: unknown key ({path} is not part of a spec: {COMMAND_OPTIONS[tuple(err['loc'])]})"
        near = nearest_key(root, err["loc"]) if root is not None else None
        return f"{path}: unknown key" + (f" (did you mean {near}?)" if near else "")
    msg = err["msg"].removeprefix("Value error, ")
    # A cross-field rule's input is the whole section: its message already says what is wrong.
    # A section's rule whose message names a field under it (``actions.x: ...``): one dotted path.
    # (``freeze[1]: ...`` and ``freeze: ...`` name the section's field the same way.)
    if err["type"] == "value_error" and err["loc"] and re.match(r"[a-z_]+(\.[^\s:]+|\[\d+\])?: ", msg):
        return f"{path}.{msg}"
    quiet = ("missing", "value_error")
    got = "" if err["type"] in quiet else f", got {err.get('input')!r}"
    return f"{path}: {msg}{got}"


def nearest_key(root: type[BaseModel], loc: tuple) -> str | None:
    """The key of the section ``loc`` points into that is closest to its last part (a
    misspelling), as a dotted path; None when none is close or the section is not a model."""
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        if not isinstance(part, str):
            continue  # a list index or a union branch's tag: the same section's model
        field = _field_named(model, part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return None
    names = sorted({info.alias or name for name, info in model.model_fields.items()})
    near = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    parent = [str(p) for p in loc[:-1] if isinstance(p, str) and not p.startswith(("function-", "tagged-"))]
    return ".".join([*parent, near[0]]) if near else None


def _field_named(model: type[BaseModel], key: str):
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info
    return None


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (itself, optional, in a list or a
    mapping's values, or annotated), if exactly one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple, dict, typing.Literal) or origin is not None:
        found = {m for a in typing.get_args(annotation) if (m := _model_in(a)) is not None}
        return found.pop() if len(found) == 1 else None
    return None
