#!/usr/bin/env bash
# The prepared GPU check (issues 50 and 62): one command on the device machine, from the repository root, at most
# 8 minutes on one H100 or H200. Before it, here: `bash benchmarks/gpu_wheels.sh`; then, with the device tool:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Steps, each under its own limit (setup about a minute; the limits add up to 420 s, leaving room for the report
# within 8 minutes and the call's 600 s), each log kept whatever the next step does:
#   1. the kernel's tests on CUDA (the CPU cases skip there), and generate's Philox draws: the GPU's against the CPU's;
#   2. bench_vocab_losses: the kernel against the pure-torch chunks per loss, d = 2,048, V = 128,256, bf16;
#   3. bench_gpu: stage one rows, then stage two rows beside the student alone and online KD;
#   4. bench_generate (issue 58): generation with capture against bare model.generate, an 8-block bf16 GPT-2;
#   5. bench_draft (issue 59), small: a tiny target, its fp16 draft cache, the EAGLE-3 head and the KD student,
#      draft-eval on the GPU (tau and speed-up; a tiny target is launch-bound, so read tau, not the speed-up).
# $OUT gets seven files (the device tool brings back eight at most): gpu.md (benchmarks/gpu_report.py: a RESULTS.md
# block naming the card, each target met, missed or missing), gpu.json, vocab.json, generate.json, draft.json,
# kernel_tests.xml and logs.tgz (every log, the card, each step's exit status).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
LOGS=$(mktemp -d /tmp/gpu-logs.XXXX)
mkdir -p "$OUT"
started=$SECONDS

finish() {  # the report and the logs, also after a failed step (not after the device tool's own kill)
    python3 benchmarks/gpu_report.py "$LOGS" > "$OUT/gpu.md" 2> "$LOGS/report.err"
    for f in gpu.json vocab.json generate.json draft.json kernel_tests.xml; do [ -f "$LOGS/$f" ] && cp "$LOGS/$f" "$OUT/"; done
    tar czf "$OUT/logs.tgz" -C "$LOGS" .
    cat "$OUT/gpu.md"
}
trap finish EXIT

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "the carried wheels did not install"; exit 3; }
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site . \
    || { echo "kdcache did not install from the tree"; exit 3; }
# The installed kdcache first, then the tree (for tests.* and benchmarks.*); PYTHONSAFEPATH keeps `python -m` from
# putting the tree first, where its bare kdcache/ folder (without stages/) would shadow the installed package.
export PYTHONPATH=/tmp/site:$PWD PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, triton, transformers, pyarrow; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, 'pyarrow', pyarrow.__version__)"
    python3 -m pip check 2>&1 | head -n 5
} > "$LOGS/card.txt"
cat "$LOGS/card.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a limit, its output in $LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: at ${SECONDS}s, limit ${limit}s"
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name exit $? after $((SECONDS - started))s" | tee -a "$LOGS/status.txt"
    tail -n 4 "$LOGS/$name.log"
}
step kernel_tests 70 python3 -m pytest -q -p no:cacheprovider tests/stages/targets/logits/vocab/test_fused_kernel.py \
    tests/stages/precompute/test_generate_sampling.py \
    tests/stages/targets/logits/vocab/test_fused_kernel_gpu.py tests/stages/targets/logits/vocab/test_kernel_guard.py \
    --junitxml="$LOGS/kernel_tests.xml"
step vocab_bench 60 python3 benchmarks/bench_vocab_losses.py --device cuda --dtype bfloat16 --dim 2048 \
    --tokens 4096 --repeats 1 --losses ce,kl,topk_renorm,sampled,ce_topk_renorm --sides head,head_chunks \
    --json "$LOGS/vocab.json"
step bench_gpu 200 python3 benchmarks/bench_gpu.py --tokens 131072 --train-steps 15 --work /tmp \
    --json "$LOGS/gpu.json"
step bench_generate 40 python3 benchmarks/bench_generate.py --device cuda --model 2048x8x32000 \
    --shapes 32x128x128 --repeats 2 --json "$LOGS/generate.json"
step bench_draft 50 python3 benchmarks/bench_draft.py --work /tmp/draft --codecs fp16 --device cuda \
    --target-steps 200 --draft-steps 100 --prompts 8 --max-new 24 --json "$LOGS/draft.json"
