#!/usr/bin/env bash
# The 16-run probe (experiments/bench/probe16.py) under several sweep settings, one after another on one GPU,
# each into a fresh runs root; prints one line per variant with its wall time. CUDA MPS is started for the
# variants that name it (nvidia-cuda-mps-control, stopped after each).
#   bash experiments/bench/probe16_variants.sh "label|mps-or-no|overrides|zoo-sweep flags" ...
set -uo pipefail
PY=${PY:-python3}
for spec in "$@"; do
  IFS="|" read -r label mps overrides flags <<<"$spec"
  root=$(mktemp -d)
  if [ "$mps" = mps ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$root/mps_pipe CUDA_MPS_LOG_DIRECTORY=$root/mps_log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || echo "MPS did not start"
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086
  $PY -m zoo.sweep experiments/bench/probe16.py $overrides --runs-root "$root/runs" $flags --name "probe16-$label" \
    >"$root/log" 2>&1
  rc=$?
  t1=$(date +%s)
  if [ "$mps" = mps ]; then echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
  printf 'variant %-28s rc=%d wall_s=%d  %s\n' "$label" "$rc" "$((t1 - t0))" "$(tail -1 "$root/log")"
  [ $rc -ne 0 ] && tail -20 "$root/log"
done
