#!/usr/bin/env bash
# One device call for the GPU figures (acceptance, the server benchmarks, FP8, CUDA tests).
#
#   bench/gpu_session.sh OUT_DIR
#
# On one GPU the runs go one after the other (acceptance, FP8 cold starts, `warmup-agent
# bench` on transformers serve, CUDA tests).  On two, device time being scarce, the
# one-GPU runs share the call:
#   GPU 0: `warmup-agent bench` on transformers serve, then the CUDA tests
#   GPU 1: gpu_acceptance.py (CLI end to end: scrape, promtool, alert replay, SIGTERM;
#          torch engine, then supervising transformers serve), then bench_gpu_cold_start.py --fp8
# and then, alone on the host, bench_two_gpu.py.  Every part writes its JSON into
# OUT_DIR as soon as it has it, so a call cut short keeps what finished.
# PARTS="diag tests:200 fp8:300" runs only those parts, in that order (NAME:SECONDS caps one).
# Parts:
#   acceptance (ACCEPTANCE_ARGS: more options), acceptance-fp8, tests, fp8
#   bench-tfserve, bench-llamacpp: `warmup-agent bench` on transformers serve or the CUDA
#     llama-server, the bench model of bench/gpu_model.py (BENCH_STARTS, BENCH_SEED, BENCH_CONDITIONS)
#   diag, diag-cudnn-deprioritized, diag-prefill (about 90 s), diag-fresh, diag-llamacpp (after bench-llamacpp)
#   inproc: `warmup-agent run --model DIR` polled from outside against a plain from_pretrained
#     start, Qwen2-1.5B and Qwen2-7B shapes, then what the imports cost; about 7 min: PARTS=inproc:470 BUDGET=480
# bench-llamacpp needs .gpu-carry/llama-cpp-src.tar.gz (tools/build_llama_server.py --source-tarball);
# the CUDA build it makes comes back as OUT_DIR/llama-server-cuda.xz.*: carry it in .gpu-carry next time.
# Needs: .whl/ (transformers serve's missing wheels, see ../shared/TESTING.md) and
# .gpu-carry/promtool.xz or .gz (a promtool binary, compressed) carried with the tree.
set -u
OUT_DIR=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT_DIR/logs"
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
# Never NVLink multicast on these shared hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || echo "wheels: not installed (transformers serve runs will fail)"
# The agent's own bytecode, as `pip install` writes it for a user: the device sets
# PYTHONDONTWRITEBYTECODE=1 and the tree comes without __pycache__, so every start of the
# agent compiled its modules again before the server's spawn (0.07-0.11 s of process age
# at the spawn on the H200, where the interpreter alone starts in 0.04-0.06 s).
python3 -m compileall -q -j 0 warmup_agent exporter > /dev/null || echo "compileall failed: the agent compiles at every start"
mkdir -p ~/.cache/huggingface/hub /tmp/pt
{ if [ -f .gpu-carry/promtool.xz ]; then xz -dc .gpu-carry/promtool.xz; else gunzip -c .gpu-carry/promtool.gz; fi; } > /tmp/pt/promtool \
    && chmod +x /tmp/pt/promtool && export PATH=/tmp/pt:$PATH
nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count())'

