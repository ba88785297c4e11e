"""The producer side: validate events and write them to the outbox in the caller's
transaction. Everything here is re-exported from :mod:`outbox_kafka`."""
