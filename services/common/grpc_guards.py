"""The servers' call guards (gRPC server interceptors, sync and asyncio): the caller's
module identity on every Surge RPC (services/common/identity.py), the bearer token on the
mutating methods (``SURGE_AUTH_TOKEN``), the principal of a tokens file (per-team access,
services/common/access.py), and the answer to a request that does not parse. Installed by
services/common/grpc_server.py's servers.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

from services.common import fencing
from services.common.access import CALLER, SERVICE, Identities, Principal, refused
from services.common.identity import MODULE_METADATA, CallerPolicy, Refused
from services.contract.failures import CAUSE_METADATA

AUTH_TOKEN_ENV = "SURGE_AUTH_TOKEN"

# RPCs that change state: they need the bearer token when SURGE_AUTH_TOKEN is set.
MUTATING_METHODS = frozenset(
    [
        f"/surge.v1.ControlService/{m}"
        for m in (
            "SubmitJob",
            "PauseJob",
            "ResumeJob",
            "ScaleJob",
            "StopJob",
            "DeleteJob",
            "RevokeOrder",
            "AnnotateJob",
            "ProfileJob",
            "SetTeamQuota",
            "DrainWorker",
        )
    ]
    + ["/surge.v1.StoreService/Delete", "/surge.v1.DataService/Delete"]
)


class _Malformed:
    """Stands in for a request that did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception):
        self.error = error


_log = structlog.get_logger("grpc")
_POLICY: CallerPolicy | None = None


def _policy() -> CallerPolicy:
    global _POLICY
    if _POLICY is None:
        _POLICY = CallerPolicy()
    return _POLICY


