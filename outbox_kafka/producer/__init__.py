"""The producer side: validate events and write them to the outbox in the caller's
transaction. Its public API is re-exported from :mod:`outbox_kafka`."""
