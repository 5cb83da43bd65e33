#!/usr/bin/env bash
# The project's GPU proof on a lent two-GPU H200 machine (kind nvidia-h200-x2), in device calls of
# at most 10 minutes, after the kit of ../shared/docs/h200-vllm.md is installed (its call 5 ends
# with `bash benchmarks/h200_session.sh a $OUT`; later calls on the warm machine run
# `export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 && bash
# benchmarks/h200_session.sh b $OUT`, then `c`).
#
# The engines of bench_gpu.py, bench_tp.py, bench_mtp_trained.py and profile_gpu.py capture only the CUDA-graph
# sizes they measure (2026-12-04: vLLM's 51-size grid took 62 s of a 190 s cold start); --capture-sizes vllm (in
# BENCH_ARGS / MTP_ARGS) restores vLLM's grid.
#
#   a: GPU 1: the kernels' CUDA tests (qwen38 ops, FLASH_ATTN_V100 numerics) then bf16
#      exactness; GPU 0: fp16 exactness (breakable and compiled CUDA graphs, eager); then TP=2.
#   b: bench_gpu.py (medium config, fp16, vLLM on GPU 0 against the roofline, two stock models of the
#      same size (the peers: Qwen3-MoE and the hybrid Qwen3-Next), ours without prefix caching and
#      compiled, and stock's model; transformers on GPU 1 at the same time). BENCH_ARGS replaces the
#      modes, e.g. BUDGET=580 BENCH_ARGS="--modes compiled --repeats 2 --no-transformers" alone in a call:
#      the compiled engine needs about 5 minutes to start on a fresh machine (results/h200_bench_gpu.txt).
#   s: the soak (tests/soak: load, preemption, prefix hits, faults) against a server with CUDA graphs, then
#      the SM70 AWQ kernels, awq_sm70 + FLASH_ATTN_V100 in an engine and the SM70 benchmarks (GPU 0);
#      meanwhile the multimodal step on GPU 1 (gpu_session.py --only mm: images and video served in fp16
#      against transformers, bench_vision.py, bench_mm_ttft.py).
#   p: the decode step under torch's profiler, breakable graphs then torch.compile, then the host cost of a
#      step by part (GPU 0), beside the decode benchmark in both modes and the peer (GPU 1).
#   e: after a kernel change: the kernels' CUDA tests and fp16 exactness with graphs (GPU 1); the decode
#      benchmark beside vLLM's own peer model, then the profile (GPU 0).
#   w: the SM70 AWQ engine tests of s alone (SM70_K: a pytest -k filter).
#   m: the multimodal step of s alone (for a one-GPU machine, where s leaves it out).
#   d: issue 12 item 5 on the GPU through stock's OpenAI server (spec_serve_gpu.py): no speculation, MTP with the
#      ladder and DFlash (TP=2 where two GPUs), greedy against the plain server, sampling's chi-square, /metrics.
#   quick: what fits a short call: fp16 exactness with CUDA graphs (GPU 1), the graphs decode benchmark (GPU 0).
#   c: CSF's kernels and both codecs served against their sources at TP=1 (GPU 0); meanwhile the
#      Qwen4Exp NVFP4-CSF check (GPU 1).
#   t: CSF at TP=2 on both GPUs, then its load overhead (after c; CSF_BUDGET seconds).
#   z: two GPUs: TP=2 exactness (issue 10 item 7), then MTP and DFlash at TP=2 against plain at TP=1
#      (issue 12 item 4, K17 inside an engine).
#   x: speculative decoding on the portable model (gpu_session.py --only spec: no speculation, MTP, MTP
#      with the concurrency ladder, DFlash; fp16, CUDA graphs) against transformers and each other
#      (SPEC_RUNS: gpu_session.py's --spec-runs); then, with SM70_K set, part w's tests.
#   k: issue 12 item 6: bench_mtp_trained.py (train the medium checkpoint's MTP head and a DFlash
#      drafter on the target's own text, then decode tokens/s and acceptance length of plain, MTP and
#      DFlash at concurrency 1 / 4 / 8 / 64, in one table). Its stages are kept under
#      /tmp/h200_session/mtp, so MTP_ARGS can spread them over calls on a warm machine (a cold one
#      starts over): the target trained on the stdlib's source first (a random target's text is
#      unlearnable: results/h200_bench_mtp_trained.txt), then the head, then the drafter (its target
#      features from the oracle, then --dflash-train-seconds of training), then the measurements:
#        BUDGET=555 MTP_ARGS="$A --stop-after generate" (with the kit's install: pretraining only fits),
#        BUDGET=560 MTP_ARGS="$A --stop-after dflash-train", then BUDGET=585 MTP_ARGS="$A" (again if
#        the call ends before every setting is measured: finished settings are kept, and the last call
#        prints the whole table), with (2026-12-02: 548 s, 340 s and 238 s)
#        A="--pretrain-steps 100000 --pretrain-seconds 300 --sequences 128 --new-tokens 128
#           --train-steps 1200 --drafts 3 --no-untrained --dflash-drafts 3 --dflash-train-seconds 110"
#      (next: --chain-train 3 as well, the head trained on its chained drafts: about 3x its 46 s)
#      Since the batched QSA indexer, pretraining runs 0.24 s a step (5.1 s before): 120 s gave 493
#      steps and non-degenerate text (2026-12-03; one call of BUDGET=555 with --pretrain-seconds 120
#      and --methods dflash got through pretrain, generate and an 80 s drafter), so --pretrain-seconds
#      120-180 fits the first call with generate and a second with both trainings. Timings that day:
#      the kit's install and pretraining about 210 s, the cold generate child 212 s (160 s of it the
#      engine's compile and graph capture), the oracle's streams, the 80 s drafter and its evaluations
#      about 130 s. Next (both methods): BUDGET=470 "$A --stop-after generate", BUDGET=420
#      "$A --stop-after dflash-train", BUDGET=585 "$A", with --pretrain-seconds 120
#      --dflash-train-seconds 80 --chain-train 3 in A.
#      2026-12-04 (that A, both methods): 444 s, 404 s (the chained head alone 202 s, so the drafter did not
#      finish) and 395 s (the drafter again, then every setting). Next: BUDGET=470, 585, 585.
#      2026-12-04, second session (BUDGET=470, 585, 585): 426 s, 433 s, 313 s (the measurements: three children,
#      about 100 s each). The speed-ups moved by up to 2x between those two sessions, so next: A with --rounds 2
#      (every setting measured twice, round after round, the faster counting): a fourth call finishes round 2.
#      Since fa6c5f9 the generate child runs eager with every sequence at once (it ran the measured settings:
#      with --batches 1 one sequence at a time, behind the compile and graph capture), so its 212 s should
#      shrink to the engine's start and Triton's compiles; since 134fbd9 the target's streams and features
#      come from transformers in batches of 64 (the oracle's 77-84 s for 128 sequences should become
#      seconds). Neither is timed on a GPU yet. Next: --sequences 512, BUDGET=400 "$A --stop-after
#      generate", then BUDGET=585 "$A" (twice if round 2 is cut).
#      Since 739bf61, --dflash-draft-vocab N: the drafter's own lm_head over the N tokens most frequent in its
#      training text (stock's d2t map), to take its 0.18 ms full-vocabulary GEMV (part l, 2026-12-06) out of
#      the step; next A adds --dflash-draft-vocab 16384.
#      2026-12-07 (H100, two calls on one machine: 345 s with the kit's install, then 287 s), with
#        A="--pretrain-steps 100000 --pretrain-seconds 100 --sequences 512 --new-tokens 128 --methods dflash
#           --dflash-drafts 3 --dflash-draft-vocab 16384 --dflash-train-seconds 80 --batches 1 --rounds 1":
#      DFlash 1.83x at acceptance 3.05, concurrency 1. Timings: the kit's install about 10 s, pretrain + generate
#      (512 sequences) + the drafter's features about 330 s, the drafter 80 s, each measuring child about 90 s.
#      Next, both methods in one run as item 6 asks, over two calls on one machine:
#        A="--pretrain-steps 100000 --pretrain-seconds 100 --sequences 512 --new-tokens 128 --train-steps 1200
#           --drafts 3 --no-untrained --dflash-drafts 3 --dflash-draft-vocab 16384 --dflash-train-seconds 80
#           --batches 1,4,8,64 --rounds 1"
#        BUDGET=585 MTP_ARGS="$A --stop-after dflash-train", then BUDGET=585 MTP_ARGS="$A" (three children: plain,
#        MTP, DFlash); a third call with --rounds 2 if the device time allows; then part i for the step's A/B.
#      Second session that day (H100), that A with BUDGET=585 MTP_ARGS="$A" twice: 579 s with the kit's install (pretrain,
#      generate, features, the MTP head's 69 s, then the limit 40 s into the drafter), then 381 s (the drafter again,
#      three measuring children of about 95 s). Both methods cleared item 6 at concurrency 1 (MTP 2.71x, DFlash 2.44x).
#      Next: the H200, --rounds 2, and part l with L_BATCHES=1,64 (DFlash's verify step at 64 cost 2.3x plain's).
#      (--methods mtp or dflash measures one of them; --dflash-layers 2 only in the V2 runner.)
#   o: after a change to the fused ops alone: their native CUDA checks and bench_fused_ops.py, medium and Flash-Next
#      mixer sizes (about 3 minutes).
#   j: K20 in a GPU engine (benchmarks/dflash2/k20_gpu_check.py: adaptive verification with dflash2's
#      acceptance estimator, with stock's, and without speculation; CUDA graphs, fp16 then fp32).
#   r: issue 16 on the machine's GPUs: bench_tp.py (Flash-Next's per-layer geometry at TP 1 / 2 / 4 as
#      the GPUs allow, MTP 3, DCP 2 at TP=4 (served since 2026-12-05); on one H200, TP=1 only). Each finished
#      run is kept, so a second call on the warm machine measures only what the first one's limit cut (2026-12-04, BUDGET=570 with the
#      kit's install: the 16 GB checkpoint 188 s, TP=1 plain about 200 s, then the limit inside the MTP run;
#      since 2026-12-05 the checkpoint's random weights are drawn on the GPU: --build-device cpu is the old way).
#   n: after part r on the same machine: a decode step of its Flash-Next-width checkpoint under the profiler (TP=1,
#      batch 1 and 64: profile_gpu.py --model).
#   y: the QSA kernels' tests natively on one GPU (tests/qwen38_plugin/test_qwen38_qsa_paged.py: Triton against torch,
#      the DCP partials included; sm_70 / sm_90 compiles; a decode step replayed from a CUDA graph), then
#      bench_qsa_paged.py --dcp 2 (fp16; a TP4 rank's attention without and with DCP 2).
#   q: a speculative decode step under torch's profiler (profile_gpu.py --speculative): none, DFlash, MTP, and MTP
#      with QWEN38_QSA_DRAFT_UPDATE=0 (each draft step's QSA metadata built on the host, one graph a step).
#   i: what a reduced draft vocabulary saves a DFlash step: profile_gpu.py --speculative dflash with the random
#      drafter's head over the target's vocabulary, then over 16,384 tokens (--draft-vocab), alternating, then
#      plain decode at the same batch sizes (I_BATCHES, default 1,8; e.g. I_BATCHES=1,64).
#   l: after part k on the same machine: its trained settings (none, MTP, DFlash: accepted drafts) under the
#      profiler at batch 1 (profile_gpu.py --trained), wall and GPU time per verify step.
#   u: the A/B of MTP's in-place draft-step metadata alone, alternating (QWEN38_QSA_DRAFT_UPDATE 0, 1, 0, 1: one
#      engine process each, profile_gpu.py --speculative mtp), since one pair's wall times differed by more than
#      the host's speed between processes (2026-12-03: results/h200_bench_mtp_trained.txt).
#   v: exactness in vLLM's V1 model runner (GPU 1) beside fp16 eager in the V2 runner (GPU 0).
#   h: the tiny target's greedy tokens against transformers, fp16 with CUDA graphs in the V2 runner alone
#      (gpu_session.py --only exact; a quick check after a change, e.g. with the stock kit's FlashInfer present).
#   f: does vLLM on the GPU draft what the DFlash reference drafts (drafts_check.py: the tiny target
#      and a random drafter, every step's drafts against the fp32 reference): fp16 with CUDA graphs (three
#      requests together, then one alone), fp16 eager, bf16 eager (2026-12-02: a trained drafter predicted
#      at 3.97 was accepted at 2.27 on the H200).
#   g: the same for MTP (drafts_check.py --method mtp: the tiny target's random MTP head, each draft position
#      against the fp32 oracle head): fp16 with CUDA graphs (three requests, then one alone), fp16 eager
#      (2026-12-02: a trained head's second draft was never accepted on the H200, while on CPU every draft was).
#
# This checkout's sources come first on PYTHONPATH (the kit's plugin wheels give the entry points).
# Every child has a time limit; each part ends by packing its results into OUT/<part>.tar.gz
# (the device returns at most 8 files) beside the summaries.
set -u
part=$1
out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=/tmp/h200_session
res=$work/results-$part
mkdir -p "$res"
src=$(printf "$root/src/%s:" qwen38_plugin sm70_backend dflash2 csf_loader tool_parsers)
# pip install --target does not run a wheel's .pth file, and the CUTLASS DSL (h200_stock_kit.sh) puts
# its `cutlass` package on sys.path only through one (nvidia_cutlass_dsl_packages.pth): without this,
# FlashInfer's GDN prefill, which vLLM picks once FlashInfer is installed, fails with "No module named
# 'cutlass'" in ours and stock's engines alike (2026-12-05, parts b and k).
dsl=""
IFS=: read -ra entries <<<"${PYTHONPATH:-}"
for entry in "${entries[@]}"; do
    [ -d "$entry/nvidia_cutlass_dsl/dsl_packages" ] && dsl="$dsl:$entry/nvidia_cutlass_dsl/dsl_packages"
