"""L1-2 resource allocator: the worker registry, rank topology and per-rank quotas.

Seed 000 L1-2: it allocates and releases resources and lays out the rank topology; it
never starts or stops training on its own, never reads training metrics, never changes
hyper-parameters. Quotas are fixed at launch and never changed while the job runs.

Inputs: ``WorkerRegistration``, ``MemoryPressure`` and ``DeviceMemoryUsage`` (node agents,
via the session relay), ``AllocateResources``, ``ReleaseResources`` and ``CordonWorker`` (from
L1-1), ``RebuildCommunicator`` (from L1-4, executing a recovery L1-1 commanded).
Outputs: ``ResourcesReady`` / ``ResourcesInsufficient`` (replies), ``LaunchRanks``
and ``ReleaseRanks`` (to one node agent each; the payload names the worker id),
``RebuildParallelGroup`` (to L2-2 of every live rank of a job rebuilt in place, through
control's session relay: the fresh rendezvous),
``ResourcePressure`` (published; the orchestrator observes it), ``ResourcesReady`` with no job
id (published when a worker registers with slots: the orchestrator's queue may start a job),
``WorkerCordoned`` (the reply to CordonWorker; published with ``cleared`` when the cordon ends).

Layout (one concern a file): allocator.py, ``ResourceAllocator`` itself (its state, the
commands from L1-1: allocate and release, placement by slot and by memory) joining the mixins
registry.py (registrations, re-attach after a control restart, memory pressure), cordons.py
(cordons, quarantine, holds: who may get new ranks) and rebuild.py (the communicator rebuilt:
relaunched, or in place); and the plain records and slot helpers in slots.py (``_Worker``,
``_Placement``, each slot's device, quota and memory peer).
"""

from services.control.resource_allocator.allocator import RELEASE_GRACE_SECONDS, ResourceAllocator
from services.control.resource_allocator.slots import _Placement, _Worker

__all__ = ["RELEASE_GRACE_SECONDS", "ResourceAllocator", "_Placement", "_Worker"]
