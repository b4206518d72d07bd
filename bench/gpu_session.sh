#!/usr/bin/env bash
# One device call for the GPU figures of issues 13, 15, 16 and 19.
#
#   bench/gpu_session.sh OUT_DIR
#
# On one GPU the runs go one after the other (acceptance, FP8 cold starts, server
# benchmark, CUDA tests).  On two, device time being scarce, the one-GPU runs share the call:
#   GPU 0: bench_gpu_server.py (transformers serve alone vs under the agent, issue 19),
#          then the CUDA tests
#   GPU 1: gpu_acceptance.py (CLI end to end: scrape, promtool, alert replay, SIGTERM;
#          torch engine, then supervising transformers serve, issue 13), then
#          bench_gpu_cold_start.py --fp8 (issue 16)
# and then, alone on the host, bench_two_gpu.py (issue 15).  Every part writes its
# JSON into OUT_DIR as soon as it has it, so a call cut short keeps what finished.
# PARTS="diag tests:200 fp8:300" runs only those parts, in that order (NAME:SECONDS caps one);
# parts: acceptance (ACCEPTANCE_ARGS: more options), bench-tfserve (BENCH_STARTS, BENCH_SEED), acceptance-fp8, diag, diag-llamacpp (after llamacpp), diag-cudnn-deprioritized, diag-prefill (about 90 s), diag-fresh, diag-server-fresh, tests, fp8, server, llamacpp,
# tfserve-cudnn, tfserve-default (issue 30: transformers serve with/without TORCH_CUDNN_SDPA_DEPRIORITIZED=1),
# inproc-proxy (issue 41: warmup-agent run --engine torch --proxy-listen against transformers serve alone),
# inproc (issue 25: `warmup-agent run --model DIR` polled from outside against a plain from_pretrained start,
# Qwen2-1.5B and Qwen2-7B shapes, then what the imports cost there; about 7 min: PARTS=inproc:470 BUDGET=480).
# llamacpp needs .gpu-carry/llama-cpp-src.tar.gz (tools/build_llama_server.py --source-tarball) or a
# CUDA build carried back as .gpu-carry/llama-server-cuda.xz.* (the first llamacpp part writes it to OUT_DIR).
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
    local m; m=$(python3 -c "import sys; sys.path.insert(0, '.'); from bench.bench_gpu_server import make_model; print(make_model('/tmp/qwen2-1.5b-random-chat', 'cuda', qwen_chat=True))" | tail -n 1)
    # SIGINT first at the cap, so the bench writes its partial JSON
    timeout -s INT -k 20 "$1" python3 -m warmup_agent bench --starts ${BENCH_STARTS:-5} --seed ${BENCH_SEED:-4201} --no-progress \
        --out "$OUT_DIR/bench_tfserve" -- transformers serve "$m" --host 127.0.0.1 --port {port} --device cuda \
        > "$OUT_DIR/logs/bench_tfserve.out" 2>&1
    echo "bench tfserve rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT_DIR/logs/bench_tfserve.out"
    mv "$OUT_DIR/bench_tfserve/logs" "$OUT_DIR/logs/bench_tfserve_logs" 2>/dev/null
}
run_acceptance_fp8() {  # $1: seconds; the torch engine on the FP8 checkpoint (issue 16)
    timeout "$1" python3 bench/gpu_acceptance.py --fp8 --out "$OUT_DIR/gpu_acceptance_fp8_h200.json" \
        --promtool /tmp/pt/promtool > "$OUT_DIR/logs/acceptance_fp8.log" 2>&1
    echo "acceptance fp8 rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 6 "$OUT_DIR/logs/acceptance_fp8.log"
}
run_server_bench() {  # $1: seconds
    # SERVER_ARGS: more options, e.g. "--server-env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 --agent-env K=V"
    timeout "$1" python3 bench/bench_gpu_server.py --starts ${SERVER_STARTS:-3} --steady ${SERVER_STEADY:-20} --budget-seconds $(( $1 - 20 )) \
        --out "$OUT_DIR/gpu_server_h200.json" --logs "$OUT_DIR/logs" ${SERVER_ARGS:-} > "$OUT_DIR/logs/gpu_server.log" 2>&1
    echo "gpu_server rc=$? at $(( $(date +%s) - T0 )) s"
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
run_llamacpp_bench() {  # $1: seconds; llama.cpp's server alone vs under the agent (issue 30)
    local bin; bin=$(llama_server_bin) || return
    "$bin" --version 2>&1 | tail -n 2
    mkdir -p "$OUT_DIR/scrapes"
    local tree=.gpu-carry/llama-convert-tree.tar.gz; [ -f $tree ] || tree=.gpu-carry/llama-cpp-src.tar.gz
    timeout "$1" python3 bench/bench_gpu_server.py --server llamacpp --llama-server "$bin" --llama-tree $tree --starts ${SERVER_STARTS:-5} \
        --steady ${SERVER_STEADY:-8} --budget-seconds $(( $1 - 20 )) --out "$OUT_DIR/gpu_server_llamacpp_h200.json" \
        --logs "$OUT_DIR/logs" --scrapes "$OUT_DIR/scrapes" ${SERVER_ARGS:-} > "$OUT_DIR/logs/gpu_server_llamacpp.log" 2>&1
    echo "llamacpp bench rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^start|llamacpp_" "$OUT_DIR/logs/gpu_server_llamacpp.log"
}
run_diag_llamacpp() {  # $1: seconds; what a warm llama-server pays at a new prompt length, and why (issue 40)
    local bin; bin=$(llama_server_bin) || return
    local gguf=/tmp/qwen2-1.5b-random-chat-bf16-padtext.gguf   # written by the llamacpp part
    [ -f $gguf ] || { echo "diag-llamacpp: run the llamacpp part first ($gguf)"; return; }
    timeout "$1" python3 -m bench.diagnostics.diag_llamacpp_length --llama-server "$bin" --gguf $gguf \
        --out "$OUT_DIR/diag_llamacpp_length_h200.json" --logs "$OUT_DIR/logs" ${DIAG_VARIANTS:+--variants $DIAG_VARIANTS} \
        > "$OUT_DIR/logs/diag_llamacpp.log" 2>&1
    echo "diag llamacpp rc=$? at $(( $(date +%s) - T0 )) s"; cat "$OUT_DIR/logs/diag_llamacpp.log"
}
run_tfserve_bench() {  # $1: seconds, $2: name (tfserve_cudnn | tfserve_default); issue 30
    local extra=""
    [ "$2" = tfserve_cudnn ] && extra="--server-env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 --prefix tfserve"
    [ "$2" = tfserve_default ] && extra="--prefix tfserve_default"
    mkdir -p "$OUT_DIR/scrapes" "$OUT_DIR/logs/$2"
    timeout "$1" python3 bench/bench_gpu_server.py --server transformers --starts ${TFSERVE_STARTS:-5} --steady ${SERVER_STEADY:-8} \
        --budget-seconds $(( $1 - 20 )) --out "$OUT_DIR/gpu_server_$2_h200.json" --logs "$OUT_DIR/logs/$2" \
        --scrapes "$OUT_DIR/scrapes" $extra ${SERVER_ARGS:-} > "$OUT_DIR/logs/gpu_server_$2.log" 2>&1
    echo "$2 bench rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^start|tfserve" "$OUT_DIR/logs/gpu_server_$2.log"
}
run_inproc_proxy_bench() {  # $1: seconds; issue 41: the torch engine behind --proxy-listen vs transformers serve alone
    mkdir -p "$OUT_DIR/logs/inproc_proxy" "$OUT_DIR/scrapes"
    timeout "$1" python3 bench/bench_gpu_server.py --server transformers --conditions alone,inproc --starts ${INPROC_STARTS:-5} \
        --steady ${SERVER_STEADY:-8} --budget-seconds $(( $1 - 40 )) --out "$OUT_DIR/gpu_inproc_proxy_h200.json" \
        --logs "$OUT_DIR/logs/inproc_proxy" --scrapes "$OUT_DIR/scrapes" ${SERVER_ARGS:-} > "$OUT_DIR/logs/gpu_inproc_proxy.log" 2>&1
    echo "inproc proxy bench rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^start|inproc_|tfserve_" "$OUT_DIR/logs/gpu_inproc_proxy.log"
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
run_diag_server_fresh() {  # $1: seconds; a warm transformers serve at fresh lengths, with the switch then without (issue 30)
    local half=$(( $1 / 2 ))
    timeout "$half" python3 -m bench.diagnostics.diag_server_fresh --server-env TORCH_CUDNN_SDPA_DEPRIORITIZED=1 \
        --out "$OUT_DIR/diag_server_fresh_h200_switch.json" > "$OUT_DIR/logs/diag_server_fresh.log" 2>&1
    echo "diag server fresh (switch) rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^L |^idle|^\{" "$OUT_DIR/logs/diag_server_fresh.log"
    timeout "$half" python3 -m bench.diagnostics.diag_server_fresh \
        --out "$OUT_DIR/diag_server_fresh_h200_default.json" > "$OUT_DIR/logs/diag_server_fresh_default.log" 2>&1
    echo "diag server fresh (default) rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^L |^idle|^\{" "$OUT_DIR/logs/diag_server_fresh_default.log"
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
            diag-fresh) run_diag_fresh "$cap" ;; diag-server-fresh) run_diag_server_fresh "$cap" ;;
            # the diagnosis again with the cuDNN attention switch libtorch_cuda.so reads (issue 19's note)
            diag-cudnn-deprioritized) TORCH_CUDNN_SDPA_DEPRIORITIZED=1 run_diag "$cap" "_cudnn_deprioritized" ;;
            fp8) run_fp8_bench "$cap" ;; server) run_server_bench "$cap" ;;
            llamacpp) run_llamacpp_bench "$cap" ;; diag-llamacpp) run_diag_llamacpp "$cap" ;;
            inproc) run_inproc_bench "$cap" ;;
            inproc-proxy) run_inproc_proxy_bench "$cap" ;;
            tfserve-cudnn) run_tfserve_bench "$cap" tfserve_cudnn ;; tfserve-default) run_tfserve_bench "$cap" tfserve_default ;;
            *) echo "unknown part $name" ;;
        esac
    done
elif [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
    # One GPU: one after the other (timings are ratios measured alone on the GPU).
    run_acceptance
    run_fp8_bench 170
    t=$(left); run_server_bench $(( t > 260 ? 230 : t - 30 ))
    t=$(left); [ "$t" -gt 30 ] && run_gpu_tests "$t"
else
    # Phase 1, until PHASE1 s: one job per GPU.
    PHASE1=${PHASE1:-330}
    until_phase1() { echo $(( PHASE1 - ($(date +%s) - T0) )); }
    ( export CUDA_VISIBLE_DEVICES=0; run_server_bench 250; t=$(until_phase1); [ "$t" -gt 30 ] && run_gpu_tests "$t" ) &
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
