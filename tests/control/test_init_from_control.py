"""Control's own check of ``init_from.hf`` at submit (the backstop behind surgectl's): a
directory that is not the spec's model is refused before anything is allocated."""

from __future__ import annotations

import re

import pytest

from services.compute import hf_format
from services.compute.model import build_model
from services.contract import control_pb2
from services.jobspec import JobSpecError, parse_job_spec, spec_from_json


def test_an_hf_directory_that_is_not_the_specs_model_is_refused_before_anything_is_allocated(plane, tmp_path):
    plane.register("wa")
    text = "name: x\nsteps: 4\ndata: {dataset: x@v1, seq_len: 16}\nmodel: {n_layers: 1, d_model: 32, n_heads: 2}\n"
    cases = (
        (str(tmp_path / "none"), "init_from.hf: " + str(tmp_path / "none") + ": not a directory"),
        (
            str(tmp_path),
            "init_from.hf: " + str(tmp_path / "config.json") + ": hidden_size 64 differs from model.d_model 32",
        ),
    )
    other = parse_job_spec(text.replace("d_model: 32", "d_model: 64"))
    hf_format.save_hf(tmp_path, build_model(other.model, seed=0).state_dict(), other)
    for where, words in cases:
        with pytest.raises(JobSpecError, match=f"^ft.yaml: {re.escape(words)}$"):
            plane.user(
                control_pb2.SubmitJobRequest(spec_yaml=text + f"init_from: {{hf: {where}}}\n", spec_path="ft.yaml")
            )
    assert list(plane.user(control_pb2.JobQuery()).jobs) == []
    hf_format.save_hf(tmp_path, build_model(parse_job_spec(text).model, seed=0).state_dict(), parse_job_spec(text))
    status = plane.user(
        control_pb2.SubmitJobRequest(spec_yaml=text + f"init_from: {{hf: {tmp_path}}}\n", spec_path="ft.yaml")
    )
    assert status.job_id


def test_a_spec_without_a_model_section_takes_the_hf_directorys_shape_in_control_too(plane, tmp_path):
    """surgectl and control parse a job file alike (services/jobspec/__init__.py parse_job_spec):
    with ``init_from.hf`` and no ``model:`` section, the job control journals has the
    directory's model (grouped-query heads, MLP width) and its own ``freeze``."""
    plane.register("wa")
    source = parse_job_spec(
        "name: src\nsteps: 1\ndata: {dataset: x@v1, seq_len: 16}\n"
        "model: {n_layers: 1, d_model: 48, n_heads: 6, n_kv_heads: 2, ffn_hidden: 40, tie_embeddings: false}\n"
    )
    hf_format.save_hf(tmp_path, build_model(source.model, seed=0).state_dict(), source)
    text = f"name: ft\nsteps: 4\ndata: {{dataset: x@v1, seq_len: 16}}\ninit_from: {{hf: {tmp_path}}}\n"
    status = plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="ft.yaml"))
    journaled = plane.user(control_pb2.JobQuery(job_id=status.job_id, with_spec=True)).spec_json
    assert spec_from_json(journaled).model == source.model
    differing = r"^ft.yaml: init_from.hf: .*config.json: num_key_value_heads 2 differs from model.n_kv_heads 6$"
    with pytest.raises(JobSpecError, match=differing):
        plane.user(control_pb2.SubmitJobRequest(spec_yaml=text + "model: {n_kv_heads: 6}\n", spec_path="ft.yaml"))


def test_a_directory_missing_a_tensor_or_with_one_of_another_shape_is_refused_by_control(plane, tmp_path):
    """Control reads the safetensors headers too (no torch there): the user trial's two
    directories, which were queued and given ranks before failing on them, are refused at
    submit in one line naming the file, the tensor and the parameter; nothing is journaled."""
    from safetensors.torch import load_file, save_file

    plane.register("wa")
    text = (
        "name: x\nsteps: 4\ndata: {dataset: x@v1, seq_len: 16}\n"
        f"model: {{n_layers: 2, d_model: 32, n_heads: 2, tie_embeddings: false}}\ninit_from: {{hf: {tmp_path}}}\n"
    )
    spec = parse_job_spec(text.split("init_from")[0])
    hf_format.save_hf(tmp_path, build_model(spec.model, seed=0).state_dict(), spec)
    weights = load_file(tmp_path / hf_format.WEIGHTS)
    up = "model.layers.1.mlp.up_proj.weight"
    cases = (
        ({k: v for k, v in weights.items() if k != up}, f"{tmp_path}: tensor {up} (for blocks.1.mlp.up.weight) is in none"),
        ({**weights, up: weights[up][:8]}, f"{tmp_path / hf_format.WEIGHTS}: tensor {up} has shape [8, 32]"),
    )  # fmt: skip
    for tensors, words in cases:
        save_file(tensors, tmp_path / hf_format.WEIGHTS)
        with pytest.raises(JobSpecError, match=f"^ft.yaml: init_from.hf: {re.escape(words)}"):
            plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="ft.yaml"))
    assert list(plane.user(control_pb2.JobQuery()).jobs) == []
    save_file(weights, tmp_path / hf_format.WEIGHTS)
    assert plane.user(control_pb2.SubmitJobRequest(spec_yaml=text, spec_path="ft.yaml")).job_id
