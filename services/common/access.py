"""Who is calling, as a person of a team: control's tokens file (issue 30 item 6).

A tokens file (control ``--tokens FILE`` / ``SURGE_TOKENS_FILE``) names the principals that may
use control's user port, each bound to a team with a role::

    principals:
      - name: alice                 # who (in refusals and logs)
        team: vision                # the team whose jobs it sees and controls
        role: user                  # user (default) | admin: every job, nodes, quotas
        token_sha256: 5e88...       # SHA-256 of its bearer token (`surgectl token new`)
      - name: ci-runner
        team: nlp
        certificate: ci-runner.nlp  # a client certificate's CN or DNS SAN (mutual TLS)

The store reads the same file (``--tokens`` / ``SURGE_TOKENS_FILE``): a team's checkpoints and
metrics are its own there too (services/store/access.py).

Only a token's digest is stored: the file gives nobody a token. A call presents its token as
``authorization: Bearer <token>`` (surgectl and every Surge client send SURGE_AUTH_TOKEN so);
its digest is compared with every principal's in constant time (``hmac.compare_digest``,
no early exit). A call without a token is the principal its client certificate names, if
any. A token that names no principal is refused even with a certificate: a wrong token is a
mistake to say, not to paper over.

The server's interceptor (services/common/grpc_guards.py) authenticates every call to an RPC
the operator (EXT_USER) may call, answers UNAUTHENTICATED for one that names no principal,
and runs the handler with :data:`CALLER` set: what the handler may do for whom is its
service's rule (control: services/control/access.py). Without a tokens file nothing here
runs: the single SURGE_AUTH_TOKEN guards the mutating RPCs as before.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import secrets
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import yaml
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.jobspec_errors import field_error

TOKENS_FILE_ENV = "SURGE_TOKENS_FILE"
# The same pattern as a job spec's `team` (services/jobspec): a principal's team is a job's team.
TEAM_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
# Names a certificate of Surge's own holds (services/common/identity.py ROLE_MODULES): every
# operator's or process's certificate carries one, so none may stand for one person.
_SHARED_CERTIFICATE_NAMES = frozenset({"surge-control", "surge-worker", "surge-data", "surge-store", "surge-user"})

# Every refusal of access, by the RPC's short name and why: unauthenticated (no principal),
# other_team (a job of another team), admin_only (nodes, quotas), spec_team (a submit naming
# another team). Served on control's /metrics.
ACCESS_REFUSED = Counter(
    "surge_control_access_refused_total", "Calls refused by per-team access control.", ["method", "reason"]
)
_log = structlog.get_logger("access")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: ``name`` (who), ``team``, ``role`` (``user`` | ``admin``)."""

    name: str
    team: str
    role: str = "user"

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def service(self) -> bool:
        """A Surge process, not a person (:data:`SERVICE`)."""
        return self.role == "service"


# A Surge process's call (a rank, control) to an RPC the operator may call too (the store's
# Load, Verify): no person's, authenticated by the cluster's token (services/common/grpc_guards.py);
# each service's gate lets it through, as the route table does.
SERVICE = Principal("surge-service", "", "service")

# The principal of the call the current handler serves (set by the server's interceptor
# around the handler; None: no tokens file, or a call outside the user port).
CALLER: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("surge_caller", default=None)


def refused(method: str, reason: str, **fields) -> None:
    """Count and log one refusal (``method``: the RPC's path or short name)."""
    short = method.rsplit("/", 1)[-1]
    ACCESS_REFUSED.labels(short, reason).inc()
    _log.warning("access refused", method=short, reason=reason, **fields)


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
    team: str = Field(pattern=TEAM_PATTERN)
    role: Literal["user", "admin"] = "user"
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    certificate: str | None = Field(None, min_length=1, max_length=253)

    @model_validator(mode="after")
    def _some_credential(self) -> _Entry:
        if self.token_sha256 is None and self.certificate is None:
            raise ValueError("needs token_sha256 (`surgectl token new` prints one) or certificate")
        if self.certificate in _SHARED_CERTIFICATE_NAMES:
            raise ValueError(
                f"certificate: {self.certificate!r} is a Surge role every such certificate holds; "
                "name the certificate's own CN or DNS SAN"
            )
        return self


