"""surgectl team set / list / remove (teams' quotas, admin) and surgectl queue (the waiting
jobs in the order control tries them, and why each waits). Issue 30 items 1 and 4; the
policy is control's (services/control/scheduler/), which validates every value again."""

from __future__ import annotations

import json
import math
import re

import typer
from rich.table import Table

from services.cli import clients, jsonout, render
from services.cli.app import OutputOpt, _say, app, team_app
from services.cli.errors import CliError
from services.cli.numbers import float_option
from services.common.access import TEAM_PATTERN
from services.contract import control_pb2
from services.jobspec.base import MAX_TEAM_SLOTS

UNLIMITED = -1  # TeamQuota's wire form of "no bound"
SLOTS_MAX = MAX_TEAM_SLOTS  # control's bound (services/jobspec/base.py), refused here too
KINDS = ("gpu", "cpu")  # the device kinds a per-kind bound names (control/scheduler/quotas.py)


def _slots(flag: str, text: str | None, default: int | None = UNLIMITED) -> int | None:
    """A slot count option: an integer >= 0, or 'unlimited' / 'none' (no bound)."""
    if text is None or text.lower() in ("unlimited", "none"):
        return default if text is None else UNLIMITED
    try:
        value = int(text)
    except ValueError:
        raise CliError(f"{flag}: expected a number of slots >= 0 or 'none' (no bound), got {text!r}", code=2) from None
    if not 0 <= value <= SLOTS_MAX:  # (refused here too, so a stack that is down still says why, exit 2)
        raise CliError(f"{flag}: expected a number of slots 0-{SLOTS_MAX} or 'none' (no bound), got {value}", code=2)
    return value


def _per_kind(flag: str, text: str) -> dict[str, int]:
    """A per-kind bound's text, ``gpu=16,cpu=64`` (a count or 'unlimited' each) -> {kind: slots}
    (UNLIMITED for 'unlimited'). Raises CliError (one line, exit 2)."""
    form = f"{flag}: expected KIND=SLOTS[,KIND=SLOTS] with KIND gpu or cpu"
    out: dict[str, int] = {}
    for item in text.split(","):
        kind, eq, value = item.strip().partition("=")
        kind = kind.strip().lower()
        if not eq or kind not in KINDS:
            raise CliError(f"{form}, got {text!r}", code=2)
        if kind in out:
            raise CliError(f"{flag}: {kind} given twice in {text!r}", code=2)
        if not value.strip():
            raise CliError(f"{flag} {kind}: expected a number of slots >= 0 or 'none' (no bound), got nothing", code=2)
        out[kind] = _slots(f"{flag} {kind}", value.strip())
    return out


def _bound(v: int) -> str:
    return "unlimited" if v == UNLIMITED else str(v)


def _bound_text(q: control_pb2.TeamQuota, field: str, none: str = "unlimited") -> str:
    """A quota's bound as people read it: ``8``, or per kind ``gpu 16, cpu 64``."""
    if q.HasField(f"{field}_by_kind"):
        per = getattr(q, f"{field}_by_kind")
        return ", ".join(f"{k} {none if getattr(per, k) == UNLIMITED else getattr(per, k)}" for k in KINDS)
    v = getattr(q, field)
    return none if v == UNLIMITED else str(v)


def _team_name(name: str | None) -> str:
    """The NAME argument checked (the job spec's ``team:`` pattern). Raises CliError (exit 2)."""
    if not name or not re.match(TEAM_PATTERN, name):
        raise CliError(
            f"NAME: a team name is lowercase letters, digits and '-', starting with a letter or digit, "
            f"at most 40 characters, got {name or ''!r}",
            code=2,
        )
    return name


def _max_wait(text: str) -> float:
    """--max-wait's text: minutes > 0, or 'none' (no bound: -1 on the wire)."""
    if text.strip().lower() in ("none", "unlimited"):
        return float(UNLIMITED)
    try:
        minutes = float(text)
    except ValueError:
        raise CliError(f"--max-wait: expected minutes > 0 or 'none', got {text!r}", code=2) from None
    if not (math.isfinite(minutes) and 0 < minutes <= 1_000_000):
        raise CliError(f"--max-wait: expected minutes > 0 (at most 1000000) or 'none', got {text!r}", code=2)
    return minutes