done
export PYTHONPATH="$src$root:${PYTHONPATH:-}$dsl" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
q38="python3 $root/benchmarks/qwen38_plugin/gpu_session.py"
csf="python3 $root/benchmarks/csf_loader/gpu_session.py"
cd "$root"
# Every child's limit is cut to what is left of BUDGET seconds (default 500), so the packing at
# the end always happens inside the device call's 10 minutes.
deadline=$(($(date +%s) + ${BUDGET:-500}))
lim() { # lim CAP: CAP seconds, or what is left before the deadline less 15 s, whichever is less
    local left=$((deadline - $(date +%s) - 15))
    echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}
nvidia-smi --query-gpu=name,memory.total --format=csv >"$res/gpus.txt" 2>&1
# The host beside the GPU: wall-time ratios between processes moved by up to 2x from one machine to the next
# (2026-12-04), and a graph launch took 250-500 us of host time under the profiler, so each part records the CPU
# model, its clock, the NUMA layout and the GPU's CPU affinity.
{
    nproc
    lscpu | grep -iE '^(model name|cpu mhz|cpu max mhz|numa|thread|core|socket|hypervisor)'
    nvidia-smi topo -m
} >"$res/host.txt" 2>&1
# On a one-GPU machine (kind nvidia-h200) "GPU 1" is GPU 0 and a job the parts start in the background
# is waited for at once (`solo`), so the two halves of a part run one after the other; part s leaves
# its multimodal half to part m there, and t (two GPUs) is refused.
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
G1=$((ngpu > 1 ? 1 : 0))
solo() { [ "$ngpu" -gt 1 ] || wait; }

