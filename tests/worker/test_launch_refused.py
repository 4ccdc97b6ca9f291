"""A rank its node agent cannot start (an evaluation job's command missing on the node, an
executable that does not exist) is refused at the launch with a typed cause
(``RankExited.cause == EXIT_NOT_STARTED``), not found late (after the queue wait, the load and
the export) as untyped text; L1-3 grades it ``rank_not_started`` (FATAL) and L1-1 stops the job
FAILED without spending a restart (services/worker/launch_check.py)."""

from __future__ import annotations

import json
import sys

import pytest
import structlog

from services.contract import Module, control_pb2, engine_pb2
from services.contract.bus import Bus
from services.control.fault_decision import JobView, decide
from services.control.fault_detector import FaultDetector
from services.jobspec import FaultPolicySpec
from services.worker import rank_launcher
from services.worker.node_agent import NodeAgent

pytestmark = pytest.mark.timeout(60)


def launched(tmp_path, spec: dict, rank_module: str = "tests.worker.fake_rank") -> list[control_pb2.RankExited]:
    """The RankExited events of a one-rank launch of ``spec`` (none for a rank that started:
    it is killed at once)."""
    events: list[control_pb2.WorkerEvent] = []
    agent = NodeAgent("w1", "127.0.0.1:1", tmp_path, emit=events.append, log=structlog.get_logger(),
                      rank_module=rank_module)  # fmt: skip
    launch = control_pb2.LaunchRanks(
        job_id="j",
        init=engine_pb2.InitJob(job_id="j", spec_json=json.dumps(spec)),
        ranks=[engine_pb2.RankAssignment(rank=0, world_size=1, device="cpu", generation=3)],
    )
    agent.launch_ranks(launch)
    started = [r for r in agent._ranks.values()]
    for r in started:  # (a rank that started: ended by its PID)
        rank_launcher.signal_group(r.proc.pid, 9)
        r.exited.wait(10)
    return [e.rank_exited for e in events if e.HasField("rank_exited") and not started]


@pytest.mark.parametrize(
    "program, why",
    [
        ("/nonexistent/eval", "evaluation command `/nonexistent/eval`: no such file on this node"),
        ("no-such-eval-program-x7", "evaluation command `no-such-eval-program-x7`: not found on this node's PATH"),
        ("{tmp}/scores.txt", "evaluation command `{tmp}/scores.txt`: not executable"),
    ],
)
def test_an_evaluation_command_missing_on_the_node_is_refused_at_launch_with_a_typed_cause(tmp_path, program, why):
    (tmp_path / "scores.txt").write_text("a file, mode 0644\n")
    (tmp_path / "scores.txt").chmod(0o644)
    program, why = program.format(tmp=tmp_path), why.format(tmp=tmp_path)
    got = launched(
        tmp_path, {"name": "eval-x", "evaluation": {"source_job": "x", "version": "x:1", "command": [program]}}
    )
    assert [(e.rank, e.exit_code, e.cause, e.generation, e.detail) for e in got] == [
        (0, 127, control_pb2.EXIT_NOT_STARTED, 3, f"launch refused: {why}")
    ]


def test_an_evaluation_command_found_on_the_node_starts_the_rank(tmp_path):
    spec = {"name": "eval-x", "evaluation": {"source_job": "x", "version": "x:1", "command": [sys.executable, "-V"]}}
    assert launched(tmp_path, spec) == []
    spec["evaluation"]["command"] = ["$SURGE_EVAL_HF_DIR/run"]  # (known only to the rank: left to it)
    assert launched(tmp_path, spec) == []


def test_a_rank_whose_executable_does_not_exist_is_not_started_and_a_host_short_of_processes_is_a_plain_exit(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(rank_launcher, "rank_command_line", lambda *a: ["/nonexistent/python", "-m", "x"])
    missing = launched(tmp_path, {"name": "j"}, rank_module="not.the.agents.module")  # (no fork server: a spawn)
    assert [(e.exit_code, e.cause) for e in missing] == [(127, control_pb2.EXIT_NOT_STARTED)]
    assert missing[0].detail.startswith("spawn failed: [Errno 2]")

    def short_of_processes(*a, **kw):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(rank_launcher.subprocess, "Popen", short_of_processes)
    again = launched(tmp_path, {"name": "j"}, rank_module="not.the.agents.module")
    assert [(e.exit_code, e.cause) for e in again] == [(127, control_pb2.EXIT_ERROR)]


def test_a_rank_not_started_is_graded_fatal_and_stops_the_job_failed_without_a_restart():
    bus = Bus()
    detector = FaultDetector(emit=bus.emitter(Module.L1_FAULT_DETECTOR))
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.RankExited, detector.on_rank_exited)
    bus.subscribe(Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring, detector.start_fault_monitoring)
    reports: list[control_pb2.FaultReport] = []
    bus.subscribe(Module.L1_ORCHESTRATOR, control_pb2.FaultReport, lambda m, p=None: reports.append(m))
    bus.command(Module.L1_ORCHESTRATOR, Module.L1_FAULT_DETECTOR, control_pb2.StartFaultMonitoring(job_id="j"))
    detail = "launch refused: evaluation command `/nonexistent/eval`: no such file on this node"
    bus.publish(Module.EXT_HARDWARE, control_pb2.RankExited(
        job_id="j", rank=0, exit_code=127, worker_id="w", detail=detail, cause=control_pb2.EXIT_NOT_STARTED,
    ))  # fmt: skip
    assert [(r.fault_class, control_pb2.FaultGrade.Name(r.grade)) for r in reports] == [("rank_not_started", "FATAL")]
    decision = decide(FaultPolicySpec(), JobView(restarts={}, ignored={}), reports[0])
    assert (decision.action, decision.outcome, decision.restart) == ("stop", control_pb2.JobOutcome.FAILED, 0)
    assert detail in decision.final
