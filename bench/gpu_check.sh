#!/usr/bin/env bash
# The GPU checks in one command, for a host with an NVIDIA GPU (CI has none): the tests
# marked `gpu` (tests/test_gpu.py: the reference stack's workers holding CUDA tensors;
# tests/test_gpu_real.py: worker SIGKILL, another job taking every free byte, daemon
# SIGKILL, a leftover holder) on both kill backends, cgroup v2 first, then process groups.
#
#   bench/gpu_check.sh [REPORT_DIR]       # default: ./gpu-report
#
# Run it from the repository root with an interpreter that has the project installed
# (`pip install -e '.[gpu,test]'` and torch with CUDA). On a machine without a package index,
# OMNID_WHEELS=DIR installs the wheels in DIR (pyzmq, structlog, setproctitle, py-spy for
# the Python of that machine) into a private target first. Each backend's pytest output and
# the matrix report (the measured figures) go to REPORT_DIR; the exit status is 0 only when
# both backends pass.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-gpu-report}" && cd "${1:-gpu-report}" && pwd) || exit 2
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -n "${OMNID_WHEELS:-}" ]; then
    site=$(mktemp -d /tmp/omnid-gpu-site.XXXXXX)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$OMNID_WHEELS"/*.whl \
        || { echo "gpu_check: cannot install the wheels in $OMNID_WHEELS" >&2; exit 3; }
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
fi
{
    date -u; uname -r; "$py" -V
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
# The spawner's compiled path (omnid/process/_spawnc.c); without it the Python path runs.
"$py" setup.py build_ext --inplace -q > "$out/build.txt" 2>&1 || echo "gpu_check: no compiled spawn path (see $out/build.txt)"
export OMNID_MATRIX_REPORT="$out/gpu_report.txt"
rc=0
for cg in 1 0; do
    name=$([ $cg = 1 ] && echo cgroup || echo pgroup)
    echo "== $name" | tee -a "$OMNID_MATRIX_REPORT"
    OMNID_TEST_CGROUP=$cg timeout 600 "$py" -m pytest -p no:cacheprovider -v -rfE -m gpu --timeout 150 \
        tests/test_gpu.py tests/test_gpu_real.py > "$out/pytest_$name.txt" 2>&1
    r=$?
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$out/pytest_$name.txt" | tail -12
    [ $r = 0 ] || rc=$r
done
echo "gpu_check: report in $out/ (rc $rc)"
exit $rc
