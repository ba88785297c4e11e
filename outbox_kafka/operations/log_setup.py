"""``outbox-kafka log-setup``: what the log mode needs on the server, made once for an
outbox whose migrations have run: its publication, its replication slot, and
``pg_logical_emit_message`` taken from PUBLIC.

A slot the server has given up (``wal_status`` lost: it held more WAL than
``max_slot_wal_keep_size`` allows) is reported, never made again here: the events
it held are gone, and an operator drops it knowingly before running this again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.statements import queries_for

#: The first PostgreSQL major version whose logical slots can follow a failover.
FAILOVER_SLOTS_SINCE = 17


@dataclass
class LogSetup:
    """What ``log-setup`` found and did."""

    publication: str
    slot: str
    created_publication: bool = False
    created_slot: bool = False
    #: pg_logical_emit_message is no longer executable by PUBLIC (now or before).
    emit_revoked: bool = False
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "publication": self.publication,
            "slot": self.slot,
            "created_publication": self.created_publication,
            "created_slot": self.created_slot,
            "emit_revoked_from_public": self.emit_revoked,
            "warnings": list(self.warnings),
        }


def set_up_log(engine: Engine, names: TableNames, *, failover: bool = False) -> LogSetup:
    """Make the outbox's publication and slot where missing, and revoke
    ``pg_logical_emit_message`` from PUBLIC where this role may; say what could not be."""
    queries = queries_for(names)
    params = {"publication": names.log_publication, "slot": names.log_slot}
    done = LogSetup(names.log_publication, names.log_slot)
    with engine.connect() as conn:
        state = conn.execute(queries["log_server_state"], params).mappings().one()
        conn.rollback()
        if state["wal_level"] != "logical":
            raise ConfigurationError(
                f"wal_level is {state['wal_level']}, not logical: set wal_level = logical and "
                "restart the server before using the log mode"
            )
        if failover and state["major"] < FAILOVER_SLOTS_SINCE:
            raise ConfigurationError(
                f"--failover needs PostgreSQL {FAILOVER_SLOTS_SINCE} or later; this server is "
                f"{state['major']}, whose slots do not follow a failover"
            )
        if state["slot_wal_status"] == "lost":
            raise ConfigurationError(
                f"replication slot {names.log_slot} is lost (it held more WAL than "
                "max_slot_wal_keep_size allows): the events it held are gone. Drop it "
                f"(SELECT pg_drop_replication_slot('{names.log_slot}')) and run log-setup again"
            )
        if state["slot_plugin"] not in (None, "pgoutput"):
            raise ConfigurationError(
                f"replication slot {names.log_slot} exists with plugin "
                f"{state['slot_plugin']}, not pgoutput"
            )
        if not state["has_publication"]:
            with conn.begin():
                conn.execute(queries["create_log_publication"])
            done.created_publication = True
        if state["slot_plugin"] is None:
            if not state["may_replicate"]:
                raise ConfigurationError(
                    "this role may not create a replication slot: run log-setup as a role "
                    "with REPLICATION (the relay's role needs it too)"
                )
            name = "create_log_slot_failover" if failover else "create_log_slot"
            with conn.begin():
                conn.execute(queries[name], params)
            done.created_slot = True
        if state["public_may_emit"]:
            try:
                with conn.begin():
                    conn.execute(queries["revoke_emit_message"])
                done.emit_revoked = True
            except DBAPIError as exc:
                done.warnings.append(
                    "pg_logical_emit_message is still executable by PUBLIC (revoking it "
                    f"needs a superuser: {str(exc.orig).strip().splitlines()[0]}): any role "
                    "of this database can put events into the log for the relay to publish"
                )
        else:
            done.emit_revoked = True
    return done
