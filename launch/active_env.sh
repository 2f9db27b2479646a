#!/usr/bin/env bash
# Sourced by the launch scripts that start processes of their own (the test bed, multi-process runs): the active
# virtual environment as it is when there is one, else .venv set up by setup_env.sh. Sets ROOT, cds there, puts the
# repository on PYTHONPATH, and leaves errexit off (the caller handles its processes' statuses itself).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${VIRTUAL_ENV:-}" ]; then
  cd "$ROOT" || return 1
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  # shellcheck disable=SC1091
  source "$ROOT/launch/setup_env.sh" || return 1
  set +e
fi