run_acceptance() {
    timeout 170 python3 bench/gpu_acceptance.py --out "$OUT_DIR/gpu_acceptance_h200.json" --promtool /tmp/pt/promtool ${ACCEPTANCE_ARGS:-} \
        --server-command "transformers serve {model} --host 127.0.0.1 --port {port} --device cuda" \
        > "$OUT_DIR/logs/acceptance.log" 2>&1
    echo "acceptance rc=$? at $(( $(date +%s) - T0 )) s"
}
run_bench_tfserve() {  # $1: seconds; issue 60's `warmup-agent bench` on transformers serve (BENCH_STARTS per condition)
    local m; m=$(python3 -m bench.gpu_model /tmp/qwen2-1.5b-random-chat --qwen-chat | tail -n 1)
    # SIGINT first at the cap, so the bench writes its partial JSON
    timeout -s INT -k 20 "$1" python3 -m warmup_agent bench --starts ${BENCH_STARTS:-5} --seed ${BENCH_SEED:-4201} --no-progress \
        ${BENCH_CONDITIONS:+--conditions $BENCH_CONDITIONS} --out "$OUT_DIR/bench_tfserve" -- transformers serve "$m" --host 127.0.0.1 --port {port} --device cuda \
        > "$OUT_DIR/logs/bench_tfserve.out" 2>&1
    echo "bench tfserve rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT_DIR/logs/bench_tfserve.out"
    mv "$OUT_DIR/bench_tfserve/logs" "$OUT_DIR/logs/bench_tfserve_logs" 2>/dev/null
}
run_acceptance_fp8() {  # $1: seconds; the torch engine on the FP8 checkpoint (issue 16)
    timeout "$1" python3 bench/gpu_acceptance.py --fp8 --out "$OUT_DIR/gpu_acceptance_fp8_h200.json" \
        --promtool /tmp/pt/promtool > "$OUT_DIR/logs/acceptance_fp8.log" 2>&1
    echo "acceptance fp8 rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 6 "$OUT_DIR/logs/acceptance_fp8.log"
}
run_fp8_bench() {  # $1: seconds
    timeout "$1" python3 bench/bench_gpu_cold_start.py --fp8 --runs ${FP8_RUNS:-2} \
        --out "$OUT_DIR/gpu_cold_start_fp8_h200.json" > "$OUT_DIR/logs/fp8.log" 2>&1
    echo "fp8 bench rc=$? at $(( $(date +%s) - T0 )) s"
}
run_diag() {  # $1: seconds, $2: a name suffix for the output
    timeout "$1" python3 -m bench.diagnostics.diag_decode_shapes --out "$OUT_DIR/diag_decode_shapes_h200$2.json" > "$OUT_DIR/logs/diag$2.log" 2>&1
    echo "diag$2 rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "prompt|attn" "$OUT_DIR/logs/diag$2.log"
}
llama_server_bin() {  # prints the CUDA llama-server: carried (.gpu-carry/llama-server-cuda.xz*), else built here
    if ls .gpu-carry/llama-server-cuda.xz* >/dev/null 2>&1; then
        cat .gpu-carry/llama-server-cuda.xz* | xz -d > /tmp/llama-server && chmod +x /tmp/llama-server && echo /tmp/llama-server && return
    fi
    local t=$(date +%s)
    python3 tools/build_llama_server.py --cuda on --from-tarball .gpu-carry/llama-cpp-src.tar.gz --data-dir /tmp/wa-data \
        --nice 0 > "$OUT_DIR/logs/llama_build.log" 2>&1 || { echo "llama-server build failed" >&2; tail -n 20 "$OUT_DIR/logs/llama_build.log" >&2; return 1; }
    local bin; bin=$(tail -n 1 "$OUT_DIR/logs/llama_build.log")
    echo "llama-server built in $(( $(date +%s) - t )) s: $bin" >&2
    # carried back for the next calls (each file under 16 MiB)
    strip -o /tmp/llama-server.stripped "$bin" && xz -T0 -6 -c /tmp/llama-server.stripped | split -b 15M - "$OUT_DIR/llama-server-cuda.xz."
    ls -la "$OUT_DIR"/llama-server-cuda.xz.* >&2
    echo "$bin"
}
run_bench_llamacpp() {  # $1: seconds; issue 60's `warmup-agent bench` on the CUDA llama-server (BENCH_STARTS per condition)
    local bin; bin=$(llama_server_bin) || return
    "$bin" --version 2>&1 | tail -n 2
    local m=/tmp/qwen2-1.5b
    python3 -m bench.gpu_model $m > "$OUT_DIR/logs/model.log" 2>&1 \
        && python3 tools/gguf_convert.py $m --render-pad-tokens --from-tarball .gpu-carry/llama-cpp-src.tar.gz \
            --data-dir /tmp/llama-data > "$OUT_DIR/logs/gguf.log" 2>&1 || { tail -n 20 "$OUT_DIR"/logs/model.log "$OUT_DIR"/logs/gguf.log; return; }
    GGUF=$(tail -n 1 "$OUT_DIR/logs/gguf.log")
    timeout -s INT -k 20 "$(( $1 - 10 ))" python3 -m warmup_agent bench --starts ${BENCH_STARTS:-5} --seed ${BENCH_SEED:-4200} --no-progress \
        ${BENCH_CONDITIONS:+--conditions $BENCH_CONDITIONS} --out "$OUT_DIR/bench_llamacpp" --agent-model $m -- "$bin" -m "$GGUF" -ngl 99 -c 4096 --host 127.0.0.1 --port {port} \
        > "$OUT_DIR/logs/bench_llamacpp.out" 2>&1
    echo "bench llamacpp rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT_DIR/logs/bench_llamacpp.out"
    mv "$OUT_DIR/bench_llamacpp/logs" "$OUT_DIR/logs/bench_llamacpp_logs" 2>/dev/null
}
run_diag_llamacpp() {  # $1: seconds; what a warm llama-server pays at a new prompt length, and why (issue 40)
    local bin; bin=$(llama_server_bin) || return
    local gguf=${GGUF:-}   # written by the bench-llamacpp part
    [ -f "$gguf" ] || { echo "diag-llamacpp: run the bench-llamacpp part first"; return; }
    timeout "$1" python3 -m bench.diagnostics.diag_llamacpp_length --llama-server "$bin" --gguf $gguf \
        --out "$OUT_DIR/diag_llamacpp_length_h200.json" --logs "$OUT_DIR/logs" ${DIAG_VARIANTS:+--variants $DIAG_VARIANTS} \
        > "$OUT_DIR/logs/diag_llamacpp.log" 2>&1
    echo "diag llamacpp rc=$? at $(( $(date +%s) - T0 )) s"; cat "$OUT_DIR/logs/diag_llamacpp.log"
}
run_inproc_bench() {  # $1: seconds; issue 25 (bench/bench_inproc_start.py, bench/diagnostics/import_costs.py)
    # 1.5B: 3 pairs + 2 agent-only starts (about 160 s); 7B: 2 pairs (about 90 s); the models are
    # written without initialising a model (1.5B about 20 s, 7B about 40 s); new pairs stop 100 s before the cap.
    mkdir -p "$OUT_DIR/logs/inproc"
    timeout "$1" python3 bench/bench_inproc_start.py --budget-seconds $(( $1 - 100 )) \
        --out "$OUT_DIR/gpu_inproc_start_h200.json" --logs "$OUT_DIR/logs/inproc" > "$OUT_DIR/logs/inproc.log" 2>&1
    echo "inproc bench rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "pair|extra|model ready|ratio|tax" "$OUT_DIR/logs/inproc.log" | cut -c1-400
    local t; t=$(left)
    if [ "$t" -gt 45 ]; then   # the same imports measured on this host (one run each, plus -X importtime)
        timeout $(( t - 10 )) python3 -m bench.diagnostics.import_costs --model /tmp/qwen2-1.5b-random-fast --repeat 1 --importtime \
            --variants auto_model_build,direct_build,auto_tokenizer,tokenizers_lib \
            --out "$OUT_DIR/import_costs_h200.json" > "$OUT_DIR/logs/import_costs.log" 2>&1
        echo "import costs rc=$? at $(( $(date +%s) - T0 )) s"; head -n 40 "$OUT_DIR/logs/import_costs.log"
    fi
}
run_diag_prefill() {  # $1: seconds; what a fresh prompt length costs and in which op (issue 30), lazy vs eager kernel loading
    local half=$(( $1 / 2 ))
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1 timeout "$half" python3 -m bench.diagnostics.diag_prefill_length \
        --out "$OUT_DIR/diag_prefill_length_h200.json" > "$OUT_DIR/logs/diag_prefill.log" 2>&1
    echo "diag prefill rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^length|^\{" "$OUT_DIR/logs/diag_prefill.log" | cut -c1-400
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1 CUDA_MODULE_LOADING=EAGER timeout "$half" python3 -m bench.diagnostics.diag_prefill_length \
        --out "$OUT_DIR/diag_prefill_length_h200_eager.json" > "$OUT_DIR/logs/diag_prefill_eager.log" 2>&1
    echo "diag prefill eager rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^length" "$OUT_DIR/logs/diag_prefill_eager.log" | cut -c1-400
}
run_diag_fresh() {  # $1: seconds; which part of an eager generate() pays for a fresh prompt length (issue 30)
    TORCH_CUDNN_SDPA_DEPRIORITIZED=1 timeout "$1" python3 -m bench.diagnostics.diag_fresh_length \
        --out "$OUT_DIR/diag_fresh_length_h200.json" > "$OUT_DIR/logs/diag_fresh.log" 2>&1
    echo "diag fresh rc=$? at $(( $(date +%s) - T0 )) s"; grep -vE "Loading|USDT" "$OUT_DIR/logs/diag_fresh.log" | cut -c1-400
}
run_gpu_tests() {  # $1: seconds
    timeout "$1" python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_cuda.py \
        tests/test_gpu_fragmentation_cuda.py tests/test_fp8_cuda.py > "$OUT_DIR/logs/gpu_tests.log" 2>&1
    echo "gpu tests rc=$? at $(( $(date +%s) - T0 )) s: $(tail -1 "$OUT_DIR/logs/gpu_tests.log")"
    grep -E "^(FAILED|ERROR)|Error:|assert " "$OUT_DIR/logs/gpu_tests.log" | cut -c1-300 | head -30
}

