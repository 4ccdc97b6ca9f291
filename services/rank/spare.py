"""A warm spare rank process: everything a rank imports is imported, then it waits to be told
which rank to become.

    python -m services.rank.spare        (started by the node agent, stdin a pipe)

Why: a replacement rank's start is dominated by the interpreter importing torch and the rank's
modules (2-3 s on an idle core, 10 s on a loaded 2-core host, measured); a group rebuilt in
place (issue 16) waits for it. A node agent running a job that rebuilds in place keeps one
spare ready (services/worker/warm_spares.py) and hands it the next launch instead of starting
a new interpreter.

The agent writes one JSON line on stdin: ``{"argv": [...], "env": {...}, "log": "<path>"}``
(the rank's command-line arguments, its environment and its log file, exactly what a fresh
rank process would have had). The spare takes the environment (nothing has read the device
or thread settings yet: CUDA is initialised lazily, torch's threads are set from the
assignment), sends its output to the log file and runs the rank's ``main``. End of input
without a line (the agent is gone, or it retired the spare) ends the process.
"""

from __future__ import annotations

import json
import os
import sys
import time

_STARTED = time.perf_counter()

# The imports a rank pays for at start, paid here before any rank is needed.
import setproctitle  # noqa: E402
import torch  # noqa: E402, F401
import torch.distributed  # noqa: E402, F401
import torch.nn.parallel  # noqa: E402, F401

import services.rank.__main__ as rank  # noqa: E402
from services.common.process_exit import exit_now  # noqa: E402
from services.rank import data_client, memory_client, store_client  # noqa: E402, F401


def main() -> None:
    # In the agent's spares log: when this spare is warm (a launch that takes it before then
    # waits for the rest of its imports), and what they cost.
    ready = {"event": "spare_ready", "pid": os.getpid(), "import_seconds": round(time.perf_counter() - _STARTED, 3)}
    print(json.dumps(ready), flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        exit_now(0)
    order = json.loads(line)
    # Seen as the rank it is now (`ps`, `pkill -f "rank --job J --rank R"`), not as a spare.
    # (Before the environment is replaced: setproctitle needs the process's original one.)
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "services.rank", *order["argv"]]))
    os.environ.clear()
    os.environ.update(order["env"])
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # as a freshly started rank: nothing on stdin
    os.close(null)
    rank.main(order["argv"])


if __name__ == "__main__":
    main()
