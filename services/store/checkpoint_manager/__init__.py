"""L5-1 checkpoint manager: hands out staging locations, verifies, commits and catalogs versions.

A package, one concern a file: ``manager.py`` (the class and its commands), ``staging.py``,
``chunks.py`` (chunks and garbage collection), ``commit.py``, ``verification.py``,
``data_plane.py``, ``layout.py`` (names on disk, errors, records the parts share),
``formats.py`` (the checkpoint format and Surge release every version records; which this
build reads).

Ranks write torch.distributed.checkpoint (DCP) shards themselves, straight to storage, or
stream them here (see "Where the bytes live" below). This
module only says where (``save_checkpoint``), seals what was written into a numbered version
(``commit_checkpoint``), proves a version intact before anyone reads it (``load_checkpoint``) and lists the
chain (``checkpoint_query``). It never decides when to save or which version to load (both come in the
command), never changes a byte it was handed and never opens a tensor.

On disk, under ``<root>/checkpoints``::

    catalog.json                               the version chain of every job
    <job_id>/.staging/step-<step>-<token>/     the job's open save: ranks write its index here
    <job_id>/<n>/                              version "<job_id>:<n>": the index + manifest.json
    <job_id>/chunks/<epoch>/<sha[:2]>/<sha>    the chunks of an epoch (content-addressed)

Incremental saves (the ranks' side: ``services/state/chunk_store.py``). A version is DCP's
``.metadata`` plus ``chunks.json`` (every chunk it references: SHA-256, bytes) in its own
directory, and chunks, each a file named by its SHA-256, in its epoch's directory. An epoch
begins with a baseline (a new directory, so its save writes every chunk); the versions after
it in the same epoch are deltas: their ranks write only the chunks the directory lacks.
``save_checkpoint`` decides which (``_next_epoch``: a new epoch every ``baseline_every``
versions, counted from the epoch's baseline whatever was pruned since, or when a version of
the epoch is recorded not ok, or its directory is gone) and says so in SaveStaged. A commit
checks the manifest, not the bytes: ``chunks.json`` is self-consistent and every chunk it
names is there with its size (one listing of the epoch; the writer hashed each chunk from
the bytes it wrote, see ``_check_chunks``). The manifest lists the chunks (SHA-256, bytes);
``bytes`` is the whole version, ``written_bytes`` what its save added: its index files and
the chunks no earlier version of the epoch references (never more than ``bytes``). Chunks
are never rewritten, so a killed delta leaves every older version whole. After retention,
the job's chunks are garbage-collected (mark and sweep: decided under the lock, removed
outside it, see ``_plan_sweep`` and ``_sweep``): a chunk no cataloged version references is
removed, and so is an epoch directory none references. Verification hashes each chunk once
per pass (a scrub or a re-hash); a damaged chunk strikes every version that references it.

Where the bytes live (the deployment's choice, ``services/store/__main__.py``; every
SaveStaged and CheckpointInfo says it in ``transfer``, so a rank never guesses):

* ``TRANSFER_PATH`` (the default): the layout above on the store's disk, which the ranks
  write and read themselves at the paths handed out: a filesystem mounted at the same path
  on every node.
* ``TRANSFER_STREAM``: the same layout on the store's disk, which only the store touches.
  Ranks stream their files (``receive_files``: index files into the staging directory,
  chunks into the epoch's directory), each checked as it arrives: the name stays inside its
  directory (``_check_index_name``; a chunk's name is a SHA-256), the size is bounded
  (``MAX_STREAMED_CHUNK_BYTES``, ``MAX_STREAMED_INDEX_BYTES``) and as declared, the bytes
  hash to the declared SHA-256 (a chunk's: its name); a file that fails is refused
  (CheckpointTransferRefused, its cause typed) and nothing of it stays. A stream only feeds
  the job's open save of its step and attempt; the commit is the same as ever (the files
  are hashed again there). ``held_chunks`` tells a rank what the epoch has (a delta sends
  only the rest); ``send_files`` streams a committed version's index files and chunks back,
  only those its manifest names.
* ``TRANSFER_FSSPEC``: chunks live in an object store (``chunk_roots.FsspecChunks``, e.g.
  ``s3://bucket/prefix/<job>/chunks/<epoch>/<sha[:2]>/<sha>``), which the ranks write and read
  themselves; the index files stream to the store as above, and the catalog, each version's
  index and manifest stay on the store's disk. Commit checks, verification, scrubs and
  garbage collection of chunks go to the object store (one listing per epoch, a read per
  chunk hashed).

These data-plane methods are called by the store's relay for the plumbing RPCs
``PutCheckpointFiles``, ``HeldCheckpointChunks`` and ``GetCheckpointFiles`` (bytes, not
routed messages; exception checkpoint-bytes-stream); nothing is decided on them.

Staging (one open save per job, a save is "the ranks of one attempt writing one step"):

* Every rank asks ``save_checkpoint(job, step, rank, attempt)``. ``attempt`` names the
  generation of ranks (one launch of the job's ranks: the same for all of them, different
  for every launch; the ranks' checkpoint relay sets it). A rank that asks for the open
  save's step, of the open save's attempt, and has not asked for it before gets the open
  save's directory: all ranks of one attempt share one.
* Another attempt never shares a directory: its first rank gets a fresh one. Without this,
  a killed generation's half-begun save of step s would be handed to some ranks of the
  next generation saving s again, and a fresh directory to the others (they "asked twice"),
  and the version committed would lack their shards. The attempt a new one replaced is
  superseded: its later asks (a straggler of a killed generation) are refused, so it can
  never remove the newer attempt's directory. The manager remembers the last
  ``_ATTEMPTS_KEPT`` attempts of each job, in memory only.
* A rank asking a second time for the same step within its attempt (or, with an empty
  ``attempt`` from an older client, at all) starts a new attempt: it gets a fresh
  directory. A different step also gets a fresh one.
* A fresh directory abandons the job's previous open save: every other staging directory of
  the job is removed then, so a dead save never blocks or leaks into a new one.
* After a store restart nothing is open; a commit adopts the single staging directory of
  its step if exactly one is on disk (ranks that wrote before the restart are not lost).
* A commit naming an attempt is refused when the open save is another attempt's, and every
  commit is refused (``CheckpointIncomplete``) when the staging directory's DCP ``.metadata``
  names a file that is not there or is shorter than the data it should hold: the index is
  read as a stream of pickle opcodes (``pickletools``), nothing is unpickled or imported.

Commit order (why: a crash at any point leaves the chain as it was, or one step ahead, and
never points at a half-written version): hash the index files, check the chunks by size ->
write + fsync ``manifest.json`` -> re-stat every file (a straggler still writing fails the
commit) -> fsync the directory ->
rename staging to ``<n>`` -> fsync the parent -> write the catalog to a temp file, fsync,
rename over ``catalog.json``. A directory ``<n>`` with no catalog entry (a crash between the
last two renames) was never acknowledged; the next commit of that job reuses ``n`` and
removes it.

Retention runs only when a commit asks for it (``keep_last``, ``keep_every``): the versions
of that job older than the newest ``keep_last``, except those whose step is a multiple of
``keep_every``, those named in ``keep_versions`` (the version the committing ranks resumed
from) and the job's newest version whose verdict is ok, leave the catalog first, then their
directories are removed, so the catalog never names a missing directory. The number of a
cataloged version is never reused (the latest version is never pruned, and numbering
continues from it).

Verification is off the critical path. At commit the version's own files (the index: a few
KB to MB) are hashed into the manifest and its chunks are checked by name and size (their
writer hashed them); every byte is re-hashed on demand (``verify`` with ``rehash``, a scrub)
and by every reader as it reads. The catalog records the
verdict and when it was reached (``verdict``: ok | corrupt | missing_file, ``verified_unix``,
``reason``; a catalog entry written before verdicts existed reads as ok, verified at its
commit). ``load_checkpoint`` re-hashes nothing: it refuses a version whose recorded verdict is not ok,
checks the manifest (a few hundred bytes) against the catalog and says where the version is;
the reader checks each file's SHA-256 as it reads it (``services/rank/store_client.py``).
``verify`` answers from the recorded verdicts, or re-hashes when asked (``rehash``). A scrub
(``scrub``: on the orchestrator's command, or the operator's schedule kept by the store's
composition root) re-hashes committed versions and records the verdicts; each version newly
found corrupt is published as ``CheckpointCorrupt`` (this module's own event emitter: it
publishes events only, it commands nobody). ``latest`` names the newest version whose recorded verdict is ok.
This module reports verdicts; it never picks the version to load.
"""

from services.store.checkpoint_manager.layout import (
    CATALOG,
    CATALOG_FORMAT,
    CHUNK_INDEX,
    CHUNK_INDEX_FORMAT,
    CHUNKS_DIR,
    DCP_METADATA,
    MANIFEST,
    MANIFEST_FORMAT,
    CheckpointDamaged,
    CheckpointFormatRefused,
    CheckpointIncomplete,
    CheckpointNotFound,
    CheckpointRejected,
    CheckpointTransferRefused,
)
from services.store.checkpoint_manager.manager import (
    CheckpointManager,
    catalog_job_ids,
    read_committed,
    recorded_verdicts,
)

__all__ = [
    "CATALOG",
    "CATALOG_FORMAT",
    "CHUNKS_DIR",
    "CHUNK_INDEX",
    "CHUNK_INDEX_FORMAT",
    "DCP_METADATA",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "CheckpointDamaged",
    "CheckpointFormatRefused",
    "CheckpointIncomplete",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointRejected",
    "CheckpointTransferRefused",
    "catalog_job_ids",
    "read_committed",
    "recorded_verdicts",
]
