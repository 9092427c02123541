#!/usr/bin/env bash
# Issue 15's GPU checks in one command, for a lent GPU machine (docs/gpu-runbook.md):
#
#   bash bench/gpu_session.sh            # from the repository root; results in $OUT (default /tmp/gpu-out)
#
# 1. env.txt      the machine: GPUs (nvidia-smi, read-only queries), driver, torch / CUDA / NCCL versions
# 2. probe.json   `ntp-agent probe --backend nvml --json`: the agent's inventory and one sample of every GPU
#    probe.txt    the same, rendered, and anything it printed on failure
# 3. pytest.log   `pytest tests/worker -k "cuda or nccl" -rA`: the CUDA variants (TP layers, NTP sync,
#                 reshard, the runtime's kill -> TP3 -> rejoin with CUDA tensors) and the NCCL tests
# 4. devices.txt  bench/devices.py: one training step, CPU against CUDA, one process and the runtime
# 5. summary.md   what ran, how it ended, the lines to copy into bench/RESULTS.md
# 6. pipeline_memory.txt  (issue 34, its own block after the summary) bench/pipeline_memory.py --device cuda:
#                 each stage's torch.cuda.max_memory_allocated under GPipe, 1F1B and 1F1B + recomputation;
#                 appended to summary.md
# 7. switch.txt   (issue 32, its own block after that) bench/worker.py --only switch --device cuda at
#                 ~150M and ~500M parameters: 2 x TP4, AdamW, one rank killed; the steady step, each
#                 phase of the switch (detected, regrouped, reshard, first step) and the reshard's
#                 GB/s per rank; appended to summary.md. Goal: kill -> first step <= steady step + 1 s.
#                 Its "lost" column (issue 42): kill -> first step less that step's time and the
#                 reshard, i.e. detection + regroup with doomed steps abandoned. Goal: <= 0.5 s.
#
#   PARTS=switch bash bench/gpu_session.sh   # only part 7, with the whole 9 minutes (a second call)
#   PARTS=peers bash bench/gpu_session.sh    # issue 42: bench/peers/compare.py, torchft against ntp-run
#                 (peers.txt, appended to summary.md). Both sides run two replicas of one process each
#                 over gloo on the machine's CPUs: with one GPU there is no NCCL between two replicas,
#                 so this measures the recovery paths on a machine with cores to spare, not GPU steps.
#                 torchft comes from .whl/peers (make gpu-wheels), never from the index.
#
# It changes no GPU setting. Every Python process it starts imports a guard (bench/gpu_guard/
# sitecustomize.py, on PYTHONPATH) that replaces each NVML call that sets or resets anything
# (nvmlDeviceSet*, nvmlDeviceReset*, nvmlDeviceClear*, nvmlSet*) with one that raises; nvidia-smi
# is called only with query options. Wheels the machine lacks (`make gpu-wheels`, carried as .whl)
# are installed into a temporary target, never into the machine's Python.
set -u
# The parts' time limits (90 + 30 + 300 + 120 s) add up to 9 minutes, inside the device tool's
# 10-minute limit for one command, so summary.md is always written before the call is cut off.
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ "$("$PY" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" != True ]; then
  echo "not Python 3.12: the carried wheels (for the GPU machine's 3.12) are not installed"
elif [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" .whl/*.whl \
    || { echo "installing the carried wheels failed" | tee "$OUT/summary.md"; exit 1; }
fi
export PYTHONPATH="$PWD/bench/gpu_guard:${work}/site:$PWD:$PWD/agent${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status() { printf '| %s | %s | %s |\n' "$1" "$2" "$3" >> "$work/rows"; }
PARTS=${PARTS:-all}  # "all"; "switch": only issue 32's block (part 7); "peers": only issue 42's peer comparison
if [ "$PARTS" != all ] && [ "$PARTS" != switch ] && [ "$PARTS" != peers ]; then
  echo "PARTS=$PARTS: must be 'all', 'switch' or 'peers'" >&2
  exit 2
fi
if [ "$PARTS" = all ]; then

# 1. the machine
{
  echo "# $(date -u +%FT%TZ) on $(hostname)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,power.limit,power.default_limit,power.max_limit \
      --format=csv 2>&1
    nvidia-smi -q 2>&1 | grep -E "Driver Version|CUDA Version|Product Name|Persistence Mode|MIG Mode|Current  *:" | head -20
  else
    echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
  fi
  "$PY" - <<'PYEOF' 2>&1
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available(), "gpus", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())), "device 0:", torch.cuda.get_device_name(0))
import grpc, google.protobuf
print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)
PYEOF
} > "$OUT/env.txt" 2>&1
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
status env "GPUs seen by torch: $gpus" env.txt

# 2. the agent's inventory and one sample (read-only)
timeout 90 "$PY" -m ntp_agent.main probe --backend nvml --json > "$OUT/probe.json" 2> "$OUT/probe.txt"
rc=$?
timeout 30 "$PY" -m ntp_agent.main probe --backend nvml >> "$OUT/probe.txt" 2>&1
case $rc in
  0) status "agent probe" "ok: $("$PY" bench/gpu_report.py gpus "$OUT/probe.json" 2>&1) GPU(s) sampled" probe.json ;;
  139) status "agent probe" "SEGFAULT (exit 139): the bug of issue 15 item 1" probe.txt ;;
  *) status "agent probe" "exit $rc: $(tail -n 1 "$OUT/probe.txt")" probe.txt ;;
esac

