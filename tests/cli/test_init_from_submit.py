"""surgectl's checks of ``init_from`` at submit (services/cli/init_from.py): the Hugging Face
directory against the spec's model, and a checkpoint version through the store (answered
here by a stand-in for the store service); each refusal one line naming the field."""

from __future__ import annotations

import pytest

from services.cli import clients
from services.cli.errors import CliError
from services.cli.init_from import check_init_from, committed, pin_latest, weights_mismatch
from services.compute import hf_format
from services.compute.model import build_model
from services.contract import control_pb2, data_pb2, store_pb2
from services.jobspec import JobSpec, parse_job_spec, spec_to_json

X = data_pb2.DatasetReady(name="x", version="v1", tokenizer="bytes", vocab_size=256)  # the job's dataset


def spec_of(init_from=None, dataset="x@v1", **model) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "ft",
            "steps": 4,
            "data": {"dataset": dataset, "seq_len": 16},
            "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, **model},
            "init_from": init_from,
        }
    )


def test_an_hf_directory_of_another_model_is_refused_naming_key_and_field(tmp_path):
    other = spec_of(n_layers=3)
    hf_format.save_hf(tmp_path, build_model(other.model, seed=0).state_dict(), other)
    with pytest.raises(CliError) as e:
        check_init_from(spec_of({"hf": str(tmp_path)}), "ft.yaml", X)
    assert e.value.code == 2
    assert str(e.value) == (
        f"ft.yaml: init_from.hf: {tmp_path / 'config.json'}: num_hidden_layers 3 differs from model.n_layers 2"
    )
    check_init_from(spec_of({"hf": str(tmp_path)}, n_layers=3), "ft.yaml", X)  # its own model: accepted


class _Store:
    """The store service's Load: the version's info with the spec it was written with."""

    def __init__(self, spec: JobSpec | None):
        self.spec, self.asked = spec, []

    def Load(self, msg, timeout=None):  # noqa: N802 - the gRPC method's name
        self.asked.append(msg.version)
        if self.spec is None:
            raise CliError(f"checkpoint {msg.version} not found (have: src-1:1)")
        return store_pb2.CheckpointLoaded(
            info=store_pb2.CheckpointInfo(version="src-1:4", spec_json=spec_to_json(self.spec))
        )

    def List(self, msg, timeout=None):  # noqa: N802 - asked for the versions of a job control does not know
        return store_pb2.CheckpointList()


class _Control:
    """Control's ListJobs: runs of the job named ``src`` (default: two ended, ``src-1`` the
    newer); GetJob: no other job."""

    def __init__(self, *jobs: tuple[str, int]):
        self.jobs = jobs or (("src-0", control_pb2.TERMINATED), ("src-1", control_pb2.TERMINATED))

    def ListJobs(self, msg, timeout=None):  # noqa: N802 - the gRPC method's name
        return control_pb2.JobList(
            jobs=[
                control_pb2.JobStatus(job_id=i, name="src", state=st, created_unix=n)
                for n, (i, st) in enumerate(self.jobs)
            ]
        )

    def GetJob(self, msg, timeout=None):  # noqa: N802 - the gRPC method's name
        raise CliError(f"no job {msg.job_id!r}", code=2)


@pytest.fixture
def store(monkeypatch):
    def use(spec, control=None):
        stub = _Store(spec)
        monkeypatch.setattr(clients, "address", lambda service: "127.0.0.1:1")
        monkeypatch.setattr(
            clients, "call", lambda service, fn: fn(stub if service == "store" else control or _Control())
        )
        return stub

    return use


