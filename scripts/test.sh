#!/usr/bin/env bash
# Installs tessera with its test tools, then runs the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q "$@"
