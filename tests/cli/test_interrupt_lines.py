"""Ctrl-C of a command while control does not answer: one line on stderr saying what may
have happened and what to run, exit 130 (was: exit 130 with nothing said when the Ctrl-C
landed in the job-name lookup, before the command's own interruption line was armed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["pause", "j"], "interrupted while looking up job 'j': nothing was asked of it yet; `surgectl pause j` again"),
        (["stop", "j"], "`surgectl stop j` again"),
        (["scale", "j", "--dp", "2"], "`surgectl scale j --dp 2` again"),
        (["status", "j"], "`surgectl status j` again"),
        (["status"], "interrupted: status only reads, nothing was changed; `surgectl status` again"),
    ],
)
def test_ctrl_c_while_control_does_not_answer_says_one_line(argv, says, tmp_path):
    silent = socket.socket()  # accepts the connection, never answers: a hung control
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(120)
    env = {**os.environ, "SURGE_HOME": str(tmp_path), "SURGE_CONTROL_ADDRESS": f"127.0.0.1:{silent.getsockname()[1]}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.surgectl", *argv],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        conn, _ = silent.accept()  # the command is in its first call to control
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        silent.close()
    assert proc.returncode == 130 and err.count("\n") == 1 and says in err, (proc.returncode, err)
