-- The whole schema that `outbox-kafka migrate` leaves for the default outbox (table
-- outbox in schema public), in one file to read: its tables, indexes, storage settings,
-- functions and their grants, and the migrations it records as applied.
--
-- Written by `make schema` (python -m tests.current_schema) from the catalog of a
-- database migrated from nothing: run it after adding a migration, and do not edit this
-- file by hand. The migrations in sql/migrations are how a database gets here, and
-- why each part is as it is; tests/integration/test_current_schema.py checks that
-- migrating an empty database ends equal to this file, object by object.

CREATE TABLE public.outbox_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone NOT NULL DEFAULT now(),
    CONSTRAINT outbox_migrations_pkey PRIMARY KEY (version)
);

CREATE TABLE public.outbox (
    event_id uuid NOT NULL,
    ordering_key text NOT NULL,
    seq bigint NOT NULL,
    topic text NOT NULL,
    type text NOT NULL,
    value bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '[]'::jsonb,
    status text NOT NULL DEFAULT 'pending'::text,
    attempts integer NOT NULL DEFAULT 0,
    available_at timestamp with time zone NOT NULL DEFAULT now(),
    claim_token uuid,
    delivered_at timestamp with time zone,
    kafka_partition integer,
    kafka_offset bigint,
    last_error text,
    created_at timestamp with time zone NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT outbox_pkey PRIMARY KEY (event_id),
    CONSTRAINT outbox_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT outbox_status_check CHECK ((status = ANY (ARRAY['pending'::text, 'delivered'::text, 'discarded'::text])))
);

CREATE TABLE public.outbox_key_seq (
    ordering_key text NOT NULL,
    last_seq bigint NOT NULL,
    CONSTRAINT outbox_key_seq_pkey PRIMARY KEY (ordering_key)
);

ALTER TABLE public.outbox_key_seq SET (
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_scale_factor = 0.02,
    fillfactor = 80
);

CREATE TABLE public.outbox_keys (
    ordering_key text NOT NULL,
    next_seq bigint NOT NULL,
    due_at timestamp with time zone NOT NULL DEFAULT now(),
    claim_token uuid,
    lease_expires_at timestamp with time zone,
    parked_at timestamp with time zone,
    created_at timestamp with time zone NOT NULL DEFAULT now(),
    claim_session uuid,
    doubt_sessions uuid[],
    doubt_until_seq bigint,
    CONSTRAINT outbox_keys_pkey PRIMARY KEY (ordering_key)
);

ALTER TABLE public.outbox_keys SET (
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    fillfactor = 70
);

CREATE TABLE public.outbox_arrivals (
    ordering_key text NOT NULL,
    first_seq bigint NOT NULL,
    due_at timestamp with time zone NOT NULL DEFAULT now(),
    CONSTRAINT outbox_arrivals_pkey PRIMARY KEY (ordering_key)
);

ALTER TABLE public.outbox_arrivals SET (
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    fillfactor = 70
);

CREATE TABLE public.outbox_floors (
    session uuid NOT NULL,
    topic text NOT NULL,
    kafka_partition integer NOT NULL,
    partitions integer NOT NULL,
    floor_offset bigint NOT NULL,
    created_at timestamp with time zone NOT NULL DEFAULT now(),
    CONSTRAINT outbox_floors_pkey PRIMARY KEY (session, topic, kafka_partition)
);

ALTER TABLE public.outbox_floors SET (
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    fillfactor = 70
);

CREATE UNIQUE INDEX outbox_claim_idx ON public.outbox USING btree (ordering_key, seq) WHERE (status = 'pending'::text);

CREATE INDEX outbox_delivered_idx ON public.outbox USING btree (delivered_at) WHERE (status = 'delivered'::text);

CREATE INDEX outbox_discarded_idx ON public.outbox USING btree (created_at) WHERE (status = 'discarded'::text);

CREATE INDEX outbox_keys_due_idx ON public.outbox_keys USING btree (due_at) WHERE (parked_at IS NULL);

CREATE OR REPLACE FUNCTION public.outbox_enqueue_one(p_event_id uuid, p_ordering_key text, p_topic text, p_type text, p_value bytea, p_headers jsonb, p_available_at timestamp with time zone, p_delay_seconds double precision, p_notify boolean)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    assigned bigint;
    due      timestamptz := COALESCE(
        p_available_at, now() + make_interval(secs => p_delay_seconds), now());
BEGIN
    IF NOT isfinite(due) THEN
        RAISE EXCEPTION 'available_at and delay must be finite'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO "public"."outbox_key_seq" AS s (ordering_key, last_seq)
    VALUES (p_ordering_key, 1)
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + 1
    RETURNING s.last_seq INTO assigned;

    INSERT INTO "public"."outbox" (event_id, ordering_key, seq, topic, type, value, headers,
                          available_at)
    VALUES (p_event_id, p_ordering_key, assigned, p_topic, p_type, p_value, p_headers, due);

    INSERT INTO "public"."outbox_arrivals" (ordering_key, first_seq, due_at)
    VALUES (p_ordering_key, assigned, due)
    ON CONFLICT (ordering_key) DO NOTHING;

    IF p_notify THEN
        IF NOT pg_try_advisory_xact_lock_shared(-3031757325835454672) THEN
            PERFORM pg_notify('outbox_kafka.public.outbox', '');
            RETURN true;
        END IF;
    END IF;
    RETURN false;
