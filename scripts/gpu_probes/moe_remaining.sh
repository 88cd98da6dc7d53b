#!/usr/bin/env bash
# The mixture-of-experts rows docs/moe.md still lacks (issue 51), one device call each, every row
# written as it is measured (JSON lines under $OUT, or ./runs/moe). Compiling an 8-layer loop takes
# about a minute, so each part has its own time limit inside the 10-minute call.
#
#   bash scripts/gpu_probes/moe_remaining.sh router      # first: Qwen3 steps at B = 1, 8, 64 and K = 3 passes (jaxspec
#                                                        # bench) with the router by its kernels and by XLA
#                                                        # (JAXSPEC_ROUTER); one token's router and experts as ops
#                                                        # (the router's product over 16, 1 and 64 programs). On an
#                                                        # H100 on 2026-12-07 the one-program router lost to XLA's
#                                                        # (docs/moe.md); B = 64 checks sorting past 256 pairs
#   bash scripts/gpu_probes/moe_remaining.sh passes      # the batch-1 pass and a 4-token pass kernel by kernel, over a
#                                                        # 128-token prefix and over an empty cache; verify passes 1-5
#   bash scripts/gpu_probes/moe_remaining.sh pads        # the 1-token profile with every one-row product padded (as before)
#   bash scripts/gpu_probes/moe_remaining.sh ab          # plain B = 1 steps, Qwen3 against an older tree, the 8B under
#                                                        # both pad rules, in one call
#   bash scripts/gpu_probes/moe_remaining.sh short       # the profile at 1 and 4 tokens and a K = 3 pass, in one short call
#   bash scripts/gpu_probes/moe_remaining.sh bars        # short, and the plain batch-1 step: the H200's two bars
#   bash scripts/gpu_probes/moe_remaining.sh tiles       # one layer's experts at 1 and 4 tokens over block_n / warps /
#                                                        # stages; the profile at 1 and 4 tokens with each pass's
#                                                        # compiled program (hlo-t1.txt.gz, hlo-t4.txt.gz)
#   bash scripts/gpu_probes/moe_remaining.sh qab         # Qwen3's plain batch-1 step, this tree against BASE (as ab)
#   bash scripts/gpu_probes/moe_remaining.sh qwen3       # the public API at random routing: plain B = 1-64, verify
#                                                        # passes of 1-5 distinct tokens with their experts and floors,
#                                                        # rounds and projections at each K (EAGLE-3 head, 0.6B draft)
#   bash scripts/gpu_probes/moe_remaining.sh same        # the same at the locality bound
#   bash scripts/gpu_probes/moe_remaining.sh mixtral     # Mixtral through the public API: plain B = 1-64, verify
#                                                        # passes, EAGLE-3 rounds, under both routings
#
# Then: python3 scripts/gpu_probes/moe_full_depth.py $OUT/*.json (the projections at full depth).
set -u
out=$(realpath -m "${OUT:-runs/moe}")
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

plain_qwen3() {  # plain_qwen3 NAME: Qwen3's plain batch-1 step through the public API (run from the current tree)
    run "$1" 100 python3 -m jaxspec.cli bench --shape $q --parts plain --batch-sizes 1 --prompt-lens 128 \
        --new-tokens 64 --no-hf --routing random
}

bench_qwen3() {  # bench_qwen3 ROUTING SECONDS
    run "qwen3-$1" "$2" python3 -m jaxspec.cli bench --shape $q --draft-shape qwen3-0.6b \
        --parts plain,forward,acceptance,eagle,spec --batch-sizes 1,8,32,64 --prompt-lens 128 --new-tokens 64 \
        --verify-sizes 1,2,3,4,5 --eagle-k 1,2,3 --spec-k 1,3 --acceptance-prompts 8 --no-hf --routing "$1" \
        --json "$out/qwen3-$1.json"
}

case ${1:-} in
router)
    for r in kernel xla; do  # the plain step and a K = 3 pass through the public API, by each router
        JAXSPEC_ROUTER=$r run qwen3-router-$r 180 python3 -m jaxspec.cli bench --shape $q --parts plain,forward \
            --batch-sizes 1,8,64 --prompt-lens 128 --new-tokens 64 --verify-sizes 1,4 --spec-k 3 --no-hf \
            --routing random --json "$out/qwen3-router-$r.json"
    done
    run qwen3-ops-1 120 python3 $costs --shape $q --skip step,verify --tokens 1,4
    grep -h '"plain"\|"forward"' "$out"/qwen3-router-*.jsonl | cut -c1-250
    grep -ho '"router[a-z_0-9]*_us": [0-9.]*' "$out"/qwen3-ops-1.jsonl
    ;;
profile)
    for r in xla kernel; do
        JAXSPEC_ROUTER=$r run qwen3-profile-$r 200 python3 scripts/gpu_probes/moe_profile.py --shape $q --tokens 1,4
    done
    grep -h '"pass"' "$out"/qwen3-profile-*.jsonl
    ;;
