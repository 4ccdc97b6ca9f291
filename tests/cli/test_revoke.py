"""`surgectl revoke JOB CLASS` against the real `python -m services.control` over loopback gRPC,
with a node agent written as a real gRPC client of WorkerSession (tests/control): the
operator's command withdraws a standing order, and control sends every rank
RevokeStandingOrder at a boundary none has passed. Refusals are one line and a non-zero exit.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from services.contract import engine_pb2
from services.control.fault_decision import STEP_FAULT_KIND, standing_orders
from services.jobspec import STEP_FAULT_CLASSES, FaultPolicySpec
from tests.control.test_control_service import (  # noqa: F401 (fixtures)
    agents,
    running_watch,
    start_control,
    submit,
)
from tests.faults.test_recovery import SURGECTL

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def surgectl(address: str, home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SURGE_HOME": str(home), "SURGE_CONTROL_ADDRESS": address}
    return subprocess.run([*SURGECTL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def revokes(agent) -> list[engine_pb2.RevokeStandingOrder]:
    out = []
    for cmd in list(agent.commands):
        if cmd.WhichOneof("command") == "routed" and cmd.routed.type == "surge.v1.RevokeStandingOrder":
            out.append(engine_pb2.RevokeStandingOrder.FromString(cmd.routed.body))
    return out


def test_revoke_withdraws_a_standing_order_at_a_boundary_and_refuses_in_one_line(start_control, agents, tmp_path):  # noqa: F811
    control = start_control()
    agent = agents(control.address, "wa", finish=False)  # 3 steps, then the ranks stay RUNNING
    job_id = submit(control, dp=1, steps=50).job_id
    running_watch(control, job_id).cancel()
    # The default policy skips gradient_overflow steps: a standing order the ranks hold.
    (order,) = [o for o in standing_orders(FaultPolicySpec()) if o.kind == STEP_FAULT_KIND["gradient_overflow"]]

    done = surgectl(control.address, tmp_path, "revoke", job_id, "gradient_overflow")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"{job_id}: standing order for gradient_overflow withdrawn")
    deadline = time.monotonic() + 10
    while not revokes(agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    (sent,) = revokes(agent)
    assert (sent.job_id, sent.order) == (job_id, order.id)
    assert sent.seq >= 1  # numbered: it takes effect at the boundary every rank agrees on

    # Again: the same boundary, not a second command (journaled, idempotent).
    assert surgectl(control.address, tmp_path, "revoke", job_id, "gradient_overflow").returncode == 0
    time.sleep(0.3)
    assert len(revokes(agent)) == 1

    # A class the job holds no order for: one line naming what it holds, a non-zero exit.
    refused = surgectl(control.address, tmp_path, "revoke", job_id, "non_finite_loss")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "holds no standing order" in refused.stderr and "gradient_overflow (withdrawn)" in refused.stderr
    assert "FAILURE_" not in refused.stderr  # a refusal, not a failure of L1-1 ...
    status = surgectl(control.address, tmp_path, "status", job_id)
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout  # ... that ends the job
    typo = surgectl(control.address, tmp_path, "revoke", job_id, "gradient_overflw")  # (bad input: exit 2)
    assert typo.returncode == 2 and typo.stderr.strip().splitlines() == [
        "error: fault_class 'gradient_overflw': not a step fault class; one of " + ", ".join(STEP_FAULT_CLASSES)
    ], typo.stderr
    unknown = surgectl(control.address, tmp_path, "revoke", "no-such-job", "gradient_overflow")
    assert unknown.returncode != 0 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert len(revokes(agent)) == 1


def test_revoke_help_names_its_arguments():
    env = {**os.environ, "COLUMNS": "200"}
    shown = subprocess.run(
        [*SURGECTL, "revoke", "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    assert "revoke [OPTIONS] {job} {fault_class}" in text
    assert "Withdraw a running job's standing order for a class of step faults" in text
