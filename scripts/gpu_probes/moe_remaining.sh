#!/usr/bin/env bash
# The mixture-of-experts rows docs/moe.md still lacks (issue 51), one device call each, every row
# written as it is measured (JSON lines under $OUT, or ./runs/moe). Compiling an 8-layer loop takes
# about a minute on an H100, so each part has its own time limit inside the 10-minute call.
#
#   bash scripts/gpu_probes/moe_remaining.sh kernel      # Qwen3 one token and K=3 with the kernel, B=64; 8-bit
#   bash scripts/gpu_probes/moe_remaining.sh mixtral     # Mixtral's verify passes and expert ops, both paths
#   bash scripts/gpu_probes/moe_remaining.sh projection  # speedups projected under both routings
set -u
out=${OUT:-runs/moe}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
costs=scripts/gpu_probes/moe_costs.py
q=qwen3-30b-a3b-8l
m=mixtral-8x7b-8l

run() {  # run NAME SECONDS COMMAND...: its rows to $out/NAME.jsonl, its log to $out/NAME.err
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$out/$name.jsonl" 2>"$out/$name.err"
    echo "$name: exit $? ($(wc -l <"$out/$name.jsonl") rows)"
}

case ${1:-} in
kernel)
    JAXSPEC_EXPERT_PATH=kernel run qwen3-kernel-forced 150 python3 $costs --shape $q --batches 1 --ks 3 --skip expert_op
    run qwen3-engine 200 python3 $costs --shape $q --batches 1,64 --ks 3 --tokens 1,4,8,32,64 --tiles 128/4/3,64/4/3
    run qwen3-int8 180 python3 $costs --shape $q --quantize int8 --batches 1,8 --ks 3
    ;;
mixtral)
    run mixtral-engine 300 python3 $costs --shape $m --skip step --tokens 1,4,8,32 --tiles 128/4/3,64/4/3
    JAXSPEC_EXPERT_PATH=xla run mixtral-xla 200 python3 $costs --shape $m --batches 64 --skip expert_op
    ;;
projection)
    for routing in random same; do
        run "projection-$routing" 280 python3 -m jaxspec.cli bench --shape $q --draft-shape qwen3-0.6b \
            --parts plain,forward,spec,acceptance,eagle --batch-sizes 1 --prompt-lens 128 --new-tokens 64 \
            --spec-k 3 --eagle-k 3 --verify-sizes 1,4 --acceptance-prompts 8 --no-hf --routing $routing \
            --json "$out/projection-$routing.json"
    done
    ;;
*)
    echo "usage: $0 kernel|mixtral|projection" >&2
    exit 2
    ;;
esac