passes)
    run qwen3-profile 150 python3 scripts/gpu_probes/moe_profile.py --shape $q --tokens 1,4 --top 45
    run qwen3-profile-empty 90 python3 scripts/gpu_probes/moe_profile.py --shape $q --tokens 4 --top 3 --prompt-len 0
    run qwen3-passes 170 python3 -m jaxspec.cli bench --shape $q --parts forward --verify-sizes 1,2,3,4,5 --spec-k 3 \
        --prompt-lens 128 --no-hf --routing random
    grep -h '"pass"' "$out"/qwen3-profile*.jsonl
    grep -h '"forward"' "$out"/*-passes.jsonl | cut -c1-300
    ;;
short)  # the passes part in under 5 minutes: the profile at 1 and 4 tokens, a K = 3 pass against one token
    run qwen3-profile 150 python3 scripts/gpu_probes/moe_profile.py --shape $q --tokens 1,4 --top 45
    run qwen3-passes 140 python3 -m jaxspec.cli bench --shape $q --parts forward --verify-sizes 1,4 --spec-k 3 \
        --prompt-lens 128 --no-hf --routing random
    grep -h '"pass"' "$out"/qwen3-profile*.jsonl
    grep -h '"forward"' "$out"/*-passes.jsonl | cut -c1-300
    ;;
bars)  # the issue's two batch-1 bars in one call (about 4 minutes): the plain step through the public API, the
    # profile at 1 and 4 tokens, and a K = 3 pass against one token (an H200 is where the bars are set)
    plain_qwen3 qwen3-plain
    bash "$0" short
    grep -h '"plain"' "$out"/qwen3-plain.jsonl | cut -c1-300
    ;;
tiles)  # the expert kernel's tiles for a few tokens (grid: blocks x n / block_n programs), and what XLA fused
    run qwen3-tiles 170 python3 $costs --shape $q --skip step,verify --tokens 1,4 \
        --tiles 0/4/3,64/4/3,32/4/3,64/4/4,32/4/4,128/4/5,64/8/3
    run qwen3-profile 150 python3 scripts/gpu_probes/moe_profile.py --shape $q --tokens 1,4 --top 45 --hlo "$out"
    grep -h '"pass"' "$out"/qwen3-profile*.jsonl
    grep -ho '"kernel_[a-z0-9_]*_us": [0-9.]*' "$out"/qwen3-tiles.jsonl
    ;;
pads)  # one-row products padded only under XLA's rewrite threshold (the default) or all of them, as before
    JAXSPEC_PAD_ONE_ROW=all run qwen3-profile-padall 120 python3 scripts/gpu_probes/moe_profile.py --shape $q \
        --tokens 1 --top 45
    grep -h '"pass"' "$out"/qwen3-profile*.jsonl
    ;;
ab)  # plain B = 1 steps: Qwen3, the 8B under both pad rules, and Qwen3 on
    # an older tree in the same call (BASE: its jaxspec, pallas_kernels and scripts, e.g. git archive REV jaxspec
    # pallas_kernels scripts | tar -x -C runs/base, carried). Most wanted first: a cut call keeps what it measured.
    base=${BASE:-runs/base}
    plain_qwen3 qwen3-plain-new
    for rule in small all; do
        JAXSPEC_PAD_ONE_ROW=$rule run llama8b-plain-pad$rule 125 python3 -m jaxspec.cli bench --shape llama3-8b \
            --parts plain --batch-sizes 1 --prompt-lens 128 --new-tokens 64 --no-hf
    done
    (cd "$base" && PYTHONPATH=. plain_qwen3 qwen3-plain-base)
    grep -h '"plain"' "$out"/*-plain-*.jsonl | cut -c1-300
    ;;
qab)  # ab's Qwen3 rows alone
    base=${BASE:-runs/base}
    plain_qwen3 qwen3-plain-new
    (cd "$base" && PYTHONPATH=. plain_qwen3 qwen3-plain-base)
    grep -h '"plain"' "$out"/*-plain-*.jsonl | cut -c1-300
    ;;
sort)
    for pairs in 256 1024; do  # batch 64's 512 pairs sorted (COMPARE_MAX_PAIRS 256) or compared
        run qwen3-b64-compare-$pairs 75 python3 $costs --shape $q --batches 64 --skip verify,expert_op \
            --compare-max-pairs $pairs
    done
    grep -h '"step"' "$out"/qwen3-b64-*.jsonl
    ;;
mixtral-passes)
    run mixtral-passes 200 python3 -m jaxspec.cli bench --shape $m --parts forward --verify-sizes 1,2,3,4,6 --spec-k 3 \
        --prompt-lens 128 --no-hf --routing random
    grep -h '"forward"' "$out"/*-passes.jsonl | cut -c1-300
    ;;
qwen3)
    bench_qwen3 random 560
    ;;
same)
    bench_qwen3 same 560
    ;;
mixtral)
    run mixtral-random 330 python3 -m jaxspec.cli bench --shape $m --parts plain,forward,acceptance,eagle \
        --batch-sizes 1,8,32,64 --prompt-lens 128 --new-tokens 64 --verify-sizes 1,2,3,4,6 --eagle-k 1,2,3 \
        --acceptance-prompts 8 --no-hf --routing random --json "$out/mixtral-random.json"
    run mixtral-same 220 python3 -m jaxspec.cli bench --shape $m --parts plain,forward,acceptance,eagle \
        --batch-sizes 1 --prompt-lens 128 --new-tokens 64 --verify-sizes 1,2,4 --eagle-k 1,3 \
        --acceptance-prompts 8 --no-hf --routing same --json "$out/mixtral-same.json"
    ;;
*)
    echo "usage: $0 router|profile|passes|short|bars|tiles|qab|pads|ab|sort|mixtral-passes|qwen3|same|mixtral" >&2
    exit 2
    ;;
esac
