"""A rank whose node agent is gone leaves with its exit code although its stdout and stderr
are pipes nobody reads any more (services/worker/rank_logs.py pipes them to the agent): the
last line and the flush before ``os._exit`` must not raise BrokenPipeError and strand it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.worker.rank_process import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

CHILD = """
import sys, time
from services.common.process_exit import exit_now, last_words
sys.stdin.readline()  # the parent closed the pipes' read ends: the reader is gone
last_words("rank: session to the node agent ended; exiting\\n")
sys.stdout.write("x")  # (buffered: PYTHONUNBUFFERED unset, so exit_now's flush meets the broken pipe)
exit_now(7)
"""


def test_a_rank_whose_log_pipes_lost_their_reader_still_exits_with_its_code():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        child.stdout.close()
        child.stderr.close()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 7
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
