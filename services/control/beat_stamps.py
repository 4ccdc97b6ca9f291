"""A node agent's liveness-only beat, taken where it is read: a stamp on the server's loop.

Why: at 10,000 agents each second's ``AgentHeartbeat`` was a message queued on the event
applier's node queue, applied by a pool thread (the hub's relay, the bus, L1-3's
``on_agent_heartbeat`` under its cluster lock): ~340 us a beat end to end on a 2-core host, so
control read ~2,000 of the 10,000 beats a second, fell behind, and declared healthy agents
silent (issue 28, session 34). A beat that says only "alive, same period" changes nothing
but a time. So once L1-3 has armed an agent's silence deadline (``arm``, from a beat it
applied), the agent's next beats of the same period are taken on the loop that read them
(``beat``): the receipt stamped, the deadline moved later in place (``Deadline.move``: a
float); no hop, no bus, no lock of L1-3's. A beat that changes something goes the old way,
to the applier: the agent's first beat, a new period, its first after a quiet spell (L1-3
re-holds a link it held while the agent was paused), its first after L1-3 declared it
silent (the ``cleared`` report) or forgot it (a registration, a withdrawal).

Order: a stamp is taken on the loop as the message is read, so a silence deadline that
fired and is decided in order behind what the loop has received (``event_applier.InOrder``)
sees every beat read before it: the deadline was moved (``Deadline.run`` arms it again) or
the stamp is fresh (L1-3 reads it before any verdict: ``last``).

Typed state only (floats and the deadline handle L1-3 armed): nothing reachable here acts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class _Armed:
    last: float  # time.monotonic() receipt of the agent's last beat (applied or stamped)
    period: float  # its beat period, as the beat L1-3 applied stated it
    wait: float  # its silence deadline, from a beat's receipt
    quiet: float  # a beat later than this after the last one ends a quiet spell: not taken here
    deadline: Any  # the Deadline L1-3 armed (services/common/deadlines.py): moved per beat


class BeatStamps:
    """Worker id -> its agent's armed silence deadline and last beat's receipt (see the module
    docstring). ``beat`` runs on the server's loop; the rest on L1-3's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a leaf: nothing is called under it but ``Deadline.move``
        self._armed: dict[str, _Armed] = {}
        self.taken = 0  # beats taken here (a metric reads it)

    def beat(self, worker_id: str, period: float, received: float) -> bool:
        """On the loop: take the agent's beat here if it changes nothing L1-3 holds (armed,
        same period, no quiet spell before it): its deadline moved to ``wait`` from
        ``received``. False: the beat goes to the applier (untouched here)."""
        with self._lock:
            armed = self._armed.get(worker_id)
            if armed is None or period != armed.period or received - armed.last > armed.quiet:
                return False
            if not armed.deadline.move(armed.wait - (time.monotonic() - received)):
                return False  # fired and being decided, or cancelled: L1-3 applies this one
            armed.last = max(armed.last, received)
            self.taken += 1
            return True

    def arm(self, worker_id: str, period: float, wait: float, quiet: float, received: float, deadline: Any) -> None:
        """L1-3 armed (or moved) ``worker_id``'s deadline for a beat it applied."""
        with self._lock:
            armed = self._armed.get(worker_id)
            # (the same deadline moved: a beat stamped meanwhile may be newer; a new one is armed
            # from this beat's receipt)
            last = max(armed.last, received) if armed is not None and armed.deadline is deadline else received
            self._armed[worker_id] = _Armed(last, period, wait, quiet, deadline)

    def last(self, worker_id: str) -> float | None:
        """The receipt of the agent's last beat stamped here or armed (None: not armed)."""
        with self._lock:
            armed = self._armed.get(worker_id)
            return None if armed is None else armed.last

    def forget(self, worker_id: str) -> float | None:
        """Its next beat goes to the applier (declared silent, registered, withdrawn);
        returns its last beat's receipt (None: it was not armed)."""
        with self._lock:
            armed = self._armed.pop(worker_id, None)
            return None if armed is None else armed.last

    def unheard(self, now: float, periods: float) -> tuple[int, int]:
        """(agents armed not heard for ``periods`` of their beat periods, agents armed)."""
        with self._lock:
            late = sum(1 for a in self._armed.values() if now - a.last > periods * a.period)
            return late, len(self._armed)
