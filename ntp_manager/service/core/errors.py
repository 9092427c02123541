"""Errors the service raises for bad requests; REST and gRPC map them to 4xx / status codes."""

from __future__ import annotations


class ServiceError(Exception):
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServiceError):
    http_status = 422
    grpc_code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    http_status = 404
    grpc_code = "NOT_FOUND"


class Conflict(ServiceError):
    http_status = 409
    grpc_code = "ALREADY_EXISTS"


class FailedPrecondition(ServiceError):
    http_status = 409
    grpc_code = "FAILED_PRECONDITION"


class PermissionDenied(ServiceError):
    """The caller is who it says, but may not do this (e.g. an agent token used for another node)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"


class ResourceExhausted(ServiceError):
    """Accepting this would take the manager past a configured size (e.g. `max_cluster_gpus`)."""

    http_status = 409
    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    """This manager cannot do it right now (it cannot reach its database): the client tries another."""

    http_status = 503
    grpc_code = "UNAVAILABLE"


def database_unreachable(exc: BaseException) -> Unavailable | None:
    """An error that says the database could not be reached or dropped the call: the connection
    failed, was closed or ended by the server (a restart; a session ended by a new leader; an
    idle-in-transaction timeout on a loaded machine), or a call timed out. The client gets
    UNAVAILABLE / 503 and tries again (another manager, in fleet mode); anything else that escapes
    a handler stays INTERNAL / 500. Either way the exception's text (SQL, values) stays in the log."""
    from sqlalchemy import exc as sa_exc  # the manager's dependency; this module stays importable without it

    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
                        OSError, TimeoutError)) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated):
        return Unavailable("this manager cannot reach its database right now; try again, or another manager")
    return None
