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
\set versions_table :table '_migrations'
\set enqueue_one_function :table '_enqueue_one'

-- name: grant_schema_usage
GRANT USAGE ON SCHEMA :"schema" TO :"relay_role", :"producer_role";

-- name: grant_relay
-- The relay reads pending events and records their outcome (claim,
-- finish_batch), deletes old ones (purge_delivered, purge_discarded), and
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
GRANT UPDATE (next_seq, due_at, claim_token, lease_expires_at, parked_at)
    ON :"schema".:"keys_table" TO :"relay_role";
GRANT SELECT, DELETE, UPDATE (due_at) ON :"schema".:"arrivals_table" TO :"relay_role";
-- finish_batch locks a key's counter (SELECT ... FOR UPDATE) while it decides
-- whether the key may leave the queue; PostgreSQL asks UPDATE privilege on one
-- column for that lock. The relay never changes a counter.
GRANT SELECT, UPDATE (last_seq) ON :"schema".:"seqs_table" TO :"relay_role";
-- For `outbox-kafka check` run with the relay's credentials.
GRANT SELECT ON :"schema".:"versions_table" TO :"relay_role";

-- name: grant_producer
-- enqueue inserts the event, moves its key's counter (INSERT ... ON CONFLICT
-- DO UPDATE ... RETURNING) and queues the key among the arrivals (INSERT ...
-- ON CONFLICT DO NOTHING). A producer reads nothing of any event, its own or
-- another service's: not the payload, the headers, the topic, nor the status;
-- and it neither reads nor writes the relay's key queue. The wake lock it
-- tries is an advisory lock, which needs no grant. A single event goes
-- through the enqueue_one function (migration 0003), which runs with the
-- producer's own rights: it needs these grants too, and EXECUTE (PUBLIC has
-- it unless default privileges took it away; without it, enqueue writes with
-- the batch statement, which is slower).
GRANT INSERT (event_id, ordering_key, seq, topic, type, value, headers, available_at)
    ON :"schema".:"table" TO :"producer_role";
GRANT SELECT (ordering_key, last_seq), INSERT (ordering_key, last_seq), UPDATE (last_seq)
    ON :"schema".:"seqs_table" TO :"producer_role";
GRANT SELECT (ordering_key), INSERT (ordering_key, first_seq, due_at)
    ON :"schema".:"arrivals_table" TO :"producer_role";
GRANT EXECUTE ON FUNCTION :"schema".:"enqueue_one_function"(
    uuid, text, text, text, bytea, jsonb, timestamptz, double precision, boolean
) TO :"producer_role";