class _TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    principals: list[_Entry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> _TokensFile:
        for field in ("name", "token_sha256", "certificate"):
            seen: set[str] = set()
            for i, entry in enumerate(self.principals):
                value = getattr(entry, field)
                if value is not None and value in seen:
                    raise ValueError(f"principals.{i}.{field}: {value!r} is named twice")
                seen.add(value)
        return self


class TokensFileError(ValueError):
    """The tokens file cannot be read or is invalid: one line naming the file and the field."""


class Identities:
    """The principals of a tokens file, by token digest and certificate name.

    Raises (constructor, via :func:`load_tokens`): TokensFileError.
    """

    def __init__(self, entries: Iterable[_Entry], source: str = "tokens file"):
        self.source = source
        self._set(entries)

    def _set(self, entries: Iterable[_Entry]) -> None:
        by_digest: list[tuple[bytes, Principal]] = []
        by_certificate: dict[str, Principal] = {}
        for e in entries:
            p = Principal(e.name, e.team, e.role)
            if e.token_sha256:
                by_digest.append((e.token_sha256.encode(), p))
            if e.certificate:
                by_certificate[e.certificate] = p
        # One assignment: a call authenticated meanwhile sees the old principals or the new.
        self._principals = (tuple(by_digest), by_certificate)

    def reload(self) -> int:
        """Read the file again (control on SIGHUP: a token added or revoked without a
        restart); the principals it now names replace the old at once. Returns how many.

        Raises:
            TokensFileError: the file is now unreadable or invalid; the old principals stay.
        """
        entries = _read(self.source)
        self._set(entries)
        return len(entries)

    def authenticate(self, metadata, certificate_names: Iterable[str] | None) -> Principal | None:
        """The principal of a call: its bearer token's (every digest compared, in constant
        time), else its client certificate's (CN or DNS SAN); None when neither names one
        (a token that names none: None, whatever the certificate)."""
        by_digest, by_certificate = self._principals
        token = _bearer(metadata)
        if token is not None:
            digest = token_digest(token).encode()
            found = None
            for stored, principal in by_digest:
                if hmac.compare_digest(digest, stored):  # (no early exit: the time is the same)
                    found = principal
            return found
        matches = {by_certificate[n] for n in certificate_names or () if n in by_certificate}
        return matches.pop() if len(matches) == 1 else None


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return None


def token_digest(token: str) -> str:
    """The SHA-256 hex digest a tokens file stores for ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh bearer token: 256 random bits, URL-safe (``secrets.token_urlsafe``)."""
    return "surge_" + secrets.token_urlsafe(32)


def entry_line(name: str, team: str, role: str, token: str) -> str:
    """The tokens file's list item for a principal holding ``token`` (flow style, one line).

    Raises:
        TokensFileError: ``name``, ``team`` or ``role`` is not valid in a tokens file.
    """
    try:
        _Entry(name=name, team=team, role=role, token_sha256=token_digest(token))
    except ValidationError as e:
        raise TokensFileError(_error_text(e)) from None
    return f"  - {{name: {name}, team: {team}, role: {role}, token_sha256: {token_digest(token)}}}"


def _error_text(e: ValidationError) -> str:
    err = e.errors()[0]
    if not err["loc"] and err["type"] == "value_error":  # a whole-file rule: its message names the field
        return err["msg"].removeprefix("Value error, ")
    return field_error(err)


def reload_tokens(identities: Identities, log) -> None:
    """SIGHUP (control, store): the tokens file read again (a token added or revoked, no
    restart); a file now invalid is logged in one line and the principals read before stay."""
    try:
        count = identities.reload()
    except TokensFileError as e:
        log.error("tokens file not reloaded: the previous principals stay", error=str(e))
        return
    log.info("tokens file reloaded", tokens=identities.source, principals=count)


def load_tokens(path: str | Path) -> Identities:
    """Read and validate a tokens file.

    Raises:
        TokensFileError: unreadable, not YAML, or invalid (one line: ``FILE: principals.1.team:
            ...``).
    """
    return Identities(_read(str(path)), str(path))


def _read(source: str) -> list[_Entry]:
    try:
        text = Path(source).read_text()
    except OSError as e:
        raise TokensFileError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        raw = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # (libyaml: ~10x faster)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise TokensFileError(f"{source}: not valid YAML{where}") from None
    try:
        parsed = _TokensFile.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        raise TokensFileError(f"{source}: {_error_text(e)}") from None
    return parsed.principals


def tokens_of_flag(path: str | Path | None) -> Identities | None:
    """A service's ``--tokens FILE`` (or TOKENS_FILE_ENV) at its start: None without one; a bad
    file is one line on stderr naming it and the field, and exit 2 (nothing started)."""
    if not path:
        return None
    try:
        return load_tokens(path)
    except TokensFileError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
