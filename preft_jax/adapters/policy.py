"""The position policy: which tokens of a sequence an adapter acts on. This module is its one owner:
the kinds, their JSON and device encodings, the per-token mask, the adapted windows on the host (prefix
cache) and the serving override. Every other module asks it; nothing else decodes a `PolicyTable`.

Kinds (`PositionPolicy.mode`):

    "prefill"    PreFT: prompt tokens only (the last prompt token included); generated tokens run on
                 base weights. `first_k` / `last_k` restrict it to the first k and/or last k prompt
                 tokens (both None: every prompt token).
    "all"        every token, prompt and generated (the all-token LoRA baseline).
    "activated"  activated LoRA (aLoRA, HF PEFT `LoraConfig(alora_invocation_tokens=...)`): from the
                 start of the LAST occurrence of `invocation_tokens` in the prompt (the invocation
                 tokens included) through every generated token. Tokens before it are base tokens, so
                 their KV is the base model's and is shared with base requests and other adapters.
                 A prompt without the sequence is refused (`MissingInvocationError`); PEFT instead
                 runs such a prompt on the base model silently.

Device encoding: `PolicyTable`, one pytree of per-slot arrays that the `AdapterBank` carries
(kind, first_k, last_k, the invocation tokens). The activation start is per *sequence*, found on
the host (`activation_start(s)`) and passed to the steps as `adapter_starts` int32 [B]; a row whose
adapter is not activated ignores it. Row b's adapted positions are then

    [0, head) U [lo, hi)                                              (`row_windows`)
    prefill     head = min(first_k, plen) when first_k is set, else 0
                [lo, hi) = [0, plen) unrestricted, [max(plen - last_k, 0), plen) with last_k, else empty
    all         [0, inf)
    activated   [start_b, inf)

so a prefill chunk at any offset and a decode row use the same rule: generated positions (>= plen)
use the adapter only for "all" and "activated" rows (`decode_uses_adapters` says when decode needs the
bank at all); PreFT rows decode on base.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("prefill", "all", "activated")
PREFILL, ALL, ACTIVATED = 0, 1, 2            # PolicyTable.kind codes, in MODES order
NEVER = 1 << 62                              # an adapted window's end when it never ends
_FAR = np.iinfo(np.int32).max                # "no end" / "not activated" on the device


class MissingInvocationError(ValueError):
    """A prompt for an activated (aLoRA) adapter does not contain its invocation sequence."""


# ------------------------------------------------------------------------------------ the policy
@dataclasses.dataclass(frozen=True)
class PositionPolicy:
    """Which tokens an adapter acts on (see the module docstring for the kinds).

    mode="prefill": prompt tokens only; first_k / last_k restrict to the first k and/or last k of them.
    mode="all": every token, prompt and generated.
    mode="activated": from the last occurrence of `invocation_tokens` in the prompt on (aLoRA).
    """
    mode: str = "prefill"
    first_k: int | None = None
    last_k: int | None = None
    invocation_tokens: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"PositionPolicy.mode must be one of {MODES}, got {self.mode!r}")
        for name in ("first_k", "last_k"):
            k = getattr(self, name)
            if k is not None and k < 0:
                raise ValueError(f"{name} must be >= 0, got {k}")
        if self.mode != "prefill" and (self.first_k is not None or self.last_k is not None):
            raise ValueError("first_k/last_k apply to prompt positions; use mode='prefill' with them")
        inv = self.invocation_tokens
        if self.mode == "activated":
            if inv is None or isinstance(inv, (str, bytes)) or not len(inv):
                raise ValueError("mode='activated' needs invocation_tokens: a non-empty sequence of token ids")
            bad = [t for t in inv if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0]
            if bad:
                raise ValueError(f"invocation_tokens must be token ids (integers >= 0), got {list(inv)!r}"[:300])
            object.__setattr__(self, "invocation_tokens", tuple(int(t) for t in inv))
        elif inv is not None:
            raise ValueError(f"invocation_tokens belong to mode='activated', not mode={self.mode!r}")

    @classmethod
    def activated(cls, invocation_tokens: Sequence[int]) -> "PositionPolicy":
        return cls(mode="activated", invocation_tokens=tuple(invocation_tokens))

    @property
    def kind(self) -> int:
        return MODES.index(self.mode)

    @property
    def adapts_generated(self) -> bool:
        """Whether generated tokens use the adapter (decode needs the bank for this adapter)."""
        return self.mode != "prefill"

    def describe(self) -> str:
        """A short human-readable form (for /v1/models and error messages)."""
        if self.mode == "activated":
            return f"activated from invocation {list(self.invocation_tokens)}"
        if self.mode == "all":
            return "all tokens"
        parts = [f"first_k={self.first_k}"] * (self.first_k is not None) + [f"last_k={self.last_k}"] * (
            self.last_k is not None)
        return "prefill" + (f" ({', '.join(parts)})" if parts else "")


# ------------------------------------------------------------------------------------------ JSON
def to_json(policy: PositionPolicy) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": policy.mode, "first_k": policy.first_k, "last_k": policy.last_k}
    if policy.invocation_tokens is not None:
        out["invocation_tokens"] = list(policy.invocation_tokens)
    return out


def from_json(data: Any, where: str) -> PositionPolicy:
    """The inverse of `to_json`; ValueError naming `where` and the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: position policy must be a JSON object, got {data!r}")
    unknown = sorted(set(data) - {"mode", "first_k", "last_k", "invocation_tokens"})
    if unknown:
        raise ValueError(f"{where}: unknown position policy field(s) {unknown}")
    if "mode" not in data:
        raise ValueError(f"{where}: position policy is missing required key 'mode'")
    for k in ("first_k", "last_k"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{where}: position policy {k} must be an integer or null, got {v!r}")
    inv = data.get("invocation_tokens")
    if inv is not None and not isinstance(inv, list):
        raise ValueError(f"{where}: position policy invocation_tokens must be a list of token ids, got {inv!r}")
    try:
        return PositionPolicy(mode=data["mode"], first_k=data.get("first_k"), last_k=data.get("last_k"),
                              invocation_tokens=None if inv is None else tuple(inv))
    except ValueError as e:
        raise ValueError(f"{where}: invalid position policy: {e}") from e


# ------------------------------------------------------------------------ host: the activation start
def last_occurrence(tokens: Sequence[int], pattern: Sequence[int]) -> int | None:
    """Start of the last occurrence of `pattern` in `tokens` (None when absent), as PEFT's
    `calculate_alora_offsets` finds it (overlapping occurrences count)."""
    n = len(pattern)
    if n == 0 or len(tokens) < n:
        return None
    arr = np.asarray(tokens, np.int64)
    pat = np.asarray(pattern, np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(arr, n)
    hits = np.flatnonzero((windows == pat).all(axis=1))
    return int(hits[-1]) if hits.size else None


def _missing(tokens: Sequence[int], invocation: Sequence[int], adapter: str) -> MissingInvocationError:
    return MissingInvocationError(
        f"the prompt ({len(tokens)} tokens) does not contain the invocation sequence {list(invocation)} of the "
        f"activated (aLoRA) adapter{' ' + adapter if adapter else ''}; an activated adapter acts from the last "
        f"occurrence of its invocation sequence in the prompt, so the prompt must contain it")


def activation_start(policy: PositionPolicy, prompt: Sequence[int], adapter: str = "") -> int:
    """Where an activated adapter starts acting on `prompt`: the start of the last occurrence of its
    invocation sequence. Raises MissingInvocationError (naming `adapter`, e.g. "'name'") when the
    prompt lacks it."""
    if policy.mode != "activated":
        raise ValueError(f"activation_start needs an activated policy, got mode={policy.mode!r}")
    start = last_occurrence(prompt, policy.invocation_tokens)
    if start is None:
        raise _missing(prompt, policy.invocation_tokens, adapter)
    return start


def adapted_windows(policy: PositionPolicy | None, prompt: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The positions the adapter acts on in a sequence with prompt `prompt`, as sorted disjoint
    [start, end) windows (end NEVER: every later position, generated ones included); () for the base
    model (`policy` None) or a policy that adapts nothing here. The host's form of `row_windows`.

    With attention causal, a KV block's contents follow from the tokens up to its end and which of
    those positions were adapted: the prefix cache hashes exactly that (serve/kv_blocks.py), so a
    block is reused only where every position up to its end was computed alike."""
    if policy is None:
        return ()
    plen = len(prompt)
    if policy.mode == "all":
        return ((0, NEVER),)
    if policy.mode == "activated":
        return ((activation_start(policy, prompt), NEVER),)
    if policy.first_k is None and policy.last_k is None:
        return ((0, plen),) if plen > 0 else ()
    windows = []
    if policy.first_k:
        windows.append((0, min(policy.first_k, plen)))
    if policy.last_k:
        windows.append((max(0, plen - policy.last_k), plen))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(w for w in windows if w[0] < w[1]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return tuple(merged)


# ------------------------------------------------------------------------------ device encoding
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PolicyTable:
    """Per-slot policies on the device (slot 0 = the base model, prefill, adapts nothing by itself).

    kind int32 [N] (PREFILL | ALL | ACTIVATED); first_k, last_k int32 [N] (-1 = unrestricted);
    invocation int32 [N, K] (activated slots' invocation tokens, -1 padded; K = the longest the
    bank holds). The host reads `invocation` back to find activation starts; the steps never do."""
    kind: jax.Array
    first_k: jax.Array
    last_k: jax.Array
    invocation: jax.Array

    @property
    def n_slots(self) -> int:
        return int(self.kind.shape[0])

    @property
    def max_invocation_tokens(self) -> int:
        return int(self.invocation.shape[1])

    @classmethod
    def encode(cls, policies: Sequence[PositionPolicy], max_invocation_tokens: int | None = None) -> "PolicyTable":
        """The table of `policies` (one per slot, slot 0 first) as device arrays; K defaults to the
        longest invocation sequence among them."""
        longest = max((len(p.invocation_tokens or ()) for p in policies), default=0)
        k = longest if max_invocation_tokens is None else max_invocation_tokens
        rows = [slot_entry(p, k) for p in policies]
        return cls(*(jnp.asarray(np.stack([getattr(r, f) for r in rows])) for f in _FIELDS))

    def write(self, slot, entry: "PolicyTable") -> "PolicyTable":
        """This table with `slot` holding `entry` (a `slot_entry`); traceable (slot may be traced)."""
        return jax.tree.map(lambda a, v: a.at[slot].set(jnp.asarray(v, a.dtype)), self, entry)

    def slot_policy(self, slot: int) -> PositionPolicy:
        """The PositionPolicy encoded in `slot` (host side)."""
        kind = int(np.asarray(self.kind)[slot])
        if kind == ALL:
            return PositionPolicy("all")
        if kind == ACTIVATED:
            inv = np.asarray(self.invocation)[slot]
            return PositionPolicy.activated(inv[inv >= 0].tolist())
        fk, lk = int(np.asarray(self.first_k)[slot]), int(np.asarray(self.last_k)[slot])
        return PositionPolicy("prefill", None if fk < 0 else fk, None if lk < 0 else lk)

    def logical_axes(self) -> "PolicyTable":
        return PolicyTable(("adapters",), ("adapters",), ("adapters",), ("adapters", None))


_FIELDS = tuple(f.name for f in dataclasses.fields(PolicyTable))


def slot_entry(policy: PositionPolicy, table_or_k: "PolicyTable | int") -> PolicyTable:
    """One slot's encoding (numpy scalars / [K] row) for `PolicyTable.write`; K is the table's."""
    k = table_or_k.max_invocation_tokens if isinstance(table_or_k, PolicyTable) else int(table_or_k)
    inv = policy.invocation_tokens or ()
    if len(inv) > k:
        raise ValueError(f"invocation sequence of {len(inv)} tokens does not fit the adapter bank, which holds "
                         f"invocation sequences of up to {k} tokens (build it with max_invocation_tokens >= "
                         f"{len(inv)})")
    row = np.full(k, -1, np.int32)
    row[:len(inv)] = inv
    return PolicyTable(np.int32(policy.kind), np.int32(-1 if policy.first_k is None else policy.first_k),
                       np.int32(-1 if policy.last_k is None else policy.last_k), row)


def _table(bank_or_table) -> PolicyTable:
    return bank_or_table if isinstance(bank_or_table, PolicyTable) else bank_or_table.policy


def activation_starts(bank_or_table, adapter_ids, prompts: Sequence[Sequence[int]],
                      names: Sequence[str] | None = None) -> np.ndarray | None:
    """Host: int32 [B] activation start of each row whose slot (adapter_ids[b]) is activated (0 for
    the others), or None when no row is. Raises MissingInvocationError naming the row's adapter
    (`names[b]`, default "in bank slot s") when a prompt lacks its invocation sequence."""
    table = _table(bank_or_table)
    ids = np.asarray(adapter_ids, np.int64).reshape(-1)
    kinds = np.asarray(table.kind)[ids]
    if not np.any(kinds == ACTIVATED):
        return None
    inv = np.asarray(table.invocation)
    starts = np.zeros(len(ids), np.int32)
    for b in np.flatnonzero(kinds == ACTIVATED):
        seq = inv[ids[b]]
        seq = seq[seq >= 0].tolist()
        s = last_occurrence(prompts[b], seq)
        if s is None:
            who = repr(names[b]) if names is not None else f"in bank slot {int(ids[b])}"
            raise _missing(prompts[b], seq, f"{who} (prompt {int(b)})")
        starts[b] = s
    return starts


def decode_uses_adapters(bank_or_table, adapter_ids) -> bool:
    """Host: whether some row's adapter acts on generated tokens ("all" or "activated"), i.e. whether
    decode needs the bank; without one every row decodes on base weights (PreFT)."""
    kinds = np.asarray(_table(bank_or_table).kind)[np.asarray(adapter_ids, np.int64)]
    return bool(np.any(kinds != PREFILL))


# ------------------------------------------------------------------------- device: the token mask
def row_windows(bank_or_table, adapter_ids, prompt_lengths, adapter_starts=None):
    """(head, lo, hi) int32 [B]: row b's adapted positions are [0, head) U [lo, hi) (module docstring).

    adapter_starts int32 [B] (from `activation_starts`): activated rows' starts; None = no row is
    activated (an activated row then adapts nothing)."""
    table = _table(bank_or_table)
    ids = jnp.asarray(adapter_ids, jnp.int32)
    plen = jnp.asarray(prompt_lengths, jnp.int32)
    kind, fk, lk = table.kind[ids], table.first_k[ids], table.last_k[ids]
    start = (jnp.full(ids.shape, _FAR, jnp.int32) if adapter_starts is None
             else jnp.asarray(adapter_starts, jnp.int32))
    unrestricted = (fk < 0) & (lk < 0)
    zero = jnp.zeros_like(plen)
    far = jnp.full_like(plen, _FAR)
    head = jnp.where((kind == PREFILL) & (fk >= 0), jnp.minimum(fk, plen), zero)
    lo = jnp.where(kind == ACTIVATED, start,
                   jnp.where((kind == PREFILL) & ~unrestricted & (lk >= 0), jnp.maximum(plen - lk, 0), zero))
    hi = jnp.where(kind == PREFILL, jnp.where(unrestricted | (lk >= 0), plen, zero), far)
    return head, lo, hi


def token_adapter_index(bank_or_table, adapter_ids, positions, prompt_lengths, adapter_starts=None):
    """Slot per token (0 = base): int32 [B, T] for adapter_ids [B] (slot per sequence), absolute
    positions [B, T], prompt_lengths [B] and, for activated adapters, adapter_starts [B].

    Token (b, t) uses slot adapter_ids[b] when its position lies in the row's adapted windows
    (`row_windows`), else base. `bank_or_table`: an AdapterBank or its PolicyTable."""
    head, lo, hi = row_windows(bank_or_table, adapter_ids, prompt_lengths, adapter_starts)
    pos = jnp.asarray(positions, jnp.int32)
    covered = (pos < head[:, None]) | ((pos >= lo[:, None]) & (pos < hi[:, None]))
    ids = jnp.asarray(adapter_ids, jnp.int32)
    return jnp.where(covered, ids[:, None], 0).astype(jnp.int32)


# ---------------------------------------------------------------------------- serving override
def serving_policy(policy: PositionPolicy, mode: str) -> PositionPolicy:
    """The policy an adapter is served with by an engine in `mode`: "all" (the all-token baseline)
    makes prefill and all-token adapters all-token; "prefill" keeps a prefill policy (its first_k /
    last_k window included) and makes an all-token adapter prefill-only. An activated (aLoRA)
    adapter keeps its own policy in both modes: it was trained to act from its invocation on."""
    if policy.mode == "activated":
        return policy
    if mode == "all":
        return PositionPolicy(mode="all")
    return policy if policy.mode == "prefill" else PositionPolicy()


def with_serving_policy(weights, mode: str):
    """LoraWeights / ReftWeights with `serving_policy(weights.config.policy, mode)` (the same object
    when unchanged)."""
    policy = serving_policy(weights.config.policy, mode)
    if policy == weights.config.policy:
        return weights
    return dataclasses.replace(weights, config=dataclasses.replace(weights.config, policy=policy))


def serving_table(table: PolicyTable, mode: str) -> PolicyTable:
    """`serving_policy` applied to every adapter slot of a table (slot 0, the base, stays as it is)."""
    kind = np.asarray(table.kind).copy()
    fk, lk = np.asarray(table.first_k).copy(), np.asarray(table.last_k).copy()
    adapters = np.arange(len(kind)) > 0
    if mode == "all":
        change = adapters & (kind != ACTIVATED)
        kind[change], fk[change], lk[change] = ALL, -1, -1
    else:
        kind[adapters & (kind == ALL)] = PREFILL
    return dataclasses.replace(table, kind=jnp.asarray(kind), first_k=jnp.asarray(fk), last_k=jnp.asarray(lk))
