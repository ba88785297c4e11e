-- The log mode's emit function (migration 0007) checks the server and the
-- outbox's slot once a second per session instead of at every call. The check
-- reads pg_replication_slots, which cost a producer's transaction about as much
-- server CPU as the rest of the emit together; wal_level cannot change without
-- a restart, which ends every session, and a slot given up or dropped is seen
-- by each session within a second. A session's last check is kept in a
-- session setting named for the slot ('outbox_kafka.' || the slot's name);
-- a transaction that rolls back also takes back the time of a check it made.
-- The setting is the session's own: a value that is not a time, or not within
-- the last second, only makes the function check again. Setting it is no way
-- past anything but the check of one's own writes.
--
-- The function keeps its owner, its grants and its SET search_path.
CREATE OR REPLACE FUNCTION {emit}(p_frame bytea) RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $body$
DECLARE
    checked_at text := current_setting('outbox_kafka.' || {log_slot_literal}, true);
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
            WHERE slot_name = {log_slot_literal}
              AND database = current_database()
              AND wal_status IS DISTINCT FROM 'lost'
        ) THEN
            RAISE EXCEPTION 'outbox log mode: no usable replication slot %', {log_slot_literal}
                  USING ERRCODE = 'object_not_in_prerequisite_state',
                        HINT = 'Make it with outbox-kafka log-setup. A lost slot must be '
                               'dropped first, and the events it held are gone.';
        END IF;
        PERFORM set_config('outbox_kafka.' || {log_slot_literal}, now_s::text, false);
    END IF;
    PERFORM pg_logical_emit_message(true, {log_prefix_literal}, p_frame);
END
$body$;
