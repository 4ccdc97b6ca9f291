"""A team's quota, the default for a team with none, and the quota file.

A quota counts slots (one rank = one slot). Each bound is either an int, which bounds the
team's slots of every kind together (as before device kinds: old files and journals load
unchanged), or a mapping per device kind (``{gpu: 16, cpu: 64}``), which bounds each kind on
its own; a job's kind is its spec's ``parallel.device`` (``gpu``, ``cpu``, or ``any``:
counted only against int bounds, and refused by a team whose quota has a per-kind bound). In a
per-kind mapping a kind left out owns nothing (``nominal``: 0, it may still borrow) and has no
limit (``borrow_limit``, ``hard_limit``: none).

- ``nominal``: the slots the team owns. ``None``: unlimited (the default team).
- ``borrow_limit``: how many slots beyond ``nominal`` it may borrow from the idle nominal
  capacity of the other teams of its ``cohort`` (Kueue's ClusterQueue ``borrowingLimit``).
  ``None``: as much as the cohort has idle.
- ``hard_limit``: the most slots its running jobs may hold together, never exceeded, even on
  an idle cluster (Slurm's ``GrpTRES``). ``None``: no hard limit.
- ``weight``: its share under contention relative to other teams (fair_share.py; Slurm's
  fairshare, YARN's queue weight).
- ``cohort``: the teams that lend each other idle nominal capacity.

A team with no entry gets the book's default, unlimited in the one cohort "default" with
weight 1 unless the file says otherwise: jobs that name no team behave as before issue 30.

The book's starvation bound, ``max_wait_minutes`` (default ``DEFAULT_MAX_WAIT_MIN``, 120): a
queued job of a team below its weighted share that has waited that long goes ahead of the
fair order (fair_share.py says exactly when); ``null`` turns the bound off (the fair order
alone, as before session 30).

The file (``control --quotas FILE``)::

    default: {weight: 1}              # optional: for every team with no entry
    max_wait_minutes: 120             # optional: the starvation bound (null: none)
    teams:
      vision: {nominal: 8, borrow_limit: 4, hard_limit: 16, weight: 2, cohort: research}
      nlp: {nominal: 8, cohort: research}
      robotics: {nominal: {gpu: 16, cpu: 64}, hard_limit: {gpu: 24}, cohort: research}

A bad file: one line naming the file and the field (``QuotaFileError``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import MappingProxyType

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.contract.failures import Refusal
from services.jobspec.base import MAX_TEAM_SLOTS
from services.jobspec_errors import spec_error_text

# A team's name: the job spec's ``team`` field's pattern (services/jobspec/__init__.py).
TEAM_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
MAX_SLOTS = MAX_TEAM_SLOTS  # (services/jobspec/base.py: surgectl checks the same bound)
# The device kinds a per-kind bound names (the allocator's slot kinds: a CUDA device, a CPU slot).
KINDS = ("gpu", "cpu")
# The starvation bound's default (minutes; fair_share.py). Measured on the bench's day with
# two kinds (bench/scheduler_bench.py --max-wait, docs/LOG.md session 30 ageing30): the worst
# p99 of the teams asking no more than their weighted share, 1,076 min without a bound, is 211
# at 120 (FIFO: 238), 251 at 240, 489 at 480; the median team's p99 (47.5 without, FIFO 224)
# pays for each drain a large job makes: 120, 82, 48. Two hours: below FIFO's tail for every
# team within its share, half FIFO's for the median team.
DEFAULT_MAX_WAIT_MIN = 120.0
# A bound: every kind together (an int; None: no bound) or one per kind.
Bound = int | dict[str, int | None] | None


class QuotaFileError(ValueError, Refusal):
    """A quota (file or `surgectl team set`) that cannot be used: one line naming the field."""


class TeamQuota(BaseModel):
    """One team's quota (see the module docstring); validated on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    nominal: Bound = None
    borrow_limit: Bound = None
    hard_limit: Bound = None
    weight: float = Field(1.0, gt=0, le=1e6)
    cohort: str = Field("default", pattern=TEAM_PATTERN)

    @field_validator("nominal", "borrow_limit", "hard_limit", mode="before")
    @classmethod
    def _bound(cls, value: object, info) -> object:
        # Checked here, not by a union of types: its errors would name the union's branches.
        least = 1 if info.field_name == "hard_limit" else 0
        missing = 0 if info.field_name == "nominal" else None  # (a kind left out: owns none, no limit)
        if isinstance(value, dict):
            for kind in value:
                if kind not in KINDS:
                    raise ValueError(f"{kind}: not a device kind (expected one of {', '.join(KINDS)})")
            return {k: _slots(value.get(k, missing), least, k) for k in KINDS}
        return _slots(value, least)

    @model_validator(mode="after")
    def _hard_limit_at_least_nominal(self) -> TeamQuota:
        # A hard limit below what the team owns would make part of its own quota unusable.
        for kind in KINDS:
            (hard, hs), (nominal, ns) = self.bound("hard_limit", kind), self.bound("nominal", kind)
            if hard is not None and nominal is not None and hard < nominal and (hs == ns or not hs):
                field = f"hard_limit.{kind}" if hs else "hard_limit"
                raise ValueError(f"{field}: must be >= nominal ({nominal}{' ' + ns if ns else ''}), got {hard}")
        return self

    @property
    def per_kind(self) -> bool:
        """Whether a bound is per device kind (then a job must name its kind)."""
        return any(isinstance(v, dict) for v in (self.nominal, self.borrow_limit, self.hard_limit))

    @property
    def ceiling(self) -> float:
        """The most slots (every kind together) the team may ever hold: nominal + borrow limit,
        within the hard limit (inf: no bound; a per-kind bound counts as the sum of its kinds)."""

        def total(v: Bound) -> float:
            if isinstance(v, dict):
                return math.inf if None in v.values() else float(sum(v.values()))
            return math.inf if v is None else float(v)

        return min(total(self.nominal) + total(self.borrow_limit), total(self.hard_limit))

    def bound(self, field: str, kind: str) -> tuple[int | None, str]:
        """The bound ``field`` sets on a job of ``kind`` and its scope: the kind it counts
        (``gpu``/``cpu``, a per-kind bound) or "" (an int: every kind together)."""
        value = getattr(self, field)
        if isinstance(value, dict):
            return value.get(kind), kind
        return value, ""

    def to_json(self) -> dict:
        return self.model_dump()


