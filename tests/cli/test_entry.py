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
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted while surgectl loaded: nothing was asked of the stack; running it again is safe\n"
    )


def test_the_entry_point_runs_the_commands(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["surgectl", "--version"])
    with pytest.raises(SystemExit) as e:
        entry.main()
    out = capsys.readouterr()
    assert e.value.code == 0 and out.out.strip(), out


def test_a_checkout_without_make_setup_says_to_run_it_not_no_module_named_surge(tmp_path):
    """A checkout installed without `make setup` has no services/contract/gen (generated, never
    committed): `surgectl up` said "No module named 'surge'" (the generated files' package) under
    a traceback. Now one line naming the folder and `make setup`, exit 1, nothing started; a
    service or `python -m` that imports the contract says the same in its ImportError."""
    import shutil
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    shutil.copytree(repo / "services", tmp_path / "services", ignore=shutil.ignore_patterns("gen", "__pycache__"))
    env = {"PATH": "/usr/bin:/bin", "SURGE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(tmp_path)}
    up = subprocess.run(
        [sys.executable, "-c", "import sys; from services.cli.entry import main; sys.argv[1:] = ['up']; main()"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    gen = tmp_path / "services" / "contract" / "gen"
    assert up.returncode == 1 and up.stdout == "", up.stderr
    said = f"{gen} has no generated gRPC code (surge/v1/control_pb2.py): run `make setup` in {tmp_path}"
    assert up.stderr == f"error: {said} (it generates it from proto/)\n"
    assert not (tmp_path / "home").exists()  # nothing started, nothing written
    control = subprocess.run(
        [sys.executable, "-m", "services.control", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert control.returncode == 1 and "No module named 'surge'" not in control.stderr
    assert control.stderr.strip().splitlines()[-1].startswith(f"ImportError: {gen} has no generated gRPC code"), (
        control.stderr
    )


def test_a_ctrl_c_no_command_caught_says_what_may_have_been_cut_short(monkeypatch, capsys):
    """A Ctrl-C that reaches the program before (or outside) a command's own handler: was a bare
    "interrupted", which told an operator's trial nothing of what to do next."""
    from services.cli import render, surgectl

    def app(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(surgectl, "app", app)
    monkeypatch.setattr(render, "interrupt_said", False)
    monkeypatch.setattr(render, "interrupt_line", "")  # (an earlier command's in this process: not this one's)
    monkeypatch.setattr(sys, "argv", ["surgectl", "scale", "j", "--dp", "2"])
    with pytest.raises(SystemExit) as e:
        surgectl.main()
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 130
    assert err.startswith("interrupted: `surgectl scale` may have been cut short after it asked the stack something"), (
        err
    )