# 3. the CUDA and NCCL tests (they skip, with their reason, where CUDA or GPUs are missing)
timeout 300 "$PY" -m pytest -q -rA -p no:cacheprovider tests/worker -k "cuda or nccl" > "$OUT/pytest.log" 2>&1
rc=$?
status "pytest -k 'cuda or nccl'" "exit $rc: $(tail -n 1 "$OUT/pytest.log")" pytest.log

# 4. CPU against CUDA, one step
size=$([ "$gpus" -gt 0 ] && echo "" || echo "--quick")  # the full model where a GPU is; a quick look elsewhere
timeout 120 "$PY" bench/devices.py $size > "$OUT/devices.txt" 2>&1
rc=$?
status "bench/devices.py $size" "exit $rc" devices.txt

{
  echo "# issue 15 GPU session, $(date -u +%FT%TZ)"
  echo
  echo "| check | result | file |"
  echo "|---|---|---|"
  cat "$work/rows"
  echo
  echo "## For bench/RESULTS.md"
  echo
  echo '```'
  head -n 4 "$OUT/env.txt"
  grep -E "passed|failed|skipped" "$OUT/pytest.log" | tail -n 1
  grep -v '^20[0-9][0-9]-' "$OUT/devices.txt" | tail -n 25  # the tables, not the runtime's log lines
  echo '```'
} > "$OUT/summary.md"

# ==== issue 34: pipeline activation memory on CUDA (bench/pipeline_memory.py) =====================
# Its own block, after summary.md is written: the parts above may use their whole 9 minutes, and if
# the device tool's 10-minute limit then cuts this block, summary.md is already in $OUT. 60 s: three
# jobs of 4 ranks (sharing the GPU, gloo staged) on the 118M model, one warm-up and two measured
# steps each; each job's rows are printed as it ends, so a cut run keeps what it measured.
if [ "$gpus" -gt 0 ]; then
  timeout --kill-after=5 60 "$PY" bench/pipeline_memory.py --device cuda --steps 2 > "$OUT/pipeline_memory.txt" 2>&1
  rc=$?
else
  echo "no CUDA device: not run" > "$OUT/pipeline_memory.txt"
  rc=0
fi
{
  echo
  echo "## Pipeline activation memory on CUDA (issue 34): bench/pipeline_memory.py --device cuda, exit $rc"
  echo
  echo '```'
  grep -v '^20[0-9][0-9]-' "$OUT/pipeline_memory.txt" | tail -n 40
  echo '```'
} >> "$OUT/summary.md"
# ==== end of issue 34's block ====================================================================
fi  # PARTS=all

# ==== issue 42: a peer side by side (bench/peers/compare.py), PARTS=peers only =====================
if [ "$PARTS" = peers ]; then
  echo "# GPU session (PARTS=peers), $(date -u +%FT%TZ)" > "$OUT/summary.md"
  NTP_PEER_WHEELS="$PWD/.whl/peers" timeout --kill-after=5 500 "$PY" bench/peers/compare.py --json "$OUT/peers.json" \
    > "$OUT/peers.txt" 2>&1
  echo "compare.py: exit $?" >> "$OUT/peers.txt"
  {
    echo
    echo "## A peer side by side (issue 42): bench/peers/compare.py on this machine's CPUs (gloo)"
    echo
    nproc | sed 's/^/cores: /'
    echo
    grep '^|' "$OUT/peers.txt" || tail -n 20 "$OUT/peers.txt"
  } >> "$OUT/summary.md"
  cat "$OUT/summary.md"
  exit 0
fi
# ==== end of issue 42's block ====================================================================

# ==== issue 32: a layout switch on CUDA, two model sizes (bench/worker.py --only switch) ==========
# 8 ranks as 2 replicas x TP4 on the GPUs there are (sharing them: gloo staged through pinned host
# memory; one GPU per rank: NCCL), AdamW, TinyGpt of ~150M and ~500M parameters (the 157M / 500M
# Llamas of the 2026-11-28 H200 run had kill -> first step 4.54 / 6.89 s against steady steps of
# 0.95 / 1.37 s). One run per size, each with what is left of the script's 9 minutes (at most 240 s
# and 300 s); a size is skipped, and says so, when under 60 s are left. Each prints its tables as it
# ends, so a cut run keeps what it measured.
gpus=${gpus:-$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
[ -f "$OUT/summary.md" ] || echo "# GPU session (PARTS=$PARTS), $(date -u +%FT%TZ)" > "$OUT/summary.md"
: > "$OUT/switch.txt"
if [ "$gpus" -gt 0 ]; then
  for spec in 150m:240 500m:300; do
    size=${spec%%:*}
    left=$((540 - SECONDS))
    limit=$(( left < ${spec##*:} ? left : ${spec##*:} ))
    if [ "$limit" -lt 60 ]; then
      echo "$size: not run, ${left} s left of the 9 minutes (run PARTS=switch)" >> "$OUT/switch.txt"
      continue
    fi
    timeout --kill-after=5 "$limit" "$PY" bench/worker.py --only switch --device cuda --size "$size" --repeat 1 \
      >> "$OUT/switch.txt" 2>&1
    echo "$size: exit $? (limit $limit s)" >> "$OUT/switch.txt"
  done
else
  echo "no CUDA device: not run" > "$OUT/switch.txt"
fi
{
  echo
  echo "## A layout switch on CUDA (issue 32): bench/worker.py --only switch --device cuda, 150m and 500m"
  echo
  echo '```'
  grep -v '^20[0-9][0-9]-' "$OUT/switch.txt" | grep -v '^{' | tail -n 60
  echo '```'
} >> "$OUT/summary.md"
# ==== end of issue 32's block ====================================================================
cat "$OUT/summary.md"