if [ -n "${PARTS:-}" ]; then
    # Chosen parts, in order, e.g. PARTS="diag tests fp8:300 server:230"; NAME:SECONDS caps a part.
    for part in $PARTS; do
        name=${part%%:*}; cap=${part#*:}; [ "$cap" = "$part" ] && cap=$(left)
        t=$(left); [ "$cap" -gt "$t" ] && cap=$t; [ "$cap" -lt 30 ] && { echo "$name: no time left"; continue; }
        case $name in
            acceptance) run_acceptance ;; bench-tfserve) run_bench_tfserve "$cap" ;; acceptance-fp8) run_acceptance_fp8 "$cap" ;;
            diag) run_diag "$cap" "" ;; tests) run_gpu_tests "$cap" ;; diag-prefill) run_diag_prefill "$cap" ;;
            diag-fresh) run_diag_fresh "$cap" ;;
            # the diagnosis again with the cuDNN attention switch libtorch_cuda.so reads (issue 19's note)
            diag-cudnn-deprioritized) TORCH_CUDNN_SDPA_DEPRIORITIZED=1 run_diag "$cap" "_cudnn_deprioritized" ;;
            fp8) run_fp8_bench "$cap" ;;
            bench-llamacpp) run_bench_llamacpp "$cap" ;; diag-llamacpp) run_diag_llamacpp "$cap" ;;
            inproc) run_inproc_bench "$cap" ;;
            *) echo "unknown part $name" ;;
        esac
    done
