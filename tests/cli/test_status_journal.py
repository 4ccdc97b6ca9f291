"""`surgectl status` says first when control's journal fails to write (JobList.journal_failing,
services/control/journal_failure.py): decisions are refused meanwhile, the jobs run on."""

from __future__ import annotations

from rich.console import Console

from services.cli.cmd_jobs import _status_tables

FAILING = (
    "control's journal fails to write since 09:01:02: JournalWriteFailed (WRITE_NO_SPACE): database or disk is full"
)


def rendered(journal: str) -> str:
    console = Console(width=400, record=True)
    console.print(_status_tables([], [], journal))
    return console.export_text()


def test_status_says_first_that_controls_journal_fails():
    lines = rendered(FAILING).splitlines()
    assert lines[0] == f"{FAILING}; decisions are refused, the jobs run on"


def test_status_says_nothing_of_a_journal_that_commits():
    assert "journal" not in rendered("")
