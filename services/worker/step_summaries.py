"""Which of its ranks' ``StepCompleted`` a node agent sends up to control (issue 28 item 3:
coalesced step traffic).

Rank 0's ``StepCompleted`` is the job's step summary (global loss, all-rank tokens, the
boundary commands every rank agreed on): control applies every one. Another rank's tells
control nothing but that the rank was heard from (``Orchestrator.on_step_completed``: after
a control restart, the job's status waits until every rank is heard again); that rank's
progress and liveness reach control's fault detector in its ``RankHeartbeat`` (``step``,
``phase``) every beat interval (sent a job's at a time: rank_beats.py). So the agent sends every rank-0 summary
and, of each other rank, the first after each registration with control (a restarted control
hears every rank once), and keeps the rest: per step, one StepCompleted per job reaches
control instead of one per rank (measured: bench/control_messages.py). Rank 0's come a beat
period's at a time (its session holds them for its beat: services/rank/session_batches.py),
and go up as one message with the node's beats (``Outbox.together``).
"""

from __future__ import annotations

import threading

from services.contract import route_pb2

STEP_COMPLETED = "surge.v1.StepCompleted"


class StepSummaries:
    """The filter :meth:`NodeAgent.relay_event` asks before sending a rank's routed event up.

    ``kept``: StepCompleted events of ranks other than 0 not sent (since the agent started).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # rank session threads relay concurrently
        self._heard: set[tuple[str, int]] = set()  # (job, rank) whose step went up this session
        self.kept = 0

    def new_session(self) -> None:
        """A registration with control (a new session: control may have restarted): each
        rank's next StepCompleted goes up again."""
        with self._lock:
            self._heard.clear()

    def send_up(self, job_id: str, rank: int, routed: route_pb2.Routed) -> bool:
        """Whether rank ``rank``'s routed event goes up to control: anything but a
        StepCompleted, rank 0's, and another rank's first of this session."""
        if routed.type != STEP_COMPLETED or rank == 0:
            return True
        with self._lock:
            if (job_id, rank) in self._heard:
                self.kept += 1
                return False
            self._heard.add((job_id, rank))
            return True
