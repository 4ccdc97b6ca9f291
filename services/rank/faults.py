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
  ``seconds=<s>`` more before the transfer: a window in which to kill the healing source)
  and ``slow_load`` (the rank's first checkpoint load at or after step ``<step>`` of its
  session, a relaunch's or a resume's, waits ``seconds=<s>`` before the store is asked: a
  window in which to stop the store under the load)
  and ``corrupt_weights`` (after that step's update, one element of the rank's first matrix
  parameter gets its top mantissa bit flipped, its value scaled by up to 1.5: a silent data
  corruption, found by the replica check, integrity.replica_check_every_steps).
  ``slow_compute`` (from that step on, each training forward, backward and optimizer update of
  the rank takes ``factor=<f>`` times its own time, default 2, by sleeping in the phase after
  (forward, update) or before (backward) the pass: a rank with a slow device, whose compute time really grows,
  for the slow-rank detector, services/control/slow_ranks.py; it stays for the process's life).
  ``slow_profile_export`` (the export of the first profile that ends at or after that step
  holds the interpreter lock ``seconds=<s>`` more, as torch.profiler's post-processing of a
  long trace does: the rank's beats stop meanwhile; services/engine/step_profiler.py).
  Each other injection fires once per job and
  rank, also across relaunches: it leaves a marker file under ``$SURGE_HOME/run/faults``.
  Except ``slow_steps``: every training step from that step on takes ``seconds=<s>`` more
  (slept before the step's first forward), on every incarnation of the rank, until the pace
  is lifted (:func:`lift_pace`: a file the test writes; the rest of the step's wait is
  dropped too): a job held to a pace it cannot beat, so that a test's action finds it
  running whatever the machine's speed (N steps paced by s last at least N x s seconds),
  and that runs at its own speed once the action is done.
"""

from __future__ import annotations

import ctypes
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
KINDS = (
    "nan_loss",
    "inf_grad",
    "hang",
    "hang_forward",
    "slow_eval",
    "slow_save",
    "slow_heal",
    "slow_load",
    "slow_steps",
    "corrupt_weights",
    "slow_compute",
    "slow_profile_export",
)
_BEFORE_BACKWARD = ("nan_loss", "inf_grad", "hang")
_PACE_POLL_SECONDS = 0.1  # how soon a paced rank sees its pace lifted, mid-wait


def lift_pace(marker_dir: Path, job_id: str) -> None:
    """End the ``slow_steps`` pace of every rank of ``job_id`` whose markers are under
    ``marker_dir`` (``$SURGE_HOME/run/faults``), now and for its later incarnations."""
    marker_dir.mkdir(parents=True, exist_ok=True)
    _lifted(marker_dir, job_id).touch()


def _lifted(marker_dir: Path, job_id: str) -> Path:
    return marker_dir / f"{job_id}.slow_steps.lifted"


@dataclass(frozen=True)
class Injection:
    kind: str
    step: int
    rank: int
    seconds: float = 1.0  # slow_eval: added to each evaluation batch; slow_save: to the save; slow_steps: to each step
    factor: float = 2.0  # slow_compute: the forward's and backward's time multiplied by it


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
            rank, seconds, factor = 0, 1.0, 2.0
            for opt in opts:
                key, value = opt.split("=")
                if key == "rank":
                    rank = int(value)
                elif key == "seconds":
                    seconds = float(value)
                elif key == "factor" and float(value) >= 1.0:
                    factor = float(value)
                else:
                    raise ValueError(key)
            if kind not in KINDS:
                raise ValueError(kind)
            injection = Injection(kind, int(step), rank, seconds, factor)
        except ValueError:
            raise ValueError(
                f"{INJECT_ENV}: {entry!r}: expected <job name>:<{'|'.join(KINDS)}>@<step>[:rank=<r>][:seconds=<s>]"
                "[:factor=<f >= 1>]"
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
        self._paced = 0  # slow_steps: the last step slept for (once a step, not per micro-batch)
        self._pace_lifted = False  # (for good: lift_pace)

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
        if training and step != self._paced:
            self._paced = step
            self._pace(sum(i.seconds for i in self._mine if i.kind == "slow_steps" and step >= i.step))
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

    def _pace(self, seconds: float) -> None:
        """Wait ``seconds``, or until the pace is lifted."""
        lifted = _lifted(self._markers, self._job_id)
        until = time.monotonic() + seconds
        while seconds > 0 and not self._pace_lifted and (left := until - time.monotonic()) > 0:
            self._pace_lifted = lifted.exists()
            if not self._pace_lifted:
                time.sleep(min(left, _PACE_POLL_SECONDS))

    def compute_factor(self, step: int) -> float:
        """How many times its own time a training forward or backward at ``step`` takes
        (``slow_compute``; 1: as it is)."""
        factor = 1.0
        for injection in self._mine:
            if injection.kind == "slow_compute" and step >= injection.step:
                factor = max(factor, injection.factor)
        return factor

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

    def before_load(self, step: int) -> None:
        """Apply what is due before a checkpoint load by a rank whose session is at ``step``."""
        for injection in self._mine:
            if injection.kind == "slow_load" and step >= injection.step and self._fire(injection):
                time.sleep(injection.seconds)

    def before_profile_export(self, step: int) -> None:
        """Apply what is due before the export of a profile ending at ``step``: hold the
        interpreter lock (a call through ``ctypes.PyDLL`` keeps it), so no other thread of the
        rank runs, its heartbeat's included."""
        for injection in self._mine:
            if injection.kind == "slow_profile_export" and step >= injection.step and self._fire(injection):
                libc = ctypes.PyDLL(None)
                libc.sleep(ctypes.c_uint(int(injection.seconds)))
                libc.usleep(ctypes.c_uint(int(injection.seconds % 1 * 1e6)))

    def after_update(self, step: int, model: torch.nn.Module | None) -> None:
        """Apply what is due after the update of ``step`` to ``model``'s weights."""
        for injection in self._mine:
            if injection.kind == "corrupt_weights" and injection.step == step and model is not None:
                if self._fire(injection):
                    flip_one_weight(model)

    def _fire(self, injection: Injection) -> bool:
        """True the first time ``injection`` is due for this job and rank (marker file)."""
        self._markers.mkdir(parents=True, exist_ok=True)
        marker = self._markers / f"{self._job_id}.rank{self._rank}.{injection.kind}@{injection.step}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return False
        return True


def flip_one_weight(model: torch.nn.Module) -> str:
    """Flip the top mantissa bit of the largest-magnitude element of ``model``'s first
    parameter with two or more dimensions (a DTensor's local shard), in place; returns the
    parameter's name. What a silent data corruption does: the value changes (by a factor in
    [0.5, 1.5)), stays finite, and training goes on."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            local = p.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            flat = local.view(-1)
            i = int(flat.abs().argmax())
            with torch.no_grad():
                as_int = flat[i : i + 1].clone().view(torch.int32) if flat.dtype == torch.float32 else None
                if as_int is None:  # (bf16 / fp16 weights: scale instead of a bit flip)
                    flat[i] *= 1.5
                else:
                    as_int ^= 1 << 22
                    flat[i] = as_int.view(torch.float32)[0]
            return name
    raise ValueError("corrupt_weights: the model has no parameter with two or more dimensions")


class StepGuard:
    """Wraps the loop's ports to the forward and backward units, the optimizer and the checkpoint relay with
    test-only injections.

    Args:
        step: the step the loop is running now (the rank session's last completed step + 1).
        injector: test-only faults, or None (then the port is returned as it is).
    """

    def __init__(self, step: Callable[[], int], *, injector: FaultInjector | None = None):
        self._step = step
        self._injector = injector
        self._model: torch.nn.Module | None = None  # (corrupt_weights: the composition root hands it over)

    def before_profile_export(self) -> None:
        """Before a profile's export (StepProfiler's ``before_export``)."""
        if self._injector is not None:
            self._injector.before_profile_export(self._step())

    def attach(self, model: torch.nn.Module) -> None:
        """The rank's model, as the composition root hands it to its units."""
        self._model = model

    def optimizer(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        def apply_update(msg: Any, payload: Any = None) -> Reply:
            if not isinstance(msg, engine_pb2.ApplyUpdate):  # (its other commands go the same port)
                return port(msg, payload)
            factor = injector.compute_factor(self._step())
            t0 = time.perf_counter()
            reply = port(msg, payload)
            if factor > 1.0:  # (still in the optimizer phase: the step's report comes after)
                time.sleep((factor - 1.0) * (time.perf_counter() - t0))
            injector.after_update(msg.step, self._model)
            return reply

        return apply_update

    def forward(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        def run_forward(msg: Any, payload: Any = None) -> Reply:
            if not isinstance(msg, engine_pb2.RunForward):  # (ConfigureForward goes the same port)
                return port(msg, payload)
            injector.before_forward(self._step(), msg.training)
            factor = injector.compute_factor(self._step()) if msg.training else 1.0
            t0 = time.perf_counter()
            reply = port(msg, payload)
            if factor > 1.0:  # (still in the forward phase: the rank's compute time grows)
                time.sleep((factor - 1.0) * (time.perf_counter() - t0))
            return reply

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
            elif isinstance(msg, store_pb2.LoadCheckpoint):
                injector.before_load(self._step())
            return port(msg, payload)

        return save

    def backward(self, port: CommandPort) -> Callable[..., Reply]:
        if self._injector is None:
            return port
        injector = self._injector

        last_seconds = [0.0]  # the previous backward's time (slow_compute sleeps before the next)

        def run_backward(msg: engine_pb2.RunBackward, payload: Any = None) -> Reply:
            if not msg.backward:
                return port(msg, payload)
            payload = injector.before_backward(self._step(), payload)
            factor = injector.compute_factor(self._step())
            if factor > 1.0:  # before the pass: after it, DDP's hook has marked the collective
                time.sleep((factor - 1.0) * last_seconds[0])
            t0 = time.perf_counter()
            reply = port(msg, payload)
            last_seconds[0] = time.perf_counter() - t0
            return reply

        return run_backward
