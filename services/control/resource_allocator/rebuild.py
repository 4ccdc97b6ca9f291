"""The communicator rebuilt (RebuildCommunicator, L1-4 executing a recovery L1-1 commanded):
every rank relaunched, or in place (the survivors keep their processes, the lost ranks are
replaced, the group resized by a new layout)."""

from __future__ import annotations

from typing import Any

from services.contract import control_pb2, engine_pb2
from services.control.resource_allocator.slots import (
    _device_name,
    _link_probe,
    _memory_peer,
    _memory_quota,
    _of_kind,
    _placed,
    _reachable_host,
    _Ring,
    _Worker,
)
from services.jobspec import LinksSpec, spec_from_json, spec_to_json, with_layout


class Rebuild:
    """The rebuild of a job's process group (a part of ``ResourceAllocator``, see
    allocator.py)."""

    def rebuild_communicator(
        self, msg: control_pb2.RebuildCommunicator, payload: Any = None
    ) -> control_pb2.ResourcesReady | control_pb2.ResourcesInsufficient:
        """重建通信域指令: the job's process group is rebuilt from scratch. Its ranks are
        killed at once (a rank blocked in a collective cannot be asked to leave it), then
        laid out again exactly as :meth:`allocate_resources` does, on a fresh rendezvous
        port, with the same job config except the checkpoint version to load first
        (``resume_version``). Workers excluded now or in an earlier rebuild of the job get
        no rank. Each node agent starts a rank only after the killed process of the same
        rank has been reaped.

        Returns ResourcesInsufficient when the job holds no allocation here, or when its
        ranks no longer fit (its old ranks are killed either way). In the latter case the
        allocation is kept: the same command places the ranks once capacity returns.
        """
        if msg.in_place:
            return self._rebuild_in_place(msg)
        with self._lock:
            allocated = self._allocations.get(msg.job_id)
        if allocated is None:
            return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason=f"job {msg.job_id} holds no allocation")
        again = control_pb2.AllocateResources()
        again.CopyFrom(allocated)
        again.adopt = False  # (an allocation adopted after a control restart is placed anew)
        again.init.resume_version = msg.resume_version
        again.exclude_worker_ids[:] = sorted(set(again.exclude_worker_ids) | set(msg.exclude_worker_ids))
        with self._lock:  # (the relaunched ranks' generation will be larger still)
            fence = self._next_generation(msg.job_id)
            ran = self._placed.get(msg.job_id)
            # Each rank back where its memory copy is: its own node, else (gone) the node that
            # holds a copy of its state, any slot there.
            prefer = [[(w, slot), (ran.peers.get(w, ""), None)] for w, slot in (ran.ranks if ran is not None else [])]
        self.release_resources(control_pb2.ReleaseResources(job_id=msg.job_id, kill=True), below_generation=fence)
        placed = self.allocate_resources(again, prefer=prefer)
        if isinstance(placed, control_pb2.ResourcesInsufficient):
            with self._lock:
                self._allocations.setdefault(msg.job_id, again)
        return placed

    def _rebuild_in_place(
        self, msg: control_pb2.RebuildCommunicator
    ) -> control_pb2.ResourcesReady | control_pb2.ResourcesInsufficient:
        """The survivors keep their processes (issue 16): kill only ``lost_ranks``, place one
        replacement per lost rank (same rank, same world size; its own worker first once the
        killed process is reaped, else the first free slot of another usable worker), started
        to heal from a live peer (InitJob.heal_from_peer), and send every live rank of the job
        the fresh rendezvous (RebuildParallelGroup, the next generation). Rank 0's host is the
        rendezvous, as at launch.

        With ``layout`` (a resize: shrink, scale, growing back) the group gets ``layout.dp``
        ranks: the surviving ranks at or above it are released, the lost ranks below it
        replaced, and the ranks from the old size up to it launched (healing like a
        replacement); the allocation's spec and world size become the new layout's.

        Returns ResourcesInsufficient, having killed the lost ranks (and nothing else), when a
        rank to launch does not fit or the job's placement is not known here (an allocation
        adopted after a control restart): the orchestrator then falls back to relaunching
        every rank, shrinks, or (a scale) lets the ranks go on at their size."""
        with self._lock:
            allocated, placed = self._allocations.get(msg.job_id), self._placed.get(msg.job_id)
            if placed is None and allocated is not None:
                placed = self._placement_from_reattach(allocated)
            if allocated is None or placed is None:
                why = "holds no allocation" if allocated is None else "has no known placement (control restarted)"
                return control_pb2.ResourcesInsufficient(job_id=msg.job_id, reason=f"job {msg.job_id} {why}")
            old_world = len(placed.ranks)
            old_nodes = [worker_id for worker_id, _ in placed.ranks]  # (the survivors' probe peers: below)
            world = msg.layout.dp if msg.HasField("layout") else old_world
            lost = sorted({r for r in msg.lost_ranks if r < old_world})
            released = [r for r in range(world, old_world) if r not in lost]  # survivors above the new size
            launched = [r for r in lost if r < world] + list(range(old_world, world))
            kills: dict[str, list[int]] = {}
            freed: list[tuple[_Worker, int]] = []  # slots of released ranks: given back if the rest does not fit
            touched: set[str] = set()  # workers whose busy slots change (the offer's free count: capacity.py)
            for r in lost + released:
                worker_id, slot = placed.ranks[r]
                if r in lost:
                    kills.setdefault(worker_id, []).append(r)
                w = self._workers.get(worker_id)
                if w is not None and msg.job_id in w.busy:
                    w.busy[msg.job_id] = [s for s in w.busy[msg.job_id] if s != slot]
                    touched.add(worker_id)
                    if r in released:
                        freed.append((w, slot))
            excluded = set(allocated.exclude_worker_ids) | set(msg.exclude_worker_ids)
            usable = [w for w in self._workers.values() if w.reg.worker_id not in excluded and self._placeable(w)]
            picks: list[tuple[_Worker, int]] = []
            kind = spec_from_json(allocated.init.spec_json).parallel.device_kind if allocated.init.spec_json else "any"
            holds = [self._holds[w] for w in sorted(self._holds) if w in self._workers]
            held = f" ({'; '.join(holds)})" if holds else ""  # (why a node is out: its agent is silent)
            for r in launched:
                own = self._workers.get(placed.ranks[r][0]) if r < old_world else None
                candidates = ([own] if own in usable else []) + [w for w in usable if w is not own]
                taken = {(w.reg.worker_id, s) for w, s in picks}
                spot = next(
                    (
                        (w, s)
                        for w in candidates
                        for s in w.free_slots()
                        if (w.reg.worker_id, s) not in taken and _of_kind(w, s, kind)
                    ),
                    None,
                )
                if spot is None:
                    what = f"a replacement of rank {r}" if r < old_world else f"new rank {r}"
                    short = self._insufficient(allocated, len(picks), f"no free slot for {what}{held}")
                    short.requested_ranks = len(launched)
                    break
                picks.append(spot)
            else:
                short = None
            launches: dict[str, control_pb2.LaunchRanks] = {}
            peers: dict[str, control_pb2.LaunchRanks] = {}  # (survivors' new probe peers)
            generation = 0
            if short is not None:
                for w, slot in freed:  # (the released ranks stay, as they were)
                    w.busy.setdefault(msg.job_id, []).append(slot)
                    touched.add(w.reg.worker_id)
            else:
                for r in released:
                    worker_id, _ = placed.ranks[r]
                    kills.setdefault(worker_id, []).append(r)
                del placed.ranks[world:]
                placed.ranks.extend([("", 0)] * (world - len(placed.ranks)))
                for r, (w, slot) in zip(launched, picks, strict=True):
                    w.busy.setdefault(msg.job_id, []).append(slot)
                    placed.ranks[r] = (w.reg.worker_id, slot)
                    touched.add(w.reg.worker_id)
                if msg.HasField("layout"):  # (also a new micro-batch split at the same size)
                    layout = msg.layout
                    spec = with_layout(
                        spec_from_json(allocated.init.spec_json),
                        dp=layout.dp,
                        micro_batch_size=layout.micro_batch_size,
                        grad_accum=layout.grad_accum,
                        source="RebuildCommunicator.layout",
                    )
                    allocated.init.spec_json, allocated.world_size = spec_to_json(spec), world
                placed.generation += 1
                generation = self._next_generation(msg.job_id)  # the replacements' incarnation (fencing)
                master_addr = _reachable_host(self._workers[placed.ranks[0][0]].reg)
                master_port = self._free_port()
                rank_nodes = [worker_id for worker_id, _ in placed.ranks]
                init = engine_pb2.InitJob()
                init.CopyFrom(allocated.init)
                init.resume_version, init.heal_from_peer = "", True
                if msg.withdrawn_orders:  # (the kept ranks no longer follow them: neither does a new one)
                    gone = set(msg.withdrawn_orders)
                    kept = [o for o in init.standing_orders if o.id not in gone]
                    del init.standing_orders[:]
                    init.standing_orders.extend(kept)
                threads = spec_from_json(init.spec_json).parallel.threads_per_rank
                # Each node's ranks in rank order (LOCAL_RANK, LOCAL_WORLD_SIZE), once; the world's
                # nodes are not sent: the ranks learn them at the rendezvous (node_map.py).
                on_node: dict[str, list[int]] = {}
                for r, worker_id in enumerate(rank_nodes):
                    on_node.setdefault(worker_id, []).append(r)
                for r, (w, slot) in zip(launched, picks, strict=True):
                    launch = launches.setdefault(w.reg.worker_id, control_pb2.LaunchRanks(job_id=msg.job_id, init=init))
                    local = on_node[w.reg.worker_id]
                    launch.ranks.append(engine_pb2.RankAssignment(
                        rank=r, world_size=len(placed.ranks), local_rank=local.index(r), local_world_size=len(local),
                        master_addr=master_addr, master_port=master_port, backend=placed.backend,
                        device=_device_name(w, slot),
                        memory_quota_bytes=_memory_quota(w, slot), num_threads=threads, worker_id=w.reg.worker_id,
                        generation=generation,
                    ))  # fmt: skip
                links = spec_from_json(init.spec_json).links
                memory_ring, probe_ring = _Ring(w.reg.worker_id for w in usable), _Ring(rank_nodes)
                for worker_id, launch in launches.items():
                    peer = _memory_peer(usable, worker_id, memory_ring)
                    if peer is not None:
                        launch.memory_peer.CopyFrom(peer)
                    probe = _link_probe(links, rank_nodes, self._workers, worker_id, probe_ring)
                    if probe is not None:
                        launch.link_probe.CopyFrom(probe)
                    placed.probes[worker_id] = probe
                peers = _new_probe_peers(links, old_nodes, rank_nodes, self._workers, msg.job_id, placed.probes)
                rebuild = engine_pb2.RebuildParallelGroup(
                    job_id=msg.job_id, master_addr=master_addr, master_port=master_port, reason=msg.reason,
                    world_size=len(placed.ranks), generation=placed.generation,  # (no nodes: node_map.py)
                    layout=msg.layout if msg.HasField("layout") else None,
                    lost_ranks=lost,  # the survivors abort their broken communicator at once
                )  # fmt: skip
                kinds = _placed(self._workers, placed)
            self._recount(*touched)
        # The kills go first on each node agent's queue: a replacement of the same rank starts
        # only once the killed process is reaped (the node agent's rule), and a survivor blocked
        # in a collective with a hung rank is freed by that rank's death.
        # With the replacements' generation: the agent keeps it, and ends a killed incarnation
        # that shows up again (one its kill did not reach: a frozen agent's backlog).
        for worker_id, ranks in kills.items():
            self._hardware(
                control_pb2.ReleaseRanks(job_id=msg.job_id, kill=True, ranks=ranks, below_generation=generation),
                worker_id,
            )
        if short is not None:
            return short
        for worker_id, launch in launches.items():
            self._hardware(launch, worker_id)
        for worker_id, launch in peers.items():
            self._hardware(launch, worker_id)
        if self._parallel is not None:
            self._parallel(rebuild)
        return control_pb2.ResourcesReady(
            job_id=msg.job_id,
            world_size=rebuild.world_size,
            master_addr=rebuild.master_addr,
            master_port=rebuild.master_port,
            worker_ids=list(launches),
            generation=rebuild.generation,
            replaced_ranks=launched,
            placed=kinds,
            rank_worker_ids=rank_nodes,  # (the whole group's, survivors too: L1-1 journals it)
            # (the replacements'; none launched, none: a shrink's kept ranks run the process
            # they ran, whose later end is theirs, never a replaced incarnation's)
            rank_generation=generation if launched else 0,
        )