def test_a_checkpoint_version_is_asked_of_the_store_and_its_model_must_have_this_specs_tensors(store):
    stub = store(spec_of())
    check_init_from(spec_of({"checkpoint": "src-1:latest"}, rope_theta=500.0), "ft.yaml", X)  # same tensors
    assert stub.asked == ["src-1:latest"]
    store(spec_of(n_layers=1))
    with pytest.raises(CliError) as e:
        check_init_from(spec_of({"checkpoint": "src-1:latest"}), "ft.yaml", X)
    assert e.value.code == 2 and str(e.value).startswith(
        "ft.yaml: init_from.checkpoint: src-1:4: holds no tensor blocks.1.attn_norm.weight (its model: n_layers 1, "
    )
    store(None)
    with pytest.raises(CliError) as e:
        check_init_from(spec_of({"checkpoint": "src-1:9"}), "ft.yaml", X)
    assert (e.value.code, str(e.value)) == (
        2,
        "ft.yaml: init_from.checkpoint: checkpoint src-1:9 not found (have: src-1:1)",
    )


def test_weights_must_match_in_size_and_heads_and_moments_must_exist_for_what_is_trained():
    assert weights_mismatch(spec_of(), spec_of(vocab_size=96), False).startswith(
        "tensor tok_emb.weight has 2048 elements, this job's needs 3072"
    )
    assert weights_mismatch(spec_of(), spec_of(n_heads=2), False) == "its model.n_heads is 4, this job's 2"
    frozen = spec_of(freeze=["blocks.0.*"])
    assert weights_mismatch(frozen, spec_of(), False) == ""
    assert weights_mismatch(frozen, spec_of(), True) == (
        "init_from.load weights+optimizer: its job froze blocks.0.attn.k.weight, which this job trains (no moments saved)"
    )
    assert weights_mismatch(spec_of(), frozen, True) == ""


def test_latest_is_pinned_to_the_version_it_names_at_submit_and_nothing_else_changes(store):
    store(spec_of())
    text = "# mine\nname: ft\nsteps: 4\ndata: {dataset: x@v1}\ninit_from: {checkpoint: 'src-1:latest'}\n"
    pinned = pin_latest(parse_job_spec(text), text, "ft.yaml")
    assert parse_job_spec(pinned).init_from.checkpoint == "src-1:4"
    assert parse_job_spec(pinned).model_dump(exclude={"init_from"}) == parse_job_spec(text).model_dump(
        exclude={"init_from"}
    )
    exact = text.replace("src-1:latest", "src-1:2")
    assert pin_latest(parse_job_spec(exact), exact, "ft.yaml") is exact


def test_a_job_name_is_pinned_to_its_live_run_and_a_name_of_several_ended_runs_is_one_line_ambiguous(store):
    live = _Control(("src-0", control_pb2.TERMINATED), ("src-1", control_pb2.RUNNING))
    stub = store(spec_of(), live)
    text = "name: ft\nsteps: 4\ndata: {dataset: x@v1}\ninit_from: {checkpoint: 'src:latest'}\n"
    assert parse_job_spec(pin_latest(parse_job_spec(text), text, "ft.yaml")).init_from.checkpoint == "src-1:4"
    assert stub.asked == ["src-1:latest"]
    exact = text.replace("src:latest", "src:2")
    assert parse_job_spec(pin_latest(parse_job_spec(exact), exact, "ft.yaml")).init_from.checkpoint == "src-1:2"
    unknown = text.replace("src:latest", "other-7:2")
    assert pin_latest(parse_job_spec(unknown), unknown, "ft.yaml") is unknown  # the store names what it lacks
    stub = store(spec_of())  # both runs ended: which one is meant cannot be told (was: the newer, silently)
    ambiguous = "job name 'src' is ambiguous: 2 ended jobs have it (src-0, src-1); give the id"
    for asked in (text, exact):
        with pytest.raises(CliError) as e:
            pin_latest(parse_job_spec(asked), asked, "ft.yaml")
        assert (e.value.code, str(e.value)) == (2, ambiguous)
    with pytest.raises(CliError) as e:
        committed("src:3", "--version")  # `surgectl evaluate --version src:3`
    assert (e.value.code, str(e.value)) == (2, ambiguous)
    assert stub.asked == []  # nothing loaded


