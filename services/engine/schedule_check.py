"""Static deadlock check of a pipeline schedule, run before the schedule runs.

The seed commentary (001, section 2.4, 执行调度层) asks for "a dependency-graph checker that
does a static deadlock detection once the schedule plan is generated, to stop the problem
before it runs" (在调度计划生成后先做一次静态的死锁检测): a pipeline with a misordered
send/receive does not fail, it hangs without an error. This module is that checker. It is a
pure function over the schedule's actions, knows nothing of models or tensors (the
commentary's "operations and dependencies, not model semantics"), and takes no part in
execution.

A schedule is, per pipeline rank, the ordered list of what that rank does:

    Action("F", s, m)       forward of micro-batch m on stage s
    Action("B", s, m)       full backward of micro-batch m on stage s
    Action("SEND_F", s, m)  stage s sends m's activations to stage s + 1
    Action("RECV_F", s, m)  stage s receives m's activations from stage s - 1
    Action("SEND_B", s, m)  stage s sends m's input gradients to stage s - 1
    Action("RECV_B", s, m)  stage s receives m's output gradients from stage s + 1

(torch.distributed.pipelining's ``_Action`` notation: ``1RECV_F3`` is stage 1 receiving
micro-batch 3.) An element of a rank's list is one action, or a tuple of send/receive
actions posted together and waited on together (``batch_isend_irecv``: how torch's 1F1B
avoids the send/send cycle between neighbours).

Semantics of the simulation: a send or receive blocks until its peer has posted the
matching operation (rendezvous). That is the strictest p2p semantics (NCCL's for large
messages); a schedule that completes under it also completes where sends are buffered or
asynchronous, so passing here is safe on gloo and NCCL alike. Messages between two ranks
are matched in posting order (p2p carries no tag that would let a receive pick a later
send), so the k-th send from rank a to rank b must be the k-th receive on b from a.

Checks, in order, each raising :class:`ScheduleError` with one line naming the rank, the
position in its list and the action:
    1. well-formed: known kinds, stage and micro-batch in range, a stage on exactly the
       rank that owns it, compute actions never inside a batch, no action twice;
    2. complete: one F and one B for every (stage, micro-batch);
    3. local order: F before its B; a received input before the compute that uses it;
       a computed output before the send of it;
    4. matching: every send has its receive on the peer, in the same order, and every
       receive its send;
    5. progress: simulated execution reaches the end of every rank's list; otherwise the
       first stuck rank, its action and the wait-for cycle (or the finished peer) are named.

The action lists that Surge runs are generated here to mirror torch 2.13's
``ScheduleGPipe._step_microbatches`` and ``Schedule1F1B._step_microbatches`` exactly
(``schedule_actions``; a multi-process test records what torch actually issues and compares).
torch's own ``pipeline_order`` IR can be checked too (``from_torch_order``); note that torch
2.13's ``Schedule1F1B.pipeline_order`` is itself malformed on the last stage (it starts at
micro-batch 1), which this check reports; the runtime does not use that IR.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
SCHEDULES = ("gpipe", "1f1b")


class ScheduleError(ValueError):
    """A schedule that would hang or is malformed; the message names the first offender."""


@dataclass(frozen=True, order=True)
class Action:
    """One operation of one stage on one micro-batch (see the module docstring)."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:  # torch's notation: 1RECV_F3
        return f"{self.stage}{self.kind}{self.microbatch}"


Step = Action | tuple[Action, ...]


def _ops(step: Step) -> tuple[Action, ...]:
    return step if isinstance(step, tuple) else (step,)


def _fmt(step: Step) -> str:
    return "[" + " + ".join(map(str, step)) + "]" if isinstance(step, tuple) else str(step)


