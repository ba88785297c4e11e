-- Adopting tables made without 0002_arrivals.sql: the arrivals table's
-- storage settings (see 0001_initial.adopt.sql).
ALTER TABLE {arrivals} SET (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_cost_delay = 0
);
