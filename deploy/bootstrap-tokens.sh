#!/bin/sh
# docker-compose: migrate the database and write tokens into /tokens (once): one per operator scope,
# and one agent token per node (an agent token speaks for exactly one node).
set -eu
ntp-manager db upgrade
for scope in admin operator viewer worker; do
  if [ ! -s "/tokens/$scope" ]; then
    ntp-manager token create --name "compose-$scope" --scope "$scope" --json \
      | python -c 'import json, sys; print(json.load(sys.stdin)["token"])' > "/tokens/$scope"
  fi
done
for node in node-a node-b; do
  if [ ! -s "/tokens/agent-$node" ]; then
    ntp-manager token create --scope agent --node "$node" --json \
      | python -c 'import json, sys; print(json.load(sys.stdin)["token"])' > "/tokens/agent-$node"
  fi
done
echo "tokens in /tokens: $(ls /tokens | tr '\n' ' ')"
