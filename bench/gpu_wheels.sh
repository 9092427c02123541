#!/usr/bin/env bash
# The wheels a lent GPU machine lacks for bench/gpu_session.sh (python 3.12, x86-64; it has torch,
# grpcio, protobuf, nvidia-ml-py, typer, rich, pytest, but older grpcio/protobuf than our stubs need
# and no structlog, pydantic, tenacity): downloaded into .whl/ (git-ignored), at the versions this
# checkout's .venv runs, so the device tests what CI tests. `make gpu-wheels` runs it.
set -eu
cd "$(dirname "$0")/.."
PY=${VENV_PYTHON:-.venv/bin/python}
NEED="grpcio protobuf pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection
typing-extensions structlog tenacity"
freeze=$("$PY" -m pip freeze)
pins=()
for n in $NEED; do
  v=$(printf '%s\n' "$freeze" | awk -F'==' -v n="$n" 'BEGIN{IGNORECASE=1} {k=$1; gsub("_","-",k)} tolower(k)==n {print $2}')
  [ -n "$v" ] || { echo "$n is not installed in $PY's environment: run make venv first" >&2; exit 1; }
  pins+=("$n==$v")
done
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
# bench/peers/compare.py's peer (torchft and its OpenTelemetry, never torch): for PARTS=peers
mkdir -p .whl/peers
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl/peers "opentelemetry-exporter-otlp-proto-http==1.39.1" \
  "opentelemetry-sdk==1.39.1" "opentelemetry-api==1.39.1"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/peers "torchft==0.2.0"
ls .whl .whl/peers
du -sh .whl
