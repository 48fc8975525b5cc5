#!/usr/bin/env bash
# The project's GPU checks as one call on a lent GPU machine (run from the repository root;
# prepare with `bash scripts/device_prepare.sh` first, and carry .whl and .kits19):
#
#   1. the environment: GPU, driver, torch and its CUDA;
#   2. tests/test_cuda.py (batches on the device against the DataLoader's, pinned memory, the
#      side-stream copy, h2d_bytes_total) and tests/test_parity.py (the DataLoader semantics,
#      on that machine's Python and torch);
#   3. scripts/gpu_bench.sh: every arm on the KiTS19 workload with the real MLPerf 3D-UNet
#      step, NVML utilisation and PCIe throughput, within what is left of BUDGET_S.
#
# Everything goes to $OUT (the device tool's folder that comes back; default ./device-out):
# env.txt, pytest.log, and the bench's files under $OUT/bench (at most 8 files come back).
set -uo pipefail
OUT=${OUT:-device-out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-530}
T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "wheel install failed" >>"$OUT/env.txt"
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv || true
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  "$PY" -c "import autominato, nibabel, cloudpickle, optuna; print('imports ok')"
  nproc
} >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout 200 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -ra \
  tests/test_cuda.py tests/test_parity.py 2>&1 | tee "$OUT/pytest.log" | tail -25

bench_s=$(($(left) - 10))
if [ "$bench_s" -lt 120 ]; then
  echo "only ${bench_s}s left: the GPU bench is not run"
  exit 0
fi
LABELS=${LABELS:-.kits19} PYTHON="$PY" BUDGET_S="$bench_s" bash scripts/gpu_bench.sh "$OUT/bench" \
  2>&1 | tail -60