def test_with_no_stack_the_version_is_read_from_the_catalog_under_surge_home(surge_home):
    from tests.cli.test_export import commit_version

    commit_version(surge_home, spec_of(), job="src-1", step=4)
    check_init_from(spec_of({"checkpoint": "src-1:latest"}), "ft.yaml", X)
    text = "name: ft\nsteps: 4\ndata: {dataset: x@v1}\ninit_from: {checkpoint: 'src-1:latest'}\n"
    assert parse_job_spec(pin_latest(parse_job_spec(text), text, "ft.yaml")).init_from.checkpoint == "src-1:1"
    with pytest.raises(CliError) as e:
        check_init_from(spec_of({"checkpoint": "src-1:2"}), "ft.yaml", X)
    assert (e.value.code, str(e.value)) == (
        2,
        "ft.yaml: init_from.checkpoint: checkpoint src-1:2 not found (have: src-1:1)",
    )


# ------------------------------------------------------------------ the tokenizer the weights were trained with


@pytest.fixture
def notes(surge_home, tmp_path):
    """notes@v1/v2: two bpe:280 tokenizers of one vocabulary size; notes@v3: v1's on v2's
    text; version src-1:1 of a model trained on notes@v1. No stack: all read under SURGE_HOME."""
    from tests.cli.test_export import commit_version
    from tests.cli.test_train_settings import bpe_versions

    paths = bpe_versions(surge_home / "datasets", tmp_path)
    commit_version(surge_home, spec_of(dataset="notes@v1", vocab_size=288), job="src-1", step=4)
    return paths


def fine_tune(dataset: str, init_from: dict) -> None:
    """check_init_from of a job on ``dataset`` (as the real L4-1 mounts it) from ``init_from``."""
    from services.cli.evaluation import mount

    check_init_from(spec_of(init_from, dataset=dataset, vocab_size=288), "ft.yaml", mount(dataset, verify=False))


def test_a_checkpoint_trained_with_another_tokenizer_of_the_same_size_is_refused(notes):
    v1, _, _ = notes
    with pytest.raises(CliError) as e:
        fine_tune("notes@v2", {"checkpoint": "src-1:latest"})
    msg = str(e.value)
    assert e.value.code == 2 and "\n" not in msg
    assert msg.startswith("ft.yaml: init_from.checkpoint: src-1:1: trained on notes@v1 (tokenizer sha256:")
    assert "but data.dataset notes@v2 was prepared with another tokenizer (sha256:" in msg
    assert msg.endswith(f"`dataset prepare --tokenizer {v1 / 'tokenizer.json'}`")
    fine_tune("notes@v3", {"checkpoint": "src-1:latest"})  # v1's tokenizer: accepted
    fine_tune("notes@v1", {"checkpoint": "src-1:latest"})  # its own dataset


def test_bytes_against_bytes_is_the_same_tokenizer_and_bytes_against_bpe_is_not(surge_home, tmp_path):
    from services.cli.evaluation import mount
    from services.data.prepare import prepare_dataset
    from tests.cli.test_export import commit_version
    from tests.cli.test_train_settings import bpe_versions, text_corpus

    src = text_corpus(tmp_path / "src")
    for version in ("v1", "v2"):
        prepare_dataset(src, "b", version, surge_home / "datasets", val_fraction=0.3, include_glob=None)
    bpe_versions(surge_home / "datasets", tmp_path)
    commit_version(surge_home, spec_of(dataset="b@v1", vocab_size=288), job="src-1", step=4)
    ft = spec_of({"checkpoint": "src-1:1"}, dataset="b@v2", vocab_size=288)
    check_init_from(ft, "ft.yaml", mount("b@v2", verify=False))
    with pytest.raises(CliError) as e:
        check_init_from(ft, "ft.yaml", mount("notes@v1", verify=False))
    assert str(e.value).startswith("ft.yaml: init_from.checkpoint: src-1:1: trained on b@v1 (tokenizer bytes), but ")
    assert str(e.value).endswith("`dataset prepare --tokenizer bytes`")


def test_a_checkpoint_whose_dataset_was_deleted_cannot_be_checked_and_is_refused(notes):
    import shutil

    shutil.rmtree(notes[0])
    with pytest.raises(CliError) as e:
        fine_tune("notes@v3", {"checkpoint": "src-1:latest"})
    assert e.value.code == 2 and str(e.value).startswith(
        "ft.yaml: init_from.checkpoint: src-1:1: trained on dataset notes@v1, which cannot be read "
        "(dataset notes@v1 not found (have: notes@v2, notes@v3)), so its tokenizer cannot be checked "
        "against notes@v3's"
    )


