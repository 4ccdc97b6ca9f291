"""Rank-side fault hooks, installed on the training loop's ports by the rank's composition
root (``rank.py``). No module file knows about them.

* :class:`StepGuard` wraps the loop's port to the backward unit to apply test-only
  injections. What a non-finite loss or non-finite gradients do is the training loop's
  decision (skip the step on every rank, or a typed failure: ``non_finite_loss``,
  ``gradient_overflow``, ``overflow_storm``, ``loss_scale_at_minimum``), taken from all-rank
  values per the spec's ``fault_policy``; a check here would see one rank only, and ranks
  could disagree.
* :class:`FaultInjector` is for tests, and off unless ``SURGE_FAULT_INJECT`` is set::

      SURGE_FAULT_INJECT="<job name>:<kind>@<step>[:rank=<r>][,...]"

  kinds: ``nan_loss`` (the logits of that step's first micro-batch become NaN, so its loss
  and gradients are NaN, as a real divergence would make them), ``inf_grad`` (the loss
  stays finite, the gradient flowing back into those logits becomes inf: what an fp16
  overflow in backward looks like) and ``hang`` (the rank's main thread blocks forever
  before that step's backward; its heartbeat goes on, its peers wait in the collective: a
  stall), ``hang_forward`` (the same, but in that step's first forward: the rank's beats say
  it is in its forward pass while its peers wait for it in the gradient all-reduce) and
  ``slow_eval`` (each batch of the evaluation after that step takes ``seconds=<s>`` more,
  default 1: a long evaluation that still advances) and ``slow_save`` (the checkpoint save
  at that step takes ``seconds=<s>`` more before it is staged) and ``slow_heal`` (the rank's
  heal from a live peer in a rebuilt group, when it holds step ``<step>`` or later, takes
  ``seconds=<s>`` more before the transfer: a window in which to kill the healing source).
  Each injection fires once per job and
  rank, also across relaunches: it leaves a marker file under ``$SURGE_HOME/run/faults``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common import paths
from services.contract import engine_pb2, store_pb2
from services.contract.bus import CommandPort, Reply

INJECT_ENV = "SURGE_FAULT_INJECT"
KINDS = ("nan_loss", "inf_grad", "hang", "hang_forward", "slow_eval", "slow_save", "slow_heal")
_BEFORE_BACKWARD = ("nan_loss", "inf_grad", "hang")


@dataclass(frozen=True)
class Injection:
    kind: str
    step: int
    rank: int
    seconds: float = 1.0  # slow_eval: added to each evaluation batch; slow_save: to the save


def parse_injections(text: str, job_name: str) -> list[Injection]:
    """The injections of ``SURGE_FAULT_INJECT`` that name ``job_name``.

    Raises:
        ValueError: an entry that does not parse (the message quotes it).
    """
    out = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            name, what, *opts = entry.split(":")
            kind, step = what.split("@")
            rank, seconds = 0, 1.0
            for opt in opts:
                key, value = opt.split("=")
                if key == "rank":
                    rank = int(value)
                elif key == "seconds":
                    seconds = float(value)
                else:
                    raise ValueError(key)
            if kind not in KINDS:
                raise ValueError(kind)
            injection = Injection(kind, int(step), rank, seconds)
        except ValueError:
            raise ValueError(
                f"{INJECT_ENV}: {entry!r}: expected <job name>:<{'|'.join(KINDS)}>@<step>[:rank=<r>][:seconds=<s>]"
            ) from None
        if name == job_name:
            out.append(injection)
    return out


class FaultInjector:
    """Test-only faults for one rank (see the module docstring).

    Args:
        injections: this job's injections (all ranks; only ``rank``'s fire here).
        job_id, rank: who this is (the marker file's name).
        marker_dir: where fired injections are remembered (default ``$SURGE_HOME/run/faults``).
    """

    def __init__(self, injections: list[Injection], job_id: str, rank: int, marker_dir: Path | None = None):
        self._mine = [i for i in injections if i.rank == rank]
        self._job_id, self._rank = job_id, rank
        self._markers = marker_dir or paths.run_dir() / "faults"
        self._slowing: set[Injection] = set()  # slow_eval injections that fired (every batch of that eval)

    @classmethod
    def from_env(cls, job_name: str, job_id: str, rank: int) -> FaultInjector | None:
        text = os.environ.get(INJECT_ENV, "")
        injections = parse_injections(text, job_name) if text else []
        return cls(injections, job_id, rank) if injections else None

    def before_backward(
        self, step: int, payload: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply what is due at ``step`` to the backward pass's (logits, labels)."""
        for injection in self._mine:
            if injection.kind not in _BEFORE_BACKWARD or injection.step != step or not self._fire(injection):
                continue
            if injection.kind == "nan_loss":
                logits, labels = payload
                payload = (logits * float("nan"), labels)
            elif injection.kind == "inf_grad":
                logits, labels = payload
                logits = logits.view_as(logits)  # a node of our own to hook, same values
                logits.register_hook(lambda g: g * float("inf"))
                payload = (logits, labels)
            elif injection.kind == "hang":
                threading.Event().wait()  # forever: the rank is alive and makes no progress
        return payload

    def before_forward(self, step: int, training: bool) -> None:
        """Apply what is due at ``step`` (the step being run; an evaluation runs after step
        ``step - 1`` completed) before a forward pass."""
        for injection in self._mine:
            if injection.kind == "hang_forward" and training and injection.step == step and self._fire(injection):
                threading.Event().wait()  # forever, in the forward pass: alive, no progress
            elif (
                injection.kind == "slow_eval"
                and not training
                and injection.step == step - 1
                and (injection in self._slowing or self._fire(injection))
            ):
                self._slowing.add(injection)  # every batch of that evaluation
                time.sleep(injection.seconds)

    def before_save(self, step: int) -> None:
        """Apply what is due before the checkpoint save at ``step``."""
        for injection in self._mine:
            if injection.kind == "slow_save" and injection.step == step and self._fire(injection):
                time.sleep(injection.seconds)

    def before_heal(self, step: int) -> None:
        """Apply what is due before a heal from a live peer of a rank holding ``step``."""
        for injection in self._mine:
            if injection.kind == "slow_heal" and step >= injection.step and self._fire(injection):
                time.sleep(injection.seconds)

    def _fire(self, injection: Injection) -> bool:
        """True the first time ``injection`` is due for this job and rank (marker file)."""
        self._markers.mkdir(parents=True, exist_ok=True)
        marker = self._markers / f"{self._job_id}.rank{self._rank}.{injection.kind}@{injection.step}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return True


class StepGuard:
    """Wraps the loop's ports to the forward and backward units and the checkpoint relay with
    test-only injections.

    Args:
        step: the step the loop is running now (the rank session's last completed step + 1).
        injector: test-only faults, or None (then the port is returned as it is).
    """

    def __init__(self, step: Callable[[], int], *, injector: FaultInjector | None = None):
        self._step = step
        self._injector = injector

    def forward(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        def run_forward(msg: Any, payload: Any = None) -> Reply:
            if isinstance(msg, engine_pb2.RunForward):  # (ConfigureForward goes the same port)
                injector.before_forward(self._step(), msg.training)
            return port(msg, payload)

        return run_forward

    def store(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        def save(msg: Any, payload: Any = None) -> Reply:
            if isinstance(msg, store_pb2.SaveCheckpoint):
                injector.before_save(msg.step)
            elif isinstance(msg, engine_pb2.HealState):
                injector.before_heal(msg.step)
            return port(msg, payload)

        return save

    def backward(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        def run_backward(msg: engine_pb2.RunBackward, payload: Any = None) -> Reply:
            if msg.backward:
                payload = injector.before_backward(self._step(), payload)
            return port(msg, payload)

        return run_backward
