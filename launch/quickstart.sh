#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv, then train the embedded default (digits, 8 workers on 8 CPU
# devices) with synchronous SGD and with local SGD, and print their summaries side by side.
# Usage: bash launch/quickstart.sh [WORKDIR_ROOT]   (default runs/quickstart; rerunning resumes / reuses)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
OUT="${1:-runs/quickstart}"
for algorithm in sync local_sgd; do
  echo "[quickstart] $algorithm -> $OUT/$algorithm"
  python -m experiments.main --config="experiments/configs/digits.py:$algorithm" --workdir="$OUT/$algorithm"
done
python - "$OUT" <<'PY'
import json, sys
root = sys.argv[1]
print(f"\n{'algorithm':<12}{'eval acc':>10}{'eval loss':>11}{'sim time s':>12}{'to 90% s':>10}{'wall s':>8}")
for name in ('sync', 'local_sgd'):
  s = json.load(open(f'{root}/{name}/summary.json'))
  hit = s['time_to_target']
  print(f"{name:<12}{s['final_eval_accuracy']:>10.4f}{s['final_eval_loss']:>11.4f}{s['sim_time']:>12.3f}"
        f"{(f'{hit:.3f}' if hit is not None else '-'):>10}{s['wall_time']:>8.1f}")
print(f'\nmetrics: {root}/<algorithm>/metrics.jsonl   tensorboard --logdir {root}')
PY