case $part in
a)
    (
        export CUDA_VISIBLE_DEVICES=$G1
        timeout $(lim 150) $q38 "$res/ops" --only ops --work $work/q38
        timeout $(lim 90) python3 -m pytest --noconftest -q -rA -p no:cacheprovider \
            tests/sm70_backend/test_attention_cuda.py >"$res/sm70_attention_cuda.log" 2>&1
        timeout $(lim 250) $q38 "$res/exact-bf16" --only exact --runners v2 --dtypes bfloat16 --modes graphs \
            --work $work/q38
    ) >"$res/gpu1.log" 2>&1 &
    solo
    CUDA_VISIBLE_DEVICES=0 timeout $(lim 330) $q38 "$res/exact-fp16" --only exact --runners v2 --dtypes float16 \
        --work $work/q38 >"$res/gpu0.log" 2>&1
    wait
    timeout $(lim 130) $q38 "$res/tp2" --only tp2 --runners v2 --dtypes float16 --work $work/q38 >"$res/tp2.log" 2>&1
    ;;
b)
    # transformers on GPU 1 while vLLM runs on GPU 0 (bench_gpu.py does that with two GPUs); the peers
    # right after graphs, so the ours / peer ratios survive a limit that stops the later modes; then
    # ours without prefix caching (what vLLM's hybrid-state copies cost a step), then torch.compile
    timeout $(lim 560) $q38 "$res/bench" --only bench --work $work/q38 \
        --bench-args "${BENCH_ARGS:---modes graphs,peer,peer-hybrid,graphs-noprefix,compiled --repeats 2}" \
        >"$res/bench.log" 2>&1
    ;;
