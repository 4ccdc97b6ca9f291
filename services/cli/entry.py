"""The `surgectl` program's entry point: loading the commands takes a second or more of CPU
(typer, grpc, the contract, torch's lazy bits), and a Ctrl-C within it is an interruption like
any other, one line and exit 130, not a traceback of whatever import it landed in."""

from __future__ import annotations

import sys


def main() -> None:
    from services.generated_code import missing

    if not_generated := missing():  # (a checkout installed without `make setup`)
        sys.stderr.write(f"error: {not_generated}\n")
        raise SystemExit(1)
    try:
        from services.cli.surgectl import main as run
    except KeyboardInterrupt:
        # (nothing can have been asked yet: the commands were still loading)
        sys.stderr.write(
            "interrupted while surgectl loaded: nothing was asked of the stack; running it again is safe\n"
        )
        raise SystemExit(130) from None
    run()