def _match(a: Action) -> Action:
    """The operation on the peer that completes ``a``."""
    return {
        "SEND_F": lambda: Action("RECV_F", a.stage + 1, a.microbatch),
        "RECV_F": lambda: Action("SEND_F", a.stage - 1, a.microbatch),
        "SEND_B": lambda: Action("RECV_B", a.stage - 1, a.microbatch),
        "RECV_B": lambda: Action("SEND_B", a.stage + 1, a.microbatch),
    }[a.kind]()


def check_schedule(
    actions: Mapping[int, Sequence[Step]],
    *,
    num_stages: int,
    num_microbatches: int,
    stage_to_rank: Mapping[int, int] | None = None,
) -> int:
    """Verify that ``actions`` (rank -> ordered steps) runs to completion without deadlock.

    ``stage_to_rank`` defaults to stage s on rank s (one stage per rank, as GPipe and 1F1B).
    Sends and receives between two stages on the same rank are not expected (and refused).

    Returns the number of simulated rounds (a rough critical-path length in steps).
    Raises ScheduleError (a ValueError) naming the first problem; see the module docstring.
    """
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"schedule: num_stages and num_microbatches must be >= 1, got {num_stages}, {num_microbatches}"
        )
    owner = dict(stage_to_rank) if stage_to_rank is not None else {s: s for s in range(num_stages)}
    if sorted(owner) != list(range(num_stages)):
        raise ScheduleError(f"schedule: stage_to_rank must map stages 0..{num_stages - 1}, got {sorted(owner)}")
    ranks = sorted(set(owner.values()))
    if sorted(actions) != ranks:
        raise ScheduleError(f"schedule: expected action lists for ranks {ranks}, got {sorted(actions)}")
    lists = {r: list(actions[r]) for r in ranks}
    _check_well_formed(lists, owner, num_stages, num_microbatches)
    _check_complete(lists, owner, num_stages, num_microbatches)
    _check_local_order(lists, owner, num_stages)
    _check_matching(lists, owner)
    return _simulate(lists, owner)


def _where(rank: int, i: int, step: Step) -> str:
    return f"rank {rank} step {i} ({_fmt(step)})"


def _check_well_formed(lists, owner, num_stages, num_microbatches) -> None:
    for r, steps in lists.items():
        seen: set[Action] = set()
        for i, step in enumerate(steps):
            if isinstance(step, tuple) and not step:
                raise ScheduleError(f"schedule: {_where(r, i, step)}: an empty batch")
            for a in _ops(step):
                if not isinstance(a, Action) or a.kind not in COMPUTE_KINDS + COMM_KINDS:
                    raise ScheduleError(f"schedule: {_where(r, i, step)}: unknown action {a!r}")
                if not (0 <= a.stage < num_stages and 0 <= a.microbatch < num_microbatches):
                    raise ScheduleError(
                        f"schedule: {_where(r, i, step)}: {a} is outside {num_stages} stages x {num_microbatches} micro-batches"
                    )
                if owner[a.stage] != r:
                    raise ScheduleError(
                        f"schedule: {_where(r, i, step)}: stage {a.stage} belongs to rank {owner[a.stage]}"
                    )
                if isinstance(step, tuple) and a.kind in COMPUTE_KINDS:
                    raise ScheduleError(
                        f"schedule: {_where(r, i, step)}: compute action {a} inside a send/receive batch"
                    )
                if a.kind in COMM_KINDS:
                    peer_stage = _match(a).stage
                    if not 0 <= peer_stage < num_stages:
                        raise ScheduleError(f"schedule: {_where(r, i, step)}: {a} has no peer stage {peer_stage}")
                    if owner[peer_stage] == r:
                        raise ScheduleError(
                            f"schedule: {_where(r, i, step)}: {a} talks to its own rank (stage {peer_stage})"
                        )
                if a in seen:
                    raise ScheduleError(f"schedule: {_where(r, i, step)}: {a} appears twice")
                seen.add(a)


