#!/usr/bin/env bash
# One prepared run on a CUDA machine (a lent GPU): the kernel tests on the GPU, then the
# GPU benchmarks. Logs and results go to $OUT (default /tmp/lowprec_gpu); the results
# files are also written under benchmarks/results/ (codegen_cuda.md, train_step_cuda.md).
#
#   bash scripts/gpu_check.sh            # uses the python3 that has a CUDA torch
#
# Each part has its own time limit, so that a slow part leaves the others their turn.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/lowprec_gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
    nvidia-smi -L
    "$py" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.txt"

# The backend is found through its entry point: install the checkout (no downloads).
"$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.txt" 2>&1 \
    || { echo "install failed:"; tail -5 "$out/install.txt"; }

echo "== kernel tests on CUDA (generated Triton compiled, Inductor) against the reference ops"
workers=()  # pytest-xdist, where installed
"$py" -c "import xdist" 2>/dev/null && workers=(-n 8)
LOWPREC_TEST_DEVICE=cuda timeout "${TEST_LIMIT:-200}" "$py" -m pytest -q "${workers[@]}" -rf \
    tests/codegen/test_codegen_ops.py tests/codegen/test_codegen_graphs.py \
    tests/numerics/test_quantize_compile.py::test_inductor_matches_eager \
    tests/backend/test_backend_numerics.py::test_quantized_tensors_bit_identical \
    >"$out/tests.txt" 2>&1
echo "exit $?"; grep -E "passed|failed|FAILED|Error|ERROR" "$out/tests.txt" | tail -25

echo "== generated kernels: GB/s"
timeout "${CODEGEN_LIMIT:-100}" "$py" -m benchmarks.bench_codegen --device cuda --numel 67108864 \
    >"$out/codegen.txt" 2>&1
echo "exit $?"; grep "^|" "$out/codegen.txt" | tail -12

echo "== training steps on CUDA"
timeout "${TRAIN_LIMIT:-170}" "$py" -m benchmarks.bench_train_step --device cuda --rounds 10 \
    >"$out/train_step.txt" 2>&1
echo "exit $?"; grep "^|" "$out/train_step.txt" | tail -24

cp benchmarks/results/*_cuda.md "$out/" 2>/dev/null
exit 0
