#!/bin/sh
# docker-compose: migrate the database and write one token per scope into /tokens (once).
set -eu
ntp-manager db upgrade
for scope in admin operator viewer agent worker; do
  if [ ! -s "/tokens/$scope" ]; then
    ntp-manager token create --name "compose-$scope" --scope "$scope" --json \
      | python -c 'import json, sys; print(json.load(sys.stdin)["token"])' > "/tokens/$scope"
  fi
done
echo "tokens in /tokens: $(ls /tokens | tr '\n' ' ')"