def _check_complete(lists, owner, num_stages, num_microbatches) -> None:
    done = {a for steps in lists.values() for step in steps for a in _ops(step)}
    for s in range(num_stages):
        for m in range(num_microbatches):
            for kind in COMPUTE_KINDS:
                if Action(kind, s, m) not in done:
                    raise ScheduleError(f"schedule: rank {owner[s]} never runs {Action(kind, s, m)}")


def _check_local_order(lists, owner, num_stages) -> None:
    """Program order on one rank: what a compute needs was received (or computed) earlier."""
    for r, steps in lists.items():
        before: set[Action] = set()
        for i, step in enumerate(steps):
            for a in _ops(step):
                s, m = a.stage, a.microbatch
                needs: list[Action] = []
                if a.kind == "F" and s > 0:
                    needs.append(Action("RECV_F", s, m) if owner[s - 1] != r else Action("F", s - 1, m))
                elif a.kind == "B":
                    needs.append(Action("F", s, m))
                    if s < num_stages - 1:
                        needs.append(Action("RECV_B", s, m) if owner[s + 1] != r else Action("B", s + 1, m))
                elif a.kind == "SEND_F":
                    needs.append(Action("F", s, m))
                elif a.kind == "SEND_B":
                    needs.append(Action("B", s, m))
                for need in needs:
                    if need not in before:
                        raise ScheduleError(f"schedule: {_where(r, i, step)}: {a} runs before {need} on rank {r}")
            before.update(_ops(step))  # ops of one batch complete together, after the batch
        # A receive whose data nobody uses is a hang waiting to happen (its sender may never come).
        for a in before:
            if a.kind == "RECV_F" and Action("F", a.stage, a.microbatch) not in before:
                raise ScheduleError(
                    f"schedule: rank {r}: {a} is never consumed by {Action('F', a.stage, a.microbatch)}"
                )
            if a.kind == "RECV_B" and Action("B", a.stage, a.microbatch) not in before:
                raise ScheduleError(
                    f"schedule: rank {r}: {a} is never consumed by {Action('B', a.stage, a.microbatch)}"
                )


def _channels(lists, owner) -> dict[tuple[int, int, str], list[tuple[Action, int]]]:
    """(src rank, dst rank, 'send'|'recv') -> ops in posting order, with their step index."""
    ch: dict[tuple[int, int, str], list[tuple[Action, int]]] = defaultdict(list)
    for r, steps in lists.items():
        for i, step in enumerate(steps):
            for a in _ops(step):
                if a.kind.startswith("SEND"):
                    ch[(r, owner[_match(a).stage], "send")].append((a, i))
                elif a.kind.startswith("RECV"):
                    ch[(owner[_match(a).stage], r, "recv")].append((a, i))
    return ch


def _check_matching(lists, owner) -> None:
    ch = _channels(lists, owner)
    for src, dst in sorted({(k[0], k[1]) for k in ch}):
        sends, recvs = ch.get((src, dst, "send"), []), ch.get((src, dst, "recv"), [])
        for k in range(max(len(sends), len(recvs))):
            if k >= len(recvs):
                a, i = sends[k]
                raise ScheduleError(
                    f"schedule: {_where(src, i, lists[src][i])}: {a} has no matching {_match(a)} on rank {dst}"
                )
            if k >= len(sends):
                a, i = recvs[k]
                raise ScheduleError(
                    f"schedule: {_where(dst, i, lists[dst][i])}: {a} has no matching {_match(a)} on rank {src}"
                )
            (sa, si), (ra, ri) = sends[k], recvs[k]
            if _match(sa) != ra:
                raise ScheduleError(
                    f"schedule: rank {src} -> rank {dst}: message {k} is {sa} (rank {src} step {si}) but rank {dst} "
                    f"receives {ra} there (step {ri}); p2p matches in posting order"
                )


