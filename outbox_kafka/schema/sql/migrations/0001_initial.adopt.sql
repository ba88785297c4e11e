-- Adopting tables made without 0001_initial.sql (from outbox_kafka.tables, by
-- Alembic say): their shape is checked first; this adds what the migration
-- sets beyond the shape, the storage settings of the key queue and counters.
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
