"""Which of a node agent's ranks' beats ride in its liveness datagram, and their packing under a
bound (``LivenessProgress`` in ``AgentLiveness.progress``), one rule for the node agent
(services/worker/control_link.py) and the bench's simulated agents (bench/control_bench.py).

Why: at 10,000 agents each with a stepping rank, the ranks' ``RankBeats`` were one gRPC message
per agent a second, ~200 us each to read at control (~2 cores of grpc aio reads, issue 28). Most
of them say only "this rank moved on": a new step, a phase of the ordinary loop, its compute
times. Those are facts of now, never resent (a lost one is superseded by the next), so they
ride in the agent's own signed datagram of the period.

What changes state stays on the session, in order with the rank's start and exit: a rank's first
beat of a session (control learns of it from the session, so a datagram never starts a watch),
a change of its generation, period or stepping, and a change of phase kind: the ordinary
training loop's phases count as one kind, each other phase (evaluation, checkpoint staging,
fault wait, frozen, profile export, idle, compile: phases L1-3 gives deadlines of their own or
decides on) as its own, so entering or leaving one goes on the session and the beats within it
ride. Beats that do not fit the bound go on the session too.

Why a rank idle or in a long phase rides too: with the agent's own beat a prompt datagram, a
session whose writes lag (a starved agent: 15-19 s at 3,000 simulated agents, load 16) made
control hear the agent but not its ranks: a rank_silent at the jobs' start, before any step.

The bound: ``PROGRESS_BYTES`` (1,024) of packed beats, so a datagram (~75 bytes of header and mac
beside them) stays under 1,232 bytes, an IPv6 minimum MTU's UDP payload: no IP fragmentation
on any path. A compacted beat is ~70-80 bytes (job id, worker id and the beat's own rank left
out: control sets them from ``RankBeats.job_id``, the session and ``RankEvent.rank``), so 12 or
more ranks of a node ride; a node with more sends the rest on its session.
"""

from __future__ import annotations

from typing import Any

from services.contract import control_pb2, worker_pb2

PROGRESS_BYTES = 1024
# The largest datagram an agent sends (the IPv6 minimum MTU's UDP payload, above): what control
# reads a datagram into must hold it whole (512 bytes cut the datagram of every node of 7 ranks or more).
DATAGRAM_BYTES = 1232
# The phases of the ordinary training loop: a beat in one of them moves only the rank's
# progress (L1-3's deadline for them is the step's). Any other phase rides the session.
ORDINARY_PHASES = frozenset(
    {
        worker_pb2.PHASE_UNSPECIFIED,
        worker_pb2.PHASE_DATA_WAIT,
        worker_pb2.PHASE_FORWARD,
        worker_pb2.PHASE_BACKWARD,
        worker_pb2.PHASE_COLLECTIVE,
        worker_pb2.PHASE_OPTIMIZER,
    }
)


class ProgressSplit:
    """One session's split of its ranks' beats: what control was told on the session of each
    rank (generation, period, stepping, phase kind). ``reset`` at each new session (a new control, or the
    same after a reconnect, learns each rank from the session again)."""

    def __init__(self) -> None:
        self._told: dict[tuple[str, int], tuple[int, float, bool, int]] = {}

    def reset(self) -> None:
        self._told.clear()

    def split(self, job: str, beats: list[Any]) -> tuple[list[Any], list[Any]]:
        """(the beats that may ride a datagram, those for the session) of ``beats`` (heartbeat
        RankEvents of ``job``); the latter are recorded as told."""
        riding, session = [], []
        for ev in beats:
            hb = ev.heartbeat
            kind = -1 if hb.phase in ORDINARY_PHASES else hb.phase  # (the ordinary loop's: one kind)
            facts = (ev.generation, hb.interval_seconds, hb.stepping, kind)
            key = (job, ev.rank)
            if self._told.get(key) == facts:
                riding.append(ev)
            else:
                self._told[key] = facts
                session.append(ev)
        return riding, session


def pack(job: str, beats: list[Any], limit: int = PROGRESS_BYTES) -> tuple[bytes, list[Any]]:
    """(a serialized LivenessProgress of ``beats`` compacted, the beats that did not fit
    ``limit`` bytes: for the session). Nothing fits: (b"", beats)."""
    progress = control_pb2.LivenessProgress()
    batch = progress.jobs.add(job_id=job)
    left = []
    size = progress.ByteSize()
    for ev in beats:
        one = worker_pb2.RankEvent(rank=ev.rank, generation=ev.generation)
        one.heartbeat.CopyFrom(ev.heartbeat)
        hb = one.heartbeat
        hb.job_id, hb.rank, hb.worker_id = "", 0, ""
        more = one.ByteSize() + 3  # (its tag and length)
        if size + more > limit:
            left.append(ev)
            continue
        batch.beats.append(one)
        size += more
    if not batch.beats:
        return b"", left
    return progress.SerializeToString(), left


def unpack(data: bytes) -> list[control_pb2.RankBeats]:
    """The RankBeats of a datagram's ``progress`` (raises DecodeError), made whole as the
    session would carry them: each beat's job id set, marked ``by_datagram``."""
    progress = control_pb2.LivenessProgress.FromString(data)
    for batch in progress.jobs:
        batch.ClearField("agent")  # (the datagram itself is the agent's beat)
        for ev in batch.beats:
            ev.job_id = batch.job_id
            ev.heartbeat.by_datagram = True
    return list(progress.jobs)
