"""The benchmark workload, shared by the vLLM worker and by callers (numpy only, no vLLM, no JAX).

The rules match `experiments.serve_benchmark` (preft_jax's own serving benchmark), so both engines can serve
token-for-token the same requests:

    prompts  = default_rng(seed).integers(0, vocab_size, prompt_len) per request, in order
    adapters = default_rng(1000 + n_adapters).integers(0, n_adapters) per request (0 = no adapters)

numpy's PCG64 stream is stable across numpy versions, so both Python environments produce the same ids.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

SMOLLM2_VOCAB = 49152


@dataclasses.dataclass(frozen=True)
class Workload:
    """A fixed batch of requests: every request gets `max_tokens` greedy tokens (EOS ignored)."""
    n_requests: int = 32
    prompt_len: int = 16
    max_tokens: int = 32
    n_adapters: int = 0          # 0: base model; N > 0: each request one of adapters 0..N-1
    seed: int = 0
    vocab_size: int = SMOLLM2_VOCAB

    def __post_init__(self):
        for name in ("n_requests", "prompt_len", "max_tokens", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {v!r}")
        if not isinstance(self.n_adapters, int) or self.n_adapters < 0:
            raise ValueError(f"Workload.n_adapters must be an int >= 0, got {self.n_adapters!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Workload.seed must be an int >= 0, got {self.seed!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown workload field(s) {unknown}; supported: {sorted(known)}")
        return cls(**d)

    def prompts(self) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        return [rng.integers(0, self.vocab_size, self.prompt_len).tolist() for _ in range(self.n_requests)]

    def adapter_ids(self) -> list[int | None]:
        """Per request: the adapter index in 0..n_adapters-1, or None (base) when n_adapters == 0."""
        if self.n_adapters == 0:
            return [None] * self.n_requests
        rng = np.random.default_rng(1000 + self.n_adapters)
        return [int(rng.integers(0, self.n_adapters)) for _ in range(self.n_requests)]

    @property
    def expected_generated_tokens(self) -> int:
        return self.n_requests * self.max_tokens


def digest(token_lists) -> str:
    """Short stable hash of generated token ids (to compare outputs across runs and engines)."""
    return hashlib.sha256(json.dumps([list(map(int, t)) for t in token_lists]).encode()).hexdigest()[:16]
