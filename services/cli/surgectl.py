"""surgectl: drive Surge from a terminal.

Every error a user can cause is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import inspect
import signal
import sys

import typer

from services.cli import render
from services.cli.app import app
from services.cli.errors import CliError

try:  # typer >= 0.2x parses with its own copy of click; older releases with click itself
    from typer._click import exceptions as _click
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _click

# Each command module registers its commands on ``app`` when imported; `--help` lists them in
# this order (typer keeps the order of registration).
for _module in (
    "cmd_stack",
    "cmd_data",
    "cmd_jobs",
    "cmd_experiments",
    "cmd_profile",
    "cmd_evaluate",
    "cmd_control",
    "cmd_teams",
    "cmd_checkpoints",
    "cmd_token",
):
    importlib.import_module(f"services.cli.{_module}")
# `--help`'s list shows each command's first paragraph: as one line, which the table wraps at its
# width (typer keeps the docstring's own line breaks in it and wraps each of those lines again).
for _info in app.registered_commands:
    if _info.short_help is None and _info.callback is not None and _info.callback.__doc__:
        _info.short_help = " ".join(inspect.cleandoc(_info.callback.__doc__).split("\n\n")[0].split())


def _terminated(signum, frame) -> None:
    # A SIGTERM (a timeout, a supervisor, `kill`) is a Ctrl-C: every command's interruption
    # path runs (`demo` stops the stack it started, a wait says what goes on), instead of the
    # process vanishing with the stack and its job left running without a word.
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        # Not standalone: a usage error (a bad option value, an unknown command) is printed
        # as one line below instead of click's framed box.
        code = app(standalone_mode=False)
    except _click.NoArgsIsHelpError as e:
        e.show()  # the help text, as a bare `surgectl` or group asks for it
        sys.exit(e.exit_code)
    except _click.UsageError as e:
        render.print_error(" ".join(e.format_message().split()))
        sys.exit(e.exit_code)
    except CliError as e:
        render.print_error(str(e))
        sys.exit(e.code)
    except (typer.Abort, KeyboardInterrupt):  # (a Ctrl-C before a command's own handler: was a bare "interrupted")
        code = 130
    if code == 130 and not render.interrupt_said:  # typer's exit for a KeyboardInterrupt no command caught
        command = sys.argv[1] if len(sys.argv) > 1 else ""
        render.err_console.print(
            render.interrupt_line
            or f"interrupted: `surgectl {command}` may have been cut short after it asked the stack something; "
            "`surgectl status` shows where the jobs stand (run it again once it says)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
