"""The spec's `metrics:` section: sinks and rank-log sampling, refused by field name."""

from __future__ import annotations

import pytest
import yaml

from services.jobspec import JobSpecError, parse_job_spec, spec_from_json, spec_to_json

BASE = {"name": "m", "steps": 10, "data": {"dataset": "tiny@v1"}}


def spec(metrics):
    return parse_job_spec(yaml.safe_dump({**BASE, "metrics": metrics}), "job.yaml")


def test_defaults_write_no_sink_and_a_line_every_ten_steps():
    m = parse_job_spec(yaml.safe_dump(BASE), "job.yaml").metrics
    assert (m.tensorboard, m.wandb, m.log_every) == (False, None, 10)


def test_tensorboard_and_offline_wandb_are_chosen_and_survive_the_json_round_trip():
    s = spec({"tensorboard": True, "wandb": {"project": "my-runs"}, "log_every": 1})
    assert s.metrics.wandb.mode == "offline"
    assert spec_from_json(spec_to_json(s)).metrics == s.metrics


@pytest.mark.parametrize(
    "metrics, message",
    [
        ({"wandb": {}}, "job.yaml: metrics.wandb.project: Field required"),
        ({"wandb": {"project": "p", "mode": "online"}}, "job.yaml: metrics.wandb.mode: Input should be 'offline'"),
        ({"wandb": {"project": "../up"}}, "job.yaml: metrics.wandb.project: String should match pattern"),
        ({"tensorbord": True}, "job.yaml: metrics.tensorbord: unknown key"),
        ({"tensorboard": "yes"}, "job.yaml: metrics.tensorboard: Input should be a valid boolean"),
        ({"log_every": -1}, "job.yaml: metrics.log_every: Input should be greater than or equal to 0"),
    ],
)
def test_a_bad_metrics_field_is_one_line_naming_it(metrics, message):
    with pytest.raises(JobSpecError) as e:
        spec(metrics)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
