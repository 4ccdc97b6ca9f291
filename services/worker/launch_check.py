"""What a node agent checks before it starts a rank: that the programs the rank will run exist
here. Today one: an evaluation job's command (JobSpec.evaluation.command, which the rank runs
once the version's weights are loaded and exported: a missing one was found only after the
queue wait, the load and the export, services/rank/evaluation_command.py). A launch refused
here, like a spawn whose executable is missing (ENOENT, EACCES, ENOEXEC), is reported as
``RankExited`` with cause ``EXIT_NOT_STARTED``: permanent, decided by L1-1 (the job stops
FAILED), no restart spent on it (services/worker/rank_launcher.py)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Mapping

# A spawn's errno that says the program itself cannot be run (not the host short of
# processes or memory: EAGAIN, ENOMEM stay a plain rank_exit, which a relaunch may cure).
NOT_STARTED_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOEXEC, errno.EISDIR})


def spawn_not_started(e: OSError) -> bool:
    """Whether a spawn's ``e`` says its executable cannot be run here (typed by errno)."""
    return e.errno in NOT_STARTED_ERRNOS


def evaluation_command_missing(spec_json: str, env: Mapping[str, str]) -> str:
    """Why an evaluation job's command cannot start on this node ("": it can, or this is no
    evaluation job, or its program is only known at run time). Its program (the command's first
    word) is looked up as the rank will run it: an absolute path must be an executable file; a
    bare name must be on ``env``'s PATH. A relative path with a slash (resolved in the
    evaluation's own directory) or one with ``$`` (expanded by the rank) is left to the rank."""
    try:
        evaluation = json.loads(spec_json or "{}").get("evaluation")
        program = str(evaluation["command"][0]) if evaluation else ""
    except (ValueError, AttributeError, KeyError, IndexError, TypeError):
        return ""  # (not a spec this agent reads: the rank itself refuses it, one line)
    if not program or "$" in program:
        return ""
    if os.path.isabs(program):
        if not os.path.isfile(program):
            return f"evaluation command `{program}`: no such file on this node"
        if not os.access(program, os.X_OK):
            return f"evaluation command `{program}`: not executable"
        return ""
    if "/" in program:
        return ""
    if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        return f"evaluation command `{program}`: not found on this node's PATH"
    return ""
