#!/usr/bin/env bash
# Prepare, on this machine, what `scripts/device_check.sh` needs on a lent GPU machine (the
# workplace's `device` tool), so that its one call spends no device time on set-up:
#
#   bash scripts/device_prepare.sh
#   then the device tool's run:  command "bash scripts/device_check.sh",
#                                carry [".whl", ".kits19"], timeout_s 560
#
# 1. .whl/: wheels of the packages that the GPU machine's image lacks (it has torch, numpy,
#    scipy, matplotlib, prometheus-client, psutil, rich, pyyaml, threadpoolctl, nvidia-ml-py;
#    see the device tool's KINDS.md), for its CPython 3.12 on x86-64. Nothing can be fetched
#    there. ~23 MB.
# 2. .kits19/: the first CASES (default 24) KiTS19 masks from ../shared/kits19/labels, since
#    ../shared does not travel. A transport copy only: .kits19/ is git-ignored and must never
#    be committed (the masks' licence and README: not in the project's repository); delete it
#    after the run. ~7 MB.
# Both must stay under the tool's 64 MiB for everything that travels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CASES=${CASES:-24}
LABELS=${LABELS:-../shared/kits19/labels}

rm -rf .whl && mkdir -p .whl
platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# autominato's own dependencies missing there, optuna's, and the bench's peers (torchdata,
# SPDL); --no-deps: each needed one is named.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  nibabel cloudpickle optuna alembic sqlalchemy mako colorlog greenlet torchdata \
  spdl spdl_core spdl_io
echo "wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1)"

if [ -d "$LABELS" ]; then
  rm -rf .kits19 && mkdir -p .kits19
  find "$LABELS" -maxdepth 1 -name 'case_*.nii.gz' | sort | head -n "$CASES" | xargs -I{} cp {} .kits19/
  echo "masks: $(ls .kits19 | wc -l) cases, $(du -sh .kits19 | cut -f1) (delete .kits19 after the run)"
else
  echo "no KiTS19 labels at $LABELS: the GPU bench will paint synthetic masks instead"
fi
git status --short --ignored .whl .kits19 | head -3
