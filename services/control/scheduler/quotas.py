"""A team's quota, the default for a team with none, and the quota file.

A quota counts slots (one rank = one slot; the allocator's CPU and CUDA slots are counted
alike, since a job spec does not ask for a device kind: see docs/LOG.md session 27):

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

The file (``control --quotas FILE``)::

    default: {weight: 1}              # optional: for every team with no entry
    teams:
      vision: {nominal: 8, borrow_limit: 4, hard_limit: 16, weight: 2, cohort: research}
      nlp: {nominal: 8, cohort: research}

A bad file: one line naming the file and the field (``QuotaFileError``).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.contract.failures import Refusal
from services.jobspec_errors import spec_error_text

# A team's name: the job spec's ``team`` field's pattern (services/jobspec/__init__.py).
TEAM_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
# No cluster has this many slots; a bigger number is a typing mistake.
MAX_SLOTS = 1_000_000


class QuotaFileError(ValueError, Refusal):
    """A quota (file or `surgectl team set`) that cannot be used: one line naming the field."""


class TeamQuota(BaseModel):
    """One team's quota (see the module docstring); validated on construction."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    nominal: int | None = Field(None, ge=0, le=MAX_SLOTS)
    borrow_limit: int | None = Field(None, ge=0, le=MAX_SLOTS)
    hard_limit: int | None = Field(None, ge=1, le=MAX_SLOTS)
    weight: float = Field(1.0, gt=0, le=1e6)
    cohort: str = Field("default", pattern=TEAM_PATTERN)

    @model_validator(mode="after")
    def _hard_limit_at_least_nominal(self) -> TeamQuota:
        # A hard limit below what the team owns would make part of its own quota unusable.
        if self.hard_limit is not None and self.nominal is not None and self.hard_limit < self.nominal:
            raise ValueError(f"hard_limit: must be >= nominal ({self.nominal}), got {self.hard_limit}")
        return self

    @property
    def ceiling(self) -> float:
        """The most slots the team may ever hold: nominal + borrow limit, within the hard limit
        (inf: no bound)."""
        borrowable = (
            float("inf") if self.nominal is None or self.borrow_limit is None else self.nominal + self.borrow_limit
        )
        return min(borrowable, float("inf") if self.hard_limit is None else self.hard_limit)

    def to_json(self) -> dict:
        return self.model_dump()


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


class QuotaBook:
    """Every team's quota: the entries and the default for the rest. Immutable: a change makes
    a new book (``with_team``/``without``), so a reader never sees one half-changed."""

    def __init__(self, teams: dict[str, TeamQuota] | None = None, default: TeamQuota = DEFAULT_QUOTA) -> None:
        for name in teams or {}:
            check_team_name(name)
        self._teams = MappingProxyType(dict(teams or {}))
        self.default = default

    @property
    def teams(self) -> MappingProxyType:
        return self._teams

    def get(self, team: str) -> TeamQuota:
        return self._teams.get(team, self.default)

    def with_team(self, name: str, quota: TeamQuota) -> QuotaBook:
        return QuotaBook({**self._teams, name: quota}, self.default)

    def without(self, name: str) -> QuotaBook:
        return QuotaBook({k: v for k, v in self._teams.items() if k != name}, self.default)

    def cohort_of(self, team: str) -> str:
        return self.get(team).cohort

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, QuotaBook) and dict(self._teams) == dict(other._teams) and self.default == other.default
        )

    __hash__ = None  # type: ignore[assignment]


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
        return QuotaBook(parsed.teams, parsed.default)
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
