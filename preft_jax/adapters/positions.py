"""Position policy -> per-token adapter slot index (0 = base) for a batch of sequences."""
from __future__ import annotations

import jax.numpy as jnp

from preft_jax.adapters.bank import AdapterBank


def token_adapter_index(bank: AdapterBank, adapter_ids, positions, prompt_lengths):
    """adapter_ids: int [B] (slot per sequence); positions: int [B, T]; prompt_lengths: int [B].

    A token at position p of sequence b uses slot adapter_ids[b] when the slot's policy covers it:
    prefill mode covers prompt positions p < prompt_length (optionally only the first k / last k of
    them); all-token mode covers every position. Otherwise the token runs on base (index 0).
    """
    ids = jnp.asarray(adapter_ids, jnp.int32)
    pos = jnp.asarray(positions, jnp.int32)
    plen = jnp.asarray(prompt_lengths, jnp.int32)[:, None]
    all_tokens = bank.all_tokens[ids][:, None]
    fk = bank.first_k[ids][:, None]
    lk = bank.last_k[ids][:, None]
    unrestricted = (fk < 0) & (lk < 0)
    in_window = unrestricted | ((fk >= 0) & (pos < fk)) | ((lk >= 0) & (pos >= plen - lk))
    covered = all_tokens | ((pos < plen) & in_window)
    return jnp.where(covered, ids[:, None], 0).astype(jnp.int32)
