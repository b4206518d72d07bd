"""Memory sizing for stage 1 (reserve) and the warmup batch sizes (stage 2).

Pure arithmetic on numbers NVML and config.json give us, so it is tested on
the CPU with recorded values.  Units: bytes.
"""
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
    """kv_bytes_per_token, or None when config.json lacks the shape or the dtype is
    not one of DTYPE_BYTES: the engines' facts say "unknown" rather than guess."""
    heads = config.get("num_attention_heads")
    if not (heads and config.get("num_hidden_layers") and (config.get("head_dim") or config.get("hidden_size"))
            and dtype in DTYPE_BYTES):
        return None
    return kv_bytes_per_token(config, dtype)


@dataclass(frozen=True)
class ReservationPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    max_tokens: int            # longest prompt + generated tokens the grid will run
    max_batch: int
    kv_bytes: int              # kv_bytes_per_token x max_tokens x max_batch
    activation_bytes: int      # headroom for activations and logits of the largest shape
    reserve_bytes: int         # what stage 1 reserves: kv + activations (weights load later)
    total_bytes: int           # weights + reserve: what must fit in free memory

    def as_dict(self) -> dict:
        return asdict(self)


def plan_reservation(config: dict, dtype: str, weight_bytes: int, prompt_lengths: list[int],
                     batch_sizes: list[int], max_new_tokens: int, activation_factor: float = 1.0) -> ReservationPlan:
    """Bytes to reserve for the configured grid.

    Activations of one forward pass over the largest shape are bounded by the
    hidden states of a few layers plus the logits of the last position; we take
    `activation_factor` x (batch x tokens x (4 x hidden + vocab)) x dtype bytes,
    a generous bound for a decoder layer run in inference mode."""
    per_token = kv_bytes_per_token(config, dtype)
    max_tokens = max(prompt_lengths) + max_new_tokens
    max_batch = max(batch_sizes)
    kv = per_token * max_tokens * max_batch
    width = 4 * config["hidden_size"] + config.get("intermediate_size", 4 * config["hidden_size"])
    act = int(activation_factor * max_batch * (max_tokens * width + config.get("vocab_size", 0)) * DTYPE_BYTES[dtype] * 2)
    reserve = kv + act
    return ReservationPlan(weight_bytes, per_token, max_tokens, max_batch, kv, act, reserve, weight_bytes + reserve)


def check_fits(plan: ReservationPlan, free_bytes: int, where: str) -> str | None:
    """None when the plan fits; else the one-line reason message with the numbers."""
    if plan.total_bytes <= free_bytes:
        return None
    gib = 2 ** 30
    return (f"{where}: needs {plan.total_bytes / gib:.2f} GiB (weights {plan.weight_bytes / gib:.2f} GiB + KV "
            f"{plan.kv_bytes / gib:.2f} GiB for {plan.max_batch} x {plan.max_tokens} tokens at "
            f"{plan.kv_bytes_per_token} B/token + activations {plan.activation_bytes / gib:.2f} GiB) "
            f"but only {free_bytes / gib:.2f} GiB is free")


def batch_sizes_from_memory(free_bytes: int, kv_bytes_per_token: int, max_seq_len: int,
                            fraction: float = 0.7, cap: int = 64) -> list[int]:
    """Seed 000 §4.2: the largest batch is fraction x free memory / (max_seq_len x
    KV bytes per token), with the real per-token KV size; warm the powers of two
    up to it (capped: a warmup grid beyond the engine's concurrency is wasted)."""
    if kv_bytes_per_token <= 0 or max_seq_len <= 0:
        return [1]
    largest = int(fraction * free_bytes // (max_seq_len * kv_bytes_per_token))
    largest = max(1, min(largest, cap))
    out, b = [], 1
    while b <= largest:
        out.append(b)
        b *= 2
    return out