END
$function$;

REVOKE ALL ON FUNCTION public.outbox_enqueue_one(p_event_id uuid, p_ordering_key text, p_topic text, p_type text, p_value bytea, p_headers jsonb, p_available_at timestamp with time zone, p_delay_seconds double precision, p_notify boolean) FROM PUBLIC;

CREATE OR REPLACE FUNCTION public.outbox_enqueue_many(p_event_ids uuid[], p_ordering_keys text[], p_topics text[], p_types text[], p_value_starts integer[], p_value_lengths integer[], p_values bytea, p_headers jsonb, p_available_ats timestamp with time zone[], p_delays double precision[], p_notify boolean)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
        INSERT INTO "public"."outbox_key_seq" AS s (ordering_key, last_seq)
        SELECT ordering_key, n FROM batch_keys ORDER BY ordering_key
        ON CONFLICT (ordering_key) DO UPDATE SET last_seq = s.last_seq + EXCLUDED.last_seq
        RETURNING s.ordering_key, s.last_seq
    ), inserted AS (
        INSERT INTO "public"."outbox" (event_id, ordering_key, seq, topic, type, value, headers,
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
    INSERT INTO "public"."outbox_arrivals" (ordering_key, first_seq, due_at)
    SELECT c.ordering_key, c.last_seq - k.n + 1, k.due
    FROM counters c
    JOIN batch_keys k ON k.ordering_key = c.ordering_key
    ORDER BY c.ordering_key
    ON CONFLICT (ordering_key) DO NOTHING;

    IF p_notify THEN
        IF NOT pg_try_advisory_xact_lock_shared(-3031757325835454672) THEN
            PERFORM pg_notify('outbox_kafka.public.outbox', '');
            RETURN true;
        END IF;
    END IF;
    RETURN false;
END
$function$;

REVOKE ALL ON FUNCTION public.outbox_enqueue_many(p_event_ids uuid[], p_ordering_keys text[], p_topics text[], p_types text[], p_value_starts integer[], p_value_lengths integer[], p_values bytea, p_headers jsonb, p_available_ats timestamp with time zone[], p_delays double precision[], p_notify boolean) FROM PUBLIC;

CREATE OR REPLACE FUNCTION public.outbox_emit(p_frame bytea)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    checked_at text := current_setting('outbox_kafka.' || 'outbox_kafka_6_public_outbox', true);
    now_s double precision := extract(epoch FROM clock_timestamp());
BEGIN
    IF p_frame IS NULL OR length(p_frame) = 0 OR get_byte(p_frame, 0) <> 1 THEN
        RAISE EXCEPTION 'outbox log mode: not an event frame of version 1'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF checked_at IS NULL OR checked_at !~ '^[0-9]+(\.[0-9]+)?$'
       OR NOT (now_s - checked_at::double precision BETWEEN 0 AND 1) THEN
        IF current_setting('wal_level') <> 'logical' THEN
            RAISE EXCEPTION 'outbox log mode: wal_level is %, not logical',
                            current_setting('wal_level')
                  USING ERRCODE = 'object_not_in_prerequisite_state',
                        HINT = 'Set wal_level = logical and restart the server.';
        END IF;
        IF NOT EXISTS (
            SELECT 1 FROM pg_replication_slots
            WHERE slot_name = 'outbox_kafka_6_public_outbox'
              AND database = current_database()
              AND wal_status IS DISTINCT FROM 'lost'
        ) THEN
            RAISE EXCEPTION 'outbox log mode: no usable replication slot %', 'outbox_kafka_6_public_outbox'
                  USING ERRCODE = 'object_not_in_prerequisite_state',
                        HINT = 'Make it with outbox-kafka log-setup. A lost slot must be '
                               'dropped first, and the events it held are gone.';
        END IF;
        PERFORM set_config('outbox_kafka.' || 'outbox_kafka_6_public_outbox', now_s::text, false);
    END IF;
    PERFORM pg_logical_emit_message(true, 'outbox-kafka:public.outbox', p_frame);
END
$function$;

REVOKE ALL ON FUNCTION public.outbox_emit(p_frame bytea) FROM PUBLIC;

INSERT INTO "public"."outbox_migrations" (version, name) VALUES
    (1, 'initial'),
    (2, 'arrivals'),
    (3, 'enqueue_function'),
    (4, 'drop_pending_index'),
    (5, 'producer_functions'),
    (6, 'exactly_once'),
    (7, 'log_messages'),
    (8, 'emit_slot_check');