def _set_max_wait(text: str) -> None:
    minutes = _max_wait(text)
    req = control_pb2.SetTeamQuotaRequest(set_max_wait=True, max_wait_minutes=minutes)
    clients.call("control", lambda st: st.SetTeamQuota(req, timeout=10))
    said = "none (the fair order alone)" if minutes == UNLIMITED else f"{minutes:g} min"
    _say(f"starvation bound (every team): {said}")


def _max_wait_text(teams: control_pb2.TeamList) -> str:
    m = teams.max_wait_minutes
    return "no starvation bound" if m == UNLIMITED else f"starvation bound {m:g} min"


@team_app.command("set")
def team_set(
    name: str = typer.Argument(
        None, help="the team, as jobs name it (`team:` in the job spec); none with --max-wait alone"
    ),
    nominal: str = typer.Option(
        None, "--nominal", help="slots the team owns, of every kind together (default: unlimited)"
    ),
    quota: str = typer.Option(
        None,
        "--quota",
        help="slots the team owns per device kind, e.g. gpu=16,cpu=64 (instead of --nominal; a kind left "
        "out owns none)",
    ),
    borrow_limit: str = typer.Option(
        None,
        "--borrow-limit",
        help="slots it may borrow beyond nominal from its cohort's idle ones, or per kind gpu=4,cpu=8 "
        "(default: unlimited)",
    ),
    hard_limit: str = typer.Option(
        None, "--hard-limit", help="slots never exceeded, even idle, or per kind gpu=24 (default: none)"
    ),
    weight: float = float_option(
        None, "--weight", help="its share under contention, relative to other teams (> 0; default 1)"
    ),
    cohort: str = typer.Option(
        None, "--cohort", help="the teams that lend each other idle nominal slots (default: default)"
    ),
    max_wait: str = typer.Option(
        None,
        "--max-wait",
        help="the starvation bound, for every team (no NAME): minutes after which a waiting job of a team "
        "below its fair share goes first, or 'none' (default: the --quotas file's, 120)",
    ),
) -> None:
    """Set a team's quota: the flags given change it, the others keep the team's current values
    (a team with no quota of its own yet: unlimited, weight 1, cohort default). Journaled by
    control, in force at once (queued jobs are tried again), kept across a restart over the
    `--quotas` file's.

    A bound is an int (every device kind together, as jobs of any kind count) or per kind
    (`--quota gpu=16,cpu=64`, `--hard-limit gpu=24`): then each kind is bounded on its own,
    and the team's jobs must say `parallel.device: gpu` or `cpu`. Per kind, the kinds given
    change, the others keep their values (none yet: a kind left out owns none, no limit).

    Example: surgectl team set vision --nominal 8 --borrow-limit 4 --hard-limit 16 --weight 2 --cohort research

    Example: surgectl team set robotics --quota gpu=16,cpu=64 --hard-limit gpu=24

    The starvation bound is the cluster's, for every team: `surgectl team set --max-wait 90`
    (no team name; 'none' turns it off). Journaled, kept across a restart over the file's.
    """
    if max_wait is not None:
        if name is not None:
            raise CliError(
                "--max-wait: the starvation bound is the cluster's, for every team: give it without a team "
                "name (`surgectl team set --max-wait 90`)",
                code=2,
            )
        if any(v is not None for v in (nominal, quota, borrow_limit, hard_limit, weight, cohort)):
            raise CliError("--max-wait: give it alone (it is the cluster's, not a team's quota)", code=2)
        _set_max_wait(max_wait)
        return
    name = _team_name(name)
    if weight is not None and not weight > 0:
        raise CliError(f"--weight: must be > 0, got {weight:g}", code=2)
    if cohort is not None and not cohort.strip():  # (was: taken, and the team's cohort silently became default)
        raise CliError("--cohort: empty (a cohort name; leave --cohort out to keep the team's)", code=2)
    if quota is not None and nominal is not None:
        raise CliError("--quota: give --nominal (every kind) or --quota (per kind), not both", code=2)
    per_kind = {
        "nominal": _per_kind("--quota", quota) if quota is not None else None,
        "borrow_limit": _per_kind("--borrow-limit", borrow_limit) if borrow_limit and "=" in borrow_limit else None,
        "hard_limit": _per_kind("--hard-limit", hard_limit) if hard_limit and "=" in hard_limit else None,
    }
    given = {
        "nominal": _slots("--nominal", nominal, default=None),
        "borrow_limit": None if per_kind["borrow_limit"] else _slots("--borrow-limit", borrow_limit, default=None),
        "hard_limit": None if per_kind["hard_limit"] else _slots("--hard-limit", hard_limit, default=None),
        "weight": weight,
        "cohort": cohort,
    }
    teams = clients.call("control", lambda st: st.ListTeams(control_pb2.TeamQuery(), timeout=10))
    current = next((q for q in teams.teams if q.name == name and q.configured), None)
    base = {
        "nominal": UNLIMITED,
        "borrow_limit": UNLIMITED,
        "hard_limit": UNLIMITED,
        "weight": 1.0,
        "cohort": "default",
    }
    if current is not None:  # (a patch: what was not given stays as it is)
        base = {k: getattr(current, k) for k in base}
    new = control_pb2.TeamQuota(name=name, **{k: base[k] if v is None else v for k, v in given.items()})
    for field, kinds in per_kind.items():
        by_kind = f"{field}_by_kind"
        if kinds is None and given[field] is None and current is not None and current.HasField(by_kind):
            getattr(new, by_kind).CopyFrom(getattr(current, by_kind))  # (not given: kept per kind)
        elif kinds is not None:
            was = getattr(current, by_kind) if current is not None and current.HasField(by_kind) else None
            missing = 0 if field == "nominal" else UNLIMITED
            values = {k: kinds.get(k, missing if was is None else getattr(was, k)) for k in KINDS}
            getattr(new, by_kind).CopyFrom(control_pb2.KindSlots(**values))
            setattr(new, field, UNLIMITED)
    weight, cohort = new.weight, new.cohort
    if UNLIMITED not in (new.hard_limit, new.nominal) and new.hard_limit < new.nominal:
        # Control refuses it too, naming the quota's field; here the user's flags are named.
        raise CliError(f"--hard-limit: must be >= --nominal ({new.nominal}), got {new.hard_limit}", code=2)
    req = control_pb2.SetTeamQuotaRequest(quota=new)
    clients.call("control", lambda st: st.SetTeamQuota(req, timeout=10))
    _say(
        f"team {name}: nominal {_bound_text(new, 'nominal')}, borrow limit {_bound_text(new, 'borrow_limit')}, "
        f"hard limit {_bound_text(new, 'hard_limit')}, weight {weight:g}, cohort {cohort}"
    )


