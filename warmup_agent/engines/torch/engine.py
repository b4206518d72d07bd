"""The `torch` engine: an in-process causal LM on CPU or CUDA, from a Hugging Face-layout directory.

The forward is native (plain torch, for the Llama/Qwen2 configs it runs exactly) or
transformers (everything else, and FP8).  Every integrity problem of the model
directory becomes an EngineError with a named reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from warmup_agent import quantization
from warmup_agent.engines.base import Engine, EngineError, EngineFacts, RequestResult, SolidifyReport
from warmup_agent.gpu import sizing
from warmup_agent.model.directory import check_model_dir, read_safetensors_header, safetensors_files

if TYPE_CHECKING:
    from warmup_agent.engines.torch.native_config import NativeConfig
    from warmup_agent.engines.torch.serving import TorchOpenAIBackend
    from warmup_agent.gpu.loader import LoadReport



def _quiet_transformers() -> None:
    """Silence transformers' progress bars and advisories, which would break our one-line output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def check_shapes_against_config(path: str) -> None:
    """Check every checkpoint tensor against the shape config.json implies, before any weight is read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except Exception as e:  # noqa: BLE001 - an unknown architecture or a broken config
        raise EngineError("config_invalid", f"{path}/config.json: cannot build the model it describes: {_one_line(e)}") from None
    found = {}
    for shard in safetensors_files(path):
        found.update({k: tuple(m["shape"]) for k, m in read_safetensors_header(shard).items()})
    for name, shape in sorted(found.items()):
        if name in expected and expected[name] != shape:
            raise EngineError("weights_shape_mismatch",
                              f"{path}: tensor {name} has shape {list(shape)} in the checkpoint but config.json implies {list(expected[name])}")
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(found) - tied)
    if missing:
        raise EngineError("weights_incomplete", f"{path}: {len(missing)} tensors missing from the checkpoint (first: {missing[0]})")


class TorchEngine(Engine):
    name = "torch"
    sets_up_device = True

    def __init__(self, model_path: str, dtype: str = "auto", device: str = "auto", implementation: str = "auto"):
        self._model_path = model_path
        self._requested_implementation = implementation   # auto | native | transformers
        self.implementation: str | None = None            # decided once by _choose_implementation
        self.implementation_reason = ""
        self._native_config: NativeConfig | None = None
        self._dtype_name = dtype
        self._device_name = device
        # torch objects are typed Any: mypy does not follow torch.
        self.tokenizer: Any | None = None
        self.model: Any | None = None
        self.device: Any | None = None
        self.dtype: Any | None = None
        self._config: dict = {}
        self._compiled: Any | None = None        # solidify mode compile
        # Set by reserve through configure(); the defaults suit a CPU run.
        self.options: dict[str, Any] = {"progressive": True, "chunk_bytes": 64 << 20, "buffers": 4, "workers": 4,
                                        "manifest": None, "cuda_context_timeout": 60.0,
                                        "kernel_compile_timeout": 600.0, "graph_max_len": 512,
                                        "batch_window_seconds": 0.003}
        self.load_report: LoadReport | None = None
        self.context_seconds: float | None = None
        self.reserved_bytes = 0
        self._decoders: dict = {}
        self.last_output: Any | None = None      # the last generate()'s tokens
        self.graph_fallback_reason: str | None = None
        self._skeleton: Future | None = None     # Future of (meta model, expected shapes, tied names)
        self._skeleton_thread: threading.Thread | None = None
        self.skeleton_wait_seconds: float | None = None
        self.skeleton_build_seconds: float | None = None
        self.quantization: quantization.QuantizationInfo = quantization.QuantizationInfo()
        self.fp8_layers = 0
        #: Held by the agent's driver around each call and by each user batch, so the model
        #: is never used from two threads at once.
        self.lock: threading.Lock = threading.Lock()
        self._warmed_shapes: list[tuple[int, int]] = []   # (prompt length, batch)
        self._openai: TorchOpenAIBackend | None = None

    @property
    def model_path(self) -> str:
        return self._model_path

    def torch_model(self) -> Any:
        return self.model

    def configure(self, **options: Any) -> None:
        self.options.update({k: v for k, v in options.items() if v is not None})

    def _ensure_device(self) -> Any:
        """The device, resolved with the dtype on first use."""
        if self.device is None:
            self.device = self._resolve_device()
            self.dtype = self._resolve_dtype(self.device)
        return self.device

    def init_device(self) -> Any:
        """Resolve the device and create its CUDA context under gpu.cuda_context_timeout_seconds."""
        import torch

        from warmup_agent.gpu.deadline import run_with_deadline
        device = self._ensure_device()
        if device.type == "cuda":
            t0 = time.perf_counter()

            def create() -> None:
                torch.cuda.set_device(device)
                torch.empty(1, device=device).fill_(0)
                torch.cuda.synchronize(device)
            run_with_deadline(create, self.options["cuda_context_timeout"], "cuda_context_timeout",
                              f"CUDA context creation on {device}")
            self.context_seconds = time.perf_counter() - t0
        return device

    def reserve_memory(self, nbytes: int) -> int:
        from warmup_agent.gpu import memory
        self.reserved_bytes = memory.reserve(self.init_device(), nbytes)
        return self.reserved_bytes

    def _resolve_device(self) -> Any:
        import torch
        if self._device_name == "auto":
            return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        dev = torch.device(self._device_name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("cuda_unavailable", f"model.device is {self._device_name} but no CUDA device is visible")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", 0)   # set_device and the stages need an index
        return dev

    def _resolve_dtype(self, device: Any) -> Any:
        import torch
        if self._dtype_name == "auto":
            # float32 on CPU, where bf16 matmuls are emulated and slow.
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self._dtype_name)

    def _read_config(self) -> None:
        self._config = check_model_dir(self.model_path)
        self.quantization = quantization.from_config(self._config, f"{self.model_path}/config.json")
        q = self.quantization
        if q.method not in ("none", "fp8"):
            # Loading these would cast the weights without their scales: wrong numbers, no error.
            raise EngineError("quantization_unsupported",
                              f"{self.model_path}/config.json: quantization_config quant_method {q.method!r} "
                              "(weights " + q.weight_dtype + "): the torch engine runs transformers' 'fp8' block layout only; "
                              "serve this model with engine openai (vLLM, SGLang)")

    def _choose_implementation(self, config: dict) -> str:
        """native or transformers, decided once; native asked for but impossible is an error."""
        if self.implementation is None:
            from warmup_agent.engines.torch import native_config
            requested = self._requested_implementation
            why = "model.implementation is transformers" if requested == "transformers" else ""
            if not why:
                try:
                    self._native_config = native_config.parse(config)
                except native_config.Ineligible as e:
                    why = str(e)
            if why and requested == "native":
                raise EngineError("native_unsupported",
                                  f"{self.model_path}/config.json: model.implementation is native but {why}")
            self.implementation, self.implementation_reason = ("transformers", why) if why else ("native", "")
        return self.implementation

    def load_tokenizer(self) -> None:
        self._read_config()
        native = self._choose_implementation(self._config) == "native"
        if native and os.path.exists(os.path.join(self.model_path, "tokenizer.json")):
            # A sentencepiece-only model still needs AutoTokenizer (and transformers).
            from warmup_agent.engines.torch.native_tokenizer import NativeTokenizer
            self.tokenizer = NativeTokenizer.from_model_dir(self.model_path)
        else:
            _quiet_transformers()
            from transformers import AutoTokenizer
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except Exception as e:  # noqa: BLE001 - any library error here means broken tokenizer files
                raise EngineError("tokenizer_invalid", f"{self.model_path}: cannot load the tokenizer: {_one_line(e)}") from None
        # The first encode/decode builds the BPE caches.
        sample = "The quick brown fox jumps over the lazy dog. " * 8
        ids = self.tokenizer.encode(sample, add_special_tokens=False)
        if not ids:
            raise EngineError("tokenizer_invalid", f"{self.model_path}: the tokenizer encodes text to no tokens")
        self.tokenizer.decode(ids)

    def load_weights(self) -> None:
        if not self._config:
            self._read_config()
        self._ensure_device()
        if self.options["manifest"]:
            from warmup_agent.gpu.loader import check_manifest
            check_manifest(self.model_path, self.options["manifest"])
        native = self._choose_implementation(self._config) == "native"
        if native or self.options["progressive"] or self.quantization.fp8_weights:
            # FP8 takes our loader: transformers' FP8Linear fetches its kernel from the Hub at first use.
            self._load_progressive()
        else:
            if self._skeleton is not None:
                # Let prestart's import finish rather than import the same modules from two threads.
                try:
                    self._skeleton.result()
                except Exception:  # noqa: BLE001, S110 - from_pretrained reports its own error
                    pass
                self._skeleton = None
            _quiet_transformers()
            self._load_from_pretrained()

    def prestart(self) -> None:
        """Import torch (and the modelling module) and build the skeleton in the background:
        the import is the largest part of a cold start and needs nothing from the agent."""
        try:
            with open(os.path.join(self.model_path, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                return
            self._choose_implementation(config)
        except (OSError, ValueError, EngineError):
            return      # load_weights reports a broken model directory with its reason
        self._start_skeleton()

    def _start_skeleton(self) -> None:
        """Build the meta-device skeleton in a background thread while the weights are read."""
        native = self.implementation == "native"
        if self._skeleton is not None or not (native or self.options["progressive"] or self.quantization.fp8_weights):
            return
        future: Future = Future()
        model_path, native_cfg = self.model_path, self._native_config

        def work() -> None:
            try:
                t0 = time.perf_counter()
                # Resolved without touching self.device: no CUDA context is made in this thread.
                dtype = self.dtype if self.dtype is not None else self._resolve_dtype(self._resolve_device())
                if native:
                    from warmup_agent.engines.torch import native_lm
                    assert native_cfg is not None
                    skeleton = native_lm.build_skeleton(native_cfg, dtype)
                else:
                    _quiet_transformers()
                    from warmup_agent.engines.torch import model_classes
                    skeleton = model_classes.build_skeleton(model_path, dtype)
                self.skeleton_build_seconds = time.perf_counter() - t0
                future.set_result(skeleton)
            except BaseException as e:  # noqa: BLE001 - re-raised in the loading thread
                future.set_exception(e)
        self._skeleton_thread = threading.Thread(target=work, name="native-skeleton" if native else "transformers-import",
                                                 daemon=True)
        self._skeleton_thread.start()
        self._skeleton = future

    def _load_progressive(self) -> None:
        """Read the weights through gpu/loader.py while the skeleton builds, check them
        against it, then bind the tensors as its parameters (no second copy)."""
        from warmup_agent.gpu import loader
        self._ensure_device()
        # Usually started by prestart(); here when the engine is driven without it.
        self._start_skeleton()
        slots = loader.checkpoint_slots(safetensors_files(self.model_path), read_safetensors_header)
        keep = quantization.keeps_stored_dtype
        tensors = loader.allocate(slots, self.dtype, self.device, keep=keep)
        report = loader.load(tensors, slots, self.device, self.options["chunk_bytes"],
                             self.options["buffers"], self.options["workers"])
        self._warm_blas()
        skeleton = self._skeleton
        assert skeleton is not None
        t0 = time.perf_counter()
        try:
            model, expected, tied = skeleton.result()
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - an unknown architecture or a broken config
            raise EngineError("config_invalid", f"{self.model_path}/config.json: cannot build the model it describes: {_one_line(e)}") from None
        finally:
            self._skeleton = None
        self.skeleton_wait_seconds = time.perf_counter() - t0
        if self.quantization.fp8_weights:
            self.fp8_layers = quantization.swap_linears(model, [s.name for s in slots], self.quantization, self.dtype)
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            names = {s.name for s in slots}
            unscaled = sorted(s.name for s in slots if s.dtype.startswith("float8")
                              and f"{s.name.rsplit('.', 1)[0]}.weight_scale_inv" not in names)
            if unscaled or not self.fp8_layers:
                raise EngineError("weights_incomplete",
                                  f"{self.model_path}: config.json says fp8 but " + (
                                      f"FP8 tensor {unscaled[0]} has no weight_scale_inv" if unscaled
                                      else "no linear layer has a weight_scale_inv in the checkpoint"))
        loader.check_against_skeleton(self.model_path, slots, expected, tied,
                                      self._config.get("torch_dtype") or self._config.get("dtype"), keep=keep)
        self.model = loader.bind(model, {k: v for k, v in tensors.items() if k in expected}, self.device)
        self.load_report = report

    def _warm_blas(self) -> None:
        """Create the cuBLAS handle and workspace while the import is still running."""
        if self.device is None or self.device.type != "cuda":
            return
        import torch
        hidden = self._config.get("hidden_size") or 64
        a = torch.ones((16, hidden), dtype=self.dtype, device=self.device)
        (a @ a.T).sum().item()

    def _load_from_pretrained(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        check_shapes_against_config(self.model_path)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.dtype, output_loading_info=True, low_cpu_mem_usage=True)
        except Exception as e:  # noqa: BLE001
            msg = _one_line(e)
            reason = "weights_shape_mismatch" if "size mismatch" in msg or "mismatched_sizes" in msg else "weights_invalid"
            raise EngineError(reason, f"{self.model_path}: cannot load weights: {msg}") from None
        missing = [k for k in info.get("missing_keys", []) if "rotary_emb" not in k]
        if missing:
            raise EngineError("weights_incomplete",
                              f"{self.model_path}: {len(missing)} tensors missing from the checkpoint (first: {sorted(missing)[0]})")
        if info.get("mismatched_keys"):
            raise EngineError("weights_shape_mismatch",
                              f"{self.model_path}: tensor shapes do not match config.json (first: {info['mismatched_keys'][0]})")
        device = self._ensure_device()
        self.model = model.to(device).eval()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def facts(self) -> EngineFacts:
        c = self._config
        params = sum(p.numel() for p in self.model.parameters()) if self.model is not None else None
        dtype_name = str(self.dtype).replace("torch.", "") if self.dtype is not None else "unknown"
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) if self.model is not None else None
        kv = sizing.kv_bytes_per_token_if_known(c, dtype_name)
        return EngineFacts(engine=self.name, model=self.model_path, device=str(self.device), dtype=dtype_name,
                           parameter_count=params, weight_bytes=weight_bytes, kv_bytes_per_token=kv,
                           max_context=c.get("max_position_embeddings"), vocab_size=c.get("vocab_size"),
                           extra={"implementation": self.implementation,
                                  "implementation_reason": self.implementation_reason})

    def tokenize(self, text: str) -> list[int]:
        assert self.tokenizer is not None, "load_tokenizer() first"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            import torch
            torch.cuda.synchronize(self.device)

    def generate(self, prompts: list[list[int]], max_new_tokens: int = 1,
                 warmup: bool = False) -> list[RequestResult]:
        """Greedy decode of a left-padded batch; shapes solidify captured use the static decoder."""
        import torch
        decoder = self._decoders.get(len(prompts))
        n = len(prompts[0])
        if (decoder and len({len(p) for p in prompts}) == 1 and n + max_new_tokens <= decoder.max_len
                and (max_new_tokens > 1 or decoder.prefill_for(n) is not None)):
            return self._generate_static(decoder, prompts, max_new_tokens)
        model = self._compiled or self.model
        assert model is not None and self.tokenizer is not None, "load_weights() and load_tokenizer() first"
        longest = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
        t0 = time.perf_counter()
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            self._sync()
            ttft = time.perf_counter() - t0
            past = out.past_key_values
            produced = 1
            tokens = [token]
            for _ in range(max_new_tokens - 1):
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                out = model(input_ids=token, attention_mask=mask, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
                tokens.append(token)
                produced += 1
            self._sync()
        total = time.perf_counter() - t0
        self.last_output = torch.cat(tokens, dim=1)   # [batch, produced]
        return [RequestResult(ttft, total, len(p), produced) for p in prompts]

    def _generate_static(self, decoder: Any, prompts: list[list[int]], max_new_tokens: int) -> list[RequestResult]:
        import torch
        n = len(prompts[0])
        t0 = time.perf_counter()
        ids = torch.tensor(prompts, dtype=torch.long).to(self.device)
        token = decoder.prefill(ids).argmax(dim=-1, keepdim=True)
        self._sync()
        ttft = time.perf_counter() - t0
        tokens = [token]
        for step in range(max_new_tokens - 1):
            token = decoder.decode(token, n + step).argmax(dim=-1, keepdim=True)
            tokens.append(token)
        self._sync()
        total = time.perf_counter() - t0
        self.last_output = torch.cat(tokens, dim=1)
        return [RequestResult(ttft, total, n, max_new_tokens) for _ in prompts]

    def openai_backend(self) -> TorchOpenAIBackend:
        """The responder that serves users from this process; made on first ask."""
        if self._openai is None:
            from warmup_agent.engines.torch.serving import TorchOpenAIBackend
            self._openai = TorchOpenAIBackend(self, self.lock, window=self.options["batch_window_seconds"])
        return self._openai

    def others_served_within(self, seconds: float) -> float | None:
        """Seconds since the last user batch (0 while one runs): a probe would time its wait for the lock."""
        return self._openai.served_within(seconds) if self._openai is not None else None

    def serving_model(self) -> Any:
        """The module requests run through (the compiled one, if any)."""
        return self._compiled or self.model

    def static_decoders(self) -> dict:
        """The static-cache decoders solidify built, by batch size."""
        return self._decoders

    def warmed_batch_sizes(self) -> list[int]:
        """The batch sizes solidify froze."""
        return sorted({batch for _, batch in self._warmed_shapes})

    def solidify(self, shapes: list[tuple[int, int]], mode: str = "auto") -> SolidifyReport:
        """Freeze the warmed shapes: replay each, capture CUDA graphs (falling back to
        replay with a reason), or torch.compile, under gpu.kernel_compile_timeout_seconds."""
        from warmup_agent.gpu.deadline import run_with_deadline
        self._warmed_shapes = list(shapes)
        if mode == "auto":
            mode = "cuda_graphs" if self.device is not None and self.device.type == "cuda" else "replay"
        t0 = time.perf_counter()
        detail = {}
        if self.fp8_layers:
            longest = max((length * batch for length, batch in shapes), default=16)
            detail.update(quantization.warm_gemms(self.model, longest))
        if mode == "none":
            return SolidifyReport(method="none", detail=detail)
        method = mode
        if mode == "cuda_graphs":
            from warmup_agent.gpu import graphs
            longest = max((length for length, _ in shapes), default=16)
            max_len = max(self.options["graph_max_len"], longest + 64)
            prefill_lengths: dict[int, list[int]] = {}
            for length, batch in shapes:
                prefill_lengths.setdefault(batch, []).append(length)
            self._decoders, reason = run_with_deadline(
                lambda: graphs.build(self.model, [b for _, b in shapes] or [1], max_len, self.device, capture=True,
                                     prefill_lengths=prefill_lengths),
                self.options["kernel_compile_timeout"], "kernel_compile_timeout", "CUDA graph capture")
            self.graph_fallback_reason = reason
            if reason:
                method, detail["fallback_reason"] = "replay", reason
            else:
                detail["graphs"] = sorted(self._decoders)
                detail["prefill_graphs"] = [[b, length] for b, d in sorted(self._decoders.items())
                                            for length in sorted(d.prefills)]
                detail["graph_max_len"] = max_len
        elif mode == "compile":
            import torch
            self._compiled = torch.compile(self.model, dynamic=False)
            method = "torch.compile"
        sample = self.tokenize("warm " * 8) or [0]

        def replay() -> None:
            for length, batch in shapes:
                prompt = (sample * (length // len(sample) + 1))[:length]
                self.generate([prompt] * batch, max_new_tokens=2 if self._decoders else 1, warmup=True)
        if mode == "compile":
            run_with_deadline(replay, self.options["kernel_compile_timeout"], "kernel_compile_timeout", "torch.compile")
        else:
            # With graphs too, so the first readiness probe is not the first request on that path.
            replay()
        # Users' mixed-length, sampled batches take other paths: warm them here too.
        from warmup_agent.engines.torch import batcher as torch_batcher
        t1 = time.perf_counter()
        torch_batcher.warm_user_paths(self, shapes)
        detail["user_paths_seconds"] = time.perf_counter() - t1
        return SolidifyReport(method=method, shapes=len(shapes), seconds=time.perf_counter() - t0, detail=detail)

    def weight_fingerprint(self) -> str:
        """SHA-256 over each tensor's name, shape, dtype, sum and sum of squares, on the device.

        Reduced in slices: a float64 copy of a whole tensor costs too much memory."""
        import torch
        h = hashlib.sha256()
        assert self.model is not None, "load_weights() first"
        items = list(self.model.state_dict().items())
        step = (1 << 24) if self.device is not None and self.device.type == "cuda" else (1 << 20)
        with torch.inference_mode():
            per_tensor = []
            for _, t in items:
                flat = t.detach().reshape(-1)
                parts = []
                for i in range(0, flat.numel(), step):
                    c = flat[i:i + step].to(torch.float64)
                    parts.append(torch.stack([c.sum(), torch.dot(c, c)]))
                per_tensor.append(torch.stack(parts).sum(0) if parts else torch.zeros(2, dtype=torch.float64, device=t.device))
            # One transfer rather than a sync per tensor.
            sums = torch.stack(per_tensor).tolist()
        for (name, t), (s1, s2) in zip(items, sums, strict=True):
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|{s1:.17g}|{s2:.17g}\n".encode())
        return h.hexdigest()

    def close(self) -> None:
        # Exiting while the skeleton thread is inside torch's import aborts the process.
        if self._skeleton_thread is not None:
            self._skeleton_thread.join(timeout=120)
        if self._openai is not None:
            self._openai.batcher.close()   # joined: no user batch is mid-forward after this
        self._decoders = {}
        self.model = None
        self._compiled = None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
