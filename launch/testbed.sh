#!/usr/bin/env bash
# The shaped test bed: H hosts on this machine (network namespaces, a CPU quota each, tc-shaped links) and a run of
# the project across them (`python -m waitless.experiments.testbed`; its docstring lists the modes). Needs root.
#   sudo bash launch/testbed.sh --cpus=0.8,0.4 --rate_mbit=174 -- spmd --config=experiments/configs/digits.py:sync,stragglers.kind=measured,workers=2,devices=2 --workdir=/tmp/tb
#   sudo bash launch/testbed.sh --cpus=0.8,0.8,0.8 --rate_mbit=174 -- ray --config=experiments/configs/digits.py:kasync,k=1,runtime=ray,workers=2 --workdir=/tmp/tb_ray
set -uo pipefail
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/active_env.sh" || exit 1
exec "${PYTHON:-python}" -m waitless.experiments.testbed "$@"