def _certificate_names(context) -> list[str] | None:
    """The client certificate's CN and subject-alternative names; None without one."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - a context without a transport (in-process tests)
        return None
    if "x509_pem_cert" not in auth and "x509_common_name" not in auth:
        return None
    return [
        v.decode() if isinstance(v, bytes) else str(v)
        for key in ("x509_common_name", "x509_subject_alternative_name")
        for v in auth.get(key, ())
    ]


def _claim(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == MODULE_METADATA:
            return value if isinstance(value, str) else value.decode()
    return None


def _identify(method: str, context) -> tuple[grpc.StatusCode, str, tuple] | None:
    """None when the caller's identity holds; else the refusal (code, details, trailers).
    A caller that names an older generation of its rank than the newest this process was
    told of is refused too (FAILED_PRECONDITION, cause ``FAILURE_FENCED``: fencing.py)."""
    try:
        _policy().check(method, _claim(context), _certificate_names(context))
    except Refused as e:
        from services.contract.audit import VIOLATION_METADATA, violation_event
        from services.contract.bus import BOUNDARY_VIOLATIONS, TRAFFIC, BoundaryViolation

        error = BoundaryViolation(e.sender, e.message, None)
        TRAFFIC.refused(e.sender, e.message, None)
        BOUNDARY_VIOLATIONS.labels(_module_label(e.sender), e.message).inc()
        _log.error("call refused: identity", method=method, error=str(e))
        event = violation_event(error, f"{method} server")
        event.detail = str(e)
        return grpc.StatusCode.PERMISSION_DENIED, str(e), ((VIOLATION_METADATA, event.SerializeToString()),)
    stale = fencing.check_call(context.invocation_metadata(), method.rsplit("/", 1)[-1])
    if stale is not None:
        _log.warning("call refused: stale generation", method=method, error=str(stale))
        return grpc.StatusCode.FAILED_PRECONDITION, f"{method}: {stale}", ((CAUSE_METADATA, "FAILURE_FENCED"),)
    return None


def _module_label(module: int) -> str:
    from services.contract import Module

    return Module.Name(module) if module in Module.values() else "MODULE_UNSPECIFIED"


def _guard_identity(handler, method: str):
    """``handler`` preceded by the identity check, of the same kind (sync or asyncio,
    function or generator) so each server runs it where it ran the handler."""

    def wrap(behavior: Callable, streaming: bool) -> Callable:
        if inspect.iscoroutinefunction(behavior):

            async def coroutine(request, context):
                refused = _identify(method, context)
                if refused:
                    context.set_trailing_metadata(refused[2])
                    await context.abort(refused[0], refused[1])
                return await behavior(request, context)

            return coroutine
        if inspect.isasyncgenfunction(behavior):

            async def agen(request, context):
                refused = _identify(method, context)
                if refused:
                    context.set_trailing_metadata(refused[2])
                    await context.abort(refused[0], refused[1])
                async for response in behavior(request, context):
                    yield response

            return agen
        if inspect.isgeneratorfunction(behavior):

            def gen(request, context):
                refused = _identify(method, context)
                if refused:
                    context.set_trailing_metadata(refused[2])
                    context.abort(refused[0], refused[1])
                yield from behavior(request, context)

            return gen

        def plain(request, context):
            refused = _identify(method, context)
            if refused:
                context.set_trailing_metadata(refused[2])
                context.abort(refused[0], refused[1])
            return behavior(request, context)

        return plain

    return _replace(handler, wrap)


def _authenticate(handler, method: str, identities: Identities, token: str | None = None):
    """``handler`` run as the call's principal (``CALLER`` set around it), or refused
    UNAUTHENTICATED (counted) when the call names none; of the same kind as the handler (sync
    or asyncio, function or generator), as ``_guard_identity``.

    Only a call that claims the operator (EXT_USER) is a person's: a Surge process's call to
    the same RPC (a rank's or control's Load and Verify on the store) runs as
    :data:`~services.common.access.SERVICE`, and needs the server's own ``token`` (the cluster's
    SURGE_AUTH_TOKEN) where it has one, so that a person cannot pass as a rank to read another
    team's objects. Without that token, a process's call that carries a token of the tokens file
    runs as that token's principal (a team's token claiming a rank's module writes and reads as
    its team, never as a process); one without runs as SERVICE, as before. Which module a caller
    may claim at all is ``_guard_identity``'s check."""
    call = method.rpartition("/")[2] or method  # (the RPC's name, not its path: a user reads it)
    message = (
        f"{call}: not authenticated: no token or certificate the tokens file names was sent "
        f"(surgectl sends {AUTH_TOKEN_ENV}: unset, unknown or revoked)"
    )

    def principal(context) -> Principal | None:
        metadata = context.invocation_metadata()
        if _claim(context) != "EXT_USER":
            if token is None:
                return identities.authenticate(metadata, None) or SERVICE
            if _bearer_matches(metadata, token):
                return SERVICE
            refused(method, "unauthenticated")
            return None
        found = identities.authenticate(metadata, _certificate_names(context))
        if found is None:
            refused(method, "unauthenticated")
        return found

    def wrap(behavior: Callable, streaming: bool) -> Callable:
        if inspect.iscoroutinefunction(behavior):

            async def coroutine(request, context):
                p = principal(context)
                if p is None:
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                token = CALLER.set(p)
                try:
                    return await behavior(request, context)
                finally:
                    CALLER.reset(token)

            return coroutine
        if inspect.isasyncgenfunction(behavior):

            async def agen(request, context):
                p = principal(context)
                if p is None:
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                # (not reset: grpc.aio serves each call in a task of its own, whose context
                # ends with it; a reset from a generator closed elsewhere would raise)
                CALLER.set(p)
                async for response in behavior(request, context):
                    yield response

            return agen
        if inspect.isgeneratorfunction(behavior):

            def gen(request, context):
                p = principal(context)
                if p is None:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
                responses = behavior(request, context)
                while True:  # set around each step: a server may run them on different threads
                    token = CALLER.set(p)
                    try:
                        response = next(responses)
                    except StopIteration:
                        return
                    finally:
                        CALLER.reset(token)
                    yield response

            return gen

        def plain(request, context):
            p = principal(context)
            if p is None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            token = CALLER.set(p)
            try:
                return behavior(request, context)
            finally:
                CALLER.reset(token)

        return plain

    return _replace(handler, wrap)


class CallGuard(grpc.ServerInterceptor):
    """Bearer token on the mutating methods; the caller's identity on every Surge RPC; a
    clear status for unparseable requests."""

    def __init__(self, token: str | None, identities: Identities | None = None, every_call: bool = False):
        """``every_call``: a tokens file authenticates every Surge RPC, the processes' too (the
        store: a rank's writes name a job, whose team the caller must be; see _authenticate),
        not only those the operator may call."""
        self._token, self._identities, self._every_call = token, identities, every_call

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self._for_principals(method):
            handler = _guard_identity(_authenticate(handler, method, self._identities, self._token), method)
            return _guard_parsing(handler, method)
        if self._token and method in MUTATING_METHODS and not self._authorized(handler_call_details):
            return _replace(
                handler,
                lambda behavior, streaming: _refuse(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{method}: not authorized: send 'authorization: Bearer <token>' with the server's token "
                    f"(Surge clients and surgectl: set {AUTH_TOKEN_ENV})",
                ),
            )
        if _policy().governs(method):
            handler = _guard_identity(handler, method)
        return _guard_parsing(handler, method)

    def _for_principals(self, method: str) -> bool:
        """Whether a tokens file authenticates ``method``: every RPC the operator may call
        (its principals replace the single token there)."""
        from services.contract import Module

        return (
            self._identities is not None
            and _policy().governs(method)
            and (self._every_call or Module.EXT_USER in _policy().callers(method))
        )

    def _authorized(self, details) -> bool:
        return _bearer_matches(details.invocation_metadata, self._token)


