"""`surgectl events --type/--tail` and `status --watch` (issue 31 item 7): the event types the
filter knows are every type control records; a bad type is one line; a relative
``init_from.hf`` is submitted absolute (no scratch path hard-coded in the examples)."""

from __future__ import annotations

import ast
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from services.cli.errors import CliError
from services.cli.event_types import EVENT_TYPES, event_types
from services.cli.spec_tools import load_spec
from services.contract import control_pb2, control_pb2_grpc

from .test_housekeeping import run_cli

REPO = Path(__file__).resolve().parents[2]
JobState = control_pb2.JobState


def _recorded_types() -> dict[str, str]:
    """Every literal event type control's orchestrator records (``_record(job, source,
    TYPE, ...)``, both arms of a conditional one), with where."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "services" / "control").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "_record" or len(node.args) < 3:
                continue
            arg = node.args[2]
            for value in (arg.body, arg.orelse) if isinstance(arg, ast.IfExp) else (arg,):
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.setdefault(value.value, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_event_type_control_records_can_be_asked_for():
    recorded = _recorded_types()
    assert {"state", "fault", "decision", "checkpoint"} <= set(recorded)  # (the scan finds them)
    unlisted = {t: where for t, where in recorded.items() if t not in EVENT_TYPES}
    assert unlisted == {}, f"add these to services/cli/event_types.py EVENT_TYPES: {unlisted}"


def test_the_readme_lists_every_event_type_the_filter_knows():
    (row,) = [
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `surgectl events JOB")
    ]
    listed = row.split("keeps those types (", 1)[1].split(";", 1)[0]
    assert [t.strip().strip("`") for t in listed.split(",")] == list(EVENT_TYPES)


@pytest.mark.parametrize(
    ("values", "wanted"),
    [([], set()), (["fault"], {"fault"}), (["fault,decision", " state "], {"fault", "decision", "state"})],
)
def test_types_are_repeated_or_comma_separated(values, wanted):
    assert event_types(values) == wanted


def test_an_unknown_type_is_one_line_naming_the_known_ones():
    with pytest.raises(CliError) as e:
        event_types(["faults"])
    assert e.value.code == 2 and str(e.value).startswith("--type: unknown event type faults (one of: state, ")


SPEC = """\
name: ft
steps: 3
init_from: {hf: HF}
model: {n_layers: 2, d_model: 64, n_heads: 2, vocab_size: 256}
data: {dataset: tiny@v1, seq_len: 16, micro_batch_size: 1}
"""


@pytest.mark.parametrize("overridden", [False, True])
def test_a_relative_init_from_hf_is_submitted_absolute_against_the_current_directory(tmp_path, monkeypatch, overridden):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "ft.yaml"
    path.write_text(SPEC.replace("HF", "/abs/model" if overridden else "exports/m"))
    overrides = ["init_from.hf=exports/m"] if overridden else []
    spec, text, _ = load_spec(path, overrides)  # (the directory's config.json is read at submit)
    assert spec.init_from.hf == str(tmp_path / "exports" / "m") and str(tmp_path) in text


def test_an_absolute_init_from_hf_keeps_the_files_own_text(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text("# mine\n" + SPEC.replace("HF", "/abs/model"))
    spec, text, _ = load_spec(path)
    assert spec.init_from.hf == "/abs/model" and text.startswith("# mine\n")


class Control(control_pb2_grpc.ControlServiceServicer):
    """Control's job queries over real gRPC: job "j", 10 events (seq 1-10; 3, 6 and 9 faults,
    the rest steps), a follow then gets event 11 (a fault) and 12 (the job's end, a state
    event); WatchJob selects as control's journal does and records each query."""

    def __init__(self):
        self.queries: list[control_pb2.JobQuery] = []
        self.history = [
            control_pb2.JobEvent(job_id="j", seq=n, type="fault" if n % 3 == 0 else "step", message=f"e{n}")
            for n in range(1, 11)
        ]
        self.live = [
            control_pb2.JobEvent(job_id="j", seq=11, type="fault", message="e11"),
            control_pb2.JobEvent(
                job_id="j", seq=12, type="state", message="e12", status=control_pb2.JobStatus(state=JobState.TERMINATED)
            ),
        ]

    def ListJobs(self, request, context):  # noqa: N802
        return control_pb2.JobList(jobs=[control_pb2.JobStatus(job_id="j", state=JobState.RUNNING)])

    def GetJob(self, request, context):  # noqa: N802
        return control_pb2.JobStatus(job_id="j", state=JobState.RUNNING)

    def WatchJob(self, request, context):  # noqa: N802
        self.queries.append(control_pb2.JobQuery.FromString(request.SerializeToString()))
        kept = [
            ev
            for ev in self.history + (self.live if request.follow else [])
            if ev.seq >= request.from_seq and (not request.types or ev.type in request.types)
        ]
        if request.tail and not request.follow:
            kept = kept[-request.tail :]
        yield from kept


