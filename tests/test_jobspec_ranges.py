"""Every numeric field of the job spec is range-checked at parse time (issue 12, part 8).

The fields are enumerated from the pydantic models themselves, so a field added later is
tried too. Each one gets values that fit no proto field or tensor it travels in (10**23,
1e300), non-finite floats, and values below its declared lower bound; each must be refused
by ``parse_job_spec`` (what control's SubmitJob runs) with one line naming the field.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from typing import Any

import pytest
import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from services.jobspec import JobSpec, JobSpecError, parse_job_spec

pytestmark = pytest.mark.timeout(60)

BASE: dict[str, Any] = {"name": "ranges", "steps": 10, "data": {"dataset": "tiny@v1"}}
# Sections that exist only together with other settings: a field under the prefix is tried in
# a spec holding these (merged into BASE at the top level).
CONTEXT: dict[tuple[str, ...], dict[str, Any]] = {
    ("precision", "loss_scale"): {"precision": {"dtype": "fp16"}},
    ("evaluation",): {
        "evaluation": {"source_job": "src-1", "version": "src-1:latest", "command": ["true"]},
        "init_from": {"checkpoint": "src-1:latest"},
    },
}


def _unwrap(annotation: Any) -> Any:
    """``X | None`` -> ``X``; ``Annotated[X, ...]`` -> ``X``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def _lower(metadata: list) -> float | None:
    """The smallest value a field's declared bound (gt / ge) refuses, if it has one."""
    for m in metadata:
        if isinstance(m, Gt):
            return m.gt
        if isinstance(m, Ge):
            return m.ge - 1
    return None


def _item_metadata(annotation: Any) -> list:
    """Constraints on a list's / mapping's items (``list[Annotated[int, Field(ge=0)]]``)."""
    args = typing.get_args(annotation)
    item = args[-1] if args else None
    if typing.get_origin(item) is typing.Annotated:
        return [m for extra in typing.get_args(item)[1:] for m in getattr(extra, "metadata", [extra])]
    return []


def numeric_fields(model: type[BaseModel] = JobSpec, path: tuple[str, ...] = ()):
    """(dotted path, kind, lower-bound value or None, container key type) of every numeric
    field, recursively. kind: int | float | list[int] | list[float] | dict[int] | dict[float]."""
    for name, info in model.model_fields.items():
        key = info.alias if info.alias and info.alias != name else name
        where = (*path, key)
        ann = _unwrap(info.annotation)
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from numeric_fields(ann, where)
        elif ann is bool:
            continue
        elif ann in (int, float):
            yield where, ann.__name__, _lower(info.metadata), None
        elif origin is list and _unwrap(typing.get_args(ann)[0]) in (int, float):
            item = _unwrap(typing.get_args(ann)[0])
            yield where, f"list[{item.__name__}]", _lower(_item_metadata(ann)), None
        elif origin is dict and _unwrap(typing.get_args(ann)[1]) in (int, float):
            k, v = typing.get_args(ann)
            item = _unwrap(v)
            keys = typing.get_args(k) if typing.get_origin(k) is typing.Literal else ("rank_exit",)
            yield where, f"dict[{item.__name__}]", _lower(_item_metadata(ann)), keys[0]


def _has_upper(metadata: list) -> bool:
    return any(isinstance(m, (Le, Lt)) for m in metadata)


