"""The security suite shares the integration suite's real servers (loopback, port 0) on SQLite and,
when NTP_TEST_POSTGRES_URL is set, PostgreSQL."""

from ntp_manager.contract.logs import configure_logging
from tests.integration.conftest import db_url, service, sqlite_service  # noqa: F401  (fixtures)

# the service's own log set-up (plain tracebacks): some tests here make the manager log exceptions
configure_logging("console")
