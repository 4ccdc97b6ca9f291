"""Boundary commands by agreement: which step boundary a pause, stop or revoke takes effect at.

L1-1 used to name the boundary (``step + max(2, ceil(1 s / step time))``): a guess. A command
delayed past it to one rank left the ranks at different boundaries, and the stop's checkpoint
collectives met a peer already in the next step (both hung until the process-group timeout).
Now every boundary command (PauseTraining, StopTraining, RevokeStandingOrder) carries ``seq``,
the job's next boundary command sequence number, and the ranks agree on the boundary in the
collective every step already runs (torchft's way: agreement folded into a collective that
runs anyway, no collective of its own):

* a rank holds the commands it received and has not seen agreed (:class:`HeldCommands`); it
  puts the lowest :data:`WINDOW` of their numbers into the step's all-reduce, one count per
  number in the slot ``seq % WINDOW`` (:func:`slots`);
* the all-reduce sums the slots (the op every other element of that reduction needs); a slot
  whose sum is the world size says every rank holds that number (:func:`agreed`): the highest
  number every rank holds, the minimum over the ranks of the highest each holds;
* the command takes effect at the boundary of that step (not before its ``at_step``, when it
  names one): the same boundary on every rank by construction, whatever the delay.

Why the window's slots never mix two numbers: L1-1 numbers a job's boundary commands without
a gap and sends each to every rank, every rank starts from the same number
(``StartTraining.command_seq``: a command sent before the group formed is void) and agrees on
the same ones at the same step, and a rank's window is the run ``agreed + 1, agreed + 2, ...``
it holds without a gap (a number that overtook an earlier one, e.g. after a control restart
resent the earlier one, waits for it). So every window is a prefix of the same run and their
union spans at most :data:`WINDOW` consecutive numbers. A rank that holds fewer only delays
the agreement; more than :data:`WINDOW` commands in flight are agreed over more than one step.

Pure and torch-free: the training loop (L2-1), the gradient reduction (L3-5: the slots and
the rule) and the simulated ranks use the same code; :func:`boundaries` replays the rule over
delivery times for the model check in tests/engine/test_boundary_agreement.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

WINDOW = 4  # the numbers one step can agree on: elements this adds to the step's all-reduce


class UnsequencedCommand(ValueError):
    """A boundary command without its sequence number (``seq`` 0): it could not be agreed on,
    so it is refused (the sender's bug: L1-1 numbers every one)."""


def slots(held: Sequence[int]) -> list[float]:
    """This rank's share of the step's all-reduce: 1.0 in slot ``seq % WINDOW`` for each
    number of ``held`` (the window: at most :data:`WINDOW` consecutive numbers)."""
    out = [0.0] * WINDOW
    for seq in held[:WINDOW]:
        out[seq % WINDOW] += 1.0
    return out


def agreed(held: Sequence[int], summed: Sequence[float], world_size: int) -> int:
    """The highest number of ``held`` (this rank's window, lowest first) that every rank holds,
    read from the all-reduced ``summed`` slots (a slot at the world size: every rank counted
    it), walking up from the lowest (a number is agreed only with every one below it); 0 when
    none is."""
    out = 0
    for seq in held[:WINDOW]:
        if round(summed[seq % WINDOW]) != world_size:
            break
        out = seq
    return out


class HeldCommands:
    """One rank's boundary commands: received, not yet in force. Thread-safe (commands arrive
    on the session's thread, the loop reads them on its own).

    ``receive`` keeps a command once (a copy sent again after a control restart, or one sent
    before the group formed, is dropped); ``window`` is what the step's all-reduce carries;
    ``agree`` takes the reduction's answer; ``due`` hands out, at a step's boundary, the
    commands in force there, in sequence order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}  # seq -> the command
        self._agreed = 0  # the highest number agreed (or void: below the group's start)

    def receive(self, msg: Any) -> bool:
        """Hold ``msg`` (a command with ``seq`` and ``at_step``); False when it was held or
        agreed already (or is void), so dropped.

        Raises:
            UnsequencedCommand: ``msg.seq`` is 0.
        """
        if not msg.seq:
            raise UnsequencedCommand(f"{type(msg).__name__}.seq: a boundary command needs its sequence number (got 0)")
        with self._lock:
            if msg.seq <= self._agreed or msg.seq in self._held:
                return False
            self._held[msg.seq] = msg
            return True

    def start(self, command_seq: int) -> None:
        """The group (re)starts at the job's ``command_seq`` (StartTraining): numbers up to it
        are void (sent before the group formed: not every rank of it has them)."""
        with self._lock:
            self._agreed = max(self._agreed, command_seq)
            self._held = {s: m for s, m in self._held.items() if s > self._agreed}

    def window(self) -> list[int]:
        """The all-reduce's share: the numbers held from the next one to agree on, without a
        gap, at most :data:`WINDOW` (a number that overtook an earlier one waits for it)."""
        with self._lock:
            run, seq = [], self._agreed + 1
            while seq in self._held and len(run) < WINDOW:
                run.append(seq)
                seq += 1
            return run

    def agree(self, seq: int) -> None:
        """Every rank holds the commands up to ``seq`` (this step's reduction)."""
        with self._lock:
            self._agreed = max(self._agreed, seq)

    @property
    def agreed_seq(self) -> int:
        with self._lock:
            return self._agreed

    def due(self, step: int) -> list[Any]:
        """The commands in force at the boundary after ``step`` (agreed, and ``at_step`` 0 or
        at most ``step``), taken out, in sequence order."""
        with self._lock:
            seqs = sorted(s for s, m in self._held.items() if s <= self._agreed and _not_before(m) <= step)
            return [self._held.pop(s) for s in seqs]

    def take(self, kind: type, step: int) -> Any | None:
        """A held command of type ``kind`` whose ``at_step`` allows the boundary after ``step``,
        agreed or not, taken out (a paused rank's stop: every rank paused at that boundary, so
        it needs no agreement); None if there is none."""
        with self._lock:
            for s in sorted(self._held):
                m = self._held[s]
                if isinstance(m, kind) and _not_before(m) <= step:
                    return self._held.pop(s)
            return None


def boundaries(arrivals: Sequence[dict[int, int]], steps: int) -> dict[int, list[int | None]]:
    """The model of the rule: ``arrivals[r][seq]`` is the step during which rank ``r`` receives
    command ``seq`` (before that step's reduction); returns, per command, the boundary each
    rank puts it in force at (None: not within ``steps``). Ranks in lockstep, every rank
    starting from 0, each step one all-reduce (sum) of :func:`slots`, as the loop runs it."""
    world = len(arrivals)
    ranks = [HeldCommands() for _ in range(world)]
    out: dict[int, list[int | None]] = {s: [None] * world for a in arrivals for s in a}
    for step in range(1, steps + 1):
        for r, a in enumerate(arrivals):
            for seq in sorted(s for s, at in a.items() if at == step):
                ranks[r].receive(_Command(seq))
        windows = [h.window() for h in ranks]
        summed = _sum(slots(w) for w in windows)
        for r, h in enumerate(ranks):
            h.agree(agreed(windows[r], summed, world))
            for cmd in h.due(step):
                out[cmd.seq][r] = step
    return out


def _not_before(msg: Any) -> int:
    """The step a command names as its earliest boundary (``at_step``; a revoke's ``after_step``)."""
    return msg.after_step if hasattr(msg, "after_step") else msg.at_step


class _Command:
    """A boundary command as the model sees it: its number, no ``at_step``."""

    def __init__(self, seq: int):
        self.seq, self.at_step = seq, 0


def _sum(vectors: Iterable[list[float]]) -> list[float]:
    total = [0.0] * WINDOW
    for v in vectors:
        total = [a + b for a, b in zip(total, v, strict=True)]
    return total
