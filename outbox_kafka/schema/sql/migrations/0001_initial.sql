-- The outbox: one row per event, written in the producer's transaction.
CREATE TABLE {events} (
    event_id        uuid        PRIMARY KEY,
    ordering_key    text        NOT NULL,
    seq             bigint      NOT NULL,
    topic           text        NOT NULL,
    type            text        NOT NULL,
    value           bytea       NOT NULL,
    -- [[name, value], ...] in send order; a value that is not UTF-8 text (or
    -- holds NUL) is {"base64": "..."}.
    headers         jsonb       NOT NULL DEFAULT '[]',
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    available_at    timestamptz NOT NULL DEFAULT now(),
    -- The claim under which the event was last sent; the lease itself is per
    -- key and lives in the keys table.
    claim_token     uuid,
    delivered_at    timestamptz,
    kafka_partition integer,
    kafka_offset    bigint,
    last_error      text,
    -- clock_timestamp(), not now(): the time of the write, not of the start of
    -- the producer's transaction, so commit-to-ack latency is not inflated.
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT {events_status_check} CHECK (status IN ('pending', 'delivered', 'discarded')),
    CONSTRAINT {events_attempts_check} CHECK (attempts >= 0)
);

-- The claim's index: a key's pending events in sequence order. The claim
-- reads it from the key's next_seq with a LIMIT, so its cost does not depend
-- on how many events are pending, for that key or any other.
CREATE UNIQUE INDEX {events_claim_idx} ON {events} (ordering_key, seq) WHERE status = 'pending';

-- Oldest pending event, cheaply, at any backlog size.
CREATE INDEX {events_pending_idx} ON {events} (created_at) WHERE status = 'pending';
-- Retention: delivered and discarded rows by age.
CREATE INDEX {events_delivered_idx} ON {events} (delivered_at) WHERE status = 'delivered';
CREATE INDEX {events_discarded_idx} ON {events} (created_at) WHERE status = 'discarded';

-- Per-key sequence counters, owned by writers. A writer locks its key's row
-- until commit, so sequence order is commit order and a rollback leaves no gap.
CREATE TABLE {seqs} (
    ordering_key    text        PRIMARY KEY,
    last_seq        bigint      NOT NULL
);

-- One row per key that may have work: the relay's queue of keys. The relay
-- claims keys (not events), holds a per-key lease, and reads each key's events
-- from next_seq on through the (ordering_key, seq) index, so a claim costs
-- O(batch) whatever the backlog looks like.
CREATE TABLE {keys} (
    ordering_key    text        PRIMARY KEY,
    next_seq        bigint      NOT NULL,
    due_at          timestamptz NOT NULL DEFAULT now(),
    claim_token     uuid,
    lease_expires_at timestamptz,
    parked_at       timestamptz,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX {keys_due_idx} ON {keys} (due_at) WHERE parked_at IS NULL;

-- The key queue and the counters are small and rewritten on every batch and
-- enqueue: vacuum them by row count, not by table fraction, so dead rows do
-- not pile up between autovacuum runs.
ALTER TABLE {keys} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);
ALTER TABLE {seqs} SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
