-- Keys with new events, written by producers and by nothing that the relay
-- does: a producer's enqueue inserts its key here (ON CONFLICT DO NOTHING),
-- and the relay moves the rows into the key queue, which only relays and
-- operators write. A producer's transaction therefore never meets a row
-- version that a relay wrote, and a REPEATABLE READ or SERIALIZABLE producer
-- fails to serialize only against another producer of the same key.
CREATE TABLE {arrivals} (
    ordering_key    text        PRIMARY KEY,
    -- The first sequence number of the producer's batch for this key.
    first_seq       bigint      NOT NULL,
    due_at          timestamptz NOT NULL DEFAULT now()
);

-- Inserted on every enqueue and deleted on every relay cycle: vacuum by row
-- count, as for the key queue.
ALTER TABLE {arrivals} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);