@team_app.command("remove")
def team_remove(name: str = typer.Argument(..., help="the team")) -> None:
    """Remove a team's own quota: its jobs get the default quota (unlimited unless the
    `--quotas` file's `default:` says otherwise). Its jobs keep running.

    Example: surgectl team remove vision
    """
    name = _team_name(name)
    req = control_pb2.SetTeamQuotaRequest(quota=control_pb2.TeamQuota(name=name), remove=True)
    clients.call("control", lambda st: st.SetTeamQuota(req, timeout=10))
    _say(f"team {name}: quota removed; its jobs get the default quota")


@team_app.command("list")
def team_list(output: str = OutputOpt) -> None:
    """Every team with a quota or a job: its quota, its slots in use (and borrowed beyond
    its nominal), its running and waiting jobs; -o json for scripts.

    Example: surgectl team list -o json
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    teams = clients.call("control", lambda st: st.ListTeams(control_pb2.TeamQuery(), timeout=10))
    if output == "json":
        print(teams_json(teams))
        return
    render.console.print(teams_table(teams))


@app.command(name="queue")
def queue(output: str = OutputOpt) -> None:
    """The waiting jobs in the order control tries them (fair share across teams, then
    priority and age within a team): position, team, slots, and why each waits (ranks to
    free up, its team at its hard limit, its fair share, beyond the cluster...; the title
    counts those that can never run as things stand: beyond what their team may ever hold or
    the slots registered); then each team's usage against its quota. -o json for scripts.

    Example: surgectl queue
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    teams = clients.call("control", lambda st: st.ListTeams(control_pb2.TeamQuery(), timeout=10))
    if output == "json":
        print(teams_json(teams))
        return
    if not teams.queue:
        _say("no job is waiting")
    else:
        never = sum(1 for j in teams.queue if j.cannot_run)  # (JobStatus.cannot_run: quota or cluster)
        title = f"{len(teams.queue)} waiting" + (f", {never} of them can never run as things stand" if never else "")
        t = Table(title=title)
        for col in ("#", "job", "team", "slots", "device", "priority", "waiting", "why"):
            t.add_column(col, justify="right" if col in ("#", "slots", "priority", "waiting") else "left")
        for j in teams.queue:
            t.add_row(
                str(j.position),
                j.job_id,
                j.team,
                str(j.slots),
                j.device or "any",
                str(j.priority),
                f"{j.waiting_seconds:.0f} s",
                j.reason,
            )
        render.console.print(t)
    render.console.print(teams_table(teams))


