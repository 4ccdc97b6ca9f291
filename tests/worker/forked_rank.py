"""A stand-in rank for the fork server's tests (tests/worker/test_rank_forkserver.py): its
``main(argv)`` does what its first argument names, as a forked rank, and reports what it is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> None:
    what = argv[0]
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                      "env": os.environ.get("FORKED_RANK_MARK"), "argv": argv, "stdin": sys.stdin.read()}),
          flush=True)  # fmt: skip
    if what == "exit":
        sys.exit(int(argv[1]))
    if what == "raise":
        raise RuntimeError("a rank's uncaught error")
    if what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        print("continued", flush=True)
    if what == "orphan":  # a helper that outlives the rank (a process the agent then adopts)
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
        print(json.dumps({"helper": helper.pid}), flush=True)
        os._exit(0)
    if what == "sleep":
        time.sleep(float(argv[1]))
    if what == "--session":  # launched by a node agent: alive a while, as a rank saying hello
        time.sleep(3.0)
