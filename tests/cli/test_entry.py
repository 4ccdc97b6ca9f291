"""The `surgectl` program's entry point: a Ctrl-C while the commands still load is one line
and exit 130 (a fresh user's `timeout -s INT 3.5 surgectl pause J` printed a traceback of the
import it landed in)."""

from __future__ import annotations

import sys

import pytest

from services.cli import entry


class _InterruptedLoad:
    """A Ctrl-C arriving while services.cli.surgectl is imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "services.cli.surgectl":
            raise KeyboardInterrupt
        return None


def test_a_ctrl_c_while_the_commands_load_is_one_line_and_exit_130(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "services.cli.surgectl", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_InterruptedLoad(), *sys.meta_path])
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130 and capsys.readouterr().err == "interrupted\n"


def test_the_entry_point_runs_the_commands(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["surgectl", "--version"])
    with pytest.raises(SystemExit) as e:
        entry.main()
    out = capsys.readouterr()
    assert e.value.code == 0 and out.out.strip(), out
