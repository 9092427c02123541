#!/bin/sh
# docker-compose: submit the demo job (if it is not there yet) and run its 8 ranks, one per fake GPU.
set -eu
export NTP_TOKEN="$(cat /tokens/operator)"
ntpctl jobs --json | grep -q '"name": "demo"' || ntpctl submit examples/specs/job-compose.yaml
GPUS=$(grep -ho 'GPU-[0-9a-f-]*' examples/scenarios/compose-node-a.yaml examples/scenarios/compose-node-b.yaml \
  | paste -sd, -)
exec python examples/train_gpt.py --manager manager:50051,manager-b:50051 --token-file /tokens/worker --job demo \
  --steps 100000 --gpus "$GPUS"
