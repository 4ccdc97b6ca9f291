"""The operator's tags and notes on a job (`surgectl tag`, `surgectl note`): labels for
comparing runs, in any state (an ended job's most of all). Tags live in the job's status,
journaled with it (a control restart keeps them); a note is an event of type "note" in the
job's log. Neither changes what the job does: nothing is commanded below L1-1.
(A part of ``Orchestrator``, see core.py.)
"""

from __future__ import annotations

import re
from typing import Any

from services.contract import Module, control_pb2
from services.control.orchestrator.refusals import BadAnnotation

ORCH = Module.L1_ORCHESTRATOR
TAG_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
TAG_VALUE_CHARS = 256
TAGS_MAX = 64
NOTE_CHARS = 2000


def check_annotation(msg: control_pb2.AnnotateJobRequest, tags: dict[str, str]) -> dict[str, str]:
    """The job's tags after ``msg`` (``tags``: its tags now), checked; raises BadAnnotation
    naming the field (nothing changed)."""
    for key, value in msg.set_tags.items():
        if not TAG_KEY.match(key):
            raise BadAnnotation(
                f"tag {key!r}: a key is 1-63 letters, digits, '_', '.' or '-', starting with one of the first two"
            )
        if not value.strip():  # (was: taken, a tag that says nothing; removing is --remove)
            raise BadAnnotation(f"tag {key}: an empty value (`surgectl tag JOB --remove {key}` removes a tag)")
        if len(value) > TAG_VALUE_CHARS or "\n" in value:
            raise BadAnnotation(f"tag {key}: a value is one line of at most {TAG_VALUE_CHARS} characters")
    if unknown := sorted(set(msg.remove_tags) - set(tags) - set(msg.set_tags)):
        raise BadAnnotation(
            f"tag {unknown[0]!r}: the job has no such tag to remove (its tags: {', '.join(sorted(tags)) or 'none'})"
        )
    if len(msg.note) > NOTE_CHARS or "\n" in msg.note.strip():
        raise BadAnnotation(f"note: one line of at most {NOTE_CHARS} characters")
    if not (msg.set_tags or msg.remove_tags or msg.note.strip()):
        raise BadAnnotation("annotate: give a tag to set or remove, or a note")
    after = {k: v for k, v in tags.items() if k not in msg.remove_tags}
    after.update(msg.set_tags)
    if len(after) > TAGS_MAX:
        raise BadAnnotation(f"tags: a job holds at most {TAGS_MAX} tags ({len(after)} asked)")
    return after


class Annotating:
    """``annotate_job_request``: a part of ``Orchestrator``."""

    def annotate_job_request(self, msg: control_pb2.AnnotateJobRequest, payload: Any = None) -> control_pb2.JobStatus:
        """Set and remove tags, and add a note. Answers the job's status with its tags.

        Raises:
            JobNotFound, BadAnnotation (a malformed key, value or note: one line naming it).
        """
        with self._lock:
            job = self._get(msg.job_id)
            after = check_annotation(msg, dict(job.status.tags))
            changed = after != dict(job.status.tags)
            if changed:
                job.status.tags.clear()
                job.status.tags.update(after)
                said = ", ".join(
                    [*(f"{k}={v}" for k, v in sorted(msg.set_tags.items())), *(f"-{k}" for k in msg.remove_tags)]
                )
                self._record(job, ORCH, "tags", f"tags: {said}")
            if note := msg.note.strip():
                self._record(job, ORCH, "note", note)
            return self._snapshot(job)
