"""`surgectl dashboard` without a stack, and the token it makes for the local stack."""

from __future__ import annotations

import stat

import pytest

from services.cli import dashboard
from services.cli.errors import CliError


def test_the_dashboard_is_not_started_without_a_stack_and_says_what_to_run(surge_home):
    with pytest.raises(CliError, match="no local stack is running .*surgectl up"):
        dashboard.start()
    assert dashboard.running() is None and not dashboard.record_file().exists()
    assert dashboard.stop() is False


def test_the_local_stacks_token_is_made_once_readable_by_its_owner_only(surge_home, monkeypatch):
    monkeypatch.delenv("SURGE_AUTH_TOKEN", raising=False)
    first = dashboard.token()
    assert len(first) >= 32 and dashboard.token() == first
    assert stat.S_IMODE(dashboard.token_file().stat().st_mode) == 0o600
    monkeypatch.setenv("SURGE_AUTH_TOKEN", "the-stacks-own")
    assert dashboard.token() == "the-stacks-own"  # the stack's token when it has one
