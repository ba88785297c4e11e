-- Producers write only through functions, and need no right on any table.
--
-- Until now a producer role held INSERT on the events, the key counters and
-- the arrivals, and SELECT on the counters' and arrivals' keys (for INSERT
-- ... ON CONFLICT): it could queue any key among the arrivals with any
-- first_seq or due_at (stranding another service's events), and read every
-- ordering key in use. From here on both enqueue paths are SECURITY DEFINER
-- functions, run with the rights of the role that ran the migrations, which
-- derive every sequence number and arrival themselves; roles.sql grants a
-- producer role EXECUTE on them and nothing on the tables. Each function
-- pins its search_path, and every name in it is schema-qualified.
--
-- {enqueue_many}: the batch statement (enqueue in queries.sql) as a function.
-- It takes the events in order and works out what the statement is given
-- precomputed (each key's count, its first event's due time, how many events
-- of its key follow each event): a caller cannot hand it numbers that
-- collide with, or skip past, another transaction's. The key counters are
-- taken in key order (no deadlock between two batches) and held until the
-- caller commits. Values come as one bytea cut by starts and lengths,
-- headers as one JSON array, as for the statement.
CREATE FUNCTION {enqueue_many}(
    p_event_ids     uuid[],
    p_ordering_keys text[],
    p_topics        text[],
    p_types         text[],
    p_value_starts  integer[],
    p_value_lengths integer[],
    p_values        bytea,
    p_headers       jsonb,
    p_available_ats timestamptz[],
    p_delays        double precision[],
    p_notify        boolean
) RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    -- A due time the relay cannot compute with (infinity) would fail every
    -- claim that reads the event; the library never sends one.
    IF EXISTS (SELECT 1 FROM unnest(p_available_ats) t WHERE NOT isfinite(t))
       OR EXISTS (SELECT 1 FROM unnest(p_delays) d WHERE d = 'Infinity' OR d = 'NaN') THEN
        RAISE EXCEPTION 'available_at and delay must be finite'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH batch AS (
        SELECT i.*,
               count(*) OVER w - row_number() OVER w AS behind,
               first_value(COALESCE(i.available_at, now() + make_interval(secs => i.delay),
                                    now())) OVER w AS key_due
        FROM unnest(p_event_ids, p_ordering_keys, p_topics, p_types, p_value_starts,
                    p_value_lengths, p_available_ats, p_delays)
             WITH ORDINALITY AS i(event_id, ordering_key, topic, type, value_start,
                                  value_length, available_at, delay, ord)
        WINDOW w AS (PARTITION BY i.ordering_key ORDER BY i.ord
                     ROWS BETWEEN UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING)
    ), batch_keys AS (
        SELECT ordering_key, count(*) AS n, min(key_due) AS due
        FROM batch
        GROUP BY ordering_key
    ), counters AS (
        INSERT INTO {seqs} AS s (ordering_key, last_seq)
        SELECT ordering_key, n FROM batch_keys ORDER BY ordering_key
        ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + EXCLUDED.last_seq
        RETURNING s.ordering_key, s.last_seq
    ), inserted AS (
        INSERT INTO {events} (event_id, ordering_key, seq, topic, type, value, headers,
                              available_at)
        SELECT b.event_id,
               b.ordering_key,
               c.last_seq - b.behind,
               b.topic,
               b.type,
               substring(p_values FROM b.value_start FOR b.value_length),
               p_headers -> CAST(b.ord - 1 AS integer),
               COALESCE(b.available_at, now() + make_interval(secs => b.delay), now())
        FROM batch b
        JOIN counters c ON c.ordering_key = b.ordering_key
    )
    INSERT INTO {arrivals} (ordering_key, first_seq, due_at)
    SELECT c.ordering_key, c.last_seq - k.n + 1, k.due
    FROM counters c
    JOIN batch_keys k ON k.ordering_key = c.ordering_key
    ORDER BY c.ordering_key
    ON CONFLICT (ordering_key) DO NOTHING;

    IF p_notify THEN
        IF NOT pg_try_advisory_xact_lock_shared({wake_lock}) THEN
            PERFORM pg_notify({channel_literal}, '');
            RETURN true;
        END IF;
    END IF;
    RETURN false;
END
$body$;

-- The single-event function of 0003, now with the owner's rights too, and
-- the same check on due times as the batch function.
CREATE OR REPLACE FUNCTION {enqueue_one}(
    p_event_id      uuid,
    p_ordering_key  text,
    p_topic         text,
    p_type          text,
    p_value         bytea,
    p_headers       jsonb,
    p_available_at  timestamptz,
    p_delay_seconds double precision,
    p_notify        boolean
) RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $body$
DECLARE
    assigned bigint;
    due      timestamptz := COALESCE(
        p_available_at, now() + make_interval(secs => p_delay_seconds), now());
BEGIN
    IF NOT isfinite(due) THEN
        RAISE EXCEPTION 'available_at and delay must be finite'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO {seqs} AS s (ordering_key, last_seq)
    VALUES (p_ordering_key, 1)
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + 1
    RETURNING s.last_seq INTO assigned;

    INSERT INTO {events} (event_id, ordering_key, seq, topic, type, value, headers,
                          available_at)
    VALUES (p_event_id, p_ordering_key, assigned, p_topic, p_type, p_value, p_headers, due);

    INSERT INTO {arrivals} (ordering_key, first_seq, due_at)
    VALUES (p_ordering_key, assigned, due)
    ON CONFLICT (ordering_key) DO NOTHING;

    IF p_notify THEN
        IF NOT pg_try_advisory_xact_lock_shared({wake_lock}) THEN
            PERFORM pg_notify({channel_literal}, '');
            RETURN true;
        END IF;
    END IF;
    RETURN false;
END
$body$;

ALTER FUNCTION {enqueue_one}(uuid, text, text, text, bytea, jsonb, timestamptz,
                             double precision, boolean)
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp;

-- A function that runs with its owner's rights is callable only by the roles
-- given EXECUTE (roles.sql), not by every role of the database. The roles
-- that write events today (they can insert into the events table: producers
-- granted by an older roles.sql, or that relied on PUBLIC's EXECUTE) are
-- given EXECUTE on both here, so that none of them loses the function it
-- calls now; the README says how to take their table rights back.
DO $grant$
DECLARE
    writer name;
BEGIN
    FOR writer IN
        SELECT r.rolname FROM pg_roles r
        WHERE has_any_column_privilege(r.oid, '{events}', 'INSERT')
          AND r.oid <> (SELECT relowner FROM pg_class WHERE oid = '{events}'::regclass)
          AND NOT r.rolsuper
          AND r.rolname NOT LIKE 'pg\_%'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s(uuid, text, text, text, bytea, jsonb, '
                       'timestamptz, double precision, boolean) TO %I',
                       '{enqueue_one}', writer);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s(uuid[], text[], text[], text[], '
                       'integer[], integer[], bytea, jsonb, timestamptz[], '
                       'double precision[], boolean) TO %I',
                       '{enqueue_many}', writer);
    END LOOP;
END
$grant$;

REVOKE EXECUTE ON FUNCTION {enqueue_one}(uuid, text, text, text, bytea, jsonb, timestamptz,
                                         double precision, boolean) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION {enqueue_many}(uuid[], text[], text[], text[], integer[],
                                          integer[], bytea, jsonb, timestamptz[],
                                          double precision[], boolean) FROM PUBLIC;
