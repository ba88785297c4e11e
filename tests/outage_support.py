"""Taking one test database away from its clients, and giving it back."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import make_url


class DatabaseSwitch:
    """Makes one test database unreachable: new connections refused, open sessions ended.

    Works the same over TCP and Unix sockets, for the machine's PostgreSQL and
    the embedded one.
    """

    def __init__(self, server_url: str, database_url: str) -> None:
        self.name = make_url(database_url).database
        self._admin = sa.create_engine(
            server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
        )

    def down(self) -> None:
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS false')
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": self.name},
            )

    def up(self) -> None:
        with self._admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{self.name}" ALLOW_CONNECTIONS true')

    def close(self) -> None:
        self.up()
        self._admin.dispose()
