"""Profiling on demand in the loop (issue 31 item 3): a ProfileSteps in force at a boundary
records a torch.profiler trace of the next N steps, hands the files to L5-2 and reports
ProfileRecorded; a profile the run outlasts ends with it; a second one while the first
records is answered with an error; none of them changes what the job trains."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import pytest
from rank_fakes import LocalRank, tiny_spec, torch_threads

from services.contract import engine_pb2

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def profiled(tmp_path: Path, steps: int, *commands: engine_pb2.ProfileSteps) -> LocalRank:
    rank = LocalRank(tiny_spec(steps=steps), tmp_path)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    for cmd in commands:
        rank.command(cmd)
    rank.run()
    assert rank.error is None, rank.error
    return rank


def test_a_profile_traces_the_steps_after_its_boundary_and_the_store_keeps_its_files(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # (where the profiler writes before the upload)
    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
    rank = profiled(tmp_path, 6, engine_pb2.ProfileSteps(job_id="job", steps=2, at_step=2, seq=1))
    [rec] = rank.up.of(engine_pb2.ProfileRecorded)
    assert (rec.seq, rec.rank, rec.first_step, rec.last_step, rec.error) == (1, 0, 3, 4, "")
    assert rec.seconds > 0 and rec.bytes > 0
    [name] = rec.files
    assert name.endswith("/profiles/cmd1/rank0.trace.json.gz")
    trace = json.loads(gzip.decompress(Path(name).read_bytes()))
    # The trace holds the steps' operators: the forward's matmuls at least.
    ops = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(op.startswith("aten::") and "mm" in op for op in ops), sorted(ops)[:20]
    assert {op for op in ops if op.startswith("ProfilerStep#")} == {"ProfilerStep#0", "ProfilerStep#1"}
    assert rank.store.profiles[0].seq == 1
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5, 6]  # (training went on through it)
    # The profiler's own scratch directory was used, and is gone.
    assert [Path(d).parent for d in made if "surge-profile-" in d] == [scratch]
    assert not list(scratch.glob("surge-profile-*"))


def test_a_profile_the_run_outlasts_ends_with_the_run(tmp_path):
    rank = profiled(tmp_path, 4, engine_pb2.ProfileSteps(job_id="job", steps=10, at_step=2, seq=1))
    [rec] = rank.up.of(engine_pb2.ProfileRecorded)
    assert (rec.first_step, rec.last_step, rec.error) == (3, 4, "")
    assert len(rec.files) == 1


def test_a_second_profile_while_the_first_records_is_refused_and_a_later_one_runs(tmp_path):
    rank = profiled(
        tmp_path,
        8,
        engine_pb2.ProfileSteps(job_id="job", steps=3, at_step=1, seq=1),  # steps 2-4
        engine_pb2.ProfileSteps(job_id="job", steps=1, at_step=2, seq=2),  # due at 2: the first records
        engine_pb2.ProfileSteps(job_id="job", steps=1, at_step=5, seq=3),  # step 6
    )
    recs = {r.seq: r for r in rank.up.of(engine_pb2.ProfileRecorded)}
    assert (recs[1].first_step, recs[1].last_step, recs[1].error) == (2, 4, "")
    assert recs[2].error == "profile #1 is still recording" and not recs[2].files
    assert (recs[2].first_step, recs[2].last_step) == (0, 0)
    assert (recs[3].first_step, recs[3].last_step, recs[3].error) == (6, 6, "")


def test_a_profile_that_fails_is_reported_and_training_goes_on(tmp_path):
    class Broken:
        def __init__(self, rank):
            pass

        def start(self):
            pass

        def step(self):
            pass

        def stop(self):
            raise OSError(28, "No space left on device")

        def discard(self):
            pass

    rank = LocalRank(tiny_spec(steps=5), tmp_path)
    rank.modules.loop._profiler_of = Broken  # (the composition root's factory, swapped for a failing one)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.command(engine_pb2.ProfileSteps(job_id="job", steps=1, at_step=1, seq=1))
    rank.run()
    assert rank.error is None
    [rec] = rank.up.of(engine_pb2.ProfileRecorded)
    assert rec.error == "OSError: [Errno 28] No space left on device" and not rec.files
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5]
    assert not rank.up.of(engine_pb2.TrainingLoopFailed)


class _Marker:
    """The loop's phase marker, recording what it is told (the export's declaration)."""

    def __init__(self):
        self.phase, self.total, self.calls = 0, 0, []

    def enter(self, phase, total=0):
        self.phase, self.total = phase, total

    def advance(self, units=1):
        pass

    def freeze(self):
        pass

    def thaw(self):
        pass

    def announce(self):
        self.calls.append(("announce", self.phase, self.total))
        return True


def test_the_export_is_declared_and_announced_before_it_starts(tmp_path):
    from services.common import phase as ph

    marker = _Marker()

    class Seen:
        def __init__(self, rank):
            pass

        def start(self):
            pass

        def step(self):
            pass

        def stop(self):
            marker.calls.append(("stop", marker.phase, marker.total))
            return {}, 0.1

        def discard(self):
            pass

    rank = LocalRank(tiny_spec(steps=6), tmp_path)
    rank.modules.loop._mark = marker
    rank.modules.loop._profiler_of = Seen
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.command(engine_pb2.ProfileSteps(job_id="job", steps=3, at_step=1, seq=1))
    rank.run()
    assert rank.error is None
    # Stated with its size (the detector's budget scales with the profiled steps), announced
    # by a beat, and only then stopped.
    assert marker.calls == [
        ("announce", ph.PROFILE_EXPORT, 3),
        ("stop", ph.PROFILE_EXPORT, 3),
    ]


def test_an_export_over_its_budget_is_a_failed_profile_and_training_goes_on(tmp_path):
    from services.engine.step_profiler import StepProfiler

    rank = LocalRank(tiny_spec(steps=5), tmp_path)
    rank.modules.loop._profiler_of = lambda r: StepProfiler(r, "cpu", export_budget_s=lambda seconds: 0.0)
    rank.command(engine_pb2.StartTraining(job_id="job"))
    rank.command(engine_pb2.ProfileSteps(job_id="job", steps=1, at_step=1, seq=1))
    rank.run()
    assert rank.error is None
    [rec] = rank.up.of(engine_pb2.ProfileRecorded)
    assert rec.error.startswith("ProfileExportOverran: its export took ") and "over its budget of 0.0 s" in rec.error
    assert not rec.files and not rank.store.profiles
    assert [s.step for s in rank.steps()] == [1, 2, 3, 4, 5]
    assert not rank.up.of(engine_pb2.TrainingLoopFailed)


def test_the_composition_root_bounds_the_export_with_the_jobs_budget(tmp_path):
    rank = LocalRank(tiny_spec(steps=2), tmp_path)
    profiler = rank.modules.loop._profiler_of(0)
    try:
        live = rank.spec.liveness
        # 2 s of profiled steps: the base and stall_step_factor x 2 s, as the detector allows.
        assert profiler._budget_of(2.0) == live.phase_seconds.profile_export + live.stall_step_factor * 2.0
    finally:
        profiler.discard()


def test_a_phase_is_announced_once_a_beat_stated_it_and_not_by_an_older_beat():
    import threading
    import time

    from services.common import phase as ph

    marker = ph.PhaseMarker()
    marker.stated_every(0.1)  # (waits 3 beat periods)
    marker.stated(ph.FORWARD, time.monotonic())  # (an older phase's beat)
    marker.enter(ph.PROFILE_EXPORT, total=3)
    t0 = time.monotonic()
    assert marker.announce() is False  # no beat stated it
    assert time.monotonic() - t0 >= 0.3

    def beat_later():
        time.sleep(0.2)
        marker.stated(*marker.read()[:1], marker.since)

    threading.Thread(target=beat_later, daemon=True).start()
    marker.stated_every(2.0)
    t0 = time.monotonic()
    assert marker.announce() is True
    assert 0.2 + ph.ANNOUNCE_GRACE_S <= time.monotonic() - t0 < 2.0
    # A beat that read the old phase with the new start (enter's stores in between) is no
    # announcement of the new phase.
    marker.enter(ph.DATA_WAIT)
    marker.stated(ph.PROFILE_EXPORT, marker.since)
    marker.stated_every(0.05)
    assert marker.announce() is False