def _simulate(lists, owner) -> int:
    """Lock-step execution with rendezvous p2p; returns rounds, raises on a stall."""
    pc = {r: 0 for r in lists}
    done: dict[int, set[Action]] = {r: set() for r in lists}  # completed ops of the current step
    rounds = 0
    while any(pc[r] < len(lists[r]) for r in lists):
        rounds += 1
        progress = False
        posted = {r: set(_ops(lists[r][pc[r]])) - done[r] for r in lists if pc[r] < len(lists[r])}
        for r in sorted(posted):
            for a in sorted(posted[r]):
                if a.kind in COMPUTE_KINDS:
                    done[r].add(a)
                    continue
                peer, want = owner[_match(a).stage], _match(a)
                if want in posted.get(peer, ()) and want not in done[peer]:
                    done[r].add(a)
                    done[peer].add(want)
        for r in sorted(posted):
            if done[r] >= set(_ops(lists[r][pc[r]])):
                pc[r], done[r], progress = pc[r] + 1, set(), True
        if not progress:
            raise ScheduleError(_stall_message(lists, owner, pc, done))
    return rounds


def _stall_message(lists, owner, pc, done) -> str:
    waits: dict[int, tuple[int, Action]] = {}
    for r in sorted(lists):
        if pc[r] < len(lists[r]):
            a = min(set(_ops(lists[r][pc[r]])) - done[r])
            waits[r] = (owner[_match(a).stage], a)
    first = min(waits)
    peer, a = waits[first]
    head = (
        f"schedule deadlock: {_where(first, pc[first], lists[first][pc[first]])} blocks in {a} waiting for rank {peer}"
    )
    if peer not in waits:
        return f"{head}, which has finished without posting {_match(a)}"
    chain, r = [first], peer
    while r in waits and r not in chain:
        chain.append(r)
        r = waits[r][0]
    tail = ", ".join(
        f"rank {x} blocks in {waits[x][1]} (step {pc[x]}) waiting for rank {waits[x][0]}" for x in chain[1:]
    )
    return f"{head}; {tail}" + (f" (cycle back to rank {r})" if r in chain else "")


# ------------------------------------------------------------------ schedules Surge runs


def gpipe_actions(num_stages: int, num_microbatches: int) -> dict[int, list[Step]]:
    """Mirror of torch 2.13 ``ScheduleGPipe._step_microbatches`` for stage s on rank s:
    all forwards (receive, compute, send), then all backwards (receive, compute, send).
    torch issues each send asynchronously and waits at the end of the phase; modelled here
    as a blocking send, which is stricter (see the module docstring)."""
    _require_sizes(num_stages, num_microbatches)
    last = num_stages - 1
    out: dict[int, list[Step]] = {}
    for s in range(num_stages):
        steps: list[Step] = []
        for m in range(num_microbatches):
            steps += ([Action("RECV_F", s, m)] if s > 0 else []) + [Action("F", s, m)]
            steps += [Action("SEND_F", s, m)] if s < last else []
        for m in range(num_microbatches):
            steps += ([Action("RECV_B", s, m)] if s < last else []) + [Action("B", s, m)]
            steps += [Action("SEND_B", s, m)] if s > 0 else []
        out[s] = steps
    return out