w)
    # issue 11 alone: awq_sm70 + FLASH_ATTN_V100 with CUDA graphs in vLLM engines (Qwen3, Qwen3-MoE, Qwen4Exp)
    SM70_ENGINE_ATTENTION_BACKEND=FLASH_ATTN_V100 SM70_ENGINE_CUDA_GRAPHS=1 timeout $(lim 560) \
        python3 -m pytest -q -rA -p no:cacheprovider ${SM70_K:+-k "$SM70_K"} tests/sm70_backend/test_awq_engine.py \
        >"$res/sm70_engine.log" 2>&1
    tail -15 "$res/sm70_engine.log"
    ;;
d)
    # issue 12 item 5 through stock's OpenAI server on the GPU: no speculation, MTP 3 with the ladder, DFlash 3
    # (TP=2 on a two-GPU machine), each greedy against the plain server and transformers, sampled against the
    # exact distribution (chi-square), /metrics (spec_serve_gpu.py: the CPU server test's workload in fp16)
    dtp=$([ "$ngpu" -ge 2 ] && echo 2 || echo 1)
    timeout $(lim 580) python3 benchmarks/qwen38_plugin/spec_serve_gpu.py "$res/spec-serve" --tp "$dtp" \
        --servers "${SERVE_SERVERS:-plain,mtp,dflash}" >"$res/spec-serve.log" 2>&1
    grep '^spec_serve ' "$res/spec-serve.log" || tail -20 "$res/spec-serve.log"
    ;;
m)
    # the multimodal step alone (issue 13), for a one-GPU machine
    timeout $(lim 560) $q38 "$res/mm" --only mm --work $work/q38 >"$res/mm.log" 2>&1
    grep -E '^(mm exactness|\|)' "$res/mm.log"
    ;;
c)
    if [ "$ngpu" -lt 2 ]; then
        # one GPU: CSF's serving at TP=1 then the Qwen4Exp check, one budget (the kernels were proven
        # on 2026-11-30; add them with CSF_STEPS=kernels,serve,qwen4exp; CSF_CODECS=mxfp4: one codec)
        # (CSF_LOAD_READ_AHEAD=1: the load step also loads each CSF checkpoint with its stream on a
        # thread ahead of stock's copies, the read-ahead's A/B in the same run; about 12 s a load;
        # CSF_REPEATS: loads of each checkpoint, default 3, the first of them compiling)
        timeout $(lim 580) $csf "$res/csf-serve" --only "${CSF_STEPS:-serve,qwen4exp}" --budget $(($(lim 580) - 10)) \
            --codecs "${CSF_CODECS:-nvfp4,mxfp4}" ${CSF_LOAD_READ_AHEAD:+--read-ahead} --repeats "${CSF_REPEATS:-3}" --work $work/csf >"$res/csf-serve.log" 2>&1
        tail -30 "$res/csf-serve.log"
    else
        # CSF (issue 14 item 2): the tiny Qwen4Exp's NVFP4-CSF on GPU 1 while GPU 0 runs CSF's kernels
        # and serves both codecs at TP=1 against their sources (each served again where outputs differ)
        CUDA_VISIBLE_DEVICES=1 timeout $(lim 300) $csf "$res/csf-qwen4exp" --only qwen4exp --budget 290 \
            --work $work/csf >"$res/csf-qwen4exp.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=0 timeout $(lim 500) $csf "$res/csf-serve" --only kernels,serve --budget 490 \
            --work $work/csf >"$res/csf-serve.log" 2>&1
        wait
    fi
    ;;
t)
    [ "$ngpu" -ge 2 ] || { echo "part t needs two GPUs (kind nvidia-h200-x2); this machine has $ngpu" >&2; exit 2; }
    # CSF at TP=2 on both GPUs, then the load overhead (after part c built the checkpoints)
    budget=${CSF_BUDGET:-520}
    timeout $(lim $((budget + 10))) $csf "$res/csf" --only tp2,load --budget "$budget" --work $work/csf \
        >"$res/csf.log" 2>&1
    ;;