def _bearer_matches(metadata, token: str) -> bool:
    """Whether the call's bearer token is ``token`` (compared in constant time)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return hmac.compare_digest(value[len("Bearer ") :].encode(), token.encode())
    return False


def _kind(handler) -> tuple[str, bool]:
    """(the handler's behavior attribute, whether its requests stream)."""
    for attr, streaming in (
        ("unary_unary", False),
        ("unary_stream", False),
        ("stream_unary", True),
        ("stream_stream", True),
    ):
        if getattr(handler, attr) is not None:
            return attr, streaming
    raise ValueError("handler without behavior")


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _replace(handler, wrap: Callable[[Callable, bool], Callable], deserializer: Callable | None = None):
    attr, streaming = _kind(handler)
    return _FACTORIES[attr](
        wrap(getattr(handler, attr), streaming),
        request_deserializer=deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _refuse(code: grpc.StatusCode, message: str, asynchronous: bool = False) -> Callable:
    if asynchronous:

        async def refuse(request_or_iterator, context):
            await context.abort(code, message)

        return refuse

    def behavior(request_or_iterator, context):
        context.abort(code, message)

    return behavior


def _is_async(behavior: Callable) -> bool:
    """Whether a grpc.aio server awaits ``behavior`` on its loop (else: its thread pool)."""
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


def _guard_parsing(handler, method: str):
    deserialize = handler.request_deserializer
    if deserialize is None:
        return handler

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's malformed request
            return _Malformed(e)

    def message(bad: _Malformed) -> str:
        return f"{method}: malformed request: cannot parse the message ({type(bad.error).__name__})"

    def wrap(behavior: Callable, streaming: bool) -> Callable:
        if _is_async(behavior):
            return _guard_async(behavior, streaming, message)
        if not streaming and inspect.isgeneratorfunction(behavior):
            # Same kind as the handler: the asyncio server runs a sync generator in its
            # thread pool, but a plain function returning an iterator on its loop, where
            # the blocking abort() then deadlocks the whole server.
            def unary_stream(request, context):
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                yield from behavior(request, context)

            return unary_stream
        if not streaming:

            def unary(request, context):
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                return behavior(request, context)

            return unary

        def checked(requests: Iterator, context) -> Iterator:
            for request in requests:
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
                yield request

        def stream(requests, context):
            return behavior(checked(requests, context), context)

        return stream

    return _replace(handler, wrap, deserializer=parse)


def _guard_async(behavior: Callable, streaming: bool, message: Callable[[_Malformed], str]) -> Callable:
    """The parse guard around an asyncio handler, of the same kind (coroutine or async
    generator), so that the aio server still awaits it on its loop."""

    async def requests_checked(requests, context):
        async for request in requests:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
            yield request

    async def checked_request(request, context):
        if not streaming and isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message(request))
        return requests_checked(request, context) if streaming else request

    if inspect.isasyncgenfunction(behavior):

        async def responses(request, context):
            async for response in behavior(await checked_request(request, context), context):
                yield response

        return responses

    async def response(request, context):
        return await behavior(await checked_request(request, context), context)

    return response


class AioCallGuard(grpc.aio.ServerInterceptor):
    """``CallGuard`` for a grpc.aio server (which takes only asyncio interceptors)."""

    def __init__(self, token: str | None, identities: Identities | None = None, every_call: bool = False):
        self._sync = CallGuard(token, identities, every_call)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if self._sync._for_principals(method):
            handler = _guard_identity(_authenticate(handler, method, self._sync._identities, self._sync._token), method)
            return _guard_parsing(handler, method)
        if self._sync._token and method in MUTATING_METHODS and not self._sync._authorized(handler_call_details):
            return _replace(
                handler,
                lambda behavior, streaming: _refuse(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{method}: not authorized: send 'authorization: Bearer <token>' with the server's token "
                    f"(Surge clients and surgectl: set {AUTH_TOKEN_ENV})",
                    asynchronous=_is_async(behavior),
                ),
            )
        if _policy().governs(method):
            handler = _guard_identity(handler, method)
        return _guard_parsing(handler, method)
