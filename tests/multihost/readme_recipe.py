"""The README's many-machine recipe, as the test bed runs it.

The bash block after "Many machines:" in README.md is split by its comment lines into the
part every node runs, the head node's, each GPU node's and the CLI's ("anywhere"). The bed
runs those lines as written, with the names replaced by the bed's: ``head.example`` and
``gpu-N.example`` by the hosts' addresses, ``gpu-N`` by the node's id, ``/srv/surge`` by the
host's own SURGE_HOME, ``...`` by a token. Lines marked ``# optional`` are left out (the
test bed runs without TLS certificates) unless a test asks for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Recipe:
    every: list[str] = field(default_factory=list)
    head: list[str] = field(default_factory=list)
    node: list[str] = field(default_factory=list)
    cli: list[str] = field(default_factory=list)


def read(readme: Path = REPO / "README.md") -> Recipe:
    text = readme.read_text()
    start = text.index("Many machines:")
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    if block is None:
        raise ValueError("README.md: no ```bash block after 'Many machines:'")
    recipe, part = Recipe(), None
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            heading = line.lower()
            part = (
                "every"
                if "every node" in heading
                else "head"
                if "head node" in heading
                else "node"
                if "gpu node" in heading
                else "cli"
                if "anywhere" in heading
                else None
            )
            if part is None:
                raise ValueError(f"README.md many-machine recipe: unknown section {line!r}")
            continue
        if part is None:
            raise ValueError(f"README.md many-machine recipe: a line before any section: {line!r}")
        getattr(recipe, part).append(line)
    return recipe


def script(lines: list[str], names: dict[str, str], optional: bool = False) -> str:
    """``lines`` with the README's names replaced (``names``: longest first), as one bash
    script; ``# optional`` lines dropped unless ``optional``."""
    out = []
    for line in lines:
        if "# optional" in line and not optional:
            continue
        for old in sorted(names, key=len, reverse=True):
            line = line.replace(old, names[old])
        out.append(line)
    return "\n".join(out) + "\n"
