#!/usr/bin/env bash
# Installs tessera and its dependencies into the current Python environment.
# torch goes first, pinned: left to pip's resolver, a machine without torch would get the
# newest CUDA build (several GB). On a GPU machine set TESSERA_TORCH to the build you want.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TESSERA_TORCH:-torch==2.13.0}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] no torch found: installing $TORCH_SPEC"
  "$PY" -m pip install --quiet "$TORCH_SPEC"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
"$PY" -c "import torch; print(f'[install] torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
