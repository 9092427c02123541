"""A call whose database connection fails under it (the server restarted, a new leader ended the
session, an idle-in-transaction timeout on a loaded machine) is answered UNAVAILABLE / 503, telling
the client to try again or go elsewhere, never INTERNAL / 500; an error of any other kind stays
INTERNAL / 500. Neither answer carries the exception's text (SQL)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from ntp_manager.contract.proto.ntp.v1 import worker_pb2, worker_pb2_grpc
from ntp_manager.service.errors import database_unreachable
from tests.integration.conftest import Service

SQL = "SELECT secret_column FROM tokens"


class _Dropped(Exception):
    pass


def dropped() -> DBAPIError:
    """What SQLAlchemy raises for a session the server ended (asyncpg's error, wrapped)."""
    return DBAPIError(SQL, {}, _Dropped("terminating connection due to idle-in-transaction timeout"),
                      connection_invalidated=True)


@pytest.mark.parametrize(("exc", "unavailable"), [
    (OperationalError(SQL, {}, Exception("connection refused")), True),
    (dropped(), True),
    (ConnectionResetError("reset by peer"), True),
    (TimeoutError(), True),
    (DBAPIError(SQL, {}, Exception("numeric overflow")), False),  # the connection is fine: a bug
    (ProgrammingError(SQL, {}, Exception("no such column")), False),
    (ValueError("x"), False),
])
def test_which_errors_say_the_database_is_out_of_reach(exc: BaseException, unavailable: bool) -> None:
    got = database_unreachable(exc)
    assert (got is not None) == unavailable
    if got is not None:
        assert got.grpc_code == "UNAVAILABLE" and got.http_status == 503 and "SELECT" not in got.message


def failing(monkeypatch: pytest.MonkeyPatch, target: Any, method: str) -> list[BaseException]:
    """Make `target`'s `method` raise what the returned list holds (a dropped connection first)."""
    raised: list[BaseException] = [dropped()]

    async def fail(*_: Any, **__: Any) -> Any:
        raise raised[0]

    monkeypatch.setattr(target, method, fail)
    return raised


async def test_rest_answers_503_for_a_dropped_connection_and_500_for_a_bug(
        sqlite_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    raised = failing(monkeypatch, sqlite_service.manager, "list_tokens")
    async with sqlite_service.client("admin") as c:
        r = await c.get("/v1/tokens")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "cannot reach its database" in r.json()["detail"] and "SELECT" not in r.text
        raised[0] = ProgrammingError(SQL, {}, Exception("no such column"))
        r = await c.get("/v1/tokens")
        assert r.status_code == 500 and "SELECT" not in r.text


async def test_grpc_answers_unavailable_for_a_dropped_connection_and_internal_for_a_bug(
        sqlite_service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    raised = failing(monkeypatch, sqlite_service.manager.watch_door, "report_steps")
    md = (("authorization", f"Bearer {sqlite_service.tokens['worker']}"),)
    async with grpc.aio.insecure_channel(sqlite_service.grpc) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)  # type: ignore[no-untyped-call]
        req = worker_pb2.StepReport(job="j", worker_id="w", step=1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReportSteps(req, metadata=md)
        details = err.value.details() or ""
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "cannot reach its database" in details and "SELECT" not in details
        raised[0] = ProgrammingError(SQL, {}, Exception("no such column"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReportSteps(req, metadata=md)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "SELECT" not in (err.value.details() or "")
