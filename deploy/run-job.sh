#!/bin/sh
# docker-compose: submit the demo job (if it is not there yet) and run its 8 ranks, one per fake GPU.
set -eu
export NTP_TOKEN="$(cat /tokens/operator)"
# the manager admits a job only over domains it knows (and no other job owns): wait for both agents' hellos
for _ in $(seq 120); do
  d="$(ntpctl domains --json 2>/dev/null || true)"
  case "$d" in *'"nvl-0"'*'"nvl-1"'*) break ;; esac
  sleep 1
done
ntpctl jobs --json | grep -q '"name": "demo"' || ntpctl submit examples/specs/job-compose.yaml
GPUS=$(grep -ho 'GPU-[0-9a-f-]*' examples/scenarios/compose-node-a.yaml examples/scenarios/compose-node-b.yaml \
  | paste -sd, -)
exec python examples/train_gpt.py --manager manager:50051,manager-b:50051 --token-file /tokens/worker --job demo \
  --steps 100000 --gpus "$GPUS"
