"""Control-side fault hooks for tests, installed by control's composition root; off unless
``SURGE_CONTROL_FAULT_INJECT`` is set::

    SURGE_CONTROL_FAULT_INJECT="<job name>:journal_create[,...]"

``journal_create``: the journal refuses to record a new job of that name (``OSError``, as a
full disk would), after its ranks were allocated and launched: a submit that fails half-way
(tests/control/test_submit_atomic.py, tests/cli/test_operator_actions.py).
"""

from __future__ import annotations

import os

from services.contract import control_pb2
from services.control.job_store import JobStore

ENV = "SURGE_CONTROL_FAULT_INJECT"


def install(journal: JobStore, spec: str | None = None) -> JobStore:
    """``journal`` with the injections of ``spec`` (default: the environment) applied."""
    spec = os.environ.get(ENV, "") if spec is None else spec
    refused = {item.split(":", 1)[0] for item in spec.split(",") if item.strip().endswith(":journal_create")}
    if refused:
        create = journal.create_job

        def create_job(status: control_pb2.JobStatus, spec_json: str) -> None:
            if status.name in refused:
                raise OSError(f"journal write refused ({ENV}: {status.name}:journal_create)")
            create(status, spec_json)

        journal.create_job = create_job  # type: ignore[method-assign]
    return journal
