# Modelyard: every target sets up what it needs, idempotently (a second run starts in seconds).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL := models/SmolLM2-135M-Instruct.Q4_1.gguf
# Gemma 3 270M (base model), with the Gemma terms beside it (models/gemma-3-270m.*)
GEMMA_MODEL := models/gemma-3-270m-q4_k_m.gguf
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: serve test bench bench-peers bench-density lint format models prometheus redis chromium venv clean

venv: $(STAMP)

# Reinstall only when the dependency pins change.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

models: $(MODEL) $(GEMMA_MODEL)

$(MODEL): | $(STAMP)
	$(PY) scripts/fetch_models.py smollm2

$(GEMMA_MODEL): | $(STAMP)
	$(PY) scripts/fetch_models.py gemma3

# Tests scrape the servers with a real Prometheus and check rules with promtool (Debian package).
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { \
		echo "installing prometheus (Debian package) ..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# Tests and the gateway benchmark start their own redis-server (Debian package) for shared limits.
redis:
	@command -v redis-server >/dev/null || { \
		echo "installing redis-server (Debian package) ..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }

# The status page's test drives a headless Chromium over the DevTools protocol (Debian package).
chromium:
	@command -v chromium >/dev/null || { \
		echo "installing chromium (Debian package) ..."; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

serve: $(STAMP) $(MODEL) $(GEMMA_MODEL)
	$(VENV)/bin/modelyard serve -c models.yaml --host $(HOST) --port $(PORT)

test: $(STAMP) $(MODEL) $(GEMMA_MODEL) prometheus redis chromium
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

bench: $(STAMP) $(MODEL) redis
	@mkdir -p bench-results
	$(PY) scripts/bench_engine.py --out bench-results/engine.json
	$(PY) scripts/bench_serving.py --serve "--model $(MODEL) --served-model-name smollm2 \
		--max-num-seqs 32 --kv-cache-memory 1GiB" --concurrency 1,4,16,32 --output-len 128 \
		--num-requests 32 --max-seconds 60 --offline --baseline-hf --out bench-results/serving.json
	# bf16 weights: fast where the CPU has AVX512-BF16 or AMX (prepacked oneDNN GEMMs), slow elsewhere
	$(PY) scripts/bench_serving.py --serve "--model $(MODEL) --served-model-name smollm2 \
		--max-num-seqs 32 --kv-cache-memory 1GiB --dtype bfloat16" --concurrency 1,4,16,32 \
		--output-len 128 --num-requests 32 --max-seconds 60 --offline --baseline-hf \
		--out bench-results/serving-bf16.json
	$(PY) scripts/bench_gateway.py --out bench-results/gateway.json
	# The Grafana dashboards as PNGs (bench-results/dashboards/): a short live run of its own, the
	# gateway with the model pinned and on demand, scraped by a Prometheus the script starts.
	# Without prometheus (`make prometheus`) it says so and draws nothing.
	$(PY) scripts/bench_dashboards.py --model $(MODEL) --out bench-results/dashboards

# Modelyard beside llama.cpp's llama-server (built once into .cache/peers/, ~15 min on 2 cores):
# same model, same seeded load, alternating rounds. MODELYARD_CPU_ISA=avx2 builds both AVX2-only.
bench-peers: $(STAMP) $(MODEL) $(GEMMA_MODEL)
	@mkdir -p bench-results
	$(PY) scripts/bench_peers.py --model $(MODEL) --model $(GEMMA_MODEL) --out bench-results/peers.json

# Copies of one GGUF awake at once in an 8 GiB budget, and latency with them all awake: Modelyard's
# gateway (park on) vs llama-server processes on the same file (built as for bench-peers).
bench-density: $(STAMP) $(MODEL)
	@mkdir -p bench-results
	$(PY) scripts/bench_density.py --model $(MODEL) --budget 8GiB --out bench-results/density.json

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) .cache models bench-results
