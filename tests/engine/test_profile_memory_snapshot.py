"""The CUDA memory snapshot of a profile (issue 31 item 3), its logic tested on CPU: torch's CUDA
memory history is replaced by a recorder (the profiler itself runs for real, its CUDA activity
disabled by torch on a machine without one), so what is checked is the order and pairing of the
calls a GPU run makes (bench/gpu.sh runs the real thing): the history starts before the trace, the
snapshot is dumped after it, and the history is switched off whatever happens (a history left on
records every later allocation of the run)."""

from __future__ import annotations

import pickle

import pytest
import torch

from services.engine.step_profiler import MEMORY_HISTORY_ENTRIES, StepProfiler

pytestmark = pytest.mark.timeout(120)


class FakeMemoryHistory:
    """torch.cuda.memory's history calls, recorded with whether the profiler was running."""

    def __init__(self, dump_fails: bool = False):
        self.calls: list[tuple[str, object, bool]] = []
        self.dump_fails = dump_fails

    def record(self, enabled="all", *, max_entries=None, **_):
        state = None if enabled is None else max_entries
        self.calls.append(("history", state, torch.autograd._profiler_enabled()))

    def dump(self, path: str) -> None:
        self.calls.append(("dump", path, torch.autograd._profiler_enabled()))
        if self.dump_fails:
            raise RuntimeError("dump failed")
        with open(path, "wb") as f:
            pickle.dump({"segments": [], "device_traces": [[]]}, f)

    @property
    def on(self) -> bool:
        states = [state for kind, state, _ in self.calls if kind == "history"]
        return bool(states) and states[-1] is not None


@pytest.fixture
def history(monkeypatch):
    fake = FakeMemoryHistory()
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump)
    return fake


def on_a_gpu_machine(rank: int, device: str) -> StepProfiler:
    """A profiler built where CUDA is available (only while it is built: torch's own profiler and
    allocator must still see this machine as it is)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        return StepProfiler(rank, device)


def steps(profiler: StepProfiler, n: int) -> None:
    x = torch.randn(16, 16)
    for _ in range(n):
        (x @ x).sum()
        profiler.step()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_cuda_rank_dumps_the_memory_snapshot_of_the_traced_steps_then_stops_the_history(history):
    profiler = on_a_gpu_machine(3, "cuda:1")
    profiler.start()
    steps(profiler, 2)
    files, seconds = profiler.stop()
    try:
        assert sorted(files) == ["rank3.memory.pickle", "rank3.trace.json.gz"]
        assert seconds > 0
        assert pickle.loads(files["rank3.memory.pickle"].read_bytes())["segments"] == []
        # On before the trace started (the snapshot covers the same steps), dumped once the trace
        # stopped, then off.
        assert history.calls == [
            ("history", MEMORY_HISTORY_ENTRIES, False),
            ("dump", str(files["rank3.memory.pickle"]), False),
            ("history", None, False),
        ]
    finally:
        profiler.discard()
    assert not files["rank3.memory.pickle"].exists()


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_failed_snapshot_fails_the_profile_and_still_stops_the_history(history):
    history.dump_fails = True
    profiler = on_a_gpu_machine(0, "cuda")
    profiler.start()
    steps(profiler, 1)
    with pytest.raises(RuntimeError, match="dump failed"):
        profiler.stop()
    profiler.discard()
    assert not history.on
    assert [kind for kind, *_ in history.calls] == ["history", "dump", "history"]


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_profile_the_run_outlasts_stops_the_history_when_discarded(history):
    profiler = on_a_gpu_machine(0, "cuda:0")
    profiler.start()
    steps(profiler, 1)
    assert history.on
    profiler.discard()
    assert not history.on


def test_a_cpu_rank_never_touches_the_cuda_memory_history_even_on_a_machine_with_a_gpu(history):
    profiler = on_a_gpu_machine(0, "cpu")
    profiler.start()
    steps(profiler, 1)
    files, _ = profiler.stop()
    profiler.discard()
    assert sorted(files) == ["rank0.trace.json.gz"]
    assert history.calls == []
