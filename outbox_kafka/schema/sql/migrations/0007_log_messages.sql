-- The log mode (Outbox(write_to="log")): a producer's events go into the
-- write-ahead log as one transactional logical decoding message per write,
-- carrying this outbox's prefix, instead of into its tables. A relay reads
-- them from the outbox's replication slot in commit order; the message of a
-- transaction that rolls back (or of a savepoint rolled back) never reaches
-- it. The tables, and the polling relay that reads them, are unchanged.
--
-- Producers emit only through {emit}, which runs with its owner's rights: a
-- producer role needs EXECUTE on it and nothing else, and every message it
-- emits carries this outbox's prefix. (pg_logical_emit_message itself is
-- executable by PUBLIC until revoked, which needs a superuser: see the log
-- mode's set-up.)
--
-- It refuses what no relay could read, so that a producer's transaction
-- fails instead of committing an event that would never be published:
-- below wal_level = logical a message cannot be decoded, and without the
-- outbox's slot, or with a slot the server has given up (wal_status 'lost',
-- past max_slot_wal_keep_size), nothing keeps the message until a relay
-- reads it.
CREATE FUNCTION {emit}(p_frame bytea) RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
BEGIN
    IF p_frame IS NULL OR length(p_frame) = 0 OR get_byte(p_frame, 0) <> 1 THEN
        RAISE EXCEPTION 'outbox log mode: not an event frame of version 1'
              USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF current_setting('wal_level') <> 'logical' THEN
        RAISE EXCEPTION 'outbox log mode: wal_level is %, not logical',
                        current_setting('wal_level')
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Set wal_level = logical and restart the server.';
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM pg_replication_slots
        WHERE slot_name = {log_slot_literal}
          AND database = current_database()
          AND wal_status IS DISTINCT FROM 'lost'
    ) THEN
        RAISE EXCEPTION 'outbox log mode: no usable replication slot %', {log_slot_literal}
              USING ERRCODE = 'object_not_in_prerequisite_state',
                    HINT = 'Make it with outbox-kafka log-setup. A lost slot must be dropped '
                           'first, and the events it held are gone.';
    END IF;
    PERFORM pg_logical_emit_message(true, {log_prefix_literal}, p_frame);
END
$body$;

-- Callable by the roles that may call the producer functions today, and by
-- no one else; roles.sql grants it to a producer role made later.
DO $grant$
DECLARE
    writer name;
BEGIN
    FOR writer IN
        SELECT r.rolname FROM pg_roles r
        WHERE has_function_privilege(
                  r.oid,
                  '{enqueue_one}(uuid, text, text, text, bytea, jsonb, timestamptz, '
                  'double precision, boolean)',
                  'EXECUTE')
          AND r.oid <> (SELECT relowner FROM pg_class WHERE oid = '{events}'::regclass)
          AND NOT r.rolsuper
          AND r.rolname NOT LIKE 'pg\_%'
          AND r.rolname <> 'public'
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s(bytea) TO %I', '{emit}', writer);
    END LOOP;
END
$grant$;

REVOKE EXECUTE ON FUNCTION {emit}(bytea) FROM PUBLIC;
