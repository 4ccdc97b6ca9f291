"""Resume at another data-parallel size, exactly: real `data` and `store` services, real
rank processes over gloo, the test as node agent and orchestrator (tests/checkpoint/harness.py).

Exactness, defined: the global batch of step s (micro_batch_size x grad_accum x dp rows) is
the same rows whatever the split, because every rank's stream reads the one global order and
the packer deals rows slot by slot (services/data/batch_packer.py; row-level equality is
tests/data/test_stream.py's); the checkpoint holds one global data position; model and
optimizer reshard through DCP. So a job checkpointed at dp 2 and resumed at dp 1 (grad_accum
2) or dp 4 (micro_batch_size 1), DDP or FSDP2, takes the same global batches as the
uninterrupted run: the same token count every step, the same losses (fp32, CPU) to 1e-5, and
the same data position in the version it commits at the end. A resume that would change the
sample sequence (here: the global batch) is refused with one line naming the field.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from services.data.prepare import prepare_dataset
from services.jobspec import JobSpec

from .harness import Cluster, Processes, full_state, start_data, start_store, versions_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STEPS, AT = 8, 4  # checkpoint at step 4, resume from it
RTOL = 1e-5


def spec(dp: int, micro_batch_size: int, grad_accum: int = 1, data_parallel: str = "ddp") -> JobSpec:
    """1 layer, d_model 32, seq 32, fp32; the global batch is micro_batch_size x grad_accum x dp rows."""
    return JobSpec.model_validate({
        "name": "reshard", "steps": STEPS, "seed": 3,
        "model": {"n_layers": 1, "d_model": 32, "n_heads": 2},
        "data": {"dataset": "tiny@v1", "seq_len": 32, "micro_batch_size": micro_batch_size, "grad_accum": grad_accum,
                 "shuffle_seed": 11, "prefetch": {"watermark": 8, "threads": 1}},
        "parallel": {"dp": dp, "data_parallel": data_parallel},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "checkpoint": {"every_steps": AT, "keep_last": 0, "at_end": True},
        "eval": {"every_steps": 0, "at_end": False, "batches": 1},
    })  # fmt: skip


def corpus(directory: Path) -> Path:
    """8 small Python-like files: an epoch is a few steps of 4 rows, so the run crosses epochs."""
    rng = random.Random(9)
    for i in range(8):
        lines = [f"def g{i}_{j}(y):\n    return y + {rng.randint(2, 99)}\n" for j in range(rng.randint(1, 3))]
        (directory / f"n{i:02d}.py").write_text("".join(lines))
    return directory


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("reshard")
    src = home / "src"
    src.mkdir()
    prepare_dataset(corpus(src), "tiny", "v1", home / "datasets", val_fraction=0.1)
    procs = Processes(home / "logs")
    try:
        _, data = start_data(procs, home / "datasets")
        _, store = start_store(procs, home / "store")
        c = Cluster(procs, data, store)
        c.home = home
        yield c
        c.close()
    finally:
        procs.close()


@pytest.fixture(scope="module")
def straight(cluster):
    """The uninterrupted runs at dp 2: DDP and FSDP2 (its checkpoint resumes under DDP)."""
    runs = {}
    for name, wrapper in (("ddp2", "ddp"), ("fsdp2", "fsdp2")):
        out = cluster.run(name, spec(2, 2, data_parallel=wrapper))
        assert out.finished and not out.failed, out.failed
        assert sorted(out.losses) == list(range(1, STEPS + 1)) and sorted(out.saved) == [AT, STEPS]
        runs[name] = out
    assert len(set(runs["ddp2"].epochs.values())) > 1  # the steps cross an epoch's end
    return runs


def close(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.mark.parametrize(
    "name, source, new",
    [
        ("dp2_to_dp1_accum2", "ddp2", spec(1, 2, grad_accum=2)),
        ("dp2_to_dp4", "ddp2", spec(4, 1)),
        ("fsdp2_dp2_to_ddp_dp4", "fsdp2", spec(4, 1, data_parallel="ddp")),
    ],
)
def test_a_dp2_checkpoint_resumes_at_another_dp_on_the_same_global_batches(cluster, straight, name, source, new):
    ref = straight["ddp2"]
    base = straight[source]
    assert close(base.losses, ref.losses) <= RTOL  # FSDP2 and DDP train alike (bit for bit, in fact)
    out = cluster.run(name, new, resume=base.saved[AT])
    assert out.finished and not out.failed, out.failed
    assert out.start_step == AT and sorted(out.losses) == list(range(AT + 1, STEPS + 1))
    later = {s: ref.losses[s] for s in out.losses}
    assert {s: ref.tokens[s] for s in out.tokens} == out.tokens  # the same rows: the same label counts
    worst = close(out.losses, later)
    print(f"{name}: max relative loss difference {worst:.2e} over steps {AT + 1}..{STEPS}")
    assert worst <= RTOL
    # The version the resumed job commits at the end stands where the uninterrupted run's does.
    (theirs,) = [v for v in versions_of(cluster.store_address, "ddp2") if v.step == STEPS]
    (ours,) = [v for v in versions_of(cluster.store_address, name) if v.step == STEPS]
    a, b = full_state(theirs)["train"], full_state(ours)["train"]
    assert torch.equal(a["data_position"], b["data_position"]) and int(b["ranks"]) == new.world_size
    assert torch.equal(a["data_order"], b["data_order"])  # the same global batch rows, another split


def test_a_resume_that_changes_the_global_batch_is_refused_naming_it(cluster, straight):
    out = cluster.run("half_batch", spec(1, 2), resume=straight["ddp2"].saved[AT])
    assert not out.finished and out.losses == {}
    ((fault, detail),) = {(f.fault_class, f.detail) for f in out.failed}
    assert fault == "config_error"
    assert "global batch rows (data.micro_batch_size x data.grad_accum x parallel.dp) 4 (this job: 2)" in detail


def mixture_spec(dp: int, micro_batch_size: int, grad_accum: int = 1) -> JobSpec:
    """:func:`spec` on a 2:1 mixture of tiny@v1 and mixb@v1 (each its own epochs and position)."""
    s = spec(dp, micro_batch_size, grad_accum).model_dump()
    s["data"].pop("dataset")
    s["data"]["mixture"] = [{"dataset": "tiny@v1", "weight": 2.0}, {"dataset": "mixb@v1", "weight": 1.0}]
    return JobSpec.model_validate(s)


def test_a_mixture_checkpoint_resumes_at_another_dp_on_the_same_global_batches(cluster):
    src = cluster.home / "src_b"
    src.mkdir()
    for i in range(5):
        (src / f"b{i}.py").write_text(f"class B{i}:\n    x = {i * 17}\n" * (i + 1))
    prepare_dataset(src, "mixb", "v1", cluster.home / "datasets", val_fraction=0.2)
    ref = cluster.run("mix_dp2", mixture_spec(2, 2))
    assert ref.finished and not ref.failed, ref.failed
    out = cluster.run("mix_dp1_accum2", mixture_spec(1, 2, grad_accum=2), resume=ref.saved[AT])
    assert out.finished and not out.failed, out.failed
    assert out.start_step == AT and sorted(out.losses) == list(range(AT + 1, STEPS + 1))
    assert {s: ref.tokens[s] for s in out.tokens} == out.tokens
    assert close(out.losses, {s: ref.losses[s] for s in out.losses}) <= RTOL
    (theirs,) = [v for v in versions_of(cluster.store_address, "mix_dp2") if v.step == STEPS]
    (ours,) = [v for v in versions_of(cluster.store_address, "mix_dp1_accum2") if v.step == STEPS]
    a, b = full_state(theirs)["train"], full_state(ours)["train"]
    assert (
        a["data_position"].tolist() == b["data_position"].tolist() == [0, STEPS * 4, *b"mix-v1".ljust(16, b"\0")]
    )  # the blended row, the format
    # A plain job cannot resume the mixture's position (data.mixture is part of the data order).
    plain = cluster.run("mix_to_plain", spec(2, 2), resume=ref.saved[AT])
    ((fault, detail),) = {(f.fault_class, f.detail) for f in plain.failed}
    assert fault == "config_error" and "data.mixture mixture " in detail and "(this job: one dataset)" in detail
