-- Every SQL statement outbox-kafka runs, one per "-- name:" block.
-- {events}, {keys}, {seqs}, {versions} and {schema} are replaced by quoted,
-- validated identifiers; :name marks a bound parameter.

-- name: enqueue
-- Writes a batch of events in one round trip, inside the caller's transaction.
-- The per-key counters are taken in key order (no deadlock between two
-- batches), and held until the caller commits: sequence order is commit order.
WITH input AS (
    SELECT *
    FROM unnest(
        CAST(:event_ids AS uuid[]),
        CAST(:ordering_keys AS text[]),
        CAST(:topics AS text[]),
        CAST(:types AS text[]),
        CAST(:event_values AS bytea[]),
        CAST(:event_headers AS jsonb[]),
        CAST(:available_ats AS timestamptz[])
    ) WITH ORDINALITY AS i(event_id, ordering_key, topic, type, value, headers, available_at, ord)
), per_key AS (
    SELECT ordering_key, count(*) AS n FROM input GROUP BY ordering_key
), counters AS (
    INSERT INTO {seqs} AS s (ordering_key, last_seq)
    SELECT ordering_key, n FROM per_key ORDER BY ordering_key
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + EXCLUDED.last_seq
    RETURNING s.ordering_key, s.last_seq
), inserted AS (
    INSERT INTO {events} (event_id, ordering_key, seq, topic, type, value, headers,
                          available_at)
    SELECT i.event_id,
           i.ordering_key,
           c.last_seq - p.n + row_number() OVER (PARTITION BY i.ordering_key ORDER BY i.ord),
           i.topic,
           i.type,
           i.value,
           i.headers,
           COALESCE(i.available_at, now())
    FROM input i
    JOIN per_key p USING (ordering_key)
    JOIN counters c USING (ordering_key)
    RETURNING ordering_key, seq, available_at
), heads AS (
    INSERT INTO {keys} (ordering_key, next_seq, due_at)
    SELECT ordering_key, min(seq), (array_agg(available_at ORDER BY seq))[1]
    FROM inserted
    GROUP BY ordering_key
    ORDER BY ordering_key
    ON CONFLICT (ordering_key) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM inserted) AS inserted,
       (SELECT count(*) FROM heads) AS new_keys,
       CASE WHEN :notify THEN pg_notify(:channel, '') END AS notified;

-- name: claim
-- Claims up to :max_keys due keys (skipping keys another relay is claiming),
-- leases them for :lease_seconds, and returns up to :batch_size of their
-- pending events in per-key sequence order. Keys that turn out to have no
-- visible pending event come back with NULL event columns and the key's
-- last sequence number as of the same snapshot.
WITH candidates AS (
    SELECT ordering_key
    FROM {keys}
    WHERE due_at <= now() AND parked_at IS NULL
    ORDER BY due_at
    LIMIT :max_keys
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE {keys} k
    SET claim_token = :token,
        lease_expires_at = now() + make_interval(secs => :lease_seconds),
        due_at = now() + make_interval(secs => :lease_seconds)
    WHERE k.ordering_key = ANY(ARRAY(SELECT ordering_key FROM candidates))
    RETURNING k.ordering_key, k.next_seq
), per_key AS (
    SELECT GREATEST(1, CAST(:batch_size AS bigint) / GREATEST(1, count(*))) AS n FROM claimed
)
SELECT c.ordering_key,
       c.next_seq,
       CAST(e.event_id AS text) AS event_id,
       e.seq,
       e.topic,
       e.type,
       e.value,
       e.headers,
       e.attempts,
       e.available_at,
       e.available_at <= now() AS due,
       EXTRACT(EPOCH FROM e.available_at - now()) AS wait_seconds,
       CASE WHEN e.event_id IS NULL
            THEN (SELECT s.last_seq FROM {seqs} s WHERE s.ordering_key = c.ordering_key)
       END AS last_seq
FROM claimed c
LEFT JOIN LATERAL (
    SELECT *
    FROM {events} ev
    WHERE ev.ordering_key = c.ordering_key
      AND ev.seq >= c.next_seq
      AND ev.status = 'pending'
    ORDER BY ev.seq
    LIMIT (SELECT n FROM per_key)
) e ON true
ORDER BY c.ordering_key, e.seq;

