"""Files rotated by size, as ``logging.handlers.RotatingFileHandler`` names them: ``<name>``
is being written, ``<name>.1`` is the newest full one, ``<name>.N`` the oldest kept. Rank logs
(services/worker/rank_logs.py) and the store's metric records (services/store/
metrics_logger.py) are rotated this way; their readers (`surgectl logs`, `surgectl plot`, a
node agent's log tail) read them oldest first with :func:`rotated_paths`."""

from __future__ import annotations

from pathlib import Path


def rotated_paths(path: Path) -> list[Path]:
    """``path``'s rotated files that exist, oldest first (``<name>.N`` .. ``<name>.1``), then
    ``path`` itself if it exists: the whole record in the order it was written."""
    rotated = []
    if path.parent.is_dir():
        for f in path.parent.glob(f"{path.name}.*"):
            suffix = f.name[len(path.name) + 1 :]
            if suffix.isdigit():
                rotated.append((int(suffix), f))
    return [f for _, f in sorted(rotated, reverse=True)] + ([path] if path.exists() else [])


def read_rotated(path: Path) -> str:
    """The text of ``path``'s rotated files and ``path``, oldest first (undecodable bytes
    replaced). A file rotated away between listing and reading is skipped."""
    parts = []
    for f in rotated_paths(path):
        try:
            parts.append(f.read_text(errors="replace"))
        except FileNotFoundError:
            continue
    return "".join(parts)
