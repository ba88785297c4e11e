"""``outbox-kafka check --source log``: what the log mode needs of the server, one line each.

* ``wal_level``: logical, or no message can be decoded.
* ``replication role``: the relay's role may stream a slot (REPLICATION or superuser).
* ``publication`` and ``replication slot``: as ``log-setup`` makes them; the slot's
  plugin, whether a relay reads it now, the WAL it holds back, and its ``wal_status``.
  A lost slot (past ``max_slot_wal_keep_size``) fails, with what it cost: the
  events it held are gone, and nothing here makes it again.
* ``slot WAL limit``: ``max_slot_wal_keep_size``, and how much more WAL the slot may
  hold before the server gives it up (unlimited: until the disk fills).
* ``slot failover``: whether the slot follows a failover (PostgreSQL 17 and later,
  made with ``log-setup --failover``); before 17 no slot does.
* ``emit privilege``: ``pg_logical_emit_message`` taken from PUBLIC, or any role of
  the database can put events into the log for the relay to publish.

And :func:`log_pending_topics`: the topics of the events the slot holds, peeked at
without consuming them, for ``check`` to look for on the broker as it does the
tables' pending events (the relay stalls at an event for a missing topic).

The lines that say how things stand rather than what is wrong (the WAL limit,
failover) pass; the detail says what follows from them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox_kafka.errors import OutboxError
from outbox_kafka.log_frames import FrameError, decode_frame
from outbox_kafka.naming import TableNames
from outbox_kafka.operations.diagnosis import (
    PENDING_TOPICS_SHOWN,
    CheckResult,
    PendingTopics,
    reason,
)
from outbox_kafka.operations.log_setup import FAILOVER_SLOTS_SINCE
from outbox_kafka.relay.pgoutput import Begin, Commit, Message, ProtocolError, decode
from outbox_kafka.schema.statements import queries_for

_MIB = 1024 * 1024

#: Rows of the slot's stream ``check`` decodes at most (a Begin, a message and a
#: Commit per transaction of one enqueue): its cost is bounded by this.
LOG_ROWS_PEEKED = 30_000

#: The server's SQLSTATEs for a slot another session reads, and a statement timeout.
_OBJECT_IN_USE = "55006"
_QUERY_CANCELED = "57014"

#: Why the slot is not peeked at while another session reads it.
_SLOT_BUSY = "another session reads the slot now (a relay, most likely)"


def check_log_mode(engine: Engine, names: TableNames) -> list[CheckResult]:
    """The log mode's lines for the outbox ``names`` on ``engine``'s server."""
    params = {"publication": names.log_publication, "slot": names.log_slot}
    try:
        with engine.connect() as conn:
            row = conn.execute(queries_for(names)["log_server_state"], params).mappings().one()
            state: dict[str, Any] = dict(row)
            conn.rollback()
    except SQLAlchemyError as exc:
        return [CheckResult("log mode", False, f"cannot read the server's state: {reason(exc)}")]
    return [
        _wal_level(state),
        _replication_role(state),
        _publication(state, names),
        _slot(state, names),
        _wal_limit(state),
        _failover(state),
        _emit_privilege(state),
    ]


def _wal_level(state: Mapping[str, Any]) -> CheckResult:
    level = state["wal_level"]
    if level == "logical":
        return CheckResult("wal_level", True, "logical")
    return CheckResult(
        "wal_level",
        False,
        f"{level}, not logical: no event written to the log can be read; set "
        "wal_level = logical and restart the server",
    )


def _replication_role(state: Mapping[str, Any]) -> CheckResult:
    if state["may_replicate"]:
        return CheckResult("replication role", True, "this role may stream a replication slot")
    return CheckResult(
        "replication role",
        False,
        "this role has neither REPLICATION nor superuser (nor RDS's rds_replication): the "
        "relay cannot read the slot (ALTER ROLE ... REPLICATION, or the provider's "
        "equivalent)",
    )


def _publication(state: Mapping[str, Any], names: TableNames) -> CheckResult:
    if state["has_publication"]:
        return CheckResult("publication", True, names.log_publication)
    return CheckResult(
        "publication", False, f"{names.log_publication} is missing: run outbox-kafka log-setup"
    )


def _slot(state: Mapping[str, Any], names: TableNames) -> CheckResult:
    slot = names.log_slot
    plugin = state["slot_plugin"]
    if plugin is None:
        return CheckResult(
            "replication slot",
            False,
            f"{slot} is missing in this database: run outbox-kafka log-setup (producers "
            "refuse to write to the log until it exists)",
        )
    if state["slot_wal_status"] == "lost":
        return CheckResult(
            "replication slot",
            False,
            f"{slot} is lost: it held more WAL than max_slot_wal_keep_size allows and the "
            "server removed what it held, so the events written since its last "
            "acknowledgement are gone; producers refuse to write until it is dropped "
            f"(SELECT pg_drop_replication_slot('{slot}')) and made again with log-setup",
        )
    if plugin != "pgoutput":
        return CheckResult(
            "replication slot", False, f"{slot} uses the plugin {plugin}, not pgoutput"
        )
    reader = "read by a relay now" if state["slot_active"] else "no relay reads it now"
    detail = (
        f"{slot}: {reader}, {_size(state['slot_lag_bytes'])} of WAL not yet acknowledged, "
        f"wal_status {state['slot_wal_status']}"
    )
    if state["slot_wal_status"] == "unreserved":
        return CheckResult(
            "replication slot",
            False,
            f"{detail}: past max_slot_wal_keep_size, the server will give it up at its next "
            "checkpoint unless a relay catches up first",
        )
    return CheckResult("replication slot", True, detail)


def _wal_limit(state: Mapping[str, Any]) -> CheckResult:
    limit = state["max_slot_wal_keep_size"]
    if limit == "-1":
        return CheckResult(
            "slot WAL limit",
            True,
            "max_slot_wal_keep_size = -1 (no limit): while no relay reads the slot the server "
            "keeps all of the database's WAL, until the disk fills",
        )
    safe = state["slot_safe_wal_size"]
    room = "" if safe is None else f"; the slot may fall {_size(safe)} further behind"
    return CheckResult(
        "slot WAL limit",
        True,
        f"max_slot_wal_keep_size = {limit}: past it the server gives the slot up and the "
        f"events it held are lost{room}",
    )


def _failover(state: Mapping[str, Any]) -> CheckResult:
    major = state["major"]
    if major < FAILOVER_SLOTS_SINCE:
        return CheckResult(
            "slot failover",
            True,
            f"PostgreSQL {major} keeps slots on the primary only: after a failover the new "
            "primary has no slot, and log-setup must make it again (what was not yet read "
            f"is not on it); PostgreSQL {FAILOVER_SLOTS_SINCE} can sync slots to a standby",
        )
    if state["slot_failover"]:
        return CheckResult(
            "slot failover",
            True,
            "on: a standby with sync_replication_slots keeps the slot (the primary needs "
            "synchronized_standby_slots to name it)",
        )
    return CheckResult(
        "slot failover",
        True,
        "off: the slot stays on this server; a slot made with log-setup --failover is kept "
        "across one (dropping this one first loses what no relay has read from it yet)",
    )


def _emit_privilege(state: Mapping[str, Any]) -> CheckResult:
    if not state["public_may_emit"]:
        return CheckResult(
            "emit privilege", True, "pg_logical_emit_message is not executable by PUBLIC"
        )
    return CheckResult(
        "emit privilege",
        False,
        "pg_logical_emit_message is executable by PUBLIC: any role of this database can put "
        "events into the log for the relay to publish; run log-setup as a superuser (or "
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message FROM PUBLIC, every signature)",
    )


def _size(value: int | None) -> str:
    if value is None:
        return "an unknown amount"
    if value < _MIB:
        return f"{max(value, 0) / 1024:.0f} kB"
    return f"{value / _MIB:,.0f} MB"


def log_pending_topics(
    engine: Engine,
    names: TableNames,
    *,
    outbox: str | None = None,
    timeout: float = 10.0,
    row_limit: int = LOG_ROWS_PEEKED,
    topic_limit: int = PENDING_TOPICS_SHOWN,
) -> PendingTopics:
    """The topics of the committed events the outbox's slot holds (the first
    ``row_limit`` rows of its stream, in commit order), peeked at without consuming
    them, within ``timeout`` seconds.

    Not read (``unread`` says why, and the check's other lines say what is wrong)
    when the slot cannot be: the server cannot decode, the role may not replicate, the
    slot is missing or lost, or another session reads it (the server lets one at a
    time: the relay finds a missing topic itself). The peek itself holds the slot
    while it runs: a relay that starts meanwhile waits for it, as for another relay.
    """
    queries = queries_for(names)
    params = {"slot": names.log_slot, "publication": names.log_publication, "rows": row_limit}

    def unread(why: str) -> PendingTopics:
        return PendingTopics({}, 0, True, outbox, unread=why)

    try:
        with engine.connect() as conn:
            state = conn.execute(queries["log_server_state"], params).mappings().one()
            why_not = _why_not_peeked(dict(state), names)
            if why_not is not None:
                return unread(why_not)
            conn.execute(queries["statement_timeout"], {"milliseconds": str(int(timeout * 1000))})
            rows = [bytes(row.data) for row in conn.execute(queries["log_peek"], params)]
            conn.rollback()
    except DBAPIError as exc:
        code = getattr(exc.orig, "pgcode", None)
        if code == _OBJECT_IN_USE:
            return unread(_SLOT_BUSY)
        if code == _QUERY_CANCELED:
            return unread(f"the slot's stream was not decoded within {timeout:g} s")
        raise OutboxError(f"cannot peek at slot {names.log_slot}: {reason(exc)}") from None
    except SQLAlchemyError as exc:
        raise OutboxError(f"cannot peek at slot {names.log_slot}: {reason(exc)}") from None
    counts: Counter[str] = Counter()
    events = 0
    inside = False
    for payload in rows:
        try:
            decoded = decode(payload)
        except ProtocolError as exc:
            raise OutboxError(f"cannot read slot {names.log_slot}'s stream: {exc}") from None
        if isinstance(decoded, Begin | Commit):
            inside = isinstance(decoded, Begin)
        elif (
            isinstance(decoded, Message)
            and inside
            and decoded.transactional
            and decoded.prefix == names.log_prefix
        ):
            try:
                framed = decode_frame(decoded.content)
            except FrameError:
                continue  # the relay counts it and goes on
            counts.update(event.topic for event in framed)
            events += len(framed)
    shown = dict(counts.most_common(topic_limit))
    return PendingTopics(
        counts=shown,
        read=events,
        complete=len(rows) < row_limit,
        outbox=outbox,
        more_topics=len(counts) > len(shown),
        read_in="in commit order",
    )


def _why_not_peeked(state: Mapping[str, Any], names: TableNames) -> str | None:
    """Why the slot cannot be peeked at, from ``log_server_state``; None if it can."""
    if state["wal_level"] != "logical":
        return "the server does not decode its log (wal_level)"
    if not state["may_replicate"]:
        return "this role may not read a replication slot"
    if state["slot_plugin"] is None:
        return f"slot {names.log_slot} is missing"
    if state["slot_wal_status"] == "lost":
        return f"slot {names.log_slot} is lost"
    if state["slot_active"]:
        return _SLOT_BUSY
    return None
