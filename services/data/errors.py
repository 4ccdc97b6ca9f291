"""Errors of the data service. Every message is one line that says what and where.

The gRPC servicer maps them to status codes (``server.py``): not found -> NOT_FOUND,
corrupt -> FAILED_PRECONDITION, bad configuration -> INVALID_ARGUMENT, no documents ->
OUT_OF_RANGE, a failed read -> DATA_LOSS.
"""

from __future__ import annotations

from services.contract.frozen import ConfigFrozen


class DataError(Exception):
    """Base class: a data-service failure with a one-line message."""


class DatasetNotFound(DataError, LookupError):
    """``name@version`` is not prepared under the data root."""


class DatasetCorrupt(DataError):
    """A dataset version's files no longer match its manifest (or the manifest is broken)."""


class VersionConflict(DataError):
    """``prepare_dataset`` found ``name@version`` already prepared with different content."""


class InvalidConfig(DataError, ValueError):
    """A command carried an unusable setting (``packer.seq_len: must be > 0, got 0``)."""


class ConfigAlreadyPushed(InvalidConfig, ConfigFrozen):
    """A stream's configuration (SetPrefetch, FilterRules, PackerConfig) was pushed a second
    time; it is fixed for the stream (``L4_FILTER: filter rules already set at init; ...``)."""


class NoDocuments(DataError):
    """A repeating stream's whole epoch yielded no batch (empty shard, or all filtered)."""


class DataReadError(DataError):
    """The prefetcher could not read what the index promised (short read, I/O error)."""
