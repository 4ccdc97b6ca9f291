"""surgectl token: make a bearer token for control's tokens file (per-team access).

The file stores each token's SHA-256 digest, never the token (services/common/access.py):
`token new` prints a fresh token (give it to its holder, who sets SURGE_AUTH_TOKEN) and the
line to add under ``principals:``; `token hash` makes that line for a token someone already
holds, read from stdin (never from the command line, where shells and ``ps`` keep it).
"""

from __future__ import annotations

import sys

import typer

from services.cli.app import HELP, _say, app
from services.cli.errors import CliError
from services.common.access import TokensFileError, entry_line, new_token

token_app = typer.Typer(
    no_args_is_help=True,
    context_settings=HELP,
    help="Make tokens for control's tokens file (per-team access).\n\n"
    "Example: surgectl token new --name alice --team vision",
)
app.add_typer(token_app, name="token")

NameOpt = typer.Option(..., "--name", help="who holds the token (shown in refusals and logs)")
TeamOpt = typer.Option(..., "--team", help="the team whose jobs it sees and controls")
RoleOpt = typer.Option("user", "--role", help="user | admin (every job, nodes, quotas)")


def _line(name: str, team: str, role: str, token: str) -> str:
    try:
        return entry_line(name, team, role, token)
    except TokensFileError as e:
        raise CliError(f"--{e}", code=2) from None  # ("team: ..." names the option)


@token_app.command("new")
def token_new(name: str = NameOpt, team: str = TeamOpt, role: str = RoleOpt) -> None:
    """Print a new random token and its line for the tokens file (the file keeps only its
    digest: the token is shown this once).

    Example: surgectl token new --name alice --team vision
    """
    token = new_token()
    line = _line(name, team, role, token)
    _say(f"token: {token}")
    _say("give it to its holder (SURGE_AUTH_TOKEN); add this line under `principals:` in control's tokens file:")
    _say(line)


@token_app.command("hash")
def token_hash(name: str = NameOpt, team: str = TeamOpt, role: str = RoleOpt) -> None:
    """Read a token from stdin and print its line for the tokens file.

    Example: surgectl token hash --name alice --team vision < token.txt (or printf %s "$TOKEN" | ...)
    """
    token = sys.stdin.readline().strip()
    if not token:
        raise CliError('token hash: no token on stdin (printf %s "$TOKEN" | surgectl token hash ...)', code=2)
    _say(_line(name, team, role, token))
