#!/usr/bin/env bash
# Installs tessera with its test tools, then lints (ruff, seconds) and runs the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check --quiet .
# Two test files at a time (--dist loadfile keeps a file's module fixtures in one worker): the suite is
# bound by one core most of the time (imports, waits for timeouts and for other ranks), so two workers on
# a 2-core machine take about half the time. TESSERA_TEST_WORKERS=0 runs it in one process.
exec "$PY" -m pytest -q -n "${TESSERA_TEST_WORKERS:-2}" --dist loadfile "$@"
