"""Errors of the data service. Every message is one line that says what and where.

The gRPC servicer maps them to status codes (``server.py``): not found -> NOT_FOUND,
corrupt -> FAILED_PRECONDITION, bad configuration -> INVALID_ARGUMENT, no documents ->
OUT_OF_RANGE, a failed read -> DATA_LOSS. Not found, a conflicting version and a bad
configuration are refusals (``Refusal``: the commander gets them as raised); the others are
failures of the module that raised them, with a typed ``failure_cause``.
"""

from __future__ import annotations

from services.contract.failures import FailureCause, Refusal
from services.contract.frozen import ConfigFrozen


class DataError(Exception):
    """Base class: a data-service failure with a one-line message."""


class DatasetNotFound(DataError, LookupError, Refusal):
    """``name@version`` is not prepared under the data root."""


class DatasetCorrupt(DataError):
    """A dataset version's files no longer match its manifest (or the manifest is broken)."""

    failure_cause = FailureCause.FAILURE_DATA_CORRUPT


class DatasetInUse(DataError, Refusal):
    """A version cannot be deleted while a stream of it is open (a rank reads it)."""


class VersionConflict(DataError, Refusal):
    """``prepare_dataset`` found ``name@version`` already prepared with different content."""


class InvalidConfig(DataError, ValueError, Refusal):
    """A command carried an unusable setting (``packer.seq_len: must be > 0, got 0``)."""


class ConfigAlreadyPushed(InvalidConfig, ConfigFrozen):
    """A stream's configuration (SetPrefetch, FilterRules, PackerConfig) was pushed a second
    time; it is fixed for the stream (``L4_FILTER: filter rules already set at init; ...``)."""


class NoDocuments(DataError):
    """A repeating stream's whole epoch yielded no batch (empty shard, or all filtered)."""

    failure_cause = FailureCause.FAILURE_EXHAUSTED


class DataReadError(DataError):
    """The prefetcher could not read what the index promised (short read, I/O error)."""

    failure_cause = FailureCause.FAILURE_IO