z)
    # the two-GPU checks of issues 10 and 12 in one call (kind nvidia-h200-x2): TP=2 against transformers and
    # against TP=1 (issue 10 item 7), then MTP and DFlash at TP=2 against plain decoding at TP=1 (issue 12 item 4:
    # the drafter's column-parallel fc, K17, inside an engine on two GPUs)
    [ "$ngpu" -ge 2 ] || { echo "part z needs two GPUs (kind nvidia-h200-x2); this machine has $ngpu" >&2; exit 2; }
    timeout $(lim 200) $q38 "$res/tp2" --only tp2 --runners v2 --dtypes float16 --work $work/q38 >"$res/tp2.log" 2>&1
    grep -E 'tp2' "$res/tp2.log" | tail -3
    timeout $(lim 560) $q38 "$res/spec-tp2" --only spec --spec-runs plain,mtp3-tp2,dflash3-tp2 \
        --work $work/q38 >"$res/spec-tp2.log" 2>&1
    grep -E '^spec ' "$res/spec-tp2.log"
    ;;
x)
    # issue 12 on the GPU: MTP, MTP with the ladder and DFlash against no speculation and transformers
    timeout $(lim 560) $q38 "$res/spec" --only spec --work $work/q38 ${SPEC_RUNS:+--spec-runs "$SPEC_RUNS"} \
        >"$res/spec.log" 2>&1
    grep -E '^spec ' "$res/spec.log"
    if [ -n "${SM70_K:-}" ]; then
        SM70_ENGINE_ATTENTION_BACKEND=FLASH_ATTN_V100 SM70_ENGINE_CUDA_GRAPHS=1 timeout $(lim 560) \
            python3 -m pytest -q -rA -p no:cacheprovider -k "$SM70_K" tests/sm70_backend/test_awq_engine.py \
            >"$res/sm70_engine.log" 2>&1
        tail -8 "$res/sm70_engine.log"
    fi
    ;;
o)
    # after a change to the fused ops alone (about 2 minutes): their native CUDA checks, then their timing
    timeout $(lim 150) python3 -m pytest --noconftest -q -rA -p no:cacheprovider \
        tests/qwen38_plugin/test_qwen38_fused_ops.py >"$res/ops.log" 2>&1
    tail -3 "$res/ops.log"
    timeout $(lim 150) python3 benchmarks/qwen38_plugin/bench_fused_ops.py --tokens 1,64 >"$res/bench_fused_ops.txt" 2>&1
    # Flash-Next's mixer (hidden 2560, rank 320): the gate kernel's 16-feature tiles at decode and prefill sizes
    timeout $(lim 120) python3 benchmarks/qwen38_plugin/bench_fused_ops.py --hidden 2560 --rank 320 --tokens 1,2048 \
        >>"$res/bench_fused_ops.txt" 2>&1
    cat "$res/bench_fused_ops.txt"
    ;;
j)
    # K20 in a GPU engine: adaptive verification with dflash2's acceptance estimator against stock's and
    # against no speculation (k20_gpu_check.py: a tiny Qwen3 target and random DFlash drafter; stock refuses
    # adaptive verification for targets with GDN layers, and without full CUDA graphs: the eager run of
    # 2026-12-07 was refused), in fp16 then in fp32 (tokens equal, or differing at a near tie). Its three
    # engines with CUDA graphs took 340 s (fp16, with the kit's install) and 240 s (fp32) on an H100
    # (2026-12-08), so one dtype fits a call: J_DTYPES=float16, then J_DTYPES=float32
    # (J_RUNS=robust,none leaves stock's run out when time is short)
    for dtype in ${J_DTYPES:-float16 float32}; do
        name=k20-$dtype
        timeout $(lim 450) python3 benchmarks/dflash2/k20_gpu_check.py "$res/$name" --work $work/k20 \
            --timeout 240 --dtype "$dtype" --runs "${J_RUNS:-robust,stock,none}" >"$res/$name.log" 2>&1
        grep '^k20 ' "$res/$name.log" || tail -5 "$res/$name.log"
    done
    ;;
r)
    # issue 16 as far as the machine's GPUs allow (TP 2 and 4 need nvidia-h200-x2 / -x4; bench_tp.py lists
    # the sizes it could not run): Flash-Next's real per-layer geometry (4 layers, the real vocabulary,
    # 512 experts: a 16 GB fp16 checkpoint built on the machine) at each TP size, then with MTP 3, and
    # with DCP 2 at TP >= 2 (served where the ranks outnumber the 2 KV heads: TP=4; refused by stock at TP=2)
    timeout $(lim 585) python3 benchmarks/qwen38_plugin/bench_tp.py "$res/tp" --tps 1,2,4 --mtp 3 --dcp 2 \
        --work $work/tp --timeout 420 >"$res/bench_tp.log" 2>&1
    tail -30 "$res/bench_tp.log"
    ;;
