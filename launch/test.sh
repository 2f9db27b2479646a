#!/usr/bin/env bash
# The test suite on a fresh machine: set up .venv, then pytest.
# Usage: bash launch/test.sh          representative subset (CI): every test not marked slow
#        bash launch/test.sh --all    everything, slow end-to-end and multi-process tests included
#        bash launch/test.sh [--all] [pytest args...]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
marker=(-m "not slow")
if [ "${1:-}" = "--all" ]; then
  marker=()
  shift
fi
# The layers and the lint first: a broken contract fails in seconds, before the suite's minutes.
ruff check --quiet .
if ! layers="$(lint-imports --no-cache 2>&1)"; then echo "$layers"; exit 1; fi
echo "[lint] ruff and the import-linter layer contracts pass"
python -m pytest -q "${marker[@]}" "$@"