def _slots(value: object, least: int, kind: str = "") -> int | None:
    """A bound's one value checked: None, or an int in [least, MAX_SLOTS]. Raises ValueError
    (its message names the kind, when one)."""
    where = f"{kind}: " if kind else ""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}expected a number of slots or null, got {value!r}")
    if not least <= value <= MAX_SLOTS:
        raise ValueError(f"{where}must be {least}-{MAX_SLOTS}, got {value}")
    return value


DEFAULT_QUOTA = TeamQuota()


def check_team_name(name: str) -> str:
    """``name`` if a team name (the job spec's pattern). Raises QuotaFileError: one line."""
    if not re.match(TEAM_PATTERN, name):
        raise QuotaFileError(f"team: must match {TEAM_PATTERN}, got {name!r}")
    return name


class _QuotaFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    default: TeamQuota = DEFAULT_QUOTA
    teams: dict[str, TeamQuota] = Field(default_factory=dict)
    max_wait_minutes: float | None = Field(DEFAULT_MAX_WAIT_MIN, gt=0, le=1e6)


class QuotaBook:
    """Every team's quota: the entries and the default for the rest, and the starvation bound
    (``max_wait_s``: seconds; None: none). Immutable: a change makes a new book
    (``with_team``/``without``), so a reader never sees one half-changed."""

    def __init__(
        self,
        teams: dict[str, TeamQuota] | None = None,
        default: TeamQuota = DEFAULT_QUOTA,
        max_wait_s: float | None = DEFAULT_MAX_WAIT_MIN * 60,
    ) -> None:
        for name in teams or {}:
            check_team_name(name)
        self._teams = MappingProxyType(dict(teams or {}))
        self.default = default
        self.max_wait_s = max_wait_s

    @property
    def teams(self) -> MappingProxyType:
        return self._teams

    def get(self, team: str) -> TeamQuota:
        return self._teams.get(team, self.default)

    def with_team(self, name: str, quota: TeamQuota) -> QuotaBook:
        return QuotaBook({**self._teams, name: quota}, self.default, self.max_wait_s)

    def without(self, name: str) -> QuotaBook:
        return QuotaBook({k: v for k, v in self._teams.items() if k != name}, self.default, self.max_wait_s)

    def with_max_wait(self, max_wait_s: float | None) -> QuotaBook:
        return QuotaBook(dict(self._teams), self.default, max_wait_s)

    def cohort_of(self, team: str) -> str:
        return self.get(team).cohort

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, QuotaBook)
            and dict(self._teams) == dict(other._teams)
            and self.default == other.default
            and self.max_wait_s == other.max_wait_s
        )

    __hash__ = None  # type: ignore[assignment]


def check_max_wait(minutes: float, source: str = "surgectl team set") -> float | None:
    """The starvation bound given by command (minutes > 0, or -1: none) -> seconds, or None.
    Raises QuotaFileError: one line, the file's rule (``max_wait_minutes``)."""
    if minutes == -1:
        return None
    if not (0 < minutes <= 1e6):  # (NaN too)
        raise QuotaFileError(
            f"{source}: max_wait_minutes: must be > 0 and <= 1000000 minutes (or -1: none), got {minutes:g}"
        )
    return minutes * 60


def quota_from_fields(fields: dict, source: str = "surgectl team set") -> TeamQuota:
    """A ``TeamQuota`` from plain fields. Raises QuotaFileError: one line naming the field."""
    try:
        return TeamQuota.model_validate(fields)
    except ValidationError as e:
        raise QuotaFileError(spec_error_text(e, source, TeamQuota)) from None


def parse_quota_text(text: str, source: str = "quotas.yaml") -> QuotaBook:
    """The quota file's YAML text -> a ``QuotaBook``.

    Raises:
        QuotaFileError: malformed YAML, an unknown key, a wrong type or value; one line naming
            ``source`` and the field's dotted path (``quotas.yaml: teams.vision.nominal: ...``).
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise QuotaFileError(f"{source}:{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise QuotaFileError(f"{source}: expected a mapping with 'teams:' (and 'default:'), got {type(raw).__name__}")
    try:
        parsed = _QuotaFile.model_validate(raw)
    except ValidationError as e:
        raise QuotaFileError(spec_error_text(e, source, _QuotaFile)) from None
    try:
        bound = None if parsed.max_wait_minutes is None else parsed.max_wait_minutes * 60
        return QuotaBook(parsed.teams, parsed.default, bound)
    except QuotaFileError as e:
        raise QuotaFileError(f"{source}: teams.{e}") from None


def load_quota_file(path: str | Path) -> QuotaBook:
    """Read and validate the quota file at ``path``. Raises QuotaFileError (one line, also for
    a file that cannot be read)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise QuotaFileError(f"{path}: cannot read the quota file: {e.strerror}") from None
    return parse_quota_text(text, str(path))