n)
    # after part r on the same warm machine: a decode step of Flash-Next's widths under the profiler (TP=1, batch 1
    # and 64, vLLM's defaults): at batch 1 the step took 4 ms, 13.5 % of the roofline (2026-12-04), and what fills it
    # has not been seen
    model=$(ls -d "$work"/tp/flash-next-4l-*-float16 2>/dev/null | head -1)
    if [ -z "$model" ]; then
        echo "part n: no Flash-Next-width checkpoint under $work/tp: run part r on this machine first"
    else
        CUDA_VISIBLE_DEVICES=0 timeout $(lim 400) python3 benchmarks/qwen38_plugin/profile_gpu.py "$res/profile-fn" \
            --model "$model" --batches 1,64 >"$res/profile-fn.log" 2>&1
        grep -E '^default batch' "$res/profile-fn.log" || tail -3 "$res/profile-fn.log"
        head -45 "$res/profile-fn/profile-b1.txt" 2>/dev/null
    fi
    ;;
k)
    timeout $(lim 580) python3 benchmarks/qwen38_plugin/bench_mtp_trained.py "$res/mtp" --work $work/mtp \
        --timeout 300 ${MTP_ARGS:-} >"$res/bench_mtp.log" 2>&1
    grep -v '^train: step' "$res/bench_mtp.log" | tail -25
    ;;
h)
    # (on a cold machine the engine's profiling run compiles every Triton kernel, 77 s on 2026-12-06, and a
    # first request compiles launchers too: 240 s stopped it in its graph capture, so give it all 280 s)
    timeout $(lim 280) $q38 "$res/exact-fp16" --only exact --runners v2 --dtypes float16 --modes graphs \
        --work $work/q38 >"$res/exact.log" 2>&1
    tail -5 "$res/exact.log"
    ;;
f)
    # (float32 is refused on CUDA: vLLM's GDN prefill kernel; the graphs variant first compiles and
    # captures, about 10 s a graph on a fresh machine)
    # F_VARIANTS: a subset, as G_VARIANTS in part g
    IFS=';' read -r -a variants <<<"${F_VARIANTS:-280 float16 --graphs;150 float16 --graphs --requests 1;150 float16;150 bfloat16}"
    for variant in "${variants[@]}"; do
        # shellcheck disable=SC2086  # the variant's words
        set -- $variant
        limit=$1
        shift
        name=$(echo "$*" | tr -d ' -')
        # shellcheck disable=SC2068  # the variant's words
        timeout $(lim "$limit") python3 benchmarks/qwen38_plugin/drafts_check.py "$res/drafts-$name" --dtype $@ \
            --work $work/drafts >"$res/drafts-$name.log" 2>&1
        grep '^drafts ' "$res/drafts-$name.log" || tail -3 "$res/drafts-$name.log"
    done
    ;;
g)
    # (run first on a cold machine, the graphs variant's engine start compiles every Triton kernel: the
    # eager variant alone did not start within 175 s that way, 2026-12-03)
    # (then one request alone, a batch of one: 2026-12-04's concurrency 1 accepted less than 4 and 8)
    # G_VARIANTS ("LIMIT FLAGS;LIMIT FLAGS"): a subset, e.g. "240 --graphs --requests 1" on a warm machine
    IFS=';' read -r -a variants <<<"${G_VARIANTS:-340 --graphs;200 --graphs --requests 1;200}"
    for variant in "${variants[@]}"; do
        # shellcheck disable=SC2086  # the variant's words
        set -- $variant
        limit=$1
        shift
        name=float16$(echo "$*" | tr -d ' -')
        # shellcheck disable=SC2068  # the variant's words
        timeout $(lim "$limit") python3 benchmarks/qwen38_plugin/drafts_check.py "$res/mtp-drafts-$name" \
            --method mtp --dtype float16 $@ --work $work/drafts >"$res/mtp-drafts-$name.log" 2>&1
        grep '^drafts ' "$res/mtp-drafts-$name.log" || tail -3 "$res/mtp-drafts-$name.log"
    done
    ;;
q)
    # where a speculative step goes (issue 12 item 6: 2.6x (DFlash) / 3.3x (MTP) a plain step at batch 1):
    # the decode step under torch's profiler without speculation (same engine settings), with a random
    # DFlash drafter and with the random MTP head, 3 drafts, all rejected (one token a step)
    # (MTP's A/B first: on a cold machine the first engine pays the Triton compiles, about 100 s more than a
    # warm one: 170 s were too few, 2026-12-03)
    cap=280
    for spec in mtp-no-draft-update mtp none dflash; do
        env=""
        method=$spec
        if [ "$spec" = mtp-no-draft-update ]; then
            # each draft step's QSA metadata built on the host (the A/B of the in-place draft update)
            env="QWEN38_QSA_DRAFT_UPDATE=0"
            method=mtp
        fi
        # shellcheck disable=SC2086  # env is one assignment or empty
        env $env CUDA_VISIBLE_DEVICES=0 timeout $(lim $cap) python3 benchmarks/qwen38_plugin/profile_gpu.py \
            "$res/profile-$spec" --speculative $method --drafts 3 --batches 1,8 --work $work/q38 \
            >"$res/profile-$spec.log" 2>&1
        if grep -qE '^(none|dflash3|mtp3) batch' "$res/profile-$spec.log"; then
            grep -E '^(none|dflash3|mtp3) batch' "$res/profile-$spec.log" | sed "s/^/$spec: /"
        else
            tail -3 "$res/profile-$spec.log"
        fi
        cap=170
    done
    ;;
