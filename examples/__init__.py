"""Runnable examples of the producer API in applications (importable by the tests)."""
