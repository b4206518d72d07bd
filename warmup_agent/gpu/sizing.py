"""Memory sizing in bytes for stage 1 (reserve) and the warmup batch sizes, from NVML and config.json."""
from __future__ import annotations

from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]


def kv_bytes_per_token_if_known(config: dict, dtype: str) -> int | None:
    """kv_bytes_per_token, or None where config.json or the dtype does not say."""
    heads = config.get("num_attention_heads")
    if not (heads and config.get("num_hidden_layers") and (config.get("head_dim") or config.get("hidden_size"))
            and dtype in DTYPE_BYTES):
        return None
    return kv_bytes_per_token(config, dtype)


@dataclass(frozen=True)
class ReservationPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    max_tokens: int            # longest prompt + generated tokens
    max_batch: int
    kv_bytes: int
    activation_bytes: int      # headroom for the largest shape's activations and logits
    reserve_bytes: int         # kv + activations; weights load later
    total_bytes: int           # weights + reserve: what must fit

    def as_dict(self) -> dict:
        return asdict(self)


def plan_reservation(config: dict, dtype: str, weight_bytes: int, prompt_lengths: list[int],
                     batch_sizes: list[int], max_new_tokens: int, activation_factor: float = 1.0) -> ReservationPlan:
    """Bytes to reserve for the configured grid, with a generous bound on one forward pass's activations."""
    per_token = kv_bytes_per_token(config, dtype)
    max_tokens = max(prompt_lengths) + max_new_tokens
    max_batch = max(batch_sizes)
    kv = per_token * max_tokens * max_batch
    width = 4 * config["hidden_size"] + config.get("intermediate_size", 4 * config["hidden_size"])
    act = int(activation_factor * max_batch * (max_tokens * width + config.get("vocab_size", 0)) * DTYPE_BYTES[dtype] * 2)
    reserve = kv + act
    return ReservationPlan(weight_bytes, per_token, max_tokens, max_batch, kv, act, reserve, weight_bytes + reserve)


def check_fits(plan: ReservationPlan, free_bytes: int, where: str) -> str | None:
    """None when the plan fits, else the reason with the numbers."""
    if plan.total_bytes <= free_bytes:
        return None
    gib = 2 ** 30
    return (f"{where}: needs {plan.total_bytes / gib:.2f} GiB (weights {plan.weight_bytes / gib:.2f} GiB + KV "
            f"{plan.kv_bytes / gib:.2f} GiB for {plan.max_batch} x {plan.max_tokens} tokens at "
            f"{plan.kv_bytes_per_token} B/token + activations {plan.activation_bytes / gib:.2f} GiB) "
            f"but only {free_bytes / gib:.2f} GiB is free")


def batch_sizes_from_memory(free_bytes: int, kv_bytes_per_token: int, max_seq_len: int,
                            fraction: float = 0.7, cap: int = 64) -> list[int]:
    """Powers of two up to the largest batch whose KV cache fits `fraction` of free memory, capped."""
    if kv_bytes_per_token <= 0 or max_seq_len <= 0:
        return [1]
    largest = int(fraction * free_bytes // (max_seq_len * kv_bytes_per_token))
    largest = max(1, min(largest, cap))
    out, b = [], 1
    while b <= largest:
        out.append(b)
        b *= 2
    return out
