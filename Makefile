# SpecPilot: `make demo` sets up and runs the main job on the embedded demo; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of torch 2.13.0 lies on disk on our machines and pip takes it; elsewhere pip fetches it
# from the CPU index, never the multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: setup demo bench loop-demo test test-slow lint train-demo train-drafters corpus-drafter llama-cpp clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "$(TORCH_SPEC)" --index-url $(TORCH_CPU_INDEX)
	$(PIP) install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

# The main job on the embedded demo: a workspace under build/, one round of the built-in tuner, the
# kept mechanism with its forcing verdict, its patch, and the command that opens it in the TUI.
DEMO_WS ?= build/demo-workspace
demo: setup
	$(VENV)/bin/specpilot demo --workspace $(DEMO_WS)

# The decoding methods side by side on the demo's code and prose prompts (about 5 minutes).
bench: setup
	$(VENV)/bin/specpilot bench --deployment demo --prompts code --max-new-tokens 128
	$(VENV)/bin/specpilot bench --deployment demo --prompts prose --max-new-tokens 128

# The agentic loop, headless, on a demo workspace under build/ (created on first use; resumes if killed).
LOOP_WS ?= build/demo-workspace
loop-demo: setup
	test -f $(LOOP_WS)/specpilot.toml || $(VENV)/bin/specpilot init demo $(LOOP_WS)
	$(VENV)/bin/specpilot-tui --auto --workspace $(LOOP_WS) --rounds 3 --agents 2 --json

# One worker per core, each test file on one worker (its module fixtures built once); the slow tier
# stays serial: it decides keep/discard on timings.
test: setup
	$(PY) -m pytest -q -n auto --dist loadfile

test-slow: setup llama-cpp
	$(PY) -m pytest -q -m slow

# llama.cpp, the engine users run (issue #19): the llama-cpp-python sdist fetched with pip, its vendored
# llama.cpp built once per version into $$SPECPILOT_DATA_DIR/engines/llama.cpp-<version>/ (default
# ~/.local/share/specpilot) and shared by every clone, then the demo target and drafter converted to GGUF
# (f32, bf16) beside it. About 7 minutes on 2 free cores the first time (18 on a loaded one); a no-op after.
# Not part of `make test`.
LLAMA_CPP_JOBS ?= 2
$(VENV)/.llamacpp-installed: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev,llamacpp]"
	touch $@

llama-cpp: $(VENV)/.llamacpp-installed
	$(PY) -m decoder.engines.llamacpp_build all --jobs $(LLAMA_CPP_JOBS)

lint: setup
	$(VENV)/bin/ruff check .

train-demo: setup
	$(VENV)/bin/specpilot train demo

# The demo target's feature drafters (self-distilled; resumable: rerun after a kill to continue).
# Measured here (one thread each): greedy data 8 min, block 24 min, MTP 19 min.
train-drafters: setup
	$(VENV)/bin/specpilot train drafter --kind router
	OMP_NUM_THREADS=1 $(VENV)/bin/specpilot train drafter --kind block
	OMP_NUM_THREADS=1 $(VENV)/bin/specpilot train drafter --kind mtp

# The demo target's corpus datastore (mechanism corpus-drafter, drafter = "corpus"): the corpus plus 8192 greedy
# continuations of the target per domain, into decoder/assets/demo/target/drafters/corpus.npz (27 MB, not
# committed). About 9 minutes on 2 cores with AMX-BF16, 24 minutes on 2 cores without native bf16 (the continuations
# then run in float32, 2.2x faster there than converted bf16); resumable (shards are kept under the data dir).
corpus-drafter: setup
	$(VENV)/bin/specpilot train drafter --kind corpus

clean:
	rm -rf $(VENV) build .pytest_cache