l)
    # after part k on the same warm machine: its trained settings' steps under the profiler (accepted drafts,
    # several tokens a step), batch 1, 127 tokens a request: where DFlash's 5.35 ms a step went (MTP 4.29, plain
    # 3.16 unprofiled; with every draft rejected a DFlash step took about a plain one's, part q, 2026-12-03)
    paths=$work/results-k/mtp/bench_mtp_trained.json
    if [ ! -f "$paths" ]; then
        echo "part l: $paths is missing: run part k on this machine first"
    else
        # (DFlash drafts as many tokens as its drafter was trained for, read from the report; MTP 3; a setting
        # the report lacks, e.g. mtp after --methods dflash, stops at once with the reason; L_BATCHES, e.g. "1,64":
        # the batch sizes profiled, since 2026-12-07's DFlash step at concurrency 64 cost 2.3x plain's, MTP's 1.4x)
        for spec in dflash mtp none; do
            CUDA_VISIBLE_DEVICES=0 timeout $(lim 200) python3 benchmarks/qwen38_plugin/profile_gpu.py \
                "$res/profile-trained-$spec" --speculative $spec --batches ${L_BATCHES:-1} --steps 127 --work $work/q38 \
                --trained "$paths" >"$res/profile-trained-$spec.log" 2>&1
            grep -E '^(none|dflash[0-9]+|mtp[0-9]+) batch' "$res/profile-trained-$spec.log" ||
                tail -3 "$res/profile-trained-$spec.log"
        done
    fi
    ;;
u)
    cap=280  # the first engine on a cold machine compiles every Triton kernel
    run=0
    for update in 0 1 0 1; do
        run=$((run + 1))
        QWEN38_QSA_DRAFT_UPDATE=$update CUDA_VISIBLE_DEVICES=0 timeout $(lim $cap) python3 \
            benchmarks/qwen38_plugin/profile_gpu.py "$res/ab-$run-update$update" --speculative mtp --drafts 3 \
            --batches 1,8 --work $work/q38 >"$res/ab-$run-update$update.log" 2>&1
        if grep -q '^mtp3 batch' "$res/ab-$run-update$update.log"; then
            grep '^mtp3 batch' "$res/ab-$run-update$update.log" | sed "s/^/run $run QWEN38_QSA_DRAFT_UPDATE=$update: /"
        else
            tail -3 "$res/ab-$run-update$update.log"
        fi
        cap=170
    done
    ;;
i)
    # what a reduced draft vocabulary saves a DFlash step (--dflash-draft-vocab in part k): profile_gpu.py's random
    # drafter with the target's lm_head, then with its own over 16,384 tokens, alternating, each engine a process;
    # every draft rejected, so a step's wall time is its whole cost (I_BATCHES, default 1,8); then a plain
    # engine at the same batch sizes, what a DFlash step costs against (part k's verify step at 64 was 2.3x plain's)
    cap=280  # the first engine on a cold machine compiles every Triton kernel
    run=0
    for vocab in 0 16384 0 16384 none; do
        run=$((run + 1))
        if [ "$vocab" = none ]; then spec="--speculative none"; else spec="--speculative dflash --drafts 3 --draft-vocab $vocab"; fi
        CUDA_VISIBLE_DEVICES=0 timeout $(lim $cap) python3 benchmarks/qwen38_plugin/profile_gpu.py \
            "$res/vocab-$run-$vocab" $spec --batches ${I_BATCHES:-1,8} \
            --work $work/q38 >"$res/vocab-$run-$vocab.log" 2>&1
        grep -E '^(dflash3(-v[0-9]+)?|none) batch' "$res/vocab-$run-$vocab.log" | sed "s/^/run $run: /" ||
            tail -3 "$res/vocab-$run-$vocab.log"
        cap=170
    done
    ;;
v)
    # vLLM's V1 model runner on GPU 1 (fp16, CUDA graphs and eager) while GPU 0 runs fp16 eager in V2
    CUDA_VISIBLE_DEVICES=$G1 timeout $(lim 250) $q38 "$res/exact-v1" --only exact --runners v1 --dtypes float16 \
        --modes graphs,eager --work $work/q38 >"$res/gpu1.log" 2>&1 &
        solo
    CUDA_VISIBLE_DEVICES=0 timeout $(lim 150) $q38 "$res/exact-fp16-eager" --only exact --runners v2 \
        --dtypes float16 --modes eager --work $work/q38 >"$res/gpu0.log" 2>&1
    wait
    ;;
p)
    # where a decode step goes (GPU 0: torch profiler, breakable CUDA graphs then torch.compile) while
    # GPU 1 runs the decode benchmark (both modes and the peer, then transformers on the same GPU)
    (
        CUDA_VISIBLE_DEVICES=0 timeout $(lim 200) python3 benchmarks/qwen38_plugin/profile_gpu.py "$res/profile-graphs" \
            --work $work/q38
        CUDA_VISIBLE_DEVICES=0 timeout $(lim 200) python3 benchmarks/qwen38_plugin/profile_gpu.py "$res/profile-compiled" \
            --compiled --work $work/q38
        # the host side of a step by part, ours against a pure-attention peer, prefix caching on and off
        CUDA_VISIBLE_DEVICES=0 timeout $(lim 240) python3 benchmarks/qwen38_plugin/host_step_cost.py \
            --config medium --dtype float16 --batches 1,64 --work $work/q38 >"$res/host_step_cost.txt" 2>&1
    ) >"$res/profile.log" 2>&1 &
    solo
    CUDA_VISIBLE_DEVICES=$G1 timeout $(lim 560) python3 benchmarks/qwen38_plugin/bench_gpu.py "$res/bench" \
        --work $work/q38 --modes graphs,peer,compiled --timeout 300 >"$res/bench.log" 2>&1
    wait
    ;;