def test_an_hf_directory_whose_tokenizer_json_differs_from_the_datasets_is_refused(notes, tmp_path):
    import json

    from services.cli.evaluation import mount

    v1, _, _ = notes
    hf = tmp_path / "hf"
    hf.mkdir()
    spec = spec_of({"hf": str(hf)}, dataset="notes@v2", vocab_size=288)
    v2 = mount("notes@v2", verify=False)
    hf_format.save_hf(hf, build_model(spec.model, seed=0).state_dict(), spec)
    check_init_from(spec, "ft.yaml", v2)  # no tokenizer.json: nothing says what it was trained with
    # v1's tokenizer, written with other whitespace (as a re-save may): the same tokenizer.
    (hf / "tokenizer.json").write_text(json.dumps(json.loads((v1 / "tokenizer.json").read_text()), indent=2))
    with pytest.raises(CliError) as e:
        check_init_from(spec, "ft.yaml", v2)
    assert e.value.code == 2 and str(e.value).startswith(
        f"ft.yaml: init_from.hf: {hf / 'tokenizer.json'} (tokenizer sha256:"
    )
    assert "differs from the tokenizer of data.dataset notes@v2 (sha256:" in str(e.value)
    fine_tune("notes@v3", {"hf": str(hf)})  # v1's tokenizer: accepted
    fine_tune("notes@v1", {"hf": str(hf)})
    (hf / "tokenizer.json").write_text("{not json")
    with pytest.raises(CliError) as e:
        fine_tune("notes@v1", {"hf": str(hf)})
    assert str(e.value).startswith(f"ft.yaml: init_from.hf: {hf / 'tokenizer.json'}: cannot be read")


def test_submit_dry_run_refuses_a_fine_tune_on_a_dataset_of_another_tokenizer(notes, tmp_path, monkeypatch, capsys):
    from tests.cli.test_housekeeping import assert_one_line, run_cli

    job = tmp_path / "ft.yaml"
    job.write_text(
        "name: ft\nsteps: 4\nmodel: {n_layers: 2, d_model: 32, n_heads: 4, vocab_size: 288}\n"
        "data: {dataset: notes@v2, seq_len: 16}\ninit_from: {checkpoint: 'src-1:latest'}\n"
    )
    code, out, err = run_cli(["submit", str(job), "--dry-run"], monkeypatch, capsys)
    assert_one_line(code, err, 2, f"{job}: init_from.checkpoint: src-1:1: trained on notes@v1", "notes@v2")
    code, out, err = run_cli(["submit", str(job), "--set", "data.dataset=notes@v3", "--dry-run"], monkeypatch, capsys)
    assert code == 0 and "valid; nothing submitted" in out, err


# ------------------------------------------------------------------ init_from.hf at submit --dry-run


