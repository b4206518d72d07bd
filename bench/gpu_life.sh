#!/usr/bin/env bash
# One device call of issue 58's GPU figures: llama.cpp's server (CUDA) beside the agent.
#
#   PARTS=restart,hang bench/gpu_life.sh OUT_DIR        # then sleep, then idle
#   PARTS=none BENCH_STARTS=5 bench/gpu_life.sh OUT_DIR   # only `warmup-agent bench` (issue 60)
#
# The CUDA llama-server comes from .gpu-carry/llama-server-cuda.xz.* when carried, else
# it is built from .gpu-carry/llama-cpp-src.tar.gz (about 4.5 min) and written to
# OUT_DIR for the next call.  With the binary there .gpu-carry no longer fits the device's
# 64 MiB carry: name its files (llama-cpp-src.tar.gz and llama-server-cuda.xz.*), not promtool.xz.  The model is the bench's random Qwen2-1.5B shape
# (bench/gpu_model.py), converted to GGUF by tools/gguf_convert.py.
set -u
OUT_DIR=${1:?usage: $0 OUT_DIR}
mkdir -p "$OUT_DIR/logs"
export PYTHONUNBUFFERED=1 BENCH_COMMIT=${BENCH_COMMIT:-unknown}
T0=$(date +%s)
nvidia-smi -L
M=/tmp/qwen2-1.5b
( python3 -m bench.gpu_model "$M" \
    > "$OUT_DIR/logs/model.log" 2>&1 \
  && python3 tools/gguf_convert.py "$M" --render-pad-tokens --from-tarball .gpu-carry/llama-cpp-src.tar.gz \
       --data-dir /tmp/llama-data > "$OUT_DIR/logs/gguf.log" 2>&1 ) &
MODEL_PID=$!
if ls .gpu-carry/llama-server-cuda.xz.* > /dev/null 2>&1; then
    cat .gpu-carry/llama-server-cuda.xz.* | xz -d > /tmp/llama-server && chmod +x /tmp/llama-server
    BIN=/tmp/llama-server
else
    python3 tools/build_llama_server.py --cuda on --from-tarball .gpu-carry/llama-cpp-src.tar.gz --data-dir /tmp/wa-data \
        --nice 0 > "$OUT_DIR/logs/llama_build.log" 2>&1 || { tail -n 30 "$OUT_DIR/logs/llama_build.log"; exit 1; }
    BIN=$(tail -n 1 "$OUT_DIR/logs/llama_build.log")
    strip -o /tmp/llama-server.stripped "$BIN" && xz -T0 -6 -c /tmp/llama-server.stripped | split -b 15M - "$OUT_DIR/llama-server-cuda.xz."
    echo "built in $(( $(date +%s) - T0 )) s"
fi
wait $MODEL_PID || { tail -n 20 "$OUT_DIR"/logs/model.log "$OUT_DIR"/logs/gguf.log; exit 1; }
GGUF=$(tail -n 1 "$OUT_DIR/logs/gguf.log")
echo "model and GGUF ready at $(( $(date +%s) - T0 )) s: $GGUF"
"$BIN" --version 2>&1 | tail -n 2
if [ "${PARTS:-restart,hang}" != none ]; then
timeout ${LIFE_SECONDS:-420} python3 bench/bench_server_life.py --server llamacpp --llama-server "$BIN" --gguf "$GGUF" \
    --model "$M" --gpu-layers 99 --max-context 4096 --parts "${PARTS:-restart,hang}" --runs ${RUNS:-3} \
    --out "$OUT_DIR/server_life_llamacpp_gpu_${NAME:-$(echo ${PARTS:-restart,hang} | tr , _)}.json" \
    --logs "$OUT_DIR/logs/life" ${LIFE_ARGS:-} 2>&1 | tee "$OUT_DIR/logs/life.out" | grep -v "^ "
echo "life rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
fi
# BENCH_STARTS=N: then issue 60's `warmup-agent bench` on the same llama-server, N starts
# per condition (BENCH_SECONDS caps it; SIGINT first, so the partial JSON is written).
if [ -n "${BENCH_STARTS:-}" ]; then
    timeout -s INT -k 20 ${BENCH_SECONDS:-300} python3 -m warmup_agent bench --starts "$BENCH_STARTS" --seed ${BENCH_SEED:-4200} \
        --no-progress --out "$OUT_DIR/bench_llamacpp" --agent-model "$M" \
        -- "$BIN" -m "$GGUF" -ngl 99 -c 4096 --host 127.0.0.1 --port {port} > "$OUT_DIR/logs/bench.out" 2>&1
    echo "bench rc=$? at $(( $(date +%s) - T0 )) s"; tail -n 25 "$OUT_DIR/logs/bench.out"
    mv "$OUT_DIR/bench_llamacpp/logs" "$OUT_DIR/logs/bench_logs" 2>/dev/null
fi
tar czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$OUT_DIR/logs"
