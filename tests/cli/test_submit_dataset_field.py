"""A submit's dataset check names the spec file and the field, as its ``--dry-run`` does: the
data service's refusal of an unknown version ("dataset nope@v1 not found (have: ...)") was
printed alone, naming neither. A data service that cannot be reached is said as it is."""

from __future__ import annotations

import grpc
import pytest

from services.cli import clients
from services.cli.errors import CliError
from services.cli.jobs import checked_submission
from services.contract import data_pb2

SPEC = """\
name: t
steps: 4
model: {n_layers: 1, d_model: 32, n_heads: 2, vocab_size: 256}
data:
  seq_len: 16
"""


@pytest.fixture
def refusing(monkeypatch):
    """The data service's Mount: ``known`` versions answer; any other is refused NOT_FOUND, as
    ``clients.call`` raises it (from_rpc); ``down``: the service unreachable."""

    def use(known: tuple[str, ...] = (), down: bool = False) -> None:
        class Data:
            def Mount(self, msg, timeout=None):  # noqa: N802 - the gRPC method's name
                label = f"{msg.name}@{msg.version}"
                if label in known:
                    return data_pb2.DatasetReady(name=msg.name, version=msg.version, vocab_size=256)
                raise CliError(f"dataset {label} not found (have: tiny@v1)", code=2, status=grpc.StatusCode.NOT_FOUND)

        def call(service, fn, retry_delays=()):
            if down:
                raise CliError("data unreachable at 127.0.0.1:1 (is the stack up? run `surgectl up`)", unreachable=True)
            return fn(Data())

        monkeypatch.setattr(clients, "call", call)

    return use


def test_an_unknown_dataset_names_the_file_and_data_dataset(tmp_path, refusing):
    job = tmp_path / "job.yaml"
    job.write_text(SPEC.replace("seq_len: 16", "dataset: nope@v1\n  seq_len: 16"))
    refusing()
    with pytest.raises(CliError) as e:
        checked_submission(job)
    assert (str(e.value), e.value.code) == (f"{job}: data.dataset: dataset nope@v1 not found (have: tiny@v1)", 2)


def test_a_mixture_names_the_component(tmp_path, refusing):
    job = tmp_path / "mix.yaml"
    mixture = "mixture: [{dataset: tiny@v1, weight: 1}, {dataset: nope@v2, weight: 1}]\n  seq_len: 16"
    job.write_text(SPEC.replace("seq_len: 16", mixture))
    refusing(known=("tiny@v1",))
    with pytest.raises(CliError) as e:
        checked_submission(job)
    assert str(e.value) == f"{job}: data.mixture[1].dataset: dataset nope@v2 not found (have: tiny@v1)"


def test_an_unreachable_data_service_is_said_as_it_is(tmp_path, refusing):
    job = tmp_path / "job.yaml"
    job.write_text(SPEC.replace("seq_len: 16", "dataset: tiny@v1\n  seq_len: 16"))
    refusing(down=True)
    with pytest.raises(CliError) as e:
        checked_submission(job)
    assert e.value.unreachable and str(e.value).startswith("data unreachable at ")