def test_dry_run_checks_an_hf_directorys_weights_names_its_own_problem_first_and_says_where_the_shape_came_from(
    surge_home, tmp_path, monkeypatch, capsys
):
    """The user trial of ``init_from: {hf: DIR}`` with no ``model:`` section, on a dataset of
    280 tokens: a directory with a tensor missing or of another shape passed ``--dry-run`` as
    valid (it failed on the ranks), and an empty directory or one with only config.json was
    refused as ``model.vocab_size: 256 is smaller than the dataset's vocabulary`` (256: a
    default the user never wrote). Each is now one line naming init_from.hf and what is
    wrong; an accepted one's report says the shape came from DIR/config.json."""
    import shutil

    from safetensors.torch import load_file, save_file

    from services.data.prepare import prepare_dataset
    from tests.cli.test_housekeeping import assert_one_line, run_cli
    from tests.cli.test_train_settings import text_corpus

    prepare_dataset(text_corpus(tmp_path / "src"), "notes", "v1", surge_home / "datasets", "bpe:280", 0.3, None)
    hf = tmp_path / "hf"
    hf.mkdir()
    job = tmp_path / "ft.yaml"
    job.write_text(f"name: ft\nsteps: 4\ndata: {{dataset: notes@v1, seq_len: 16}}\ninit_from: {{hf: {hf}}}\n")
    dry = ["submit", str(job), "--dry-run"]
    code, _, err = run_cli(dry, monkeypatch, capsys)
    assert_one_line(code, err, 2, f"{job}: init_from.hf: {hf / 'config.json'}: missing")
    source = spec_of(n_kv_heads=2, vocab_size=288, tie_embeddings=False)
    hf_format.save_hf(hf, build_model(source.model, seed=0).state_dict(), source)
    weights = load_file(hf / hf_format.WEIGHTS)
    (hf / hf_format.WEIGHTS).unlink()
    code, _, err = run_cli(dry, monkeypatch, capsys)
    assert_one_line(code, err, 2, f"{job}: init_from.hf: {hf}: no *.safetensors file")
    assert "vocab_size" not in err

    up = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in weights.items() if k != up}, hf / hf_format.WEIGHTS)
    code, _, err = run_cli(dry, monkeypatch, capsys)
    assert_one_line(
        code, err, 2, f"{job}: init_from.hf: {hf}: tensor {up} (for blocks.1.mlp.up.weight) is in none of its 1"
    )
    save_file({**weights, up: weights[up][:, :16].contiguous()}, hf / hf_format.WEIGHTS)
    code, _, err = run_cli(dry, monkeypatch, capsys)
    assert_one_line(
        code, err, 2, f"{job}: init_from.hf: {hf / hf_format.WEIGHTS}: tensor {up} has shape [88, 16], "
        "this job's blocks.1.mlp.up.weight needs [88, 32]"
    )  # fmt: skip

    save_file(weights, hf / hf_format.WEIGHTS)
    code, out, err = run_cli(dry, monkeypatch, capsys)
    assert code == 0 and "valid; nothing submitted" in out, err
    lines = out.splitlines()
    assert (
        f"# model: n_layers, d_model, n_heads, n_kv_heads, mlp, ffn_hidden, qkv_bias, tie_embeddings, vocab_size, "
        f"rope_theta, norm_eps from {hf / 'config.json'} (the fields the spec's model: leaves out)"
    ) in lines
    assert (
        f"# weights: each of the model's {len(weights)} tensors in {hf}'s 1 *.safetensors file(s), of its shape "
        "(their headers read; the data is read by the ranks)"
    ) in lines
    code, out, err = run_cli([*dry, "--set", "model.n_layers=2"], monkeypatch, capsys)  # one field written
    assert code == 0 and "# model: d_model, n_heads, n_kv_heads, mlp, ffn_hidden, " in out, err
    shutil.rmtree(hf)


def test_evaluate_takes_its_jobs_version_by_number_or_latest_and_refuses_another_jobs():
    from services.cli.cmd_evaluate import evaluated_version

    asked: list[str] = []

    def pin(ref: str) -> str:  # (committed(): a name resolved to its id, latest to its number)
        asked.append(ref)
        job, _, n = ref.rpartition(":")
        return f"{'src-1' if job == 'src' else job}:{4 if n == 'latest' else n}"

    assert evaluated_version("src-1", None, pin) == "src-1:4"
    assert evaluated_version("src-1", "latest", pin) == "src-1:4"
    assert evaluated_version("src-1", "2", pin) == "src-1:2"  # (was refused: "expected <job>:<n>")
    assert evaluated_version("src-1", "src:3", pin) == "src-1:3"  # its name
    assert asked == ["src-1:latest", "src-1:latest", "src-1:2", "src:3"]
    with pytest.raises(CliError) as e:  # (was accepted: the other run's scores filed under src-1)
        evaluated_version("src-1", "other-7:2", pin)
    assert (e.value.code, str(e.value)) == (
        2,
        "--version other-7:2: a version of job other-7, not of src-1 "
        "(`surgectl evaluate other-7 --version other-7:2` scores it as that job's)",
    )
