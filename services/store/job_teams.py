"""Each job's team, as the store learned it from the job's own writes (issue 30 item 6).

The store holds a job's checkpoints and metrics but is never told about jobs by control; what it
knows of a job comes with the job's writes. Two of them carry the team control gave the job
(``JobSpec.team``, set from the submitter's identity): the loop's ``LogCollectionConfig``
(``team``, sent by every rank before its first step) and a version's ``CommitCheckpoint``
(``spec_json``, the job's spec). The first one seen is kept: a job's team never changes, so a
later write naming another is not believed (it is logged).

Kept on disk, one small file per job (``<root>/job_teams/<job_id>``, written whole and renamed
into place), so a restarted store still knows every team; read once into memory.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import structlog

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # (a file name: no separators, no dots alone)
_TEAM = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")  # (services/common/access.py TEAM_PATTERN)
_log = structlog.get_logger("job_teams")


class JobTeams:
    """``team_of(job)``: the team a job's writes named, or None (nothing of it named one)."""

    def __init__(self, root: Path):
        self._dir = Path(root) / "job_teams"
        self._lock = threading.Lock()
        self._teams: dict[str, str] = {}
        if self._dir.is_dir():
            for f in self._dir.iterdir():
                if _JOB_ID.match(f.name):
                    team = f.read_text().strip()
                    if _TEAM.match(team):
                        self._teams[f.name] = team

    def team_of(self, job_id: str) -> str | None:
        return self._teams.get(job_id)

    def learn(self, job_id: str, team: str) -> None:
        """Record ``job_id``'s team, once (a write naming a team must not fail for it: an
        unusable id or team is passed over; an I/O error is logged, the team kept in memory).
        """
        if not team or not _JOB_ID.match(job_id) or not _TEAM.match(team):
            return
        known = self._teams.get(job_id)
        if known == team:
            return
        if known is not None:
            _log.warning("job team not changed", job_id=job_id, team=known, named=team)
            return
        with self._lock:
            if job_id in self._teams:
                return
            self._teams[job_id] = team
            try:
                self._dir.mkdir(parents=True, exist_ok=True)
                tmp = self._dir / f".{job_id}.tmp"
                tmp.write_text(team + "\n")
                os.replace(tmp, self._dir / job_id)
            except OSError as e:
                _log.error("job team not written", job_id=job_id, team=team, error=str(e))

    def learn_from_spec(self, job_id: str, spec_json: str) -> None:
        """Record the team a committed version's spec names (``spec_json``: the job spec as JSON)."""
        if job_id in self._teams or not spec_json:
            return
        try:
            team = json.loads(spec_json).get("team")
        except (ValueError, AttributeError):
            return
        if isinstance(team, str):
            self.learn(job_id, team)
