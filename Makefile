# The two commands of the README, plus helpers. Each target installs what it needs first.
.PHONY: install demo test test-fast fuzz bench lint clean

install:
	scripts/install.sh dev

demo: install
	.venv/bin/arl demo

test:
	scripts/test.sh

test-fast: install
	.venv/bin/python -m pytest -m "not slow and not slurm and not vllm" -x -q

# The fuzz suites with ten times the cases CI runs (ARL_FUZZ_SCALE multiplies each suite's default count), against
# one proxy process and against a pool of two workers (ARL_FUZZ_POOL=1, proxy.workers).
fuzz: install
	ARL_FUZZ_SCALE=10 ARL_FUZZ_POOL=1 .venv/bin/python -m pytest -q tests/integration/test_fuzz_proxy.py \
		tests/integration/test_proxy_fuzz.py tests/integration/test_fuzz_engine.py

bench:
	scripts/install.sh dev,bench
	.venv/bin/arl bench

lint: install
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy pipeline stages schemas

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
