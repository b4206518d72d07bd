"""Every named reason a warmup can fail with: the `reason` label values of
`model_loading_failures_total`.

Each is exported as 0 from start-up, so `increase()` sees the first failure.  A test
fails when the code raises a reason missing here.
"""
from __future__ import annotations

REASONS: dict[str, str] = {
    # model directory and files (engines, checked before loading)
    "model_dir_missing": "the model directory does not exist",
    "model_dir_unreadable": "the model directory cannot be read",
    "config_missing": "config.json is missing",
    "config_invalid": "config.json is empty, not JSON, or not a causal LM config",
    "invalid_config": "the engine rejected its configuration",
    "tokenizer_invalid": "the tokenizer is missing or corrupt",
    "weights_missing": "no safetensors weights",
    "weights_corrupt": "a truncated shard, a lying header, or a SHA-256 manifest mismatch",
    "weights_incomplete": "tensors missing from the checkpoint",
    "weights_shape_mismatch": "tensor shapes do not match config.json",
    "weights_invalid": "the weights could not be loaded",
    # host and GPU (reserve, prewarm, solidify)
    "insufficient_memory": "the model does not fit in free host memory",
    "insufficient_gpu_memory": "the model does not fit in free GPU memory",
    "cuda_unavailable": "model.device asks for CUDA but no GPU is visible",
    "cuda_context_timeout": "CUDA context creation passed its deadline",
    "kernel_compile_timeout": "CUDA graph capture or torch.compile passed its deadline",
    "prewarm_memory_budget_exceeded": "not even batch size 1 fits prewarm.memory_budget_bytes",
    # state deadlines (states.StateMachine.check_deadline: "<state>_deadline_exceeded")
    "init_deadline_exceeded": "INIT took longer than deadlines.init_seconds",
    "preload_deadline_exceeded": "PRELOAD took longer than deadlines.preload_seconds",
    "prime_deadline_exceeded": "PRIME took longer than deadlines.prime_seconds",
    # readiness (ready stage; validation.Check.reason is "validation_<check>")
    "readiness_thresholds_not_met": "P50/P90 never met their thresholds within readiness.max_probes",
    "validation_structure": "the model's structure check failed",
    "validation_numerics": "the logits check failed",
    "validation_performance": "slower than the recorded baseline allows",
    "weight_fingerprint_mismatch": "the weights changed between PRELOAD and SERVING",
    # engines and supervised servers
    "engine_unavailable": "the engine's package is missing or the engine is unknown",
    "engine_start_failed": "the in-process engine could not start",
    "server_command_missing": "--engine openai without openai.url or a server command",
    "server_command_not_found": "the server command is not on PATH",
    "server_command_failed": "the server command could not be started",
    "server_exited": "the server exited before it became healthy",
    "server_never_healthy": "the server did not become healthy in time",
    "server_unreachable": "the server does not answer",
    "server_crashed": "a supervised server died after it was healthy (the agent re-warms it)",
    "port_in_use": "the server's port is already in use",
    "no_model_served": "the server lists no model",
    "model_not_served": "the server does not serve the configured model",
    "request_failed": "a warmup or probe request failed",
    "gave_way": "a warm-up request behind the users stopped for a user's request (sent again after them)",
    "lora_load_failed": "a LoRA adapter could not be registered",
    "stopped": "stopped before the server became healthy",
    "no_openai_api": "the server answers neither /v1/chat/completions nor /v1/completions",
    "no_model_name": "no model name in the config, on /v1/models or in the server command",
    "wrong_answer_after_wake": "after a wake the server answers the agent's fixed greedy prompts otherwise than the model it warmed",
    "wrong_answer_after_restart": "after a restart the same served model answers the agent's fixed greedy prompts otherwise",
    "decode_not_converged": "probes never met the time-per-output-token gate",
    "quantization_unsupported": "the checkpoint's quantization is one the engine cannot load",
    "native_unsupported": "model.implementation native, but the model is not a Llama/Qwen2 the native forward runs",
    "fp8_saturation": "an FP8 layer's scales saturate more of seed 003's test values than allowed",
    "fp8_roundtrip_error": "an FP8 layer's quantize/dequantize round trip errs more than allowed",
}
