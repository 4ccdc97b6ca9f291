"""A rank's event decided without waiting for its journal commit (``CommitLater``): the
applier's thread applies the event, hands its records to the journal's group-commit writer
and goes on to the next; what must not precede durability is released by the commit.

Why (issue 28, the start at scale): a job's start is one "rank N ready" record per rank, and
the thread that decided each waited for its commit (``_after_decision``) before the job's
queue gave it the next rank's event: one commit per rank, serial. 512 ranks in process were
512 commits (11.5 s to RUNNING on a loaded host, 9.7 s of it waiting on them); 8,192 ranks
8,192 commits, each dumping the job's 8,192-rank runtime. Now the job's ready events are
applied back to back and the writer commits what they queued in a few groups (a runtime
dumped once per group: job_store.py ``_save_statements``).

What still waits for the commit, released from it:
- the ack to the node agent: the write carries the event's cursor and the session hub acks
  from its future (exactly_once.py ``_ack_when``): an event acked is durable, and an event
  whose write failed is not acked (resent after a reconnect or a restart), as before;
- the commands to the ranks and the releases (the job's ``Outbox``): once the job's last
  write of the decision is done, the job's drain is handed off the writer's thread
  (``_drain_soon``: a command may call back into the orchestrator), only when something waits;
- a failed write's report: L1-1's typed failure event (OrchestratorFailed, FAILURE_WRITE_REFUSED
  for a refused write: journal_failure.py) to L1-3, as the handler raising it reported it
  (held_steps.py ``_report_soon``), graded ``journal_write_failed`` and decided by the job's
  policy (faults.py ``_journal_refused``).

The same for a job's other per-rank events (session 31): every rank's paused report (a
pause, a stop's checkpoint pause, a scale's, a rollback's, a drain's, a departure's, a
preemption's: training.py ``on_training_loop_paused``), its finish (``on_training_loop_finished``),
its failure record (``on_training_loop_failed``), a step fault's consequence record, and L1-3's
per-rank reports recorded only (faults.py: a clean exit after the rank's finish, an exit control
asked for, an incident's consequence, a late one). What a failed write of one of these leaves:
the rank's mark in memory (``paused``, ``finished``, ``exited``) ahead of the journal and its
event un-acked; nothing to undo: each write is the job's whole bookkeeping (``_runtime``), so the
job's next write that commits journals the mark too, and the agent's resend after a reconnect
applies it again (a set; or ignored once the job moved on). The rank's last report, whose
decision moves the job (PAUSED, TERMINATED, a resize, a move), goes on only where that
decision registers no undo and asks for no start of the queue's head: a finish's release and a
departure's move wait as before.

Only where nobody waits on the thread: a worker event applied by the event applier
(``JobStore.goes_on``: the session hub's bursts, ``wait=False``), the handler's decision
being the outermost (``DecisionLock.outermost``); its end (``_decision_over``, the lock's
``after``) then does not wait. A decision that must undo itself if its write fails
(``_undo_if_lost``), or that asks the queue's head to be tried once its releases went, waits
as before: its undo runs before the job's next event is decided (session 28).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from google.protobuf.message import Message


class CommitLater:
    """A part of ``Orchestrator`` (see core.py): decisions of a rank's event that go on before
    their journal commit (see the module docstring)."""

    def _commit_later(self, msg: Message) -> None:
        """Under the lock, in the handler of ``msg`` (a node agent's event): if nobody waits on
        this thread and this is the outermost decision, it will not wait for its writes."""
        if self._lock.outermost() and self._journal.goes_on():
            self._decided.go_on = msg

    def _decision_over(self, error: BaseException | None) -> None:
        """The decision lock was let go by this thread: a decision of ``_commit_later`` that
        raised nothing, registered no undo and asked for no start of the queue's head goes on
        (``_released_on_commit``); any other waits for its writes (decision_writes.py ``_after_decision``)."""
        decided = self._decided
        msg, decided.go_on = getattr(decided, "go_on", None), None
        if msg is None or error is not None or getattr(decided, "undos", None) or getattr(decided, "start", False):
            self._after_decision(error)
            return
        writes, decided.writes = getattr(decided, "writes", None) or [], None
        jobs, decided.jobs = getattr(decided, "jobs", None) or {}, None
        self._released_on_commit(msg, writes, jobs)

    def _released_on_commit(self, msg: Message, writes: list[tuple[str, Future]], jobs: dict[str, Any]) -> None:
        """The decision of ``msg`` is over (the lock let go): its failed writes are reported and
        the jobs' commands sent once their writes are done, from the writer's callbacks."""

        def written(future: Future) -> None:  # (on the writer's thread: leaf locks and hand-offs only)
            if future.exception() is not None:
                self._report_soon(msg, future.exception())

        def committed(job_id: str) -> None:
            if self._outbox.waiting(job_id):  # (a ready event's: nothing, no hand-off)
                self._drain_soon(job_id)

        for _, future in writes:
            future.add_done_callback(written)
        for job_id in dict.fromkeys([*jobs, *(job_id for job_id, _ in writes)]):
            last = self._last_write.get(job_id)  # (the journal is one FIFO: the job's earlier writes are done by then)
            if last is None or last.done():
                self._outbox.drain((job_id,))
            else:
                last.add_done_callback(lambda _, job_id=job_id: committed(job_id))

    def _drain_soon(self, job_id: str) -> None:
        """Off the journal writer's thread (a hand-off, no delay): the job's commands whose write
        is committed are sent (``Outbox.drain``)."""
        self._deadlines.after(0.0, self._outbox.drain, ((job_id,),))
