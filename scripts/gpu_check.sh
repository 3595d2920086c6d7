#!/usr/bin/env bash
# One prepared run on a CUDA machine (a lent GPU): the kernel and adaptive-scaling tests
# on the GPU, then the GPU benchmarks. Logs and results go to $OUT (default
# /tmp/lowprec_gpu); the results files are also written under benchmarks/results/
# (*_cuda.md).
#
#   bash scripts/gpu_check.sh                     # uses the python3 that has a CUDA torch
#   PARTS="tests zoo" bash scripts/gpu_check.sh   # some parts only
#
# Parts: tests codegen train_step adaptive_compile zoo profile. Each has its own time limit, so
# that a slow part leaves the others their turn.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/lowprec_gpu}
py=${PYTHON:-python3}
parts=" ${PARTS:-tests codegen train_step adaptive_compile zoo profile} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1

{
    nvidia-smi -L
    "$py" -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.txt"

# The backend is found through its entry point: install the checkout (no downloads).
"$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.txt" 2>&1 \
    || { echo "install failed:"; tail -5 "$out/install.txt"; }

if [[ $parts == *" tests "* ]]; then
    echo "== kernel and adaptive-scaling tests on CUDA against the reference ops"
    workers=()  # pytest-xdist, where installed
    "$py" -c "import xdist" 2>/dev/null && workers=(-n 8)
    LOWPREC_TEST_DEVICE=cuda timeout "${TEST_LIMIT:-200}" "$py" -m pytest -q "${workers[@]}" -rf \
        -m "slow or not slow" \
        tests/codegen/test_codegen_ops.py tests/codegen/test_codegen_graphs.py \
        tests/numerics/test_quantize_compile.py::test_inductor_matches_eager \
        tests/numerics/test_quantize_tensorwise.py::test_the_compiled_operator_rounds_like_the_reference \
        tests/numerics/test_quantize_rowwise.py::test_the_compiled_operator_rounds_like_the_reference \
        tests/backend/test_backend_numerics.py::test_quantized_tensors_bit_identical \
        tests/backend/test_adaptive.py::test_recording_and_plain_calls_share_one_compiled_graph \
        tests/passes/test_histogram_pass.py tests/passes/test_flex_attention.py \
        >"$out/tests.txt" 2>&1
    echo "exit $?"; grep -E "passed|failed|FAILED|Error|ERROR" "$out/tests.txt" | tail -25
fi

if [[ $parts == *" codegen "* ]]; then
    echo "== generated kernels: GB/s"
    timeout "${CODEGEN_LIMIT:-100}" "$py" -m benchmarks.bench_codegen --device cuda --numel 67108864 \
        >"$out/codegen.txt" 2>&1
    echo "exit $?"; grep "^|" "$out/codegen.txt" | tail -12
fi

if [[ $parts == *" train_step "* ]]; then
    echo "== training steps on CUDA"
    timeout "${TRAIN_LIMIT:-170}" "$py" -m benchmarks.bench_train_step --device cuda --rounds 10 \
        >"$out/train_step.txt" 2>&1
    echo "exit $?"; grep "^|" "$out/train_step.txt" | tail -24
fi

if [[ $parts == *" adaptive_compile "* ]]; then
    echo "== adaptive scaling's compile on CUDA"
    timeout "${ADAPTIVE_LIMIT:-150}" "$py" -m benchmarks.bench_adaptive_compile --device cuda \
        --models ${ADAPTIVE_MODELS:-gpt2 transformer_encoder} >"$out/adaptive_compile.txt" 2>&1
    echo "exit $?"; grep "^|" "$out/adaptive_compile.txt" | tail -6
fi

if [[ $parts == *" zoo "* ]]; then
    echo "== zoo training steps on CUDA: fp32 eager, fp32 Inductor, lowprec"
    timeout "${ZOO_LIMIT:-200}" "$py" -m benchmarks.bench_zoo --device cuda --name zoo_cuda --steps 50 \
        --models ${ZOO_MODELS:-gpt2 llama bert resnet lstm_lm} >"$out/zoo.txt" 2>&1
    echo "exit $?"; grep "^|" "$out/zoo.txt" | tail -10
fi

if [[ $parts == *" profile "* ]]; then
    echo "== where a cold compile's time goes on CUDA (cProfile): fp32 Inductor, lowprec"
    for backend in inductor lowprec; do
        timeout "${PROFILE_LIMIT:-60}" "$py" scripts/profile_compile.py "${PROFILE_MODEL:-gpt2}" \
            --backend $backend --device cuda >"$out/profile_$backend.txt" 2>&1
        echo "exit $?"; grep "first step" "$out/profile_$backend.txt"
    done
fi

cp benchmarks/results/*_cuda.md "$out/" 2>/dev/null
exit 0
