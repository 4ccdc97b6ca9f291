"""Job specs: unknown or mistyped keys and malformed YAML become one-line errors."""

from pathlib import Path

import pytest

from services.jobspec import JobSpecError, load_job_spec, parse_job_spec

DEMO = Path(__file__).parents[1] / "examples" / "jobs" / "demo.yaml"


def test_the_demo_spec_is_valid_and_gives_the_reference_global_batch():
    spec = load_job_spec(DEMO)
    assert spec.parallel.dp == 2
    assert spec.tokens_per_step == 16 * 256


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: x\nsteps: 5\ndata: {dataset: a@v1, seq_lenn: 4}\n", "job.yaml: data.seq_lenn: unknown key"),
        (
            "name: x\nsteps: 5\ndata: {dataset: a@v1, seq_len: -4}\n",
            "job.yaml: data.seq_len: Input should be greater than 0, got -4",
        ),
        ("name: x\nstepz: 500\ndata: {dataset: a@v1}\n", "job.yaml: stepz: unknown key; steps: Field required"),
        ("name: x\nsteps: 5\ndata: {dataset: a@v1, seq_len: 4}\nmodle: {}\n", "job.yaml: modle: unknown key"),
        ("name: x\nsteps: five\ndata: {dataset: a@v1}\n", "job.yaml: steps: Input should be a valid integer"),
        ("name: x\nsteps: 5\n", "job.yaml: data: Field required"),
        ("name: x\nsteps: 5\ndata: {dataset: nover}\n", "job.yaml: data.dataset: String should match pattern"),
        ("name: [x\n", "job.yaml: line 2: malformed YAML"),
        ("- a\n- b\n", "job.yaml: expected a mapping"),
        (
            "name: x\nsteps: 5\nmodel: {d_model: 100, n_heads: 3}\ndata: {dataset: a@v1}\n",
            "job.yaml: model: d_model (100) must be divisible by n_heads (3)",
        ),
        (
            "name: x\nsteps: '120'\ndata: {dataset: a@v1}\n",
            "job.yaml: steps: Input should be a valid integer, got '120'",
        ),
        (
            "name: x\nsteps: 5\nsteps: 6\ndata: {dataset: a@v1}\n",
            "job.yaml: line 3: malformed YAML: duplicate key 'steps'",
        ),
        (
            "name: x\nsteps: 5\nmodel: {tie_embeddings: false}\nparallel: {pp: 2, microbatches: 3}\n"
            "data: {dataset: a@v1, micro_batch_size: 8}\n",
            "job.yaml: data.micro_batch_size: 8 rows must split into parallel.microbatches (3)",
        ),
    ],
)
def test_bad_specs_fail_with_one_line_naming_the_field(text, expected):
    with pytest.raises(JobSpecError) as e:
        parse_job_spec(text, "job.yaml")
    assert str(e.value).startswith(expected)
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(JobSpecError, match="latin1.yaml: not UTF-8 text"):
        load_job_spec(p)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(JobSpecError, match="nope.yaml: cannot read job spec"):
        load_job_spec(tmp_path / "nope.yaml")