def unbounded_above(model: type[BaseModel] = JobSpec, path: tuple[str, ...] = ()):
    """Dotted paths of the numeric fields (or their list / mapping items) without an upper
    bound of their own (``le`` / ``lt``), recursively."""
    for name, info in model.model_fields.items():
        key = info.alias if info.alias and info.alias != name else name
        ann = _unwrap(info.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from unbounded_above(ann, (*path, key))
        elif ann in (int, float) and not _has_upper(info.metadata):
            yield ".".join((*path, key))
        elif typing.get_origin(ann) in (list, dict) and _unwrap(typing.get_args(ann)[-1]) in (int, float):
            if not _has_upper(_item_metadata(ann)):
                yield ".".join((*path, key))


# The numeric fields with no upper bound of their own, and why the floor (int64; |float| <=
# 1e15; a *_seconds duration <= 30 days) is theirs. A new numeric field gets a bound of
# meaning (Field(le=...)), or a line here saying why it has none.
NO_UPPER_BOUND = {
    "steps": "a step count: int64, as the loop carries steps",
    "seed": "a seed: any int64 (torch and numpy take 64 bits)",
    "data.shuffle_seed": "a seed",
    "model.rope_theta": "RoPE's base: long-context models use 1e6 .. 1e8 and more",
    "optimizer.weight_decay": "bounded with lr: lr x weight_decay < 1",
    "optimizer.warmup_steps": "a step count",
    "precision.loss_scale.growth_interval": "a step count",
    "precision.loss_scale.min_scale": "bounded by init_scale",
    "checkpoint.every_steps": "a step count",
    "eval.every_steps": "a step count",
    "liveness.heartbeat_interval_seconds": "a duration; stall_min_seconds covers two of them",
    "liveness.heartbeat_timeout_seconds": "a duration",
    "liveness.heartbeat_timeout_running_seconds": "a duration; at least heartbeat_timeout_seconds",
    "liveness.stall_min_seconds": "a duration",
    "liveness.attribution_seconds": "a duration",
}


def test_every_numeric_field_has_an_upper_bound_or_a_reason():
    missing = sorted(set(unbounded_above()) - set(NO_UPPER_BOUND))
    assert not missing, f"numeric fields without an upper bound (add Field(le=...) or a reason here): {missing}"
    assert sorted(NO_UPPER_BOUND) == sorted(unbounded_above()), "NO_UPPER_BOUND lists a field that has one now"


def bad_values(kind: str, lower: float | None) -> list[Any]:
    scalar = kind.removeprefix("list[").removeprefix("dict[").rstrip("]")
    values: list[Any] = [10**23] if scalar == "int" else [1e300, math.inf, -math.inf, math.nan]
    if lower is not None:
        values.append(int(lower) if scalar == "int" else float(lower))
    return values


def spec_with(path: tuple[str, ...], value: Any) -> str:
    """BASE with ``path`` set to ``value`` (and a section's required sibling setting), as YAML."""
    raw = copy.deepcopy(BASE)
    for prefix, extra in CONTEXT.items():
        if path[: len(prefix)] == prefix:
            for key, section in copy.deepcopy(extra).items():
                raw[key] = {**raw.get(key, {}), **section}
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return yaml.safe_dump(raw)


CASES = [
    pytest.param(path, kind, value, key, id=f"{'.'.join(path)}={value!r}")
    for path, kind, lower, key in numeric_fields()
    for value in bad_values(kind, lower)
]


def test_the_enumeration_finds_every_section():
    paths = {".".join(p) for p, *_ in numeric_fields()}
    assert len(paths) >= 45, sorted(paths)
    for expected in (
        "steps",
        "seed",
        "model.vocab_size",
        "data.seq_len",
        "data.filter.banned_tokens",
        "precision.loss_scale.init_scale",
        "fault_policy.restarts",
        "liveness.heartbeat_timeout_seconds",
        "checkpoint.keep_last",
        "eval.batches",
        "optimizer.lr",
        "parallel.threads_per_rank",
    ):
        assert expected in paths


def test_the_base_spec_is_valid_in_every_context():
    parse_job_spec(yaml.safe_dump(BASE), "ranges.yaml")
    for extra in CONTEXT.values():
        parse_job_spec(yaml.safe_dump({**BASE, **extra}), "ranges.yaml")


@pytest.mark.parametrize(("path", "kind", "value", "key"), CASES)
def test_an_out_of_range_value_is_refused_naming_its_field(path, kind, value, key):
    wrapped = [value] if kind.startswith("list") else {key: value} if kind.startswith("dict") else value
    text = spec_with(path, wrapped)
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(text, "ranges.yaml")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("ranges.yaml: ")
    assert ".".join(path) in message, message


@pytest.mark.parametrize(
    ("yaml_text", "names"),
    [
        ("steps: 100000000000000000000000", "steps: 100000000000000000000000 does not fit a 64-bit integer"),
        ("data: {dataset: tiny@v1, pad_id: 256}", "data.pad_id: 256 is not a token id of model.vocab_size 256"),
        (
            "data: {dataset: tiny@v1, filter: {banned_tokens: [3, 999]}}",
            "data.filter.banned_tokens: 999 is not a token id",
        ),
        ("data: {dataset: tiny@v1, seq_len: 65536, micro_batch_size: 128}", "seq_len x micro_batch_size: 65536 x 128"),
        ("parallel: {dp: 65536, tp: 65536, pp: 2}", "parallel: dp (65536) * tp (65536) * pp (2) = 8589934592 ranks"),
        (
            "liveness: {stall_min_seconds: 1.0e+12}",
            "liveness.stall_min_seconds: 1000000000000.0 is out of range (at most 2592000 s (30 days))",
        ),
        (
            # just over the bound: printed as given, not rounded onto the bound
            "liveness: {stall_min_seconds: 2592000.5}",
            "liveness.stall_min_seconds: 2592000.5 is out of range (at most 2592000 s (30 days))",
        ),
        (
            "liveness: {heartbeat_interval_seconds: 0.001, heartbeat_timeout_seconds: 1.0}",
            "liveness.heartbeat_interval_seconds: 0.001 s is shorter than",
        ),
        (
            "liveness: {heartbeat_interval_seconds: 2.0, heartbeat_timeout_seconds: 5.0, stall_min_seconds: 3.0}",
            "liveness.stall_min_seconds: 3 s cannot be met: step progress is heard in heartbeats, every 2 s",
        ),
        (
            "liveness: {heartbeat_interval_seconds: 2.0, heartbeat_timeout_seconds: 3.0}",
            "heartbeat_timeout_seconds (3.0) must be at least twice heartbeat_interval_seconds (2.0)",
        ),
        (
            "optimizer: {lr: 0.5, weight_decay: 2.0}",
            "optimizer.weight_decay: lr x weight_decay = 0.5 x 2 must be < 1",
        ),
        # Bounds of meaning, below the transport floor (issue 15 part 4).
        ("model: {rope_theta: 1.0}", "model.rope_theta: Input should be greater than 1"),
        ("model: {init_std: 1.5}", "model.init_std: Input should be less than or equal to 1"),
        ("optimizer: {lr: 2.0}", "optimizer.lr: Input should be less than or equal to 1"),
        (
            "precision: {dtype: fp16, loss_scale: {init_scale: 1.0e+12}}",
            "precision.loss_scale.init_scale: Input should be less than or equal to 4294967296",
        ),
        (
            "fault_policy: {overflow_storm_steps: 4294967296}",
            "fault_policy.overflow_storm_steps: Input should be less than or equal to 4294967295",
        ),
        ("liveness: {stall_step_factor: 1.0e+5}", "liveness.stall_step_factor: Input should be less than or equal"),
    ],
)
def test_cross_field_ranges_name_what_is_wrong(yaml_text, names):
    raw = {**BASE, **yaml.safe_load(yaml_text)}
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(yaml.safe_dump(raw), "ranges.yaml")
    assert names in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "section, field",
    [
        ("{actions: {non_finite_los: stop}}", "fault_policy.actions.non_finite_los"),
        ("{actions: {bogus_class: stop}}", "fault_policy.actions.bogus_class"),
        ("{actions: {severe: stop}}", "fault_policy.actions.severe"),
        ("{restarts: {rank_exitt: 2}}", "fault_policy.restarts.rank_exitt"),
    ],
)
def test_an_unknown_fault_class_in_the_policy_is_one_line_naming_it(section, field):
    raw = {**BASE, "fault_policy": yaml.safe_load(section)}
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(yaml.safe_dump(raw), "ranges.yaml")
    text = str(caught.value)
    assert text.startswith(f"ranges.yaml: {field}: unknown fault class (known: MINOR, MEDIUM, SEVERE, FATAL, "), text
    assert "\n" not in text and "non_finite_loss" in text and "rank_exit" in text


