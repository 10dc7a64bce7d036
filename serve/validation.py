"""What a request must satisfy before the engine queues it: every rule that depends on the model
or the engine (vocabulary, context length, KV pool, rows, tokenizer), defined here once and checked
once, at submit (`Engine.submit_many`, which `submit`, `submit_n` and `generate` go through), before
anything is queued or referenced.

Who owns which rule:
* sampling fields on their own (types, finiteness, ranges: temperature >= 0, top_p in (0, 1], ...):
  `preft_jax.sampling.SamplingParams` (raises `SamplingError` naming the field);
* the OpenAI request body (JSON shapes and types, API-only limits such as temperature <= 2,
  prompts x n per request, stop-string counts): serve/protocol.py;
* everything below: here. Each raises a `RequestError` (HTTP 400; `PromptTooLongError` for the
  context) naming the field;
* the prompt of an activated (aLoRA) adapter must contain its invocation sequence
  (`activation_start`, checked at submit when the adapter is loaded, else when it has loaded; the
  rule itself is `preft_jax.adapters.policy.activation_start`'s).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from preft_jax.adapters import policy as position_policy
from preft_jax.sampling import SamplingParams, shown
from serve.errors import InvocationMissingError, PromptTooLongError, RequestError


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What an engine can represent (`Engine.limits`)."""
    vocab_size: int
    max_model_len: int                   # prompt + generated tokens
    max_num_seqs: int                    # decode rows: the most completions of one prompt (n)
    kv_tokens: int                       # tokens the KV pool holds
    fits_ever: Callable[[int], bool]     # whether a sequence of that many tokens can ever be held (scheduler)
    has_tokenizer: bool                  # stop strings need one
    max_request_sequences: int = 64      # one client request's prompts x n (`check_request_group`)
    max_request_prompt_logprob_tokens: int = 8192   # one client request's prompt tokens with log-probs


def prompt_ids(ids, vocab_size: int) -> list[int]:
    """Token ids as ints in [0, vocab_size) (a non-empty prompt)."""
    try:
        ids = list(map(int, ids))
    except (TypeError, ValueError, OverflowError):
        raise RequestError("prompt token ids must be integers", "prompt") from None
    if not ids:
        raise RequestError("prompt is empty", "prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    return ids


def check_request(limits: RequestLimits, ids, sampling: SamplingParams, stop=(), n: int = 1,
                  timeout: float | None = None, events: Sequence | None = None) -> tuple[list[int], tuple[str, ...]]:
    """Checks one submission (`n` completions of a prompt); returns (prompt ids, stop strings)."""
    if not isinstance(sampling, SamplingParams):
        raise RequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    vocab = limits.vocab_size
    ids = prompt_ids(ids, vocab)
    if sampling.top_k > vocab:
        raise RequestError(f"top_k must be in [0, {vocab}] (the vocabulary size), got {sampling.top_k}", "top_k")
    bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
    if bad_stop:
        raise RequestError(f"stop token ids must be < {vocab} (negative: none), got {bad_stop}", "stop_token_ids")
    limit = limits.max_model_len
    if len(ids) >= limit:
        raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context length is {limit} "
                                 f"tokens (prompt + at least 1 generated token)", "prompt")
    if len(ids) + sampling.max_new_tokens > limit:
        raise PromptTooLongError(f"prompt of {len(ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                 f"exceeds the context length {limit}; ask for at most "
                                 f"{limit - len(ids)} tokens", "max_tokens")
    if not limits.fits_ever(len(ids) + sampling.max_new_tokens):
        raise PromptTooLongError(f"prompt of {len(ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                 f"can never fit the KV cache ({limits.kv_tokens} tokens)", "max_tokens")
    if isinstance(stop, str):
        stop = (stop,)
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("stop strings must be strings", "stop")
    stop = tuple(s for s in stop if s)
    if stop and not limits.has_tokenizer:
        raise RequestError("stop strings need an engine with a tokenizer", "stop")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_num_seqs:
        raise RequestError(f"n must be an integer in [1, {limits.max_num_seqs}] (the engine's "
                           f"max_num_seqs), got {shown(n)}", "n")
    if events is not None and len(events) != n:
        raise RequestError(f"events: need one sink per completion ({n}), got {len(events)}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise RequestError(f"timeout must be a positive number of seconds, got {timeout}", "timeout")
    return ids, stop


def check_request_group(limits: RequestLimits, prompt_lengths: Sequence[int], n: int,
                        prompt_logprobs: bool) -> None:
    """Bounds the work one client request brings (its prompts x n sequences, and the prompt tokens
    it wants log-probabilities of): beyond the engine's limits it is a 400 naming the limit and the
    server flag, before anything is queued."""
    seqs = len(prompt_lengths) * n
    if seqs > limits.max_request_sequences:
        raise RequestError(f"this request starts {seqs} sequences ({len(prompt_lengths)} prompt(s) x n={n}); the "
                           f"server's limit is {limits.max_request_sequences} per request "
                           f"(--max-request-sequences)", "n")
    tokens = sum(prompt_lengths)
    if prompt_logprobs and tokens > limits.max_request_prompt_logprob_tokens:
        raise RequestError(f"echo with logprobs asks for the log-probabilities of {tokens} prompt tokens; the "
                           f"server's limit is {limits.max_request_prompt_logprob_tokens} per request "
                           f"(--max-request-prompt-logprob-tokens)", "logprobs")


def activation_start(policy: position_policy.PositionPolicy | None, prompt: Sequence[int], adapter: str) -> int:
    """Where adapter `adapter` (served with `policy`; None: the base model) starts acting on `prompt`
    when it is an activated (aLoRA) adapter: the start of the last occurrence of its invocation
    sequence; 0 for any other policy (the device ignores it). Raises InvocationMissingError (400)
    naming the adapter and the sequence when the prompt lacks it (HF PEFT would silently run such a
    prompt on the base model)."""
    if policy is None or policy.mode != "activated":
        return 0
    try:
        return position_policy.activation_start(policy, prompt, repr(adapter))
    except position_policy.MissingInvocationError as e:
        raise InvocationMissingError(str(e), "prompt") from None