-- name: finish_batch
-- Records one batch's outcome in one statement, fenced by the claim token:
-- keys whose lease was taken over by another relay are left alone, and so
-- are their events. A key found empty is removed from the queue only when no
-- writer holds its counter and every sequence number handed out is done;
-- otherwise it is released and looked at again.
WITH batch_keys AS (
    SELECT *
    FROM unnest(
        CAST(:key_names AS text[]),
        CAST(:key_next_seqs AS bigint[]),
        CAST(:key_delays AS double precision[]),
        CAST(:key_parks AS boolean[]),
        CAST(:key_exhausted AS boolean[])
    ) AS v(ordering_key, next_seq, delay, park, exhausted)
), removable AS (
    SELECT s.ordering_key
    FROM {seqs} s
    JOIN batch_keys b ON b.ordering_key = s.ordering_key
    WHERE s.ordering_key = ANY(CAST(:key_names AS text[]))
      AND b.exhausted AND NOT b.park AND s.last_seq < b.next_seq
    FOR UPDATE OF s SKIP LOCKED
), removed AS (
    DELETE FROM {keys} h
    WHERE h.ordering_key = ANY(ARRAY(SELECT ordering_key FROM removable))
      AND h.claim_token = :token
    RETURNING h.ordering_key
), kept AS (
    UPDATE {keys} h
    SET next_seq = v.next_seq,
        due_at = now() + make_interval(secs => v.delay),
        claim_token = NULL,
        lease_expires_at = NULL,
        parked_at = CASE WHEN v.park THEN now() END
    FROM batch_keys v
    WHERE h.ordering_key = v.ordering_key
      AND h.ordering_key = ANY(CAST(:key_names AS text[]))
      AND h.claim_token = :token
      AND h.ordering_key NOT IN (SELECT ordering_key FROM removed)
    RETURNING h.ordering_key
), owned AS (
    SELECT ordering_key FROM removed
    UNION ALL
    SELECT ordering_key FROM kept
), marked AS (
    UPDATE {events} e
    SET status = r.status,
        attempts = e.attempts + r.attempt,
        available_at = CASE WHEN r.status = 'pending'
                            THEN now() + make_interval(secs => r.delay)
                            ELSE e.available_at END,
        delivered_at = CASE WHEN r.status = 'delivered' THEN now() ELSE e.delivered_at END,
        kafka_partition = COALESCE(r.kafka_partition, e.kafka_partition),
        kafka_offset = COALESCE(r.kafka_offset, e.kafka_offset),
        last_error = COALESCE(r.error, e.last_error),
        claim_token = :token
    FROM unnest(
        CAST(:event_ids AS uuid[]),
        CAST(:event_keys AS text[]),
        CAST(:event_statuses AS text[]),
        CAST(:event_attempts AS integer[]),
        CAST(:event_delays AS double precision[]),
        CAST(:event_partitions AS integer[]),
        CAST(:event_offsets AS bigint[]),
        CAST(:event_errors AS text[])
    ) AS r(event_id, ordering_key, status, attempt, delay, kafka_partition, kafka_offset, error)
    WHERE e.event_id = r.event_id
      AND e.status = 'pending'
      AND r.ordering_key IN (SELECT ordering_key FROM owned)
    RETURNING e.event_id, e.status, EXTRACT(EPOCH FROM now() - e.created_at) AS latency
)
SELECT (SELECT count(*) FROM owned) AS keys_owned,
       (SELECT count(*) FROM removed) AS keys_removed,
       (SELECT count(*) FROM marked WHERE status = 'delivered') AS delivered,
       (SELECT count(*) FROM marked WHERE status = 'discarded') AS discarded,
       (SELECT count(*) FROM marked WHERE status = 'pending') AS retried,
       (SELECT array_agg(latency) FROM marked WHERE status = 'delivered') AS latencies;

-- name: requeue_events
-- Puts discarded events back to pending and makes sure their keys are queued
-- again from the earliest requeued sequence number, unparked.
WITH picked AS (
    UPDATE {events} e
    SET status = 'pending', available_at = now(), attempts = 0
    WHERE e.event_id = ANY(CAST(:event_ids AS uuid[])) AND e.status = 'discarded'
    RETURNING e.ordering_key, e.seq
), per_key AS (
    SELECT ordering_key, min(seq) AS first_seq FROM picked GROUP BY ordering_key
), heads AS (
    INSERT INTO {keys} AS h (ordering_key, next_seq, due_at)
    SELECT ordering_key, first_seq, now() FROM per_key ORDER BY ordering_key
    ON CONFLICT (ordering_key) DO UPDATE
    SET next_seq = LEAST(h.next_seq, EXCLUDED.next_seq),
        parked_at = NULL,
        due_at = CASE WHEN h.claim_token IS NULL THEN now() ELSE h.due_at END
    RETURNING 1
)
SELECT (SELECT count(*) FROM picked) AS requeued, (SELECT count(*) FROM heads) AS keys;

-- name: unpark_keys
-- Lets parked keys flow again without requeueing anything.
UPDATE {keys} SET parked_at = NULL, due_at = now()
WHERE parked_at IS NOT NULL AND ordering_key = ANY(CAST(:ordering_keys AS text[]));

-- name: purge_delivered
-- Retention for delivered events, in bounded batches.
DELETE FROM {events}
WHERE event_id IN (
    SELECT event_id FROM {events}
    WHERE status = 'delivered'
      AND delivered_at < now() - make_interval(secs => :older_than_seconds)
    LIMIT :batch
);

-- name: purge_discarded
-- Retention for discarded events, in bounded batches.
DELETE FROM {events}
WHERE event_id IN (
    SELECT event_id FROM {events}
    WHERE status = 'discarded'
      AND created_at < now() - make_interval(secs => :older_than_seconds)
    LIMIT :batch
);

-- name: oldest_pending_age
-- Seconds since the oldest pending event was written (NULL when none).
SELECT EXTRACT(EPOCH FROM now() - min(created_at)) AS age
FROM {events} WHERE status = 'pending';

-- name: status_counts
SELECT topic, status, count(*) AS n FROM {events} GROUP BY topic, status ORDER BY topic, status;

-- name: parked_keys
SELECT ordering_key, next_seq, parked_at FROM {keys}
WHERE parked_at IS NOT NULL ORDER BY parked_at LIMIT :limit;

-- name: migration_lock
SELECT pg_advisory_xact_lock(:lock_id);

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_versions_table
CREATE TABLE IF NOT EXISTS {versions} (
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);

-- name: applied_versions
SELECT version FROM {versions} ORDER BY version;

-- name: record_version
INSERT INTO {versions} (version, name) VALUES (:version, :name);

-- name: table_exists
SELECT to_regclass(:qualified_name) IS NOT NULL AS present;