def one_f_one_b_actions(num_stages: int, num_microbatches: int) -> dict[int, list[Step]]:
    """Mirror of torch 2.13 ``Schedule1F1B._step_microbatches`` (Narayanan et al. 2021,
    PipeDream-Flush): stage s warms up with min(n, S - s) forwards, then alternates one
    backward and one forward, fusing each pending send with the next receive into one
    ``batch_isend_irecv``; then cools down with the remaining backwards.

    Raises ScheduleError when num_microbatches < num_stages (torch refuses it too)."""
    _require_sizes(num_stages, num_microbatches)
    if num_microbatches < num_stages:
        raise ScheduleError(f"schedule: 1f1b needs microbatches >= stages, got {num_microbatches} < {num_stages}")
    last, n = num_stages - 1, num_microbatches
    out: dict[int, list[Step]] = {}
    for s in range(num_stages):
        recv_f = (lambda m, s=s: [Action("RECV_F", s, m)]) if s > 0 else (lambda m: [])
        send_f = (lambda m, s=s: [Action("SEND_F", s, m)]) if s < last else (lambda m: [])
        recv_b = (lambda m, s=s: [Action("RECV_B", s, m)]) if s < last else (lambda m: [])
        send_b = (lambda m, s=s: [Action("SEND_B", s, m)]) if s > 0 else (lambda m: [])
        steps: list[Step] = []

        def post(ops: list[Action], steps: list[Step] = steps) -> None:  # one _batch_p2p call, then its wait
            if ops:
                steps.append(ops[0] if len(ops) == 1 else tuple(ops))

        warmup = min(n, num_stages - s)
        fwd = bwd = 0
        pending_f: list[Action] = []
        for _ in range(warmup):
            post(recv_f(fwd))
            steps.append(Action("F", s, fwd))
            if fwd != warmup - 1:
                post(send_f(fwd))
            else:
                pending_f = send_f(fwd)  # fused with the first backward's receive
            fwd += 1
        while True:
            post(pending_f + recv_b(bwd))
            steps.append(Action("B", s, bwd))
            pending_b = send_b(bwd)
            bwd += 1
            if fwd == n:
                break
            post(pending_b + recv_f(fwd))
            steps.append(Action("F", s, fwd))
            pending_f = send_f(fwd)
            fwd += 1
        post(pending_b)
        while bwd < n:
            post(recv_b(bwd))
            steps.append(Action("B", s, bwd))
            post(send_b(bwd))
            bwd += 1
        out[s] = steps
    return out


def schedule_actions(schedule: str, num_stages: int, num_microbatches: int) -> dict[int, list[Step]]:
    """The action lists of ``schedule`` ("gpipe" | "1f1b"). Raises ScheduleError otherwise."""
    if schedule == "gpipe":
        return gpipe_actions(num_stages, num_microbatches)
    if schedule == "1f1b":
        return one_f_one_b_actions(num_stages, num_microbatches)
    raise ScheduleError(f"parallel.pipeline_schedule: expected one of {SCHEDULES}, got {schedule!r}")


def check_pipeline(schedule: str, num_stages: int, num_microbatches: int) -> int:
    """Generate and check the action lists of a one-stage-per-rank pipeline: what the
    engine runs before it lets a pipeline stage be built. Returns the simulated rounds.
    Raises ScheduleError (a ValueError) with the first problem."""
    actions = schedule_actions(schedule, num_stages, num_microbatches)
    return check_schedule(actions, num_stages=num_stages, num_microbatches=num_microbatches)


def _require_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"schedule: stages and microbatches must be >= 1, got {num_stages}, {num_microbatches}")


def from_torch_order(pipeline_order: Mapping[int, Iterable]) -> dict[int, list[Step]]:
    """Convert torch.distributed.pipelining's schedule IR (rank -> list of ``_Action`` or
    None) into :class:`Action` lists. Idle slots (None) and actions without p2p or compute
    meaning here (REDUCE_GRAD, UNSHARD, RESHARD) are dropped; split backwards (I, W) and
    OVERLAP_F_B are refused, since this check models full backwards only.

    A compute-only IR (no SEND/RECV) must first be lowered, e.g. with torch's
    ``_add_send_recv``; otherwise the check reports the missing receives.
    """
    out: dict[int, list[Step]] = {}
    for rank, seq in pipeline_order.items():
        steps: list[Step] = []
        for a in seq:
            if a is None:
                continue
            kind = getattr(a.computation_type, "value", a.computation_type)
            if kind in ("REDUCE_GRAD", "UNSHARD", "RESHARD"):
                continue
            if kind not in COMPUTE_KINDS + COMM_KINDS:
                raise ScheduleError(f"schedule: rank {rank}: action kind {kind!r} ({a}) is not supported by the check")
            steps.append(Action(kind, a.stage_index, a.microbatch_index))
        out[rank] = steps
    return out