elif [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
    # One GPU: one after the other (timings are ratios measured alone on the GPU).
    run_acceptance
    run_fp8_bench 170
    t=$(left); run_bench_tfserve $(( t > 260 ? 230 : t - 30 ))
    t=$(left); [ "$t" -gt 30 ] && run_gpu_tests "$t"
else
    # Phase 1, until PHASE1 s: one job per GPU.
    PHASE1=${PHASE1:-330}
    until_phase1() { echo $(( PHASE1 - ($(date +%s) - T0) )); }
    ( export CUDA_VISIBLE_DEVICES=0; run_bench_tfserve 250; t=$(until_phase1); [ "$t" -gt 30 ] && run_gpu_tests "$t" ) &
    ( export CUDA_VISIBLE_DEVICES=1; run_acceptance; t=$(until_phase1); [ "$t" -gt 30 ] && run_fp8_bench "$t" ) &
    wait
    # Phase 2: alone on the host, both GPUs.
    t=$(left); echo "two-GPU run with $t s left"
    if [ "$t" -gt 100 ]; then
        timeout "$t" python3 bench/bench_two_gpu.py --out-dir "$OUT_DIR" --pairs 3 \
            --budget-seconds $(( t - 20 )) --hard-limit-seconds $(( t - 8 )) > "$OUT_DIR/logs/two_gpu.log" 2>&1
        echo "two-GPU rc=$? at $(( $(date +%s) - T0 )) s"
    fi
fi
tail -n 5 "$OUT_DIR"/logs/*.log
# few files come back: everything but the JSONs and the carried-back binary goes in one tarball
tar czf "$OUT_DIR/logs.tgz" -C "$OUT_DIR" logs $( [ -d "$OUT_DIR/scrapes" ] && echo scrapes ) && rm -rf "$OUT_DIR/logs" "$OUT_DIR/scrapes"
