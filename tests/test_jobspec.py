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
        (
            "name: x\nsteps: 5\ndata: {dataset: a@v1, seq_lenn: 4}\n",
            "job.yaml: data.seq_lenn: unknown key (did you mean data.seq_len?)",
        ),
        (  # a misspelling two sections deep, in a mapping of sections
            "name: x\nsteps: 5\ndata: {dataset: a@v1}\nfault_policy: {actoins: {}}\n",
            "job.yaml: fault_policy.actoins: unknown key (did you mean fault_policy.actions?)",
        ),
        ("name: x\nsteps: 5\ndata: {dataset: a@v1}\nzzzqqq: 1\n", "job.yaml: zzzqqq: unknown key"),  # (none near)
        (  # a submit's option written into the spec: where it goes instead
            "name: x\nsteps: 5\ndata: {dataset: a@v1}\npriority: 5\n",
            "job.yaml: priority: unknown key (priority is not part of a spec: give it to `surgectl submit --priority N`)",
        ),
        (
            "name: x\nsteps: 5\ndata: {dataset: a@v1, seq_len: -4}\n",
            "job.yaml: data.seq_len: Input should be greater than 0, got -4",
        ),
        (
            "name: x\nstepz: 500\ndata: {dataset: a@v1}\n",
            "job.yaml: stepz: unknown key (did you mean steps?); steps: Field required",
        ),
        (
            "name: x\nsteps: 5\ndata: {dataset: a@v1, seq_len: 4}\nmodle: {}\n",
            "job.yaml: modle: unknown key (did you mean model?)",
        ),
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
        (
            "name: x\nsteps: 5\nmodel: {d_model: 96, n_heads: 6, n_kv_heads: 4}\ndata: {dataset: a@v1}\n",
            "job.yaml: model.n_kv_heads: 4 must divide n_heads (6)",
        ),
        (
            "name: x\nsteps: 5\nmodel: {n_kv_heads: 2}\nparallel: {tp: 4, data_parallel: fsdp2}\n"
            "data: {dataset: a@v1}\n",
            "job.yaml: parallel.tp: model.n_kv_heads (2) must be divisible by tp (4)",
        ),
        (
            "name: x\nsteps: 5\nmodel: {rope_scaling: {factor: 8, low_freq_factor: 4}}\ndata: {dataset: a@v1}\n",
            "job.yaml: model.rope_scaling.high_freq_factor: 4 must be greater than low_freq_factor (4)",
        ),
        (
            "name: x\nsteps: 5\nmodel: {rope_scaling: {type: yarn, factor: 8}}\ndata: {dataset: a@v1}\n",
            "job.yaml: model.rope_scaling.type: Input should be 'llama3'",
        ),
        (
            "name: x\nsteps: 5\nmodel: {ffn_hidden: 0}\ndata: {dataset: a@v1}\n",
            "job.yaml: model.ffn_hidden: Input should be greater than 0",
        ),
        ("", "job.yaml: the file is empty (expected a mapping of job fields"),
        ("# nothing but a comment\n", "job.yaml: the file is empty"),
        ("- name: x\n", "job.yaml: expected a mapping of job fields, got a list"),
        ("just text\n", "job.yaml: expected a mapping of job fields, got a single value"),
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


def test_numbers_are_read_as_people_write_them_in_yaml():
    """YAML 1.2 floats PyYAML's YAML 1.1 resolver reads as strings: an exponent with no dot
    (``3e-4``) or no sign (``5.0e5``, ``.5e6``); integers with underscores stay integers."""
    spec = parse_job_spec(
        "name: x\nsteps: 1_000\ndata: {dataset: a@v1}\noptimizer: {lr: 3e-4, eps: 1.0e-8}\n"
        "model: {rope_theta: 5.0e5, norm_eps: 1e-6, rope_scaling: {factor: 3.2e1}}\n"
        "liveness: {stall_min_seconds: .5e2}\n"
    )
    assert spec.steps == 1000 and spec.optimizer.lr == 3e-4 and spec.optimizer.eps == 1e-8
    assert spec.model.rope_theta == 500000.0 and spec.model.norm_eps == 1e-6 and spec.model.rope_scaling.factor == 32.0
    assert spec.liveness.stall_min_seconds == 50.0
    # Not numbers: a version string, a dataset name, an unquoted word stay strings.
    with pytest.raises(JobSpecError, match=r"^job.yaml: model.rope_theta: Input should be a valid number"):
        parse_job_spec("name: x\nsteps: 5\ndata: {dataset: a@v1}\nmodel: {rope_theta: 5.0e5x}\n")


def test_the_shapes_people_fine_tune_validate_and_default_to_todays_model():
    """n_kv_heads, ffn_hidden, qkv_bias and rope_scaling: unset, the model is today's
    (multi-head, MLP width from mlp_ratio, no biases, plain RoPE)."""
    plain = parse_job_spec("name: x\nsteps: 5\ndata: {dataset: a@v1}\n").model
    assert (plain.n_kv_heads, plain.ffn_hidden, plain.qkv_bias, plain.rope_scaling) == (None, None, False, None)
    assert plain.kv_heads == plain.n_heads == 4 and plain.head_dim == 32
    gqa = parse_job_spec(
        "name: x\nsteps: 5\ndata: {dataset: a@v1}\nmodel: {d_model: 256, n_heads: 32, n_kv_heads: 8, ffn_hidden: 1024, "
        "qkv_bias: true, rope_scaling: {factor: 32.0}}\nparallel: {tp: 8, data_parallel: fsdp2}\n"
    ).model
    assert (gqa.kv_heads, gqa.head_dim, gqa.ffn_hidden, gqa.qkv_bias) == (8, 8, 1024, True)
    assert gqa.rope_scaling.model_dump() == {  # Llama 3.1's defaults but for the factor
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
