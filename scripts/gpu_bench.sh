#!/usr/bin/env bash
# GPU check of `autominato bench` (issue 8, item 6): on a machine with an NVIDIA GPU, run the
# KiTS19 workload with the real MLPerf 3D-UNet training step for every arm, sample NVML GPU
# utilisation and PCIe throughput, and write the CSV files, plots and log under OUT.
#
#   bash scripts/gpu_bench.sh OUT
#
# (On a GPU machine that cannot reach a package index: scripts/device_prepare.sh here, then
# scripts/device_check.sh there, which installs the carried wheels, runs tests/test_cuda.py
# and calls this script.)
#
# Run from the repository root with the project installed in the current python
# (pip install -e ".[bench,gpu]"). Nothing is downloaded: a missing peer (torchdata, spdl) or
# nvidia-ml-py is installed only from a local wheel folder (WHEELS=dir), else the bench reports
# that arm as missing. The whole script stays within BUDGET_S seconds (default 450, so that it
# ends inside 8 minutes with the machine's start-up), each phase under its own timeout.
#
# Environment (all optional):
#   PYTHON   interpreter (default: python)
#   LABELS   KiTS19 label folder (default ../shared/kits19/labels); absent: synthetic masks
#   DATA     a folder already prepared by `autominato prepare` (skips preparation)
#   CASES    cases to prepare (default 24; the limit's serial cost is measured on one sample
#            of each and extrapolated)           SAMPLES  samples per epoch (default 192)
#   SCALE    volume and patch scale (default 1)  REPEATS  timed runs per arm (default 1)
#   MODEL    mlperf | compact (default mlperf)   CACHE    where prepared cases go
#   BUDGET_S seconds for the whole script (default 450)
set -euo pipefail

OUT=${1:?usage: bash scripts/gpu_bench.sh OUT_DIR}
PY=${PYTHON:-python}
BUDGET_S=${BUDGET_S:-450}
CASES=${CASES:-24}
SAMPLES=${SAMPLES:-192}
SCALE=${SCALE:-1}
REPEATS=${REPEATS:-1}
MODEL=${MODEL:-mlperf}
LABELS=${LABELS:-../shared/kits19/labels}
CACHE=${CACHE:-${TMPDIR:-/tmp}/autominato-gpu-bench}
T0=$(date +%s)
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_bench.log") 2>&1

left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
say() { echo "[gpu_bench +$(($(date +%s) - T0))s] $*"; }

# 1. The GPU and a CUDA build of torch.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  say "no nvidia-smi: this check needs a machine with an NVIDIA GPU"
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv | tee "$OUT/gpu.csv"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "torch in $PY has no CUDA ($("$PY" -c 'import torch; print(torch.__version__)'))"
  exit 2
fi
"$PY" -c "import autominato" || { say "autominato is not installed in $PY"; exit 2; }

# 2. Peers and NVML: install only from a local wheel folder; otherwise the arm reports missing.
missing=()
for pair in torchdata:torchdata spdl:spdl pynvml:nvidia-ml-py matplotlib:matplotlib; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ -n "${WHEELS:-}" ] && [ -d "$WHEELS" ]; then
    say "installing ${missing[*]} from $WHEELS"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${missing[@]}" || true
  else
    say "not installed: ${missing[*]} (set WHEELS=dir to install from local wheels)"
  fi
fi
nvml=()
"$PY" -c "import pynvml" 2>/dev/null && nvml=(--nvml)

# 3. Data: a prepared folder, or KiTS19 labels (or synthetic masks) prepared here.
data=()
if [ -n "${DATA:-}" ]; then
  data=(--data "$DATA")
elif [ -d "$LABELS" ]; then
  data=(--labels "$LABELS" --cases "$CASES")
else
  say "no KiTS19 labels at $LABELS: the bench prepares synthetic masks instead"
  data=(--labels none --cases "$CASES")
fi

# 4. The bench: every arm, the real UNet step, NVML sampling. The grid is kept to
# num_workers {cores, 2 x cores} x prefetch 2 so that the probes fit the budget.
cores=$("$PY" -c "from autominato.pipeline.knobs import usable_cores; print(usable_cores())")
run_s=$(($(left) - 15))
say "cores=$cores; bench for at most ${run_s}s"
set +e
timeout --kill-after=10 "$run_s" "$PY" -m autominato.cli bench \
  --workload kits19 --unet on --unet-model "$MODEL" "${nvml[@]}" \
  "${data[@]}" --samples "$SAMPLES" --scale "$SCALE" --cache "$CACHE" \
  --serial-samples "$CASES" --repeats "$REPEATS" --grid-workers "$cores" $((2 * cores)) --grid-prefetch 2 \
  --grid-fraction 0.25 --timeout 90 --out "$OUT"
rc=$?
set -e
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  say "the bench ran out of its ${run_s}s budget (lower SAMPLES or CASES); partial log above"
fi
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >>"$OUT/gpu.csv" || true
say "done (exit $rc); files in $OUT:"
ls -l "$OUT"
exit $rc
