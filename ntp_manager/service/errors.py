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
