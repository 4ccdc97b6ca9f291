"""`resume --from` and `rollback --version` read the README's VERSION forms `latest` and
`<job>:latest` as the newest usable version, what leaving the flag out asks (an operator's trial:
both were refused, exit 2, as unknown versions); another job's `latest` stays bad input."""

from __future__ import annotations

import pytest

from services.cli import cmd_control
from services.cli.errors import CliError


@pytest.fixture(autouse=True)
def names(monkeypatch):
    jobs = {"demo": "demo-3f2a1c", "demo-3f2a1c": "demo-3f2a1c", "other-9": "other-9"}

    def resolve(ref):
        if ref not in jobs:
            raise CliError(f"no job {ref!r}", code=2)
        return jobs[ref]

    monkeypatch.setattr(cmd_control, "resolve_job", resolve)


@pytest.mark.parametrize("version", [None, "latest", "demo-3f2a1c:latest", "demo:latest"])
def test_latest_of_the_job_itself_asks_for_the_newest(version):
    assert cmd_control._own_version("demo-3f2a1c", version, "--from") == ""


def test_a_numbered_version_is_passed_as_given():
    assert cmd_control._own_version("demo-3f2a1c", "demo-3f2a1c:4", "--version") == "demo-3f2a1c:4"


def test_another_jobs_latest_is_refused_naming_the_flag():
    with pytest.raises(CliError) as e:
        cmd_control._own_version("demo-3f2a1c", "other-9:latest", "--version")
    assert e.value.code == 2
    assert str(e.value) == "--version other-9:latest: names another job's versions; demo-3f2a1c loads one of its own"


def test_an_unknown_jobs_latest_is_refused_as_an_unknown_job():
    with pytest.raises(CliError) as e:
        cmd_control._own_version("demo-3f2a1c", "nosuch:latest", "--from")
    assert e.value.code == 2
