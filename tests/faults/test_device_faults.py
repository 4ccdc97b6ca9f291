"""GPU health and `stop` while starting, on the real stack (issue 26 item 5).

One stack (control, store, data, two node agents, ranks as real processes) serves the module.
The node agents sample their "GPUs" through a stand-in NVML library (tests/worker/fake_nvml,
put on their PYTHONPATH: the one boundary a machine without a GPU cannot have), whose state
the test writes per agent process; what follows is the real chain: the agent's sampler, its
session, L1-2 / L1-3 on control, L1-1's decision, the relaunch. Every process the stack
started is killed by PID at the end.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from services.contract import control_pb2
from services.rank.faults import lift_pace
from tests.conftest import REPO
from tests.faults.test_recovery import causes, finished, of_type, running_stack, spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JobState, JobOutcome = control_pb2.JobState, control_pb2.JobOutcome
GIB = 1 << 30
FAKE_NVML = REPO / "tests" / "worker" / "fake_nvml"
HEALTHY = {"devices": [{"total": 80 * GIB, "used": 1 * GIB}], "xids": []}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("surge-devices")
    nvml = home / "nvml"
    nvml.mkdir()
    (nvml / "default.json").write_text(json.dumps(HEALTHY))
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), str(FAKE_NVML)]),
        "FAKE_NVML_DIR": str(nvml),
        "SURGE_WORKER_GPU_CHECK_SECONDS": "0.2",
        # tecc's rank waits before step 5 (every incarnation) until the test lifts the pace once
        # the fault is in: the job is still training when the sampler reports, whatever the load.
        "SURGE_FAULT_INJECT": "tecc:slow_steps@5:rank=0:seconds=90",
    }
    with running_stack(home, ("json", "email"), ("tstart", "tecc"), env=env) as s:
        s.nvml = nvml
        yield s


def agent_pid(stack, worker: str) -> int:
    return json.loads((stack.home / "run" / "stack.json").read_text())["services"][worker]["pid"]


def gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def test_stop_ends_ranks_that_are_still_starting(stack):
    job = stack.submit(spec("tstart", steps=20))
    assert stack.status(job).state == JobState.WARMING_UP
    deadline = time.monotonic() + 30
    while not (pids := stack.rank_pids(job, 0)):  # launched: importing torch, not ready yet
        assert time.monotonic() < deadline, "the rank process never started"
        time.sleep(0.02)
    stopped = stack.stub.StopJob(control_pb2.StopJobRequest(job_id=job))
    stopped_at = time.monotonic()
    assert (stopped.state, stopped.outcome) == (JobState.TERMINATED, JobOutcome.STOPPED)
    assert gone_within(pids, 5.0), f"rank processes {pids} still run 5 s after the stop"
    print(f"stop while starting: rank gone {time.monotonic() - stopped_at:.2f} s after the stop")
    events = stack.events(job)
    assert not [m for m in of_type(events, "rank") if " ready at step " in m], "the rank was ready: not a start"
    assert of_type(events, "state")[-1] == (
        "WARMING_UP -> TERMINATED: STOPPED: stopped by the operator; its ranks were still starting "
        "(killed; nothing trained since they launched)"
    )


def test_an_uncorrectable_ecc_error_excludes_the_node_and_memory_pressure_reaches_l1_2(stack):
    # (held before step 5 until the fault is in: still training when the sampler, every 0.2 s,
    # reports; 40 steps at 10-70 ms a step on a loaded host were done in a second or two)
    job = stack.submit(spec("tecc", steps=40, every=4).replace("dp: 2", "dp: 1"))
    stack.wait_step(job, 3)
    try:
        placed = next(iter(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job), timeout=30))).message
        worker = placed.split(" allocated on ")[1].split(";")[0]  # "1 ranks allocated on worker-N; ..."
        bad = {"devices": [{"total": 80 * GIB, "used": 78 * GIB, "ecc_uncorrected": 1}], "xids": []}
        (stack.nvml / f"{agent_pid(stack, worker)}.json").write_text(json.dumps(bad))
        deadline = time.monotonic() + 60
        while not causes(so_far := list(stack.stub.WatchJob(control_pb2.JobQuery(job_id=job), timeout=30)), "SEVERE"):
            assert time.monotonic() < deadline, [e.message for e in so_far[-12:]]
            time.sleep(0.1)
    finally:
        lift_pace(stack.home / "run" / "faults", job)  # (the relaunched rank trains at its own speed)
    events = stack.events(job)
    assert f"memory pressure on {worker} cuda:0: 2.0 GiB of 80.0 GiB available" in of_type(events, "resource")
    (fault,) = causes(events, "SEVERE device_error")
    assert fault.message == (
        f"SEVERE device_error: device 0 of {worker}: uncorrectable ECC errors: 1 since the driver loaded"
    )
    decisions = of_type(events, "decision")[1:]
    assert decisions[0] == (
        f"exclude_node after device_error of rank 0 on {worker} (restart 1 of 3 for device_error); excluding {worker}"
    )
    (relaunch,) = [m for m in of_type(events, "recovery") if m.startswith("ranks killed and relaunched")]
    assert relaunch.startswith("ranks killed and relaunched on worker-")
    assert worker not in relaunch.split(" (rendezvous")[0], relaunch
    finished(events)
