"""Part of L5-1 (the checkpoint manager): the checkpoint formats this build writes and reads.

Every version records, in its manifest and its catalog entry, ``checkpoint_format`` (how its
files are laid out: the manifest, ``chunks.json``, DCP's ``.metadata`` with plain per-item
chunk lists, the state slots the ranks save) and ``surge_version`` (the release that
committed it). A version committed before they were recorded is format 1: nothing of the
layout changed since (``tests/checkpoint/golden/`` keeps a version of each format this build
reads, and a test loads them). A load of a format outside :data:`READABLE` is refused in one
line naming both formats, both releases and what to do (:func:`refusal`); there is no
migration command: no format needs one yet.

Format history (add a line, a golden version and, for a format this build no longer reads,
the way to move such a checkpoint forward):

1. surge 0.1.0: ``surge.checkpoint.manifest/1``, ``surge.checkpoint.chunks/1``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

CHECKPOINT_FORMAT = 1  # what this build writes
READABLE = (1, 1)  # the oldest and newest format this build reads
UNRECORDED_FORMAT = 1  # a version whose manifest records none (committed before it was recorded)


@cache
def surge_version() -> str:
    """This build's release (the installed ``surge`` package's version; "unknown" without one)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("surge")
    except PackageNotFoundError:
        return "unknown"


def recorded(entry: dict[str, Any]) -> tuple[int, str]:
    """(format, release) a catalog entry or manifest records (a version older than the
    record: format 1, release "before 0.1.0's format record")."""
    return int(entry.get("checkpoint_format", UNRECORDED_FORMAT)), str(entry.get("surge_version", "unrecorded"))


def refusal(version: str, entry: dict[str, Any]) -> str:
    """Why this build cannot read ``version`` (its catalog entry ``entry``), in one line, or
    "" when it can: ``checkpoint J:3: format 2 (written by Surge 0.3.0) is newer than this
    Surge (0.1.0) reads (formats 1 to 1); load it with Surge 0.3.0 or newer``."""
    fmt, writer = recorded(entry)
    lo, hi = READABLE
    if lo <= fmt <= hi:
        return ""
    said = f"checkpoint {version}: format {fmt} (written by Surge {writer}) is"
    reads = f"this Surge ({surge_version()}) reads (formats {lo} to {hi})"
    if fmt > hi:
        return f"{said} newer than {reads}; load it with Surge {writer} or newer"
    return (
        f"{said} older than {reads}; load it with Surge {writer} (`surgectl export` there keeps its weights "
        "for a new job's init_from) or start the job from scratch"
    )
