-- Least-privilege grants for outbox-kafka: one role for the relay, one for producers.
--
-- A psql script, run by the owner of the outbox tables (or a superuser) after
-- `outbox-kafka migrate`, once per database:
--
--   psql "$ADMIN_URL" -v relay_role=outbox_relay -v producer_role=orders_service \
--        -f deploy/sql/roles.sql
--
-- Optional: -v schema=public -v table=outbox (the --db-schema and --table of
-- the outbox). The roles must exist already (CREATE ROLE outbox_relay LOGIN
-- PASSWORD '...'); this script only grants. It is idempotent.
-- Every statement comes in a named block, like the library's own SQL.

\set ON_ERROR_STOP on
\if :{?schema}
\else
\set schema public
\endif
\if :{?table}
\else
\set table outbox
\endif
\set keys_table :table '_keys'
\set arrivals_table :table '_arrivals'
\set seqs_table :table '_key_seq'
\set floors_table :table '_floors'
\set versions_table :table '_migrations'
\set enqueue_one_function :table '_enqueue_one'
\set enqueue_many_function :table '_enqueue_many'
\set emit_function :table '_emit'

-- name: grant_schema_usage
GRANT USAGE ON SCHEMA :"schema" TO :"relay_role", :"producer_role";

-- name: grant_relay
-- The relay reads pending events and records their outcome (claim,
-- record_batch), deletes old ones (purge_delivered, purge_discarded), and
-- reads the queue and the counters (claim, backlog sampler). It never inserts
-- an event. LISTEN needs no grant.
GRANT SELECT, DELETE ON :"schema".:"table" TO :"relay_role";
GRANT UPDATE (status, attempts, available_at, claim_token, delivered_at, kafka_partition,
              kafka_offset, last_error)
    ON :"schema".:"table" TO :"relay_role";
-- It moves the keys producers queued from the arrivals into its key queue
-- (admit_arrivals: SELECT ... FOR UPDATE SKIP LOCKED, which asks UPDATE
-- privilege on one column, then DELETE; the relay never changes an arrival).
GRANT SELECT, INSERT (ordering_key, next_seq, due_at), DELETE
    ON :"schema".:"keys_table" TO :"relay_role";
GRANT UPDATE (next_seq, due_at, claim_token, lease_expires_at, parked_at, claim_session,
              doubt_sessions, doubt_until_seq)
    ON :"schema".:"keys_table" TO :"relay_role";
GRANT SELECT, DELETE, UPDATE (due_at) ON :"schema".:"arrivals_table" TO :"relay_role";
-- record_batch locks a key's counter (SELECT ... FOR UPDATE) while it decides
-- whether the key may leave the queue; PostgreSQL asks UPDATE privilege on one
-- column for that lock. The relay never changes a counter; its retention
-- deletes the counters of keys it left with nothing (forget_idle_counters).
GRANT SELECT, DELETE, UPDATE (last_seq) ON :"schema".:"seqs_table" TO :"relay_role";
-- Each relay session writes its floors before it produces to a partition
-- (open_floors), raises them as it records (record_batch), reads those of the
-- sessions a key is in doubt about, and deletes the floors of sessions no key
-- names any more (forget_floors). It changes nothing of a floor but its offset.
GRANT SELECT, INSERT, DELETE, UPDATE (floor_offset)
    ON :"schema".:"floors_table" TO :"relay_role";
-- For `outbox-kafka check` run with the relay's credentials.
GRANT SELECT ON :"schema".:"versions_table" TO :"relay_role";

-- name: grant_producer
-- A producer writes only through the two enqueue functions (migrations 0003
-- and 0005), which run with their owner's rights: it needs EXECUTE on them
-- and no right on any table. So it reads nothing, neither of any event (its
-- own or another service's: payload, headers, topic, status) nor of the key
-- counters, arrivals or key queue (no ordering key in use), and it cannot
-- queue a key or move another key's queue row. The wake lock the functions
-- try is an advisory lock, which needs no grant. (Roles granted by this
-- script before schema version 5 still hold table rights: the README's
-- upgrade notes say how to take them back.)
GRANT EXECUTE ON FUNCTION :"schema".:"enqueue_one_function"(
    uuid, text, text, text, bytea, jsonb, timestamptz, double precision, boolean
) TO :"producer_role";
GRANT EXECUTE ON FUNCTION :"schema".:"enqueue_many_function"(
    uuid[], text[], text[], text[], integer[], integer[], bytea, jsonb, timestamptz[],
    double precision[], boolean
) TO :"producer_role";
-- In the log mode (migration 0007) a producer emits its events through the
-- emit function instead, which also runs with its owner's rights.
GRANT EXECUTE ON FUNCTION :"schema".:"emit_function"(bytea) TO :"producer_role";
