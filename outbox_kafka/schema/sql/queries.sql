-- Every SQL statement outbox-kafka runs, one per "-- name:" block.
-- {events}, {keys}, {seqs}, {versions} and {schema} are replaced by quoted,
-- validated identifiers; :name marks a bound parameter.

-- name: enqueue
-- Writes a batch of events in one round trip, inside the caller's transaction.
-- The per-key counters are taken in key order (no deadlock between two
-- batches), and held until the caller commits: sequence order is commit order.
-- Each distinct key comes once (:key_names, with its number of events in the
-- batch and the delay of its first event), so its counter and arrival are
-- written once per batch. The key goes to {arrivals}, never to the relay's
-- key queue: see 0002_arrivals.sql. The notify is sent only while a relay
-- waits idle: such a relay holds the wake lock (:wake_lock) exclusively, so
-- the shared try fails. Otherwise the try takes the lock, shared, until the
-- commit, and a relay about to go idle waits for this transaction to end
-- before it looks for work one last time (Store.announce_idle): no event is
-- left unseen, and a busy relay costs writers no notify at all. NOTIFY
-- serialises the commits that send one, cluster-wide. Each event comes with how many events of its key
-- follow it in the batch (:behind): the last one gets the key's new last_seq,
-- and no grouping, sorting or numbering of rows is left to do here. The values
-- come as one bytea, cut by :value_starts and :value_lengths, and the headers
-- as one JSON array: the server parses an array literal of large elements
-- character by character, which cost about a third of the statement's
-- time. A NULL array of available_ats or delays means none (unnest pads it
-- with NULLs). A delay counts from the database's now(), not the writer's clock.
WITH batch_keys AS (
    SELECT *
    FROM unnest(
        CAST(:key_names AS text[]),
        CAST(:key_counts AS bigint[]),
        CAST(:key_available_ats AS timestamptz[]),
        CAST(:key_delays AS double precision[])
    ) AS k(ordering_key, n, available_at, delay)
), counters AS (
    INSERT INTO {seqs} AS s (ordering_key, last_seq)
    SELECT ordering_key, n FROM batch_keys ORDER BY ordering_key
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + EXCLUDED.last_seq
    RETURNING s.ordering_key, s.last_seq
), inserted AS (
    INSERT INTO {events} (event_id, ordering_key, seq, topic, type, value, headers,
                          available_at)
    SELECT i.event_id,
           i.ordering_key,
           c.last_seq - i.behind,
           i.topic,
           i.type,
           substring(CAST(:event_values AS bytea) FROM i.value_start FOR i.value_length),
           CAST(:event_headers AS jsonb) -> CAST(i.ord - 1 AS integer),
           COALESCE(i.available_at, now() + make_interval(secs => i.delay), now())
    FROM unnest(
        CAST(:event_ids AS uuid[]),
        CAST(:ordering_keys AS text[]),
        CAST(:behind AS bigint[]),
        CAST(:topics AS text[]),
        CAST(:types AS text[]),
        CAST(:value_starts AS integer[]),
        CAST(:value_lengths AS integer[]),
        CAST(:available_ats AS timestamptz[]),
        CAST(:delays AS double precision[])
    ) WITH ORDINALITY AS i(event_id, ordering_key, behind, topic, type, value_start,
                           value_length, available_at, delay, ord)
    JOIN counters c ON c.ordering_key = i.ordering_key
), arrived AS (
    INSERT INTO {arrivals} (ordering_key, first_seq, due_at)
    SELECT c.ordering_key,
           c.last_seq - k.n + 1,
           COALESCE(k.available_at, now() + make_interval(secs => k.delay), now())
    FROM counters c
    JOIN batch_keys k ON k.ordering_key = c.ordering_key
    ORDER BY c.ordering_key
    ON CONFLICT (ordering_key) DO NOTHING
)
SELECT CASE WHEN :notify THEN
           CASE WHEN NOT pg_try_advisory_xact_lock_shared(:wake_lock)
                THEN pg_notify(:channel, '') END
       END AS notified;

-- name: enqueue_one
-- The enqueue for a single event: the same writes (counter, event, arrival,
-- wake-up) by the function of migration 0003, whose statements the server
-- keeps planned for the session, where the batch statement above is parsed
-- and planned on every call (see the README's performance section). Used
-- where enqueue_function_callable says so; else the batch statement.
SELECT {enqueue_one}(
           CAST(:event_id AS uuid),
           CAST(:ordering_key AS text),
           CAST(:topic AS text),
           CAST(:type AS text),
           CAST(:value AS bytea),
           CAST(:headers AS jsonb),
           CAST(:available_at AS timestamptz),
           CAST(:delay_seconds AS double precision),
           CAST(:notify AS boolean)
       ) AS notified;

-- name: enqueue_many_call
-- The enqueue for a batch, by the function of migration 0005: the same writes
-- as the enqueue statement, with the rights of the function's owner, so that
-- a producer role needs no grant on any table (deploy/sql/roles.sql). Takes
-- the enqueue statement's parameters (those it needs; the function works out
-- the per-key ones itself). Used where enqueue_function_callable says so.
SELECT {enqueue_many}(
           CAST(:event_ids AS uuid[]),
           CAST(:ordering_keys AS text[]),
           CAST(:topics AS text[]),
           CAST(:types AS text[]),
           CAST(:value_starts AS integer[]),
           CAST(:value_lengths AS integer[]),
           CAST(:event_values AS bytea),
           CAST(:event_headers AS jsonb),
           CAST(:available_ats AS timestamptz[]),
           CAST(:delays AS double precision[]),
           CAST(:notify AS boolean)
       ) AS notified;

-- name: enqueue_function_callable
-- Whether this session can call the function of enqueue_one (:signature, its
-- qualified name and argument types) and that of enqueue_many_call
-- (:batch_signature): false when it does not exist (tables made from
-- outbox_kafka.tables, or a database not migrated that far yet) or the role
-- lacks EXECUTE on it.
SELECT COALESCE(has_function_privilege(to_regprocedure(:signature), 'EXECUTE'), false)
       AS callable,
       COALESCE(has_function_privilege(to_regprocedure(:batch_signature), 'EXECUTE'), false)
       AS batch_callable;

-- name: admit_arrivals
-- Moves up to :admit_limit keys from {arrivals} into the key queue, in key
-- order from just after :after_key (the last key the previous pass moved, ''
-- to start over): successive passes sweep the whole table through its
-- primary key, so every arrival is taken in within one sweep however many
-- keep coming, and no pass reads the dead rows of the ones taken before. A
-- key the queue holds already keeps its row (its next_seq is at or below the
-- arrival's first_seq, or the arrival's events are done); a new one comes
-- with the arrival's first_seq and due time. Rows a concurrent relay is
-- moving are skipped. Returns how many were moved and the last key moved;
-- the claim runs it in the same transaction before claim_keys.
WITH picked AS (
    SELECT ordering_key FROM {arrivals}
    WHERE ordering_key > :after_key
    ORDER BY ordering_key
    LIMIT :admit_limit
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM {arrivals} a
    WHERE a.ordering_key = ANY(ARRAY(SELECT ordering_key FROM picked))
    RETURNING a.ordering_key, a.first_seq, a.due_at
), queued AS (
    INSERT INTO {keys} (ordering_key, next_seq, due_at)
    SELECT ordering_key, first_seq, due_at FROM moved ORDER BY ordering_key
    ON CONFLICT (ordering_key) DO NOTHING
)
SELECT count(*) AS moved, max(ordering_key) AS last_key FROM moved;

