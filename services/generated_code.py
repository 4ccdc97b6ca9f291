"""Whether the generated gRPC code is there: the one precondition every Surge program has
beyond its packages.

``services/contract/gen`` is written by ``make setup`` (``protoc`` over ``proto/``) and never
committed. A checkout used before it (``pip install -e .`` then ``surgectl up``, as with any
Python project) failed deep in an import with "No module named 'surge'" (the generated files'
own package name), which names neither the folder nor the step that makes it. This module
imports nothing of Surge's, so it can be asked before the contract is imported.
"""

from __future__ import annotations

from pathlib import Path

GEN = Path(__file__).resolve().parent / "contract" / "gen"
_MARK = GEN / "surge" / "v1" / "control_pb2.py"  # (one file protoc writes; `make proto` writes them together)


def missing() -> str | None:
    """None when the generated code is there, else the one line that says what to run.

    Example: ``services/contract/gen has no generated gRPC code (surge/v1/control_pb2.py):
    run `make setup` in /src/surge (it generates it from proto/)``."""
    if _MARK.is_file():
        return None
    repo = GEN.parents[2]
    return (
        f"{GEN} has no generated gRPC code ({_MARK.relative_to(GEN)}): "
        f"run `make setup` in {repo} (it generates it from proto/)"
    )
