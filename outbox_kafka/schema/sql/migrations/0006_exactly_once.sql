-- What a relay needs to publish each event once across crashes: which relay
-- session made a key's claim, which sessions may have sent events of the key
-- that are not recorded, and where in Kafka each session's unrecorded
-- messages can start. A session is one relay loop's producer.
--
-- On the key queue, written only by relays and operators (never by a
-- producer's transaction):
--   claim_session   the session that made the key's current claim, written
--                   by every claim together with claim_token.
--   doubt_sessions  the sessions that may have sent events of the key that
--                   are not recorded (NULL: none): a claim that ended without
--                   a record (its lease ran out with claim_token still set),
--                   or an outcome that may have been delivered (a timeout).
--                   Before a relay sends the key again it reads Kafka back
--                   from those sessions' floors.
--   doubt_until_seq the last sequence number those sessions may have sent:
--                   the doubt ends once the key's next_seq has passed it.
-- All are nullable without a default, so adding them changes the catalog
-- only, with no table rewrite. ADD COLUMN takes the key queue's ACCESS
-- EXCLUSIVE lock until the migration commits: quick, but it first waits for
-- the transactions that use the table, and relays and operator commands wait
-- behind it for as long (producers never touch the key queue). No index:
-- they change on every claim and record, and an index would cost each of
-- them a new entry.
ALTER TABLE {keys}
    ADD COLUMN claim_session uuid,
    ADD COLUMN doubt_sessions uuid[],
    ADD COLUMN doubt_until_seq bigint;

-- A relay session's floor per partition: no message of the session on that
-- partition that is not recorded lies below floor_offset. The session writes
-- (and commits) a floor for a partition before it first produces to it, at
-- the partition's end offset read just before, and raises it as its batches
-- are recorded, never past an outcome that may have been delivered. A relay
-- reading back a session in doubt starts there. The purge of events never
-- touches it; the relay deletes the rows of old sessions that no key names
-- any more. partitions is the topic's partition count the session produced
-- under (which partition a key goes to depends on it).
CREATE TABLE {floors} (
    session         uuid        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    partitions      integer     NOT NULL,
    floor_offset    bigint      NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (session, topic, kafka_partition)
);

-- Small and updated on every recorded batch: vacuum by row count, as for the
-- key queue.
ALTER TABLE {floors} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);