s)
    # the multimodal step on GPU 1 (issue 13) while the soak of tests/soak runs against a server on GPU 0
    # with CUDA graphs (issue 17 item 4), fp16
    if [ "$ngpu" -gt 1 ]; then
        CUDA_VISIBLE_DEVICES=1 timeout $(lim 420) $q38 "$res/mm" --only mm --work $work/q38 >"$res/mm.log" 2>&1 &
    fi
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout $(lim 300) python3 benchmarks/soak_gpu.py "$res/soak" --dtype float16 \
            --requests 120 --concurrency 32 >"$res/soak.log" 2>&1
        # then issue 11 on the same GPU: the AWQ kernels against their reference, awq_sm70 with
        # FLASH_ATTN_V100 and CUDA graphs inside a vLLM engine, both SM70 benchmarks
        SM70_ENGINE_ATTENTION_BACKEND=FLASH_ATTN_V100 SM70_ENGINE_CUDA_GRAPHS=1 timeout $(lim 200) \
            python3 -m pytest -q -rA -p no:cacheprovider tests/sm70_backend/test_awq_cuda.py \
            tests/sm70_backend/test_awq_engine.py >"$res/sm70_gpu.log" 2>&1
        timeout $(lim 60) python3 benchmarks/sm70_backend/bench_awq.py >"$res/bench_awq.log" 2>&1
        timeout $(lim 60) python3 benchmarks/sm70_backend/bench_attention.py >"$res/bench_attention.log" 2>&1
    )
    wait
    tail -20 "$res/soak.log"
    grep -E '^(mm exactness|\|)' "$res/mm.log"
    tail -3 "$res/sm70_gpu.log"
    ;;
quick)
    # what fits a short call: fp16 exactness with CUDA graphs (GPU 1), the graphs decode bench (GPU 0)
    # (it was part d until part d became issue 12's served check, which shadowed it)
    CUDA_VISIBLE_DEVICES=$G1 timeout $(lim 200) $q38 "$res/exact-fp16" --only exact --runners v2 --dtypes float16 \
        --modes graphs --work $work/q38 >"$res/gpu1.log" 2>&1 &
        solo
    CUDA_VISIBLE_DEVICES=0 timeout $(lim 220) $q38 "$res/bench" --only bench --work $work/q38 \
        --bench-args "--modes graphs --batches 1,8,64 --repeats 2 --no-transformers" >"$res/bench.log" 2>&1
    wait
    ;;
e)
    # after a change to the kernels: their CUDA tests then fp16 exactness with CUDA graphs (GPU 1);
    # the decode benchmark against vLLM's own peer model (GPU 0), then where a step goes (profile)
    (
        export CUDA_VISIBLE_DEVICES=$G1
        timeout $(lim 120) python3 -m pytest --noconftest -q -rA -p no:cacheprovider \
            tests/qwen38_plugin/test_qwen38_fused_ops.py tests/qwen38_plugin/test_qwen38_qsa_paged.py \
            >"$res/ops.log" 2>&1
        timeout $(lim 250) $q38 "$res/exact-fp16" --only exact --runners v2 --dtypes float16 --modes graphs \
            --work $work/q38
    ) >"$res/gpu1.log" 2>&1 &
    solo
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout $(lim 330) python3 benchmarks/qwen38_plugin/bench_gpu.py "$res/bench" --work $work/q38 \
            --modes graphs,peer --repeats 2 --no-transformers --timeout 300
        timeout $(lim 150) python3 benchmarks/qwen38_plugin/profile_gpu.py "$res/profile-graphs" --work $work/q38
    ) >"$res/gpu0.log" 2>&1
    wait
    ;;
y)
    # after a change to the QSA kernels alone, on any one GPU: their native CUDA checks against the torch
    # references (the decode-context-parallel partials included), the sm_70 / sm_90 compiles, CUDA graphs
    CUDA_VISIBLE_DEVICES=0 timeout $(lim 200) python3 -m pytest --noconftest -q -rA -p no:cacheprovider \
        tests/qwen38_plugin/test_qwen38_qsa_paged.py >"$res/qsa_ops.log" 2>&1
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$res/qsa_ops.log" | tail -30
    # then the QSA layer's speed, with the TP4 / DCP2 table (a rank's attention without and with DCP)
    CUDA_VISIBLE_DEVICES=0 OUT="$res" timeout $(lim 300) python3 benchmarks/qwen38_plugin/bench_qsa_paged.py \
        --dtypes float16 --dcp 2 >"$res/bench_qsa_paged.log" 2>&1
    tail -30 "$res/bench_qsa_paged.log"
    ;;
*)
    echo "part: a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y or z" >&2
    exit 2
    ;;
esac
tar czf "$out/$part.tar.gz" -C $work "results-$part"
for f in exact-bf16/exact.json exact-fp16/exact.json tp2/tp2.json bench/bench_gpu.json exact-v1/exact.json \
    exact-fp16-eager/exact.json mm/mm.json; do
    [ -f "$res/$f" ] && cp "$res/$f" "$out/$(echo "$f" | tr / -)"
done
ls -la "$out"
