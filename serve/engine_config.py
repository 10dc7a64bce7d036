"""`EngineConfig`: the serving engine's settings, shared by its loop (serve/engine.py), its device
side (serve/step_runner.py) and request validation (serve/validation.py)."""
from __future__ import annotations

import dataclasses
import math

from preft_jax import native_decode

CPU_BINDING = ("off", "on")              # EngineConfig.cpu_binding


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16               # sequences running at once (decode rows)
    max_model_len: int = 1024            # tokens per sequence: prompt + generated
    mode: str = "prefill"                # "prefill" (PreFT: base decode) or "all" (all-token baseline)
    max_prefill_seqs: int = 4            # prefill rows per step
    max_num_batched_tokens: int = 256    # tokens per step: decode tokens + prefill chunk tokens
    block_size: int = 16
    kv_cache_tokens: int | None = None   # KV pool size in tokens (default: max_num_seqs * max_model_len)
    kv_cache_memory: int | None = None   # ... or in bytes (K and V, every layer)
    enable_prefix_cache: bool = True
    seed: int = 0
    max_queued: int = 1024               # waiting requests beyond this are refused (HTTP 429)
    max_request_sequences: int = 64      # sequences one client request may start (prompts x n; HTTP 400)
    max_request_prompt_logprob_tokens: int = 8192   # prompt tokens one request may ask log-probs of (echo)
    request_timeout: float | None = 600.0   # total deadline per request in seconds (queue + generation)
    wedge_timeout: float = 60.0          # a step running longer than this makes `health()` report wedged
    starvation_s: float = 2.0            # waiting longer than this jumps the adapter-grouping order
    min_chunk: int = 16                  # smallest prefill chunk bucket
    num_scheduler_steps: int = 4         # decode calls per step when nothing waits (pipelined; > 1: the last stays
                                         # in flight into the next quiet step, async scheduling; Engine._run_decode)
    decode_steps_per_call: int = 1       # decode steps fused in one jitted call inside a pipelined chain (a device
                                         # loop: 1/k of the dispatches and host passes; tokens reach requests k at a
                                         # time, and a row that stops mid-call computes the rest for nothing)
    warmup_logprobs: bool = False        # warmup() also compiles the log-probability variants (else: on first use)
    cpu_decode: str = "auto"             # CPU float32 base decode: "native" (one FFI call), "xla", "auto"
    cpu_binding: str = "off"             # "on": the thread that steps the engine (its own loop thread, or a caller's:
                                         # generate, step) on a core of its own, the runtime's threads on the
                                         # others (serve/cpu_binding.py; helps where host work is large next to
                                         # the step, costs compute one core: docs/serving.md "CPU binding")
    freeze_gc: bool = True               # after warm-up: gc.collect() + gc.freeze() (serve/warmup.py freeze_heap):
                                         # a full collection then skips the startup heap (~0.2 s -> ~0 on the tiny
                                         # model's process, every stream paused meanwhile); undone at shutdown()
    gc_gen0_threshold: int = 50_000       # with freeze_gc: the collector's young-generation threshold while the
                                         # engine serves (Python's 700 collected every ~5 decode calls of a 64-row
                                         # batch for per-token events freed by reference counting; 0: unchanged)

    def __post_init__(self):
        if self.mode not in ("prefill", "all"):
            raise ValueError(f"engine mode must be 'prefill' or 'all', got {self.mode!r}")
        if self.cpu_decode not in native_decode.CPU_DECODE:
            raise ValueError(f"cpu_decode must be one of {native_decode.CPU_DECODE}, got {self.cpu_decode!r}")
        if self.cpu_binding not in CPU_BINDING:
            raise ValueError(f"cpu_binding must be one of {CPU_BINDING}, got {self.cpu_binding!r}")
        for name in ("max_num_seqs", "max_prefill_seqs", "block_size", "min_chunk", "num_scheduler_steps",
                     "decode_steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gc_gen0_threshold < 0:
            raise ValueError(f"gc_gen0_threshold must be >= 0 (0: unchanged), got {self.gc_gen0_threshold}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs + 1:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes one token per step")
        if self.kv_cache_tokens is not None and self.kv_cache_memory is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size ({self.block_size})")
        if self.max_queued < 1:
            raise ValueError(f"max_queued must be >= 1 (every request waits in the queue first), got {self.max_queued}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout)
                                                     and self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds or None, "
                             f"got {self.request_timeout}")
        for name in ("wedge_timeout", "starvation_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v}")

    def num_blocks(self, bytes_per_token: int) -> int:
        """Blocks in the pool (block 0, reserved, included)."""
        if self.kv_cache_memory is not None:
            tokens = self.kv_cache_memory // bytes_per_token
        elif self.kv_cache_tokens is not None:
            tokens = self.kv_cache_tokens
        else:                                  # every sequence at full length fits
            return self.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        blocks = tokens // self.block_size
        if blocks < 1:
            raise ValueError(f"the KV cache holds {tokens} tokens, less than one block of {self.block_size}")
        return blocks + 1
