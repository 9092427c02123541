"""What every gRPC call passes through besides auth: error mapping, capped error text, identity.

- `GuardInterceptor` wraps every handler: a ServiceError becomes its status code; anything else is
  logged with its traceback and answered INTERNAL with a fixed sentence, so no exception text (SQL,
  paths, values) reaches a client, and no failure ends a stream with OK.
- Error text sent in trailers is capped (`limits.cap_message`): trailers are metadata, and gRPC
  refuses metadata past ~8 KiB.
- `principal_of` and `peer_fingerprint` say who is calling: the token's principal, and the SHA-256
  of the client certificate when the call came over mTLS.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog

from ntp_manager.auth import Principal, parse_bearer
from ntp_manager.contract.limits import cap_message
from ntp_manager.rpc.tls import fingerprint_of_pem
from ntp_manager.service.core.errors import ServiceError, database_unreachable
from ntp_manager.service.leadership.leader import NotLeader

log = structlog.get_logger("ntp.rpc")

INTERNAL = "internal error; the manager's log has the details"


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    await context.abort(code, cap_message(message))


def code_of(err: ServiceError) -> grpc.StatusCode:
    code: grpc.StatusCode = getattr(grpc.StatusCode, err.grpc_code)
    return code


def principal_of(tokens: Any, context: grpc.aio.ServicerContext) -> Principal | None:
    header = dict(context.invocation_metadata() or ()).get("authorization")
    token = parse_bearer(header if isinstance(header, str) else None)
    found: Principal | None = tokens.verify(token) if token else None
    return found


def peer_fingerprint(context: grpc.aio.ServicerContext) -> str | None:
    """SHA-256 (hex) of the verified client certificate of this call, None without mTLS."""
    try:
        pems = context.auth_context().get("x509_pem_cert") or []
    except Exception:
        return None
    if not pems:
        return None
    return fingerprint_of_pem(pems[0])


class GuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/ntp.v1."):
            return handler  # health and reflection are grpc's own
        return _wrap(handler, details.method)


def _over(context: grpc.aio.ServicerContext, exc: BaseException) -> bool:
    """The call has ended already: the client went away, or a status could not be sent any more
    (grpc then raises its own errors from `abort`)."""
    try:
        if context.cancelled() or context.done():
            return True
    except Exception:  # a context that cannot say: treat the call as live
        return False
    return type(exc).__name__ in ("ExecuteBatchError", "UsageError")


async def _fail(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if _over(context, exc):
        # nobody is left to answer: end quietly (no second abort, no traceback). A storm of these
        # (a manager losing its lease with a thousand calls queued, clients gone) once held the
        # event loop for seconds just formatting tracebacks.
        log.info("rpc ended before its error could be sent", method=method, error=type(exc).__name__)
        raise asyncio.CancelledError
    if isinstance(exc, NotLeader) and exc.leader is not None and exc.leader.grpc:
        context.set_trailing_metadata((("ntp-leader", exc.leader.grpc),))  # where to go instead
    if isinstance(exc, ServiceError):
        await abort(context, code_of(exc), exc.message)
    unreachable = database_unreachable(exc)
    if unreachable is not None:
        log.warning("rpc failed: the database is out of reach", method=method,
                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        await abort(context, code_of(unreachable), unreachable.message)
    log.error("rpc failed", method=method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL)


_PASS = (asyncio.CancelledError, grpc.aio.AbortError)


def _wrap(handler: Any, method: str) -> Any:
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        inner = handler.stream_stream if handler.request_streaming else handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in inner(request, context):
                    yield item
            except _PASS:
                raise
            except Exception as e:
                await _fail(context, method, e)

        make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                else grpc.unary_stream_rpc_method_handler)
        return make(streaming, **kw)
    inner_u = handler.stream_unary if handler.request_streaming else handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await inner_u(request, context)
        except _PASS:
            raise
        except Exception as e:
            await _fail(context, method, e)

    make_u = grpc.stream_unary_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make_u(unary, **kw)