def test_every_known_fault_class_and_grade_is_accepted_in_the_policy():
    from services.jobspec import FAULT_GRADES, KNOWN_FAULT_CLASSES

    keys = sorted(KNOWN_FAULT_CLASSES) + list(FAULT_GRADES)
    actions = {k: "ignore" if k == "slow_rank" else "stop" for k in keys}  # (slow_rank: ignore | replace | shrink)
    raw = {**BASE, "fault_policy": {"actions": actions, "restarts": dict.fromkeys(keys, 1)}}
    parse_job_spec(yaml.safe_dump(raw), "ranges.yaml")


@pytest.mark.parametrize(
    ("prompts", "words"),
    [
        (["p"] * 9, ("eval.sample_prompts", "at most 8")),
        (["x" * 1001], ("eval.sample_prompts.0", "at most 1000")),
        ([""], ("eval.sample_prompts.0", "at least 1")),
        ([], ("eval.sample_prompts", "at least 1")),
    ],
)
def test_sample_prompts_are_bounded_in_count_and_length_with_one_line(prompts, words):
    with pytest.raises(JobSpecError) as caught:
        parse_job_spec(spec_with(("eval", "sample_prompts"), prompts), "ranges.yaml")
    message = str(caught.value)
    assert "\n" not in message and all(w in message for w in words), message
    ok = parse_job_spec(spec_with(("eval", "sample_every_steps"), 5), "ranges.yaml")
    assert ok.eval.sample_prompts == ["\n"] and ok.eval.sample_tokens == 64 and ok.eval.sample_temperature == 0