-- name: index_plans
-- For the current transaction: the claim's and the record's statements reach
-- their rows through indexes, a batch's worth of probes, whatever the planner's
-- statistics of the queue tables say. Those tables' row counts swing by
-- millions between two ANALYZEs (autovacuum's, or none), and with counts taken
-- while they were small the planner read every due key and sorted them all to
-- take a claim's first few hundred (claim_keys), and scanned every key's counter
-- to find a batch's (record_batch, claim_events): work that grows with the
-- backlog, not the batch. Every such statement has an index to go by, so this
-- only steers the planner off whole-table plans; it forbids none.
SELECT set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true);

-- name: claim_keys
-- Locks up to :max_keys due keys (skipping keys another relay is claiming),
-- which lease_keys then leases; returns each key with its next_seq and
-- the due time it had before this claim (seconds since the epoch): its place
-- in the queue, which claim_events shares the byte budget out by and which
-- a key the budget left out gets back when it is recorded. Keys due at the
-- same moment are taken in index order: breaking the tie here would sort every
-- key of a group, and one enqueue can make a million keys due at one moment.
-- The events are read by claim_events, the next statement of the same
-- transaction, and not here: a key row that changed after this statement's
-- snapshot was taken (an operator's requeue lowering next_seq) is locked and
-- returned in its newest version, while events read by this statement would
-- come from the older snapshot, where the requeued events are still
-- discarded. The next statement takes a new snapshot, after these locks are
-- held, so it sees every change committed to these keys.
--
-- A key whose claim token is still set was claimed and never recorded: the
-- relay session that claimed it (claim_session) may have sent its events.
-- Such keys come back with that session (unrecorded_session), and doubt_keys,
-- in the same transaction, puts them in doubt; each key comes back with the
-- sessions it was in doubt about already (doubt_sessions).
--
-- Two statements, not one UPDATE joined to its candidates: with the key
-- queue's statistics taken while it was nearly empty, the planner joined them
-- by nested loop over a scan of the whole queue, seconds for a thousand keys.
SELECT ordering_key, next_seq, CAST(EXTRACT(EPOCH FROM due_at) AS double precision),
       CAST(doubt_sessions AS text[]),
       CASE WHEN claim_token IS NOT NULL THEN CAST(claim_session AS text) END
FROM {keys}
WHERE due_at <= now() AND parked_at IS NULL
ORDER BY due_at
LIMIT :max_keys
FOR UPDATE SKIP LOCKED;

-- name: lease_keys
-- Leases the keys claim_keys has just locked (:key_names) to the claim
-- (:token) of the relay session :session for :lease_seconds.
UPDATE {keys}
SET claim_token = :token,
    claim_session = CAST(:session AS uuid),
    lease_expires_at = now() + make_interval(secs => :lease_seconds),
    due_at = now() + make_interval(secs => :lease_seconds)
WHERE ordering_key = ANY(CAST(:key_names AS text[]));

-- name: doubt_keys
-- The keys claim_keys found claimed and never recorded (:key_names, each with
-- the session of that claim, :key_sessions): the session joins the key's
-- doubt_sessions, and may have sent any event of the key written by now
-- (doubt_until_seq). Run in the claim's transaction, on keys it has locked.
UPDATE {keys} k
SET doubt_sessions = CASE
        WHEN d.session = ANY(coalesce(k.doubt_sessions, '{}')) THEN k.doubt_sessions
        ELSE array_append(coalesce(k.doubt_sessions, '{}'), d.session)
    END,
    doubt_until_seq = GREATEST(
        k.doubt_until_seq, k.next_seq - 1,
        (SELECT s.last_seq FROM {seqs} s WHERE s.ordering_key = k.ordering_key))
FROM unnest(CAST(:key_names AS text[]), CAST(:key_sessions AS uuid[])) AS d(ordering_key, session)
WHERE k.ordering_key = d.ordering_key;

-- name: claim_events
-- The next pending events of the keys claim_keys has just leased
-- (:key_names with their :key_next_seqs and :key_due_ats), up to :per_key_limit of each key
-- (the relay's even share of its batch), in per-key sequence order; each row with its key's
-- last sequence number handed out (so the relay knows how many events each
-- key has waiting). Keys that turn out to have no visible pending event come
-- back with NULL event columns. wait_seconds is NULL for an event that is
-- due. Headers come as jsonb's text form: the relay decodes it without a
-- general JSON parser in the common case. With :values_as_text (the database
-- and the connection speak UTF-8) the value comes as text: an envelope is
-- UTF-8 JSON, which the server only has to validate, and the relay checks
-- the text it got. convert_from fails the whole statement on a value that is
-- not UTF-8 (only a row written behind the library's back); the relay then
-- claims again without :values_as_text and gets every value in bytea's escape
-- format, which any byte survives, at half the size of hex.
--
-- At most :max_bytes of values and headers come back (as stored, read from
-- the values' headers without fetching them), counted round-robin over the
-- keys (every key's first event, then every key's second, ...), the keys in
-- their order in the queue (the due time each had before the claim, then
-- the key's bytes): the events that start past the budget come with NULL id,
-- value and headers and withheld set, and the relay hands their keys back
-- untouched, due when they were, so that they come first at the next claim
-- (for each key they are the last of its events). The first event always
-- comes, whatever its size.
WITH claimed AS (
    SELECT *
    FROM unnest(
        CAST(:key_names AS text[]),
        CAST(:key_next_seqs AS bigint[]),
        CAST(:key_due_ats AS double precision[])
    ) AS c(ordering_key, next_seq, due_at)
), read AS (
    SELECT c.ordering_key,
           c.next_seq,
           c.due_at,
           e.event_id,
           e.seq,
           e.topic,
           e.type,
           e.value,
           e.headers,
           e.attempts,
           e.available_at,
           s.last_seq,
           octet_length(e.value) + pg_column_size(e.headers) AS size,
           row_number() OVER (PARTITION BY c.ordering_key ORDER BY e.seq) AS position
    FROM claimed c
    LEFT JOIN {seqs} s ON s.ordering_key = c.ordering_key
    LEFT JOIN LATERAL (
        SELECT *
        FROM {events} ev
        WHERE ev.ordering_key = c.ordering_key
          AND ev.seq >= c.next_seq
          AND ev.status = 'pending'
        ORDER BY ev.seq
        LIMIT CAST(:per_key_limit AS bigint)
    ) e ON true
), budgeted AS (
    SELECT read.*,
           COALESCE(sum(size) OVER (ORDER BY position, due_at, ordering_key COLLATE "C"
                                    ROWS UNBOUNDED PRECEDING)
                    - size >= CAST(:max_bytes AS bigint),
                    false) AS withheld
    FROM read
)
SELECT ordering_key,
       next_seq,
       CASE WHEN NOT withheld THEN CAST(event_id AS text) END AS event_id,
       seq,
       topic,
       type,
       CASE WHEN withheld THEN NULL
            WHEN :values_as_text THEN convert_from(value, 'UTF8')
            ELSE encode(value, 'escape')
       END AS value,
       CASE WHEN NOT withheld THEN CAST(headers AS text) END AS headers,
       attempts,
       CASE WHEN available_at > now()
            THEN CAST(EXTRACT(EPOCH FROM available_at - now()) AS double precision)
       END AS wait_seconds,
       last_seq,
       withheld
FROM budgeted
ORDER BY ordering_key, seq;

-- name: record_batch
-- Records one batch's outcome in one statement, fenced by the claim token:
-- keys whose lease was taken over by another relay are left alone, and so
-- are their events. A key found empty is removed from the queue only when no
-- writer holds its counter and every sequence number handed out is done;
-- otherwise it is released and looked at again. A key kept is due after its
-- delay, or, given a due time (:key_due_ats, seconds since the epoch; NULL
-- for none), at that time: a key handed back as it was claimed keeps its
-- place in the queue.
--
-- A key's doubt (see claim_keys) ends once its next_seq has passed
-- doubt_until_seq: every event the sessions in doubt may have sent is
-- settled, found on Kafka by the read-back or sent after it. The batch's own
-- session (:session) joins the doubt, up to :key_doubt_until, when an event of
-- the key may have reached Kafka without an acknowledgement. When every key of the batch is still owned, the session's
-- floors are raised to just past the offsets this batch recorded
-- (:floor_topics, :floor_partitions, :floor_offsets; the relay gives none
-- when an outcome of the session may have been delivered unrecorded).
WITH batch_keys AS (
    SELECT *
    FROM unnest(
        CAST(:key_names AS text[]),
        CAST(:key_next_seqs AS bigint[]),
        CAST(:key_delays AS double precision[]),
        CAST(:key_due_ats AS double precision[]),
        CAST(:key_parks AS boolean[]),
        CAST(:key_drained AS boolean[]),
        CAST(:key_doubt_until AS bigint[])
    ) AS v(ordering_key, next_seq, delay, due_at, park, drained, doubt_until)
), removable AS (
    SELECT s.ordering_key
    FROM {seqs} s
    JOIN batch_keys b ON b.ordering_key = s.ordering_key
    WHERE s.ordering_key = ANY(CAST(:key_names AS text[]))
      AND b.drained AND NOT b.park AND s.last_seq < b.next_seq
    FOR UPDATE OF s SKIP LOCKED
), removed AS (
    DELETE FROM {keys} h
    WHERE h.ordering_key = ANY(ARRAY(SELECT ordering_key FROM removable))
      AND h.claim_token = :token
    RETURNING h.ordering_key
), kept AS (
    UPDATE {keys} h
    SET next_seq = v.next_seq,
        due_at = COALESCE(to_timestamp(v.due_at), now() + make_interval(secs => v.delay)),
        claim_token = NULL,
        lease_expires_at = NULL,
        parked_at = CASE WHEN v.park THEN now() END,
        doubt_sessions = CASE
            WHEN v.doubt_until IS NOT NULL THEN array_append(
                array_remove(
                    CASE WHEN v.next_seq > h.doubt_until_seq THEN '{}'
                         ELSE coalesce(h.doubt_sessions, '{}') END,
                    CAST(:session AS uuid)),
                CAST(:session AS uuid))
            WHEN v.next_seq > h.doubt_until_seq THEN NULL
            ELSE h.doubt_sessions
        END,
        doubt_until_seq = CASE
            WHEN v.doubt_until IS NOT NULL THEN GREATEST(
                CASE WHEN v.next_seq > h.doubt_until_seq THEN NULL ELSE h.doubt_until_seq END,
                v.doubt_until)
            WHEN v.next_seq > h.doubt_until_seq THEN NULL
            ELSE h.doubt_until_seq
        END
    FROM batch_keys v
    WHERE h.ordering_key = v.ordering_key
      AND h.ordering_key = ANY(CAST(:key_names AS text[]))
      -- Not a plain comparison: the planner would estimate a single row here
      -- and join the batch by nested loop, O(keys squared).
      AND coalesce(h.claim_token = :token, false)
      AND h.ordering_key NOT IN (SELECT ordering_key FROM removed)
    RETURNING h.ordering_key
), owned AS (
    SELECT ordering_key FROM removed
    UNION ALL
    SELECT ordering_key FROM kept
), outcomes AS (
    -- Delivered events, the common case, come as three arrays; every other
    -- outcome (a retry, a discard) with its attempt, delay and error.
    SELECT d.event_id,
           'delivered' AS status,
           0 AS attempt,
           CAST(0 AS double precision) AS delay,
           d.kafka_partition,
           d.kafka_offset,
           CAST(NULL AS text) AS error
    FROM unnest(
        CAST(:delivered_ids AS uuid[]),
        CAST(:delivered_partitions AS integer[]),
        CAST(:delivered_offsets AS bigint[])
    ) AS d(event_id, kafka_partition, kafka_offset)
    UNION ALL
    SELECT *
    FROM unnest(
        CAST(:event_ids AS uuid[]),
        CAST(:event_statuses AS text[]),
        CAST(:event_attempts AS integer[]),
        CAST(:event_delays AS double precision[]),
        CAST(:event_partitions AS integer[]),
        CAST(:event_offsets AS bigint[]),
        CAST(:event_errors AS text[])
    ) AS o(event_id, status, attempt, delay, kafka_partition, kafka_offset, error)
), marked AS (
    UPDATE {events} e
    SET status = r.status,
        -- GREATEST: a row someone set below zero behind the CHECK constraint's back
        -- would otherwise fail this whole statement, batch after batch.
        attempts = GREATEST(e.attempts, 0) + r.attempt,
        available_at = CASE WHEN r.status = 'pending'
                            THEN now() + make_interval(secs => r.delay)
                            ELSE e.available_at END,
        delivered_at = CASE WHEN r.status = 'delivered' THEN now() ELSE e.delivered_at END,
        kafka_partition = COALESCE(r.kafka_partition, e.kafka_partition),
        kafka_offset = COALESCE(r.kafka_offset, e.kafka_offset),
        last_error = COALESCE(r.error, e.last_error),
        claim_token = :token
    FROM outcomes r
    WHERE e.event_id = r.event_id
      -- The batch's events are found through their ids, whatever the statistics
      -- say, and their keys' ownership is a filter on each, not a join: as a join,
      -- the planner (which takes owned for two keys) read every pending event of
      -- the batch's keys to find the batch's, all of a deep backlog.
      AND e.event_id = ANY(ARRAY(SELECT event_id FROM outcomes))
      AND e.status = 'pending'
      AND coalesce(e.ordering_key = ANY(ARRAY(SELECT ordering_key FROM owned)), false)
    -- As float8, not numeric: the driver reads a float array far faster than decimals.
    RETURNING e.event_id, e.status,
              CAST(EXTRACT(EPOCH FROM now() - e.created_at) AS double precision) AS latency
), raised AS (
    UPDATE {floors} f
    SET floor_offset = GREATEST(f.floor_offset, r.floor_offset)
    FROM unnest(
        CAST(:floor_topics AS text[]),
        CAST(:floor_partitions AS integer[]),
        CAST(:floor_offsets AS bigint[])
    ) AS r(topic, kafka_partition, floor_offset)
    WHERE f.session = CAST(:session AS uuid)
      AND f.topic = r.topic
      AND f.kafka_partition = r.kafka_partition
      AND (SELECT count(*) FROM owned) = cardinality(CAST(:key_names AS text[]))
    RETURNING 1
)
SELECT (SELECT count(*) FROM owned) AS keys_owned,
       (SELECT count(*) FROM removed) AS keys_removed,
       (SELECT count(*) FROM marked WHERE status = 'delivered') AS delivered,
       (SELECT count(*) FROM marked WHERE status = 'discarded') AS discarded,
       (SELECT count(*) FROM marked WHERE status = 'pending') AS retried,
       (SELECT array_agg(latency) FROM marked WHERE status = 'delivered') AS latencies;

-- name: requeue_events
-- Puts discarded events back to pending and makes sure their keys are queued
-- again from the earliest requeued sequence number, unparked. The caller
-- (operations.requeue) has locked the keys' queue rows and made sure a parked
-- key's requeue includes the event that parked it. A key a relay holds right
-- now is taken back: that relay's outcome for it is not recorded (the finish
-- is fenced by the claim token, so it cannot move next_seq past the requeued
-- events), and nobody claims the key before that relay's lease has ended.
WITH picked AS (
    UPDATE {events} e
    -- A fresh start: no attempt and no error (an event with none counts as held
    -- only once a relay holds it again).
    SET status = 'pending', available_at = now(), attempts = 0, last_error = NULL
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
        -- Due now, unless the key waits already: a lease, or the relay holding it
        -- while a message of it may still land. Never sooner than that.
        due_at = GREATEST(h.due_at, now()),
        -- The relay holding the key may have sent its events: its session stays
        -- in doubt, for the next holder to read back (see claim_keys).
        doubt_sessions = CASE
            WHEN h.claim_token IS NULL OR h.claim_session IS NULL
                 OR h.claim_session = ANY(coalesce(h.doubt_sessions, '{}'))
                THEN h.doubt_sessions
            ELSE array_append(coalesce(h.doubt_sessions, '{}'), h.claim_session)
        END,
        doubt_until_seq = CASE
            WHEN h.claim_token IS NULL OR h.claim_session IS NULL THEN h.doubt_until_seq
            ELSE GREATEST(h.doubt_until_seq, h.next_seq - 1,
                          (SELECT s.last_seq FROM {seqs} s WHERE s.ordering_key = h.ordering_key))
        END,
        claim_token = NULL,
        lease_expires_at = NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM picked) AS requeued, (SELECT count(*) FROM heads) AS keys;

-- name: unpark_keys
-- Lets parked keys flow again without requeueing anything: due now, or when the
-- wait the relay gave the key ends (a message of it may still land).
UPDATE {keys} SET parked_at = NULL, due_at = GREATEST(due_at, now())
WHERE parked_at IS NOT NULL AND ordering_key = ANY(CAST(:ordering_keys AS text[]));

-- name: open_floors
-- A relay session's floors on partitions it is about to produce to for the
-- first time: the partition's end offset read just before, committed before
-- anything is produced. A floor the session has already keeps its value.
INSERT INTO {floors} (session, topic, kafka_partition, partitions, floor_offset)
SELECT CAST(:session AS uuid), f.topic, f.kafka_partition, f.partitions, f.floor_offset
FROM unnest(
    CAST(:topics AS text[]),
    CAST(:kafka_partitions AS integer[]),
    CAST(:partition_counts AS integer[]),
    CAST(:floor_offsets AS bigint[])
) AS f(topic, kafka_partition, partitions, floor_offset)
ORDER BY f.topic, f.kafka_partition
ON CONFLICT (session, topic, kafka_partition) DO NOTHING;

-- name: read_floors
-- The floors of the sessions in doubt on these topics: where to start reading
-- Kafka back.
SELECT CAST(session AS text) AS session, topic, kafka_partition, partitions, floor_offset
FROM {floors}
WHERE session = ANY(CAST(:sessions AS uuid[])) AND topic = ANY(CAST(:topics AS text[]))
ORDER BY topic, kafka_partition, session;

-- name: forget_floors
-- Deletes the floors of sessions older than :older_seconds that no key names
-- any more: neither in its doubt, nor as the session of a claim never recorded
-- (which the next claim of the key turns into a doubt). A relay session lives
-- at most a day; the relay's retention task runs this.
WITH old AS (
    SELECT DISTINCT session FROM {floors}
    WHERE created_at < now() - make_interval(secs => :older_seconds)
), named AS (
    SELECT claim_session AS session FROM {keys}
    WHERE claim_token IS NOT NULL AND claim_session IN (SELECT session FROM old)
    UNION
    SELECT d.session
    FROM {keys} k, unnest(k.doubt_sessions) AS d(session)
    WHERE k.doubt_sessions IS NOT NULL
)
DELETE FROM {floors}
WHERE session IN (SELECT session FROM old EXCEPT SELECT session FROM named);

-- name: purge_delivered
-- Retention for delivered events, in bounded batches. Rows another
-- transaction holds are skipped (the next run takes them), so retention never
-- waits for, or deadlocks with, an operator's requeue. The outer condition
-- repeats the inner one: a row changed by a transaction that committed after
-- this statement began is checked again against the outer condition.
DELETE FROM {events}
WHERE event_id IN (
    SELECT event_id FROM {events}
    WHERE status = 'delivered'
      AND delivered_at < now() - make_interval(secs => :older_than_seconds)
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
  AND status = 'delivered'
  AND delivered_at < now() - make_interval(secs => :older_than_seconds)
RETURNING ordering_key, seq;

-- name: purge_discarded
-- Retention for discarded events, in bounded batches. An event a requeue has
-- locked is skipped (no wait, no deadlock with the requeue's own locks); one
-- a requeue made pending and committed after this statement began is checked
-- again against the conditions, repeated outside for that, and kept.
DELETE FROM {events}
WHERE event_id IN (
    SELECT event_id FROM {events}
    WHERE status = 'discarded'
      AND created_at < now() - make_interval(secs => :older_than_seconds)
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
  AND status = 'discarded'
  AND created_at < now() - make_interval(secs => :older_than_seconds)
RETURNING ordering_key, seq;

-- name: forget_idle_counters
-- After a purge: deletes the counter of each key whose last sequence number
-- handed out was one of the purged events' (:key_names with their :seqs),
-- when nothing of the key is left that sequence numbers order: no row in the
-- key queue or among the arrivals, no pending and no discarded event (a
-- requeue could bring a discarded one back). Delivered events that are still
-- kept are not ordered by anything any more. A writer that holds the counter
-- (it is enqueueing for the key) is skipped, and one that moved it on since
-- this snapshot makes the last_seq condition fail when the row is locked:
-- the key keeps its counter. A key that comes back starts again at 1, after
-- everything it had is gone. Discarded events are read once per statement
-- (hashed), not per key.
WITH purged AS (
    SELECT *
    FROM unnest(CAST(:key_names AS text[]), CAST(:seqs AS bigint[])) AS p(ordering_key, seq)
), idle AS (
    SELECT s.ordering_key, s.last_seq
    FROM {seqs} s
    JOIN purged p ON p.ordering_key = s.ordering_key AND p.seq = s.last_seq
    WHERE NOT EXISTS (SELECT 1 FROM {keys} k WHERE k.ordering_key = s.ordering_key)
      AND NOT EXISTS (SELECT 1 FROM {arrivals} a WHERE a.ordering_key = s.ordering_key)
      AND NOT EXISTS (SELECT 1 FROM {events} e
                      WHERE e.ordering_key = s.ordering_key AND e.status = 'pending')
      AND s.ordering_key NOT IN (SELECT ordering_key FROM {events}
                                 WHERE status = 'discarded')
    FOR UPDATE OF s SKIP LOCKED
)
DELETE FROM {seqs} s
USING idle i
WHERE s.ordering_key = i.ordering_key AND s.last_seq = i.last_seq;

-- name: backlog_slice
-- One slice of a sweep over the keys with work (the key queue and the
-- arrivals), in key order from just after :after_key ('' to start), at most
-- :slice_keys keys of each table: the backlog sampler adds the slices up, so
-- that no statement reads more than a slice whatever the backlog, and none
-- holds its snapshot long. No event rows are counted:
-- * pending: for each key, the sequence numbers from its next one to its last
--   one handed out (a parked key's next event is the discarded one it waits
--   behind; keys still among the arrivals count from their first_seq). Exact
--   unless events were recorded out of turn (delivered behind a held-back
--   retry, left behind by unpark_keys), counted until their key moves past
--   them, or an arrival is stale (its events done before a relay took it in);
-- * oldest_age: seconds since the oldest pending event of the slice was
--   written (NULL when none). A key's events are written in sequence order (its
--   counter row is held until commit), so that is the first pending event of
--   one of its keys: one probe of the claim index per key;
-- * parked: parked keys of the slice;
-- * last_key: where the slice ends, NULL when it reached the end of both
--   tables. It ends where the first table to fill its :slice_keys ends: past
--   that key, that table has keys not read yet.
-- A pending event whose key is in neither table is a consistency violation,
-- counted there, not here.
WITH queued_keys AS (
    SELECT ordering_key, next_seq, parked_at FROM {keys}
    WHERE ordering_key > :after_key
    ORDER BY ordering_key
    LIMIT :slice_keys
), arrived AS (
    SELECT ordering_key, first_seq FROM {arrivals}
    WHERE ordering_key > :after_key
    ORDER BY ordering_key
    LIMIT :slice_keys
), bound AS (
    SELECT LEAST(
        CASE WHEN (SELECT count(*) FROM queued_keys) >= :slice_keys
             THEN (SELECT max(ordering_key) FROM queued_keys) END,
        CASE WHEN (SELECT count(*) FROM arrived) >= :slice_keys
             THEN (SELECT max(ordering_key) FROM arrived) END
    ) AS last_key
), queued AS (
    SELECT k.ordering_key, k.next_seq, k.parked_at
    FROM queued_keys k CROSS JOIN bound b
    WHERE b.last_key IS NULL OR k.ordering_key <= b.last_key
    UNION ALL
    SELECT a.ordering_key, a.first_seq, NULL
    FROM arrived a CROSS JOIN bound b
    WHERE (b.last_key IS NULL OR a.ordering_key <= b.last_key)
      AND NOT EXISTS (SELECT 1 FROM {keys} k WHERE k.ordering_key = a.ordering_key)
)
-- The counters are looked up key by key (a subquery per row): joined, the
-- planner hashed the whole counter table for a slice of it.
SELECT (SELECT COALESCE(sum(GREATEST(0, (SELECT s.last_seq FROM {seqs} s
                                         WHERE s.ordering_key = q.ordering_key)
                                        - q.next_seq + 1
                                        - CASE WHEN q.parked_at IS NULL THEN 0 ELSE 1 END)), 0)
        FROM queued q) AS pending,
       (SELECT CAST(EXTRACT(EPOCH FROM now() - min(head.created_at)) AS double precision)
        FROM queued q
        CROSS JOIN LATERAL (
            SELECT e.created_at FROM {events} e
            WHERE e.ordering_key = q.ordering_key AND e.status = 'pending'
            ORDER BY e.seq
            LIMIT 1
        ) head) AS oldest_age,
       (SELECT count(*) FROM queued q WHERE q.parked_at IS NOT NULL) AS parked,
       (SELECT last_key FROM bound) AS last_key;

-- ===========================================================================
-- Wake-ups: a relay with nothing to do holds the outbox's wake lock
-- exclusively, on its LISTEN connection, while it waits; a producer's enqueue
-- notifies only when its shared try of the same lock fails (see enqueue).
-- ===========================================================================

-- name: wake_lock_timeout
-- How long announce_idle waits for the producers that hold the wake lock
-- shared (those that committed no notify) to end (milliseconds, as text).
SELECT set_config('lock_timeout', :milliseconds, false);

-- name: announce_idle
SELECT pg_advisory_lock(:wake_lock);

-- name: announce_busy
SELECT pg_advisory_unlock(:wake_lock);

-- name: wake_lock_held_by_relay
-- Whether another relay of this database holds the wake lock (exclusively,
-- granted): it is idle and producers notify. A bigint advisory lock shows as
-- its high and low 32 bits in classid and objid, with objsubid 1.
SELECT EXISTS (
    SELECT 1 FROM pg_locks
    WHERE locktype = 'advisory'
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = CAST(:lock_high AS oid)
      AND objid = CAST(:lock_low AS oid)
      AND objsubid = 1
      AND mode = 'ExclusiveLock'
      AND granted
) AS held;

-- name: statement_timeout
-- Bounds the statements of the current transaction (milliseconds, as text).
SELECT set_config('statement_timeout', :milliseconds, true);

-- name: ping
SELECT 1;

-- name: migration_lock
SELECT pg_advisory_xact_lock(:lock_id);

-- name: create_schema
-- Only a missing schema: CREATE SCHEMA IF NOT EXISTS asks for CREATE on the
-- database even when the schema exists, which the owner of the tables in an
-- existing schema (public) need not have.
DO $create_schema$
BEGIN
    IF to_regnamespace('{schema}') IS NULL THEN
        CREATE SCHEMA IF NOT EXISTS {schema};
    END IF;
END
$create_schema$;

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

-- name: describe_outbox
-- The shape of an outbox as the catalog has it, for migrate --adopt: one row
-- per column, constraint, index and storage setting of the tables :tables in
-- schema :schema, and per function of :functions there, as (kind, table_name,
-- name, definition). Index definitions name their table without its schema,
-- so that the outboxes of two schemas compare equal.
SELECT 'column' AS kind, c.relname AS table_name, a.attname AS name,
       format_type(a.atttypid, a.atttypmod)
       || CASE WHEN a.attnotnull THEN ' NOT NULL' ELSE '' END
       || COALESCE(' DEFAULT ' || pg_get_expr(d.adbin, d.adrelid), '') AS definition
FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE n.nspname = :schema AND c.relname = ANY(CAST(:tables AS text[]))
  AND a.attnum > 0 AND NOT a.attisdropped
UNION ALL
SELECT 'constraint', c.relname, con.conname, pg_get_constraintdef(con.oid)
FROM pg_constraint con
JOIN pg_class c ON c.oid = con.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema AND c.relname = ANY(CAST(:tables AS text[]))
UNION ALL
SELECT 'index', c.relname, i.relname,
       regexp_replace(pg_get_indexdef(i.oid), ' ON \S+ USING ', ' ON ' || c.relname || ' USING ')
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class c ON c.oid = x.indrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema AND c.relname = ANY(CAST(:tables AS text[]))
UNION ALL
SELECT 'storage', c.relname, '',
       array_to_string(ARRAY(SELECT o FROM unnest(c.reloptions) AS o ORDER BY o), ', ')
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = :schema AND c.relname = ANY(CAST(:tables AS text[]))
UNION ALL
SELECT 'function', '', p.proname, pg_get_function_identity_arguments(p.oid)
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = :schema AND p.proname = ANY(CAST(:functions AS text[]))
ORDER BY 1, 2, 3;

-- name: drop_schema
DROP SCHEMA {schema} CASCADE;

-- ===========================================================================
-- Operator commands: the statements behind outbox_kafka.operations
-- (outbox-kafka stats, requeue, unpark, purge, check). In the selections, a
-- NULL selector matches everything; a time range is [since, until) on
-- created_at.
-- ===========================================================================

-- name: stats_topic_counts
-- Events per topic and status. Pending and discarded events are read through
-- their partial indexes; delivered events, normally most of the table, are
-- counted by a sequential scan, which :count_delivered = false skips.
SELECT topic, 'pending' AS status, count(*) AS n
FROM {events} WHERE status = 'pending' GROUP BY topic
UNION ALL
SELECT topic, 'discarded', count(*)
FROM {events} WHERE status = 'discarded' GROUP BY topic
UNION ALL
SELECT topic, 'delivered', count(*)
FROM {events} WHERE status = 'delivered' AND :count_delivered GROUP BY topic
ORDER BY 1, 2;

-- name: stats_backlog
-- The key queue at a glance: keys with work (those among the arrivals
-- included), keys leased by a relay, parked keys.
SELECT count(*) + (SELECT count(*) FROM {arrivals} a
                   WHERE NOT EXISTS (SELECT 1 FROM {keys} k
                                     WHERE k.ordering_key = a.ordering_key)) AS keys_queued,
       count(*) FILTER (WHERE claim_token IS NOT NULL AND lease_expires_at > now()) AS keys_leased,
       count(*) FILTER (WHERE parked_at IS NOT NULL) AS keys_parked
FROM {keys};

-- name: stats_parked_keys
-- The :limit keys parked longest, each with the discarded event that parked
-- it: the one at the key's next_seq (NULL once retention has removed it).
SELECT k.ordering_key, k.next_seq, k.parked_at,
       CAST(e.event_id AS text) AS event_id, e.topic, e.type, e.attempts, e.last_error,
       e.created_at
FROM (SELECT ordering_key, next_seq, parked_at FROM {keys}
      WHERE parked_at IS NOT NULL
      ORDER BY parked_at, ordering_key
      LIMIT :limit) k
LEFT JOIN {events} e
       ON e.ordering_key = k.ordering_key AND e.seq = k.next_seq AND e.status = 'discarded'
ORDER BY k.parked_at, k.ordering_key;

-- name: stats_recent_discards
-- The :limit most recently written discarded events, newest first (the
-- discarded index is ordered by created_at; the time of the discard itself
-- is not stored).
SELECT CAST(event_id AS text) AS event_id, ordering_key, seq, topic, type, attempts,
       last_error, created_at
FROM {events}
WHERE status = 'discarded'
ORDER BY created_at DESC, event_id
LIMIT :limit;

-- name: requeue_candidates
-- The discarded events an operator selected, in key order, locked until the
-- requeue commits (a concurrent requeue or purge waits for it).
SELECT CAST(e.event_id AS text) AS event_id, e.ordering_key, e.seq, e.topic, e.type,
       e.attempts, e.last_error, e.created_at
FROM {events} e
WHERE e.status = 'discarded'
  AND (CAST(:event_ids AS uuid[]) IS NULL OR e.event_id = ANY(CAST(:event_ids AS uuid[])))
  AND (CAST(:ordering_keys AS text[]) IS NULL
       OR e.ordering_key = ANY(CAST(:ordering_keys AS text[])))
  AND (CAST(:types AS text[]) IS NULL OR e.type = ANY(CAST(:types AS text[])))
  AND (CAST(:topics AS text[]) IS NULL OR e.topic = ANY(CAST(:topics AS text[])))
  AND (CAST(:since AS timestamptz) IS NULL OR e.created_at >= CAST(:since AS timestamptz))
  AND (CAST(:until AS timestamptz) IS NULL OR e.created_at < CAST(:until AS timestamptz))
ORDER BY e.ordering_key, e.seq
FOR UPDATE OF e;

-- name: requeue_queue_rows
-- Gives each key of the events about to be requeued a queue row if it has
-- none (every event it had was done), from its earliest one, so that
-- lock_keys can lock it: without a row, a writer could add one and a relay
-- park the key before the requeue writes, unseen by it.
INSERT INTO {keys} (ordering_key, next_seq, due_at)
SELECT ordering_key, min(seq), now()
FROM {events}
WHERE event_id = ANY(CAST(:event_ids AS uuid[])) AND status = 'discarded'
GROUP BY ordering_key
ORDER BY ordering_key
ON CONFLICT (ordering_key) DO NOTHING;

-- name: lock_keys
-- Locks the queue rows of these keys, in key order, until the transaction
-- ends: no relay can claim, park or release them meanwhile. A statement that
-- locks rows reads the other tables from the snapshot it began with, older
-- than a row it waited for or found changed; what a key's events look like
-- is read by the next statement, after the lock.
SELECT ordering_key FROM {keys}
WHERE ordering_key = ANY(CAST(:ordering_keys AS text[]))
ORDER BY ordering_key
FOR UPDATE;

-- name: requeue_key_states
-- The queue rows of the keys about to be requeued (locked by lock_keys), each
-- parked one with the discarded event that parked it (the one at next_seq).
SELECT k.ordering_key, k.next_seq, k.parked_at,
       k.claim_token IS NOT NULL AND k.lease_expires_at > now() AS leased,
       CAST(e.event_id AS text) AS parked_by
FROM {keys} k
LEFT JOIN {events} e
       ON k.parked_at IS NOT NULL
      AND e.ordering_key = k.ordering_key AND e.seq = k.next_seq AND e.status = 'discarded'
WHERE k.ordering_key = ANY(CAST(:ordering_keys AS text[]))
ORDER BY k.ordering_key;

-- name: lock_parked_keys
-- Locks the parked keys an unpark may apply to (by key, when keys are
-- selected), in key order, as lock_keys does; unpark_candidates then reads
-- them after the lock.
SELECT ordering_key FROM {keys}
WHERE parked_at IS NOT NULL
  AND (CAST(:ordering_keys AS text[]) IS NULL
       OR ordering_key = ANY(CAST(:ordering_keys AS text[])))
ORDER BY ordering_key
FOR UPDATE;

-- name: unpark_candidates
-- The parked keys an operator selected (locked by lock_parked_keys), each with
-- the discarded event that parked it; event selectors match that event.
SELECT k.ordering_key, k.next_seq, k.parked_at,
       CAST(e.event_id AS text) AS event_id, e.topic, e.type, e.attempts, e.last_error,
       e.created_at
FROM {keys} k
LEFT JOIN {events} e
       ON e.ordering_key = k.ordering_key AND e.seq = k.next_seq AND e.status = 'discarded'
WHERE k.parked_at IS NOT NULL
  AND (CAST(:ordering_keys AS text[]) IS NULL
       OR k.ordering_key = ANY(CAST(:ordering_keys AS text[])))
  AND (CAST(:event_ids AS uuid[]) IS NULL OR e.event_id = ANY(CAST(:event_ids AS uuid[])))
  AND (CAST(:types AS text[]) IS NULL OR e.type = ANY(CAST(:types AS text[])))
  AND (CAST(:topics AS text[]) IS NULL OR e.topic = ANY(CAST(:topics AS text[])))
  AND (CAST(:since AS timestamptz) IS NULL OR e.created_at >= CAST(:since AS timestamptz))
  AND (CAST(:until AS timestamptz) IS NULL OR e.created_at < CAST(:until AS timestamptz))
ORDER BY k.ordering_key;

-- name: purge_counts
-- What purge_delivered and purge_discarded would remove now (same predicates,
-- same partial indexes).
SELECT (SELECT count(*) FROM {events}
        WHERE status = 'delivered'
          AND delivered_at < now() - make_interval(secs => :delivered_seconds)) AS delivered,
       (SELECT count(*) FROM {events}
        WHERE status = 'discarded'
          AND created_at < now() - make_interval(secs => :discarded_seconds)) AS discarded;

-- ===========================================================================
-- Consistency: the invariants the relay and the operator commands rely on
-- (outbox-kafka check --consistency). Each check returns one row per
-- violation, (ordering_key, event_id, detail), at most :limit of them, read
-- in one REPEATABLE READ snapshot.
-- ===========================================================================

-- name: consistency_unqueued_pending
-- A pending event whose key has no row in the key queue nor among the
-- arrivals: no relay will ever claim it.
SELECT e.ordering_key, CAST(e.event_id AS text) AS event_id,
       'pending event seq ' || e.seq || ' and its key has no queue row' AS detail
FROM {events} e
WHERE e.status = 'pending'
  AND NOT EXISTS (SELECT 1 FROM {keys} k WHERE k.ordering_key = e.ordering_key)
  AND NOT EXISTS (SELECT 1 FROM {arrivals} a
                  WHERE a.ordering_key = e.ordering_key AND a.first_seq <= e.seq)
ORDER BY e.ordering_key, e.seq
LIMIT :limit;

-- name: consistency_passed_pending
-- A pending event below its key's next_seq: the key moved past it, and the
-- claim, which reads from next_seq on, will never read it.
SELECT e.ordering_key, CAST(e.event_id AS text) AS event_id,
       'pending event seq ' || e.seq || ' is below its key''s next_seq ' || k.next_seq AS detail
FROM {events} e
JOIN {keys} k ON k.ordering_key = e.ordering_key
WHERE e.status = 'pending' AND e.seq < k.next_seq
ORDER BY e.ordering_key, e.seq
LIMIT :limit;

-- name: consistency_counter_behind
-- A pending or discarded event whose sequence number is above its key's
-- counter (or whose key has no counter): the next enqueue of the key would
-- hand out a number already taken.
SELECT e.ordering_key, CAST(e.event_id AS text) AS event_id,
       'event seq ' || e.seq || ' is above its key''s counter '
       || COALESCE(CAST(s.last_seq AS text), '(none)') AS detail
FROM {events} e
LEFT JOIN {seqs} s ON s.ordering_key = e.ordering_key
WHERE e.status IN ('pending', 'discarded')
  AND (s.last_seq IS NULL OR e.seq > s.last_seq)
ORDER BY e.ordering_key, e.seq
LIMIT :limit;

-- name: consistency_queue_rows
-- Queue rows the relay cannot work right: no counter row; next_seq past every
-- number handed out plus one (the key's next events would be skipped); a
-- lease half set; a parked key whose next event is pending rather than the
-- discarded event that parked it.
SELECT k.ordering_key, CAST(h.event_id AS text) AS event_id,
       CASE WHEN s.ordering_key IS NULL THEN 'queue row without a counter row'
            WHEN k.next_seq > s.last_seq + 1
                 THEN 'next_seq ' || k.next_seq || ' is past the counter ' || s.last_seq || ' + 1'
            WHEN (k.claim_token IS NULL) <> (k.lease_expires_at IS NULL)
                 THEN 'claim token and lease expiry are not set together'
            ELSE 'parked, but its next event (seq ' || k.next_seq || ') is pending'
       END AS detail
FROM {keys} k
LEFT JOIN {seqs} s ON s.ordering_key = k.ordering_key
LEFT JOIN {events} h
       ON h.ordering_key = k.ordering_key AND h.seq = k.next_seq AND h.status = 'pending'
WHERE s.ordering_key IS NULL
   OR k.next_seq > s.last_seq + 1
   OR (k.claim_token IS NULL) <> (k.lease_expires_at IS NULL)
   OR (k.parked_at IS NOT NULL AND h.event_id IS NOT NULL)
ORDER BY k.ordering_key
LIMIT :limit;

-- name: consistency_discarded_without_reason
-- A discarded event must say why.
SELECT e.ordering_key, CAST(e.event_id AS text) AS event_id,
       'discarded event seq ' || e.seq || ' has no last_error' AS detail
FROM {events} e
WHERE e.status = 'discarded' AND e.last_error IS NULL
ORDER BY e.ordering_key, e.seq
LIMIT :limit;

-- name: consistency_violation_count
-- The relay sampler's cheap count of the checks above that matter most: keys
-- whose first pending event is unreachable (no queue row nor arrival, or
-- below next_seq),
-- plus queue rows without a counter, past it, or with a half-set lease. The
-- pending keys are found by a skip scan of the claim index (one probe per key
-- with pending events), so the cost grows with the keys that have work, not
-- with the events.
WITH RECURSIVE pending_keys AS (
    (SELECT ordering_key, seq FROM {events}
     WHERE status = 'pending'
     ORDER BY ordering_key, seq
     LIMIT 1)
    UNION ALL
    SELECT n.ordering_key, n.seq
    FROM pending_keys p
    CROSS JOIN LATERAL (
        SELECT ordering_key, seq FROM {events}
        WHERE status = 'pending' AND ordering_key > p.ordering_key
        ORDER BY ordering_key, seq
        LIMIT 1
    ) n
)
SELECT (SELECT count(*)
        FROM pending_keys p
        LEFT JOIN {keys} k ON k.ordering_key = p.ordering_key
        WHERE (k.ordering_key IS NULL
               AND NOT EXISTS (SELECT 1 FROM {arrivals} a
                               WHERE a.ordering_key = p.ordering_key
                                 AND a.first_seq <= p.seq))
           OR p.seq < k.next_seq)
     + (SELECT count(*)
        FROM {keys} k
        LEFT JOIN {seqs} s ON s.ordering_key = k.ordering_key
        WHERE s.ordering_key IS NULL
           OR k.next_seq > s.last_seq + 1
           OR (k.claim_token IS NULL) <> (k.lease_expires_at IS NULL)) AS violations;

-- name: remaining_work
-- What is still pending, by why it is not being sent now: its key is leased
-- by a relay, parked, waiting for a retry (its next event has failed before)
-- or for a delay, due now, or unreachable (a consistency violation). Also how
-- many seconds until the first key that is not parked comes due (a lease
-- ends, a backoff or a delay passes), NULL when none will. A key still among
-- the arrivals counts as queued from its arrival's first_seq.
-- Of the delayed ones, held: their key's next event was held back until an
-- operator acts (its topic is missing, or access to it is not granted): no
-- attempt counted (attempts = 0) and the reason in last_error; one retried
-- has attempts > 0. With them, the held events' reasons, the one holding the
-- most keys first (at most three), and how many different reasons there
-- are: read from the waiting keys' next events, one claim-index probe each.
WITH queued AS (
    SELECT ordering_key, next_seq, due_at, claim_token, lease_expires_at, parked_at FROM {keys}
    UNION ALL
    SELECT a.ordering_key, a.first_seq, a.due_at, NULL, NULL, NULL FROM {arrivals} a
    WHERE NOT EXISTS (SELECT 1 FROM {keys} k WHERE k.ordering_key = a.ordering_key)
), held_heads AS (
    -- A key among the arrivals only was never sent, so never held.
    SELECT h.last_error
    FROM {keys} k
    JOIN {events} h
      ON h.ordering_key = k.ordering_key AND h.seq = k.next_seq AND h.status = 'pending'
    WHERE k.parked_at IS NULL AND NOT COALESCE(k.lease_expires_at > now(), false)
      AND k.due_at > now() AND h.attempts = 0 AND h.last_error IS NOT NULL
)
SELECT count(*) AS pending,
       count(*) FILTER (WHERE k.ordering_key IS NULL OR e.seq < k.next_seq) AS unreachable,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NOT NULL) AS parked,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NULL
                          AND k.claim_token IS NOT NULL AND k.lease_expires_at > now()) AS leased,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NULL
                          AND NOT COALESCE(k.lease_expires_at > now(), false)
                          AND k.due_at > now() AND h.attempts > 0) AS retrying,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NULL
                          AND NOT COALESCE(k.lease_expires_at > now(), false)
                          AND k.due_at > now() AND COALESCE(h.attempts, 0) = 0) AS delayed,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NULL
                          AND NOT COALESCE(k.lease_expires_at > now(), false)
                          AND k.due_at > now() AND h.attempts = 0
                          AND h.last_error IS NOT NULL) AS held,
       count(*) FILTER (WHERE e.seq >= k.next_seq AND k.parked_at IS NULL
                          AND NOT COALESCE(k.lease_expires_at > now(), false)
                          AND k.due_at <= now()) AS due,
       CAST(EXTRACT(EPOCH FROM min(k.due_at) FILTER (WHERE e.seq >= k.next_seq
                                                       AND k.parked_at IS NULL) - now())
            AS double precision) AS next_due_seconds,
       ARRAY(SELECT last_error FROM held_heads
             GROUP BY last_error ORDER BY count(*) DESC, last_error LIMIT 3) AS held_reasons,
       (SELECT count(DISTINCT last_error) FROM held_heads) AS held_reason_count
FROM {events} e
LEFT JOIN queued k ON k.ordering_key = e.ordering_key
LEFT JOIN {events} h
       ON h.ordering_key = k.ordering_key AND h.seq = k.next_seq AND h.status = 'pending'
WHERE e.status = 'pending';

-- name: pending_topics
-- The topics pending events wait for, with how many events each (most
-- first, at most :topic_limit topics), read from at most :scan_limit pending
-- events in the claim index's order (by key, then sequence number). The
-- cost is bounded by :scan_limit index entries and heap rows whatever the
-- backlog (measured: 55-200 ms for 100,000 of 1,000,000 pending events),
-- where counting every pending event reads the whole table. scanned: how
-- many were read; when it is :scan_limit, more may be pending, the counts
-- are lower bounds and a topic only later events wait for is not seen.
WITH scanned AS (
    SELECT topic FROM {events}
    WHERE status = 'pending'
    ORDER BY ordering_key, seq
    LIMIT :scan_limit
)
SELECT topic, count(*) AS events, CAST(sum(count(*)) OVER () AS bigint) AS scanned
FROM scanned
GROUP BY topic
ORDER BY count(*) DESC, topic
LIMIT :topic_limit;

-- name: server_version
-- The server's version, and the role this session is (a URL's ?user= names
-- another role than its user part).
SELECT current_setting('server_version') AS version, CAST(current_user AS text) AS role_name;

-- name: emit_frame
-- The log mode's write: one frame of events (outbox_kafka/log_frames.py) into
-- the write-ahead log through the outbox's emit function (migration 0007), in
-- the caller's transaction.
SELECT {emit}(CAST(:frame AS bytea));

-- name: log_server_state
-- What the log mode needs of the server and of the outbox's slot, for log-setup and
-- check: wal_level, the server's major version (failover slots need 17),
-- max_slot_wal_keep_size, whether the session may replicate (superuser,
-- REPLICATION, or Amazon RDS's rds_replication role), whether the publication exists and whether PUBLIC may still call
-- pg_logical_emit_message; and the slot's plugin, wal_status, whether a session
-- reads it, the WAL it holds back (bytes from its confirmed position to the
-- server's current one), safe_wal_size and failover (NULL before 17). The slot's
-- columns are NULL when there is no such slot in this database.
SELECT current_setting('wal_level') AS wal_level,
       current_setting('server_version_num')::int / 10000 AS major,
       current_setting('max_slot_wal_keep_size') AS max_slot_wal_keep_size,
       (SELECT rolsuper OR rolreplication FROM pg_roles WHERE rolname = current_user)
       OR EXISTS (SELECT 1 FROM pg_roles
                  WHERE rolname = 'rds_replication'
                    AND pg_has_role(current_user, oid, 'MEMBER'))
           AS may_replicate,
       EXISTS (SELECT 1 FROM pg_publication WHERE pubname = :publication) AS has_publication,
       EXISTS (SELECT 1 FROM pg_proc p
               WHERE p.proname = 'pg_logical_emit_message'
                 AND p.pronamespace = 'pg_catalog'::regnamespace
                 AND has_function_privilege('public', p.oid, 'EXECUTE'))
           AS public_may_emit,
       s.plugin AS slot_plugin,
       s.wal_status AS slot_wal_status,
       s.active AS slot_active,
       CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn) AS bigint)
           AS slot_lag_bytes,
       s.safe_wal_size AS slot_safe_wal_size,
       CAST(to_jsonb(s) ->> 'failover' AS boolean) AS slot_failover
FROM (SELECT 1) AS server
LEFT JOIN pg_replication_slots s
       ON s.slot_name = :slot AND s.database = current_database();

-- name: create_log_publication
-- The publication the log mode streams with: it names no table, so the stream holds
-- only the logical decoding messages (and transaction boundaries).
CREATE PUBLICATION {log_publication};

-- name: create_log_slot
-- The outbox's slot, for the pgoutput plugin; not temporary, no two-phase decoding.
SELECT pg_create_logical_replication_slot(:slot, 'pgoutput', false, false);

-- name: create_log_slot_failover
-- The same, kept on a standby that syncs slots (PostgreSQL 17 and later).
SELECT pg_create_logical_replication_slot(:slot, 'pgoutput', false, false, true);

-- name: revoke_emit_message
-- pg_logical_emit_message, every signature of it, from PUBLIC: until then any role
-- of the database can put a message with this outbox's prefix into the log, which
-- the relay would publish. The emit function's owner keeps it (the function runs
-- with its rights). Needs the rights of the functions' owner: a superuser.
DO $revoke$
DECLARE
    f regprocedure;
    owner name := (SELECT pg_get_userbyid(proowner) FROM pg_proc
                   WHERE oid = to_regprocedure({emit_signature_literal}));
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.proname = 'pg_logical_emit_message'
               AND p.pronamespace = 'pg_catalog'::regnamespace
    LOOP
        IF owner IS NOT NULL THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, owner);
        END IF;
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$revoke$;

-- name: log_peek
-- What the outbox's slot would stream next, without consuming it (check): at most
-- about :rows rows of pgoutput (protocol 1, logical decoding messages on; the
-- server ends at the first transaction's end past :rows), each a Begin, a
-- Message or a Commit. SQLSTATE 55006 while a relay reads the slot.
SELECT data
FROM pg_logical_slot_peek_binary_changes(
    :slot, NULL, :rows,
    'proto_version', '1', 'publication_names', :publication, 'messages', 'true');

-- name: log_slot_state
-- The outbox's slot as the log mode's relay samples it: the WAL not yet
-- acknowledged (bytes from its confirmed position to the server's current one), how much more
-- WAL may be written before the server gives it up (NULL: no limit,
-- max_slot_wal_keep_size = -1), and its wal_status (lost: given up). No row: no
-- such slot.
SELECT CAST(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) AS bigint) AS lag_bytes,
       safe_wal_size,
       wal_status
FROM pg_replication_slots
WHERE slot_name = :slot AND database = current_database();
