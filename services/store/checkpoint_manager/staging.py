"""Part of L5-1 (the checkpoint manager): staging, one open save per job.

A fresh staging directory per save (abandoning the job's previous one), the claim a commit
makes on it, and after a restart the adoption of the single directory of a step found on
disk. The rules (attempts, superseded attempts) are in the package docstring.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

from services.contract.failures import writing
from services.store.checkpoint_manager.layout import (
    CheckpointRejected,
    _OpenSave,
)


class Staging:
    """The manager's staging directories (a mixin of CheckpointManager)."""

    def _staging_root(self, job: str) -> Path:
        return self._dir / job / ".staging"

    def _fresh_staging(self, job: str, step: int, attempt: str = "") -> _OpenSave:
        staging = self._staging_root(job)
        if staging.is_dir():
            for old in staging.iterdir():  # abandoned saves: nobody will commit them now
                shutil.rmtree(old, ignore_errors=True)
        path = staging / f"step-{step}-{secrets.token_hex(4)}"
        with writing(path):  # a full or read-only store: WriteRefused, typed from the errno
            path.mkdir(parents=True)
        save = _OpenSave(step=step, path=path, attempt=attempt)
        self._open[job] = save
        self._opened[job] = self._opened.get(job, 0) + 1  # (stops a sweep of the job in progress)
        return save

    def _claim(self, job: str, step: int, attempt: str = "") -> _OpenSave:
        """The open save of (job, step), marked committing. Caller holds the lock."""
        save = self._open.get(job)
        if save is None:
            save = self._adopt(job, step)
        if save.step != step:
            raise CheckpointRejected(
                f"checkpoint {job}: no open save of step {step} (the open save is step {save.step})"
            )
        if attempt and save.attempt and save.attempt != attempt:
            raise CheckpointRejected(
                f"checkpoint {job}: the open save of step {step} is attempt {save.attempt}'s, not {attempt}'s"
            )
        if save.committing:
            raise CheckpointRejected(f"checkpoint {job}: step {step} is already being committed")
        if not save.path.is_dir():
            raise CheckpointRejected(f"checkpoint {job}: step {step}: staging {save.path} is gone")
        save.committing = True
        self._open[job] = save
        return save

    def _adopt(self, job: str, step: int) -> _OpenSave:
        """After a restart: the single staging directory of (job, step) on disk, if any."""
        staging = self._staging_root(job)
        found = sorted(staging.glob(f"step-{step}-*")) if staging.is_dir() else []
        if len(found) != 1:
            raise CheckpointRejected(
                f"checkpoint {job}: no open save of step {step} (BeginSave first)"
                + (f"; {len(found)} staging directories match" if found else "")
            )
        return _OpenSave(step=step, path=found[0])
