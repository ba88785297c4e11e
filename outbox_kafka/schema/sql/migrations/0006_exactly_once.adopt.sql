-- Adopting tables made without 0006_exactly_once.sql: the floors table's
-- storage settings (the key queue's new columns are part of the shape).
ALTER TABLE {floors} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);
