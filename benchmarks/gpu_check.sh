#!/usr/bin/env bash
# The prepared GPU check (issue 50), one command on the device machine from the repository root, ≤ 8 minutes on one
# H100 or H200. Before it, here: `bash benchmarks/gpu_wheels.sh`; then run it with the device tool as
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Steps, each under its own time limit, each leaving its log under $OUT (a later step runs whatever an earlier one
# did): the kernel's tests on CUDA (the CPU cases skip there), bench_vocab_losses (the kernel against the pure-torch
# chunks per loss, at d = 2,048 and V = 128,256, bf16), bench_gpu (stage one rows, stage two rows beside the
# student alone and online KD). benchmarks/gpu_report.py then writes gpu.md: a RESULTS.md block naming the card,
# each figure against issue 50's targets.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
started=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 3; }
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . \
    || { echo "kdcache did not install from the tree"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/card.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" >> "$OUT/card.txt"
cat "$OUT/card.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: at ${SECONDS}s, limit ${limit}s"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $? after $((SECONDS - started))s" | tee -a "$OUT/status.txt"
    tail -n 4 "$OUT/$name.log"
}
step kernel_tests 150 python3 -m pytest -q -p no:cacheprovider tests/stages/test_fused_kernel.py \
    tests/stages/test_fused_kernel_gpu.py tests/stages/test_kernel_guard.py --junitxml="$OUT/kernel_tests.xml"
step vocab_bench 90 python3 benchmarks/bench_vocab_losses.py --device cuda --dtype bfloat16 --dim 2048 \
    --tokens 4096 --repeats 1 --losses ce,kl,topk_renorm,sampled,ce_topk_renorm --sides head,head_chunks \
    --json "$OUT/vocab.json"
step bench_gpu 300 python3 benchmarks/bench_gpu.py --tokens 196608 --train-steps 20 --work /tmp \
    --json "$OUT/gpu.json"
python3 benchmarks/gpu_report.py "$OUT" > "$OUT/gpu.md"
cat "$OUT/gpu.md"