@pytest.fixture
def control(surge_home, monkeypatch):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = Control()
    control_pb2_grpc.add_ControlServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    monkeypatch.setenv("SURGE_CONTROL_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv("COLUMNS", "200")
    yield servicer
    server.stop(0)


def printed(out: str) -> list[int]:
    return [int(line.split()[0]) for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("args", "asked", "shown"),
    [
        (["--tail", "2"], [(0, 2, [], False)], [9, 10]),
        (["--tail", "2", "--type", "fault"], [(0, 2, ["fault"], False)], [6, 9]),
        (["--type", "fault,step", "--tail", "50"], [(0, 50, ["fault", "step"], False)], list(range(1, 11))),
        (["--type", "fault"], [(0, 0, ["fault"], False)], [3, 6, 9]),
        ([], [(0, 0, [], False)], list(range(1, 11))),  # no tail, no type: the whole history, as before
        (["--tail", "0"], [(0, 1, [], False)], []),  # none printed (the newest asked: where the log ends)
        (["--tail", "1", "--type", "fault", "--follow"], [(0, 1, ["fault"], False), (10, 0, ["fault"], True)], [9, 11]),
        (["--tail", "0", "--type", "fault", "-f"], [(0, 1, [], False), (11, 0, ["fault"], True)], [11]),
        (["--tail", "3", "--type", "state", "-f"], [(0, 3, ["state"], False), (0, 0, ["state"], True)], [12]),
        (["--type", "fault", "--follow"], [(0, 0, ["fault"], True)], [3, 6, 9, 11]),
    ],
)
def test_events_tail_and_type_ask_control_for_exactly_that(control, monkeypatch, capsys, args, asked, shown):
    code, out, err = run_cli(["events", "j", *args], monkeypatch, capsys)
    assert code == 0, err
    assert [(q.from_seq, q.tail, list(q.types), q.follow) for q in control.queries] == asked
    assert printed(out) == shown


@pytest.mark.parametrize("values", [[""], [" , "], ["fault", ""]])
def test_an_empty_type_is_refused_not_read_as_every_type(values):
    with pytest.raises(CliError) as e:
        event_types(values)
    assert e.value.code == 2 and str(e.value).startswith("--type: empty")


def test_timestamps_begin_each_line_with_the_events_utc_time(control, monkeypatch, capsys):
    """`events` printed no times (the dashboard does; the CLI only in -o json): a new user's trial.
    --timestamps / -T, as `kubectl logs --timestamps`."""
    for n, ev in enumerate(control.history):
        ev.unix_time = 1_796_000_000.25 + 60 * n  # 2026-11-30T00:53:20.250Z on
    code, out, err = run_cli(["events", "j", "--tail", "2", "-T"], monkeypatch, capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == ["2026-11-30T01:01:20.250Z", "2026-11-30T01:02:20.250Z"]
    assert [int(line.split()[1]) for line in lines] == [9, 10]
    code, out, err = run_cli(["events", "j", "--tail", "2"], monkeypatch, capsys)  # (without: as before)
    assert code == 0 and printed(out) == [9, 10]
