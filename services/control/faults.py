"""Control-side fault hooks for tests, installed by control's composition root; off unless
``SURGE_CONTROL_FAULT_INJECT`` is set::

    SURGE_CONTROL_FAULT_INJECT="<job name>:<kind>[,...]"

kinds: ``journal_create`` (the journal refuses to record a new job of that name: before
anything is allocated) and ``journal_record`` (it refuses the job's first event, the
allocation: after its ranks were launched), both as ``OSError``, as a full disk would: a
submit that fails half-way (tests/control/test_submit_atomic.py,
tests/cli/test_operator_actions.py).
"""

from __future__ import annotations

import os
from typing import Any

from services.contract import control_pb2
from services.control.job_store import JobStore

ENV = "SURGE_CONTROL_FAULT_INJECT"


def install(journal: JobStore, spec: str | None = None) -> JobStore:
    """``journal`` with the injections of ``spec`` (default: the environment) applied."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    kinds: dict[str, set[str]] = {}
    for item in spec.split(","):
        name, _, kind = item.strip().partition(":")
        if name and kind in ("journal_create", "journal_record"):
            kinds.setdefault(kind, set()).add(name)
    if kinds.get("journal_create"):
        create, refused = journal.create_job, kinds["journal_create"]

        def create_job(status: control_pb2.JobStatus, spec_json: str, *request: str) -> None:
            if status.name in refused:
                raise OSError(f"journal write refused ({ENV}: {status.name}:journal_create)")
            create(status, spec_json, *request)

        journal.create_job = create_job  # type: ignore[method-assign]
    if kinds.get("journal_record"):
        save, refused_events = journal.save_status, kinds["journal_record"]

        def save_status(status: control_pb2.JobStatus, event=None, runtime=None, spec_json=None, **how: Any) -> Any:
            if event is not None and status.name in refused_events:
                raise OSError(f"journal write refused ({ENV}: {status.name}:journal_record)")
            return save(status, event, runtime, spec_json=spec_json, **how)

        journal.save_status = save_status  # type: ignore[method-assign]
    return journal
