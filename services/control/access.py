"""What a caller may do on control's user port: a team sees and controls its own jobs only
(issue 30 item 6).

The caller is the principal the server's interceptor authenticated from control's tokens file
(services/common/access.py: a token or a client certificate bound to a team and a role) and set
as ``CALLER`` around the handler. ``ControlServicer`` (server.py) asks this module before it
relays a command onto the bus and filters what it answers:

* a job-scoped command or read (status, events, logs, stop, pause, tag, profile, scale, ...)
  of another team's job: refused, ``job X belongs to team Y; your identity (NAME) is team Z``;
* a list: the caller's team's jobs only;
* a submit: the job takes the caller's team; a spec naming another team is refused;
* nodes (drain, uncordon) and, later, quotas: the admin role only (``require_admin``).

An admin sees and controls every job. Every refusal is PERMISSION_DENIED (UNAUTHENTICATED for
no principal), one line, counted in ``surge_control_access_refused_total{method,reason}`` and
logged. Without a tokens file (``enforced`` False) every check passes and a submit's job keeps
its spec's team: control behaves as before.

No decision is taken here: this is the operator's gate in front of L1-1, not a module of it.
It reads nothing but the principal and the job's status the servicer hands it.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from services.common.access import CALLER, Principal, refused
from services.contract import control_pb2
from services.jobspec import JobSpecError, read_spec_mapping


class AccessRefused(PermissionError):
    """A call the caller's identity may not make: ``code`` (PERMISSION_DENIED, or
    UNAUTHENTICATED: no principal) and the one line it is answered with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.PERMISSION_DENIED):
        super().__init__(message)
        self.code = code


class ControlAccess:
    """Per-team access on control's user port. ``enforced``: control has a tokens file."""

    def __init__(self, enforced: bool = False):
        self.enforced = enforced

    def caller(self, method: str) -> Principal | None:
        """The call's principal; None when access is not enforced.

        Raises:
            AccessRefused (UNAUTHENTICATED): enforced, and the call came with no principal
                (a handler reached without the interceptor: refused, never let through).
        """
        if not self.enforced:
            return None
        principal = CALLER.get()
        if principal is None:
            refused(method, "unauthenticated")
            raise AccessRefused(f"{method}: not authenticated", grpc.StatusCode.UNAUTHENTICATED)
        return principal

    def check_job(self, method: str, job: control_pb2.JobStatus) -> None:
        """Raises AccessRefused when the caller may not see or control ``job`` (another
        team's, and the caller is no admin)."""
        p = self.caller(method)
        if p is None or p.admin or job.team == p.team:
            return
        refused(method, "other_team", caller=p.name, team=p.team, job_id=job.job_id, job_team=job.team)
        raise AccessRefused(f"job {job.job_id} belongs to team {job.team}; your identity ({p.name}) is team {p.team}")

    def require_admin(self, method: str, what: str) -> None:
        """Raises AccessRefused unless the caller is an admin (or access is not enforced).
        ``what``: the action, for the refusal's line (``drain a node``)."""
        p = self.caller(method)
        if p is None or p.admin:
            return
        refused(method, "admin_only", caller=p.name, team=p.team)
        raise AccessRefused(f"{what} needs the admin role; your identity ({p.name}) is a user of team {p.team}")

    def team_view(self, method: str) -> str:
        """The team whose jobs alone the caller sees ("": every job: an admin, or no enforcement)."""
        p = self.caller(method)
        return "" if p is None or p.admin else p.team

    def visible(self, method: str, jobs: Iterable[control_pb2.JobStatus]) -> list[control_pb2.JobStatus]:
        """The jobs the caller may see: all for an admin or without enforcement, else its
        team's."""
        p = self.caller(method)
        jobs = list(jobs)
        if p is None or p.admin:
            return jobs
        return [j for j in jobs if j.team == p.team]

    def submit(self, method: str, request: control_pb2.SubmitJobRequest) -> control_pb2.SubmitJobRequest:
        """The submit to relay: its job's team set from the caller's (``team``, which replaces
        the spec's), or the spec's own for an admin's spec naming one; without enforcement the
        field cleared (only control sets it).

        Raises:
            AccessRefused: a user's spec names another team than its identity's.
        """
        out = control_pb2.SubmitJobRequest()
        out.CopyFrom(request)
        out.team = ""
        p = self.caller(method)
        if p is None:
            return out
        source = request.spec_path or "job.yaml"
        try:
            named = read_spec_mapping(request.spec_yaml, source).get("team")
        except JobSpecError:
            named = None  # (the orchestrator refuses the spec itself, with its own line)
        if named is not None and named != p.team:
            if p.admin:
                return out  # an admin submits for the team its spec names
            refused(method, "spec_team", caller=p.name, team=p.team, spec_team=str(named))
            raise AccessRefused(
                f"{source}: team: {named!r} is another team; your identity ({p.name}) is team {p.team} "
                "(only an admin submits for another team)"
            )
        out.team = p.team
        return out
