#!/usr/bin/env bash
# Installs tessera with its test tools, then lints (ruff, seconds) and runs the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check --quiet .
exec "$PY" -m pytest -q "$@"