def teams_json(teams: control_pb2.TeamList) -> str:
    """`team list`/`queue` -o json: one document (a list of one view, as before), each bound in
    a plain JSON shape: a number, null for no bound, or per kind ``{"gpu": 16, "cpu": null}``
    (not the wire's -1 and ``*_by_kind`` fields); ``max_wait_minutes`` null for none."""
    view = jsonout.to_plain(teams)
    for plain, q in [*zip(view["teams"], teams.teams, strict=True), (view["default_quota"], teams.default_quota)]:
        for field in ("nominal", "borrow_limit", "hard_limit"):
            by_kind = plain.pop(f"{field}_by_kind", None)
            if q.HasField(f"{field}_by_kind"):
                plain[field] = {k: None if v == UNLIMITED else v for k, v in by_kind.items()}
            else:
                plain[field] = None if plain[field] == UNLIMITED else plain[field]
        if not q.HasField("borrowed_by_kind"):
            plain["borrowed_by_kind"] = None
    view["max_wait_minutes"] = None if teams.max_wait_minutes == UNLIMITED else teams.max_wait_minutes
    return json.dumps([view], indent=2)


def teams_table(teams: control_pb2.TeamList) -> Table:
    """Teams' usage against their quotas (``TeamList.teams``), the default quota in the caption."""
    d = teams.default_quota
    c = teams.cluster_by_kind
    t = Table(
        title=f"teams (cluster: {c.gpu} gpu, {c.cpu} cpu slots placeable; {_max_wait_text(teams)})",
        caption=f"a team with no quota of its own: nominal {_bound_text(d, 'nominal')}, borrow limit "
        f"{_bound_text(d, 'borrow_limit')}, hard limit {_bound_text(d, 'hard_limit', 'none')}, weight "
        f"{d.weight:g}, cohort {d.cohort}",
    )
    cols = ("team", "used", "gpu used", "cpu used", "nominal", "borrowed", "borrow limit", "hard limit", "weight")
    for col in (*cols, "cohort", "jobs"):
        t.add_column(
            col, justify="left" if col in ("team", "cohort", "nominal", "borrow limit", "hard limit") else "right"
        )
    for q in teams.teams:
        per_kind_borrowed = q.HasField("borrowed_by_kind") and (q.borrowed_by_kind.gpu or q.borrowed_by_kind.cpu)
        t.add_row(
            q.name + ("" if q.configured else " (default)"),
            str(q.used),
            str(q.used_by_kind.gpu),
            str(q.used_by_kind.cpu),
            _bound_text(q, "nominal"),
            f"gpu {q.borrowed_by_kind.gpu}, cpu {q.borrowed_by_kind.cpu}" if per_kind_borrowed else str(q.borrowed),
            _bound_text(q, "borrow_limit"),
            _bound_text(q, "hard_limit", "none"),
            f"{q.weight:g}",
            q.cohort,
            f"{q.running_jobs} running, {q.waiting_jobs} waiting",
        )
    return t
