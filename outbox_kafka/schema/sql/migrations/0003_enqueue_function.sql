-- The single-event enqueue as a function: the same writes as the batch
-- statement (enqueue in queries.sql), in the caller's transaction, with the
-- caller's rights (SECURITY INVOKER: a producer needs the grants it needed
-- for the statement this replaces; EXECUTE is granted to PUBLIC, as for any
-- new function, and gives no other right). PL/pgSQL keeps each statement's
-- plan for the rest of the session, so a call is parsed and planned as a
-- one-line SELECT, where the statement it replaces (three data-modifying
-- CTEs, about 1.5 kB of SQL) was parsed and planned anew on every call: the
-- drivers most producers use send it unprepared (psycopg2 always, with the
-- parameters inlined; psycopg 3 until its fifth execution on a connection).
-- The plans live in the server session, so they also hold behind a
-- transaction-mode connection pooler, where prepared statements do not.
--
-- The key's counter is taken first and held until the commit: sequence order
-- is commit order. The key goes to {arrivals} (see 0002_arrivals.sql). The
-- notify is sent only while a relay waits idle, holding the wake lock
-- exclusively: the shared try fails. Otherwise the try takes the lock, shared,
-- until the commit, and a relay about to go idle waits for this transaction
-- before it looks for work one last time. Returns whether it notified.
CREATE FUNCTION {enqueue_one}(
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

    -- Nested, so that the lock is tried only when notifying is on.
    IF p_notify THEN
        IF NOT pg_try_advisory_xact_lock_shared({wake_lock}) THEN
            PERFORM pg_notify({channel_literal}, '');
            RETURN true;
        END IF;
    END IF;
    RETURN false;
END
$body$;
