"""What a caller may read and change in the store: a team's checkpoints and metrics are its own
(issue 30 item 6).

With a tokens file (``--tokens FILE`` / ``SURGE_TOKENS_FILE``, the file control reads:
services/common/access.py), the server's interceptor authenticates every call that claims the
operator (EXT_USER) and runs the handler with ``CALLER`` set to its principal; a Surge process's
call (a rank, control) runs as ``SERVICE``. The relay (server.py) asks this gate before it puts an
operator's request on the bus:

* a job's object (List, Load, Delete, Verify, Scrub of a job, ReadMetrics) of another team:
  refused, ``job X belongs to team Y; your identity (NAME) is team Z``;
* one whose team the store has not learned (JobTeams: from the job's own writes): refused too,
  never guessed; an admin still reaches it;
* a request naming no job (List of every job: answered with the caller's team's versions only;
  ``Load latest``, Scrub of every job: the admin role).

* a write (BeginSave, CommitSave, a Record stream's records, the checkpoint data plane's
  uploads, PutProfile) by a person's token (one claiming a rank's module on a store without a
  cluster token; with one, such a call is UNAUTHENTICATED before it gets here): to its own team's
  job only; a job the store knows no team of takes the writer's team (the first writer names it,
  as a rank's first record does), never the team the write itself names.

An admin, and a Surge process, reach every job. A refusal is PERMISSION_DENIED, one line,
counted in ``surge_control_access_refused_total{method,reason}`` (the one counter of every
service's refusals, on this process's /metrics) and logged. Without a tokens file every check
passes, as before.

No decision is taken here: this is the operator's gate in front of L5, as control/access.py is
in front of L1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc

from services.common.access import CALLER, Principal, refused
from services.store.job_teams import JobTeams


class AccessRefused(PermissionError):
    """A call the caller's identity may not make: the one line, and its status ``code``."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED):
        super().__init__(message)
        self.code = code


class StoreAccess:
    """Per-team access on the store. ``teams``: each job's team (None: not enforced)."""

    def __init__(self, teams: JobTeams | None = None):
        self.teams = teams

    @property
    def enforced(self) -> bool:
        return self.teams is not None

    def _person(self, method: str) -> Principal | None:
        """The caller, when its view is limited to its team (None: no enforcement, an admin,
        or a Surge process).

        Raises:
            AccessRefused (UNAUTHENTICATED): enforced and no principal (a handler reached
                without the interceptor: refused, never let through).
        """
        if self.teams is None:
            return None
        p = CALLER.get()
        if p is None:
            refused(method, "unauthenticated")
            raise AccessRefused(f"{method}: not authenticated", grpc.StatusCode.UNAUTHENTICATED)
        return None if p.admin or p.service else p

    def check_job(self, method: str, job_id: str) -> None:
        """Raises AccessRefused when the caller may not reach ``job_id``'s objects."""
        p = self._person(method)
        if p is None:
            return
        team = self.teams.team_of(job_id)
        if team == p.team:
            return
        if team is None:
            refused(method, "team_unknown", caller=p.name, team=p.team, job_id=job_id)
            raise AccessRefused(
                f"the store knows no team of job {job_id} (it learns one from the job's first step or "
                f"checkpoint); your identity ({p.name}) is team {p.team}: an admin's token reads it"
            )
        refused(method, "other_team", caller=p.name, team=p.team, job_id=job_id, job_team=team)
        raise AccessRefused(f"job {job_id} belongs to team {team}; your identity ({p.name}) is team {p.team}")

    def check_write(self, method: str, job_id: str) -> None:
        """``check_job`` for a write of ``job_id``'s data: a job the store knows no team of
        takes the writer's (a person's writes can only ever land in its own team's jobs)."""
        p = self._person(method)
        if p is None:
            return
        if self.teams.team_of(job_id) is None:
            self.teams.learn(job_id, p.team)
        self.check_job(method, job_id)

    def check_version(self, method: str, version: str) -> None:
        """``check_job`` for a version (``<job>:<n>``, ``<job>:latest``); ``latest`` of every
        job is the admin's."""
        job, sep, _ = version.rpartition(":")
        if sep and job:
            self.check_job(method, job)
        else:
            self.require_admin(method, f"{version or 'a version'} of every job")

    def require_admin(self, method: str, what: str) -> None:
        """Raises AccessRefused unless the caller sees every job (``what``: for the line)."""
        p = self._person(method)
        if p is None:
            return
        refused(method, "admin_only", caller=p.name, team=p.team)
        raise AccessRefused(f"{what} needs the admin role; your identity ({p.name}) is a user of team {p.team}")

    def visible(self, method: str, items: Iterable, job_of: Callable[[object], str]) -> list:
        """The items (of every job) whose job is the caller's team's; all of them for an admin."""
        p = self._person(method)
        items = list(items)
        if p is None:
            return items
        return [i for i in items if self.teams.team_of(job_of(i)) == p.team]
