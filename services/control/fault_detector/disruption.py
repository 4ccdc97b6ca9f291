"""Held silence verdicts (agent_silent, a rank's silence): when control itself is behind, or most agents go quiet at once,
an agent whose silence deadline passed is not declared; its verdict waits (``Disruption``).

Why: slowness is never death. At 10,000 agents on a loaded 2-core host control's loop read
~2,000 of the 10,000 beats a second; every agent whose beats waited unread passed its
deadline and was declared ``agent_silent``: 65,707 placement holds and 55,982 lifts in ten
minutes, each an offer and a queue pass, which kept control behind (session 34). As the
Kubernetes node lifecycle controller stops evicting in "full disruption" (every node of a
zone not ready: the controller's own view is the likelier fault), L1-3 holds its verdicts:

* control's loop is behind (its probe ran late, or has not run: control_health.py), or the
  event applier's oldest message waited, more than ``CONTROL_LAG_LIMIT_S``: the beats that
  would re-arm the deadline may be waiting unread;
* at least ``FULL_DISRUPTION_SHARE`` of the watched agents (and at least
  ``FULL_DISRUPTION_MIN_AGENTS`` of them) are quiet at once (unheard for ``UNHEARD_PERIODS``
  of their periods, or declared silent already: their deadlines pass within a second of each
  other, so the first one's must already see the others quiet): one agent silent among many
  that beat is that agent's fault; most of them at once is control's, or the network's, and
  holding a node out of placement helps no one. It ends once fewer than
  ``FULL_DISRUPTION_END_SHARE`` of them are quiet (not at the entry share: agents starved in
  waves would otherwise be declared by the thousand each time the share dips below it).

A held verdict is looked at again once control keeps up and the disruption ends (one check
every ``HOLD_RECHECK_S``, in order on the node queue, not one per agent): an agent that beat
meanwhile is armed again as after any beat; one still quiet is declared then, with how long
it was quiet. One log line says when verdicts start being held and why (typed: ``loop``,
``applier``, ``disruption``), one when they are released; the metrics
``surge_control_silence_verdicts_waiting`` (held now) and
``surge_control_silence_verdicts_held_total{reason}`` count them. A rank's silence verdict is
held the same way (its beats come through the same loop), and decided again on its job's
queue once control keeps up, unless it beat meanwhile.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import structlog

from services.control import metrics
from services.control.fault_detector.rules import UNHEARD_PERIODS

_log = structlog.get_logger("fault_detector")

CONTROL_LAG_LIMIT_S = 1.0  # control behind by more than this: its beats may be waiting unread
FULL_DISRUPTION_SHARE = 0.55  # (Kubernetes' unhealthyZoneThreshold)
FULL_DISRUPTION_END_SHARE = 0.1  # a full disruption ends when fewer are quiet (hysteresis)
FULL_DISRUPTION_MIN_AGENTS = 10  # fewer watched agents: every silence is that agent's own
HOLD_RECHECK_S = 1.0
_SHARE_CACHE_S = 0.5  # the share of quiet agents is counted over all of them at most this often


class Disruption:
    """Holding silence verdicts while control is behind (a part of ``FaultDetector``: its
    ``_held_agents``, ``_held_ranks``, ``_stamps``, ``_health`` and ``_silent_agents``)."""

    def _verdicts_held_because(self) -> tuple[str, str] | None:
        """(reason, what was seen) when silence verdicts are held now; None: they are not."""
        now = time.monotonic()
        behind = self._health.behind(CONTROL_LAG_LIMIT_S, now) if self._health is not None else None
        if behind is not None:
            which, seconds = behind
            return which, f"control's {'gRPC loop' if which == 'loop' else 'event applier'} is {seconds:.1f} s behind"
        cached = self._share_cache
        if cached is None or now - cached[0] > _SHARE_CACHE_S:
            late, armed = self._stamps.unheard(now, UNHEARD_PERIODS)
            with self._cluster:
                silent = len(self._silent_agents)
            cached = self._share_cache = (now, late + silent, armed + silent)
        _, quiet, watched = cached
        # Entered at FULL_DISRUPTION_SHARE, left below FULL_DISRUPTION_END_SHARE: starved
        # agents come and go in waves (4,000 simulated agents at load 27 swung between 40 % and
        # 90 % quiet); leaving at the entry share declared the 45 % still quiet at once.
        share = FULL_DISRUPTION_END_SHARE if self._disrupted else FULL_DISRUPTION_SHARE
        self._disrupted = watched >= FULL_DISRUPTION_MIN_AGENTS and quiet >= share * watched
        if self._disrupted:
            return "disruption", f"{quiet} of {watched} node agents are quiet at once"
        return None

    def _hold_agent_verdict(self, worker_id: str, token: object, wait: float, heard: bool = False) -> bool:
        """Hold the agent's verdict if control is behind or in full disruption (True).
        ``heard``: a beat of it was read as its deadline ran: held until the next check."""
        why = self._verdicts_held_because()
        if why is None and not heard:
            return False
        with self._cluster:
            armed = self._agents.get(worker_id)
            if armed is None or armed[0] is not token:
                return True  # heard meanwhile: nothing to hold
            first = self._held_now() == 0
            self._held_agents[worker_id] = (token, wait)
            self._arm_recheck()
        self._held(why or ("heard", "a beat read as its deadline passed"), first)
        return True

    def _hold_rank_verdict(self, job_id: str, rank: int, watch: Any) -> bool:
        """Hold a rank's silence verdict while control is behind or in full disruption (True):
        its beats go through the same loop and its agent (session 34 at 10,000 agents: a
        ``rank_silent`` cascade, "no heartbeat for 18.2 s", while control read a fifth of them)."""
        why = self._verdicts_held_because()
        if why is None:
            return False
        with self._cluster:
            first = self._held_now() == 0
            self._held_ranks[(job_id, rank)] = watch
            self._arm_recheck()
        self._held(why, first)
        return True

    def _held_now(self) -> int:
        return len(self._held_agents) + len(self._held_ranks)

    def _arm_recheck(self) -> None:
        """Under ``_cluster``: the one check of the held verdicts, if none is armed."""
        if self._hold_check is None:
            self._hold_check = self._deadlines.after(HOLD_RECHECK_S, self._recheck_held, post=self._in_order(""))

    def _held(self, why: tuple[str, str], first: bool) -> None:
        reason, seen = why
        metrics.SILENCE_VERDICTS_WAITING.set(self._held_now())
        metrics.SILENCE_VERDICTS_HELD.labels(reason).inc()
        if first:
            _log.warning("silence verdicts held", reason=reason, seen=seen)

    def _recheck_held(self) -> None:
        """Every ``HOLD_RECHECK_S`` while verdicts are held: once control keeps up and no full
        disruption is seen, each held deadline is decided again: an agent's (armed again if it
        beat meanwhile, declared if it is still quiet), a rank's on its job's queue, unless it
        beat since (its beat armed its deadline anew)."""
        why = self._verdicts_held_because()
        with self._cluster:
            self._hold_check = None
            if why is not None and self._held_now():
                self._arm_recheck()
                return
            agents, self._held_agents = self._held_agents, {}
            ranks, self._held_ranks = self._held_ranks, {}
        metrics.SILENCE_VERDICTS_WAITING.set(0)
        if not agents and not ranks:
            return
        self._share_cache = None
        _log.info("silence verdicts released", agents=len(agents), ranks=len(ranks))
        for worker_id, (token, wait) in agents.items():
            self._agent_silence_passed(worker_id, token, wait)
        now = time.monotonic()
        for (job_id, rank), watch in ranks.items():
            if watch.silence_due <= now:  # (else it beat since: its own deadline is armed again)
                self._post(functools.partial(self._silence_passed, job_id, rank, watch), job_id)
