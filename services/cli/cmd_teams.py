"""surgectl team set / list / remove (teams' quotas, admin) and surgectl queue (the waiting
jobs in the order control tries them, and why each waits). Issue 30 items 1 and 4; the
policy is control's (services/control/scheduler/), which validates every value again."""

from __future__ import annotations

import typer
from rich.table import Table

from services.cli import clients, jsonout, render
from services.cli.app import OutputOpt, _say, app, team_app
from services.cli.errors import CliError
from services.contract import control_pb2

UNLIMITED = -1  # TeamQuota's wire form of "no bound"
SLOTS_MAX = 2**63 - 1


def _slots(flag: str, text: str | None, default: int | None = UNLIMITED) -> int | None:
    """A slot count option: an integer >= 0, or 'unlimited' / 'none' (no bound)."""
    if text is None or text.lower() in ("unlimited", "none"):
        return default if text is None else UNLIMITED
    try:
        value = int(text)
    except ValueError:
        raise CliError(f"{flag}: expected a number of slots >= 0 or 'unlimited', got {text!r}", code=2) from None
    if not 0 <= value <= SLOTS_MAX:  # (TeamQuota's int64 fields)
        raise CliError(f"{flag}: expected a number of slots 0-{SLOTS_MAX} or 'unlimited', got {value}", code=2)
    return value


def _bound(v: int) -> str:
    return "unlimited" if v == UNLIMITED else str(v)


@team_app.command("set")
def team_set(
    name: str = typer.Argument(..., help="the team, as jobs name it (`team:` in the job spec)"),
    nominal: str = typer.Option(None, "--nominal", help="slots the team owns (default: unlimited)"),
    borrow_limit: str = typer.Option(
        None,
        "--borrow-limit",
        help="slots it may borrow beyond nominal from its cohort's idle ones (default: unlimited)",
    ),
    hard_limit: str = typer.Option(None, "--hard-limit", help="slots never exceeded, even idle (default: none)"),
    weight: float = typer.Option(
        None, "--weight", help="its share under contention, relative to other teams (> 0; default 1)"
    ),
    cohort: str = typer.Option(
        None, "--cohort", help="the teams that lend each other idle nominal slots (default: default)"
    ),
) -> None:
    """Set a team's quota: the flags given change it, the others keep the team's current values
    (a team with no quota of its own yet: unlimited, weight 1, cohort default). Journaled by
    control, in force at once (queued jobs are tried again), kept across a restart over the
    `--quotas` file's.

    Example: surgectl team set vision --nominal 8 --borrow-limit 4 --hard-limit 16 --weight 2 --cohort research
    """
    if weight is not None and not weight > 0:
        raise CliError(f"--weight: must be > 0, got {weight:g}", code=2)
    given = {
        "nominal": _slots("--nominal", nominal, default=None),
        "borrow_limit": _slots("--borrow-limit", borrow_limit, default=None),
        "hard_limit": _slots("--hard-limit", hard_limit, default=None),
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
    quota = control_pb2.TeamQuota(name=name, **{k: base[k] if v is None else v for k, v in given.items()})
    weight, cohort = quota.weight, quota.cohort
    if UNLIMITED not in (quota.hard_limit, quota.nominal) and quota.hard_limit < quota.nominal:
        # Control refuses it too, naming the quota's field; here the user's flags are named.
        raise CliError(f"--hard-limit: must be >= --nominal ({quota.nominal}), got {quota.hard_limit}", code=2)
    req = control_pb2.SetTeamQuotaRequest(quota=quota)
    clients.call("control", lambda st: st.SetTeamQuota(req, timeout=10))
    _say(
        f"team {name}: nominal {_bound(quota.nominal)}, borrow limit {_bound(quota.borrow_limit)}, "
        f"hard limit {_bound(quota.hard_limit)}, weight {weight:g}, cohort {cohort}"
    )


@team_app.command("remove")
def team_remove(name: str = typer.Argument(..., help="the team")) -> None:
    """Remove a team's own quota: its jobs get the default quota (unlimited unless the
    `--quotas` file's `default:` says otherwise). Its jobs keep running.

    Example: surgectl team remove vision
    """
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
        print(jsonout.dumps([teams]))
        return
    render.console.print(teams_table(teams))


@app.command(name="queue")
def queue(output: str = OutputOpt) -> None:
    """The waiting jobs in the order control tries them (fair share across teams, then
    priority and age within a team): position, team, slots, and why each waits (ranks to
    free up, its team at its hard limit, its fair share, beyond the cluster...); then each
    team's usage against its quota. -o json for scripts.

    Example: surgectl queue
    """
    if output not in ("table", "json"):
        raise CliError(f"--output: expected 'table' or 'json', got {output!r}", code=2)
    teams = clients.call("control", lambda st: st.ListTeams(control_pb2.TeamQuery(), timeout=10))
    if output == "json":
        print(jsonout.dumps([teams]))
        return
    if not teams.queue:
        _say("no job is waiting")
    else:
        t = Table(title=f"{len(teams.queue)} waiting")
        for col in ("#", "job", "team", "slots", "priority", "waiting", "why"):
            t.add_column(col, justify="right" if col in ("#", "slots", "priority", "waiting") else "left")
        for j in teams.queue:
            t.add_row(
                str(j.position),
                j.job_id,
                j.team,
                str(j.slots),
                str(j.priority),
                f"{j.waiting_seconds:.0f} s",
                j.reason,
            )
        render.console.print(t)
    render.console.print(teams_table(teams))


def teams_table(teams: control_pb2.TeamList) -> Table:
    """Teams' usage against their quotas (``TeamList.teams``), the default quota in the caption."""
    d = teams.default_quota
    t = Table(
        title="teams",
        caption=f"a team with no quota of its own: nominal {_bound(d.nominal)}, borrow limit "
        f"{_bound(d.borrow_limit)}, hard limit {_bound(d.hard_limit)}, weight {d.weight:g}, cohort {d.cohort}",
    )
    for col in ("team", "used", "nominal", "borrowed", "borrow limit", "hard limit", "weight", "cohort", "jobs"):
        t.add_column(col, justify="left" if col in ("team", "cohort") else "right")
    for q in teams.teams:
        t.add_row(
            q.name + ("" if q.configured else " (default)"),
            str(q.used),
            _bound(q.nominal),
            str(q.borrowed),
            _bound(q.borrow_limit),
            _bound(q.hard_limit) if q.hard_limit != UNLIMITED else "none",
            f"{q.weight:g}",
            q.cohort,
            f"{q.running_jobs} running, {q.waiting_jobs} waiting",
        )
    return t