def _new_probe_peers(
    links: LinksSpec,
    old_nodes: list[str],
    rank_nodes: list[str],
    workers: dict[str, _Worker],
    job_id: str,
    told: dict[str, control_pb2.LinkProbe | None],
) -> dict[str, control_pb2.LaunchRanks]:
    """A ``LaunchRanks`` with no ranks for each node of the job before or after a rebuild in
    place whose probe peers changed since its agent was last told (``told``, updated here; the
    nodes launched to carry their own and are in it already): its agent probes the new layout's
    links (an empty ``link_probe``: none of this job any more, e.g. a node the rebuild left
    without ranks, whose agent only had some ranks killed). Why: a survivor kept probing the
    excluded node and never the replacement's, so a cut link to the replacement went unseen and
    a cut to the excluded node was stated for a job not on it; and a replacement on its own node
    whose agent came back at another address was probed at the old one. What a node was told is
    compared, addresses included; where it is not known (after a control restart) the old
    layout's peers at today's addresses stand in for it."""
    peers: dict[str, control_pb2.LaunchRanks] = {}
    old_ring, new_ring = _Ring(old_nodes), _Ring(rank_nodes)
    for worker_id in dict.fromkeys(w for w in old_nodes + rank_nodes if w):
        if worker_id not in workers:
            told.pop(worker_id, None)
            continue  # (its agent is gone: nothing to tell; one that comes back is told at its launch)
        if worker_id in told:
            before = told[worker_id]
        else:
            before = _link_probe(links, old_nodes, workers, worker_id, old_ring)
        after = _link_probe(links, rank_nodes, workers, worker_id, new_ring)
        if before != after:
            update = peers[worker_id] = control_pb2.LaunchRanks(job_id=job_id)
            if after is not None:
                update.link_probe.CopyFrom(after)
        told[worker_id] = after
    return peers
