"""Analytic cost model (a model, not a measurement): bytes moved and FLOPs of a decode step, a prefill
chunk and a LoRA training step, for the roofline bounds of `benchmarks.roofline` and
`benchmarks.train_mfu`; and the decode table of base vs all-token multi-LoRA vs PreFT (= base) with
the throughput ratio it predicts on one H200.

    python -m benchmarks.cost_model [--bandwidth-tbs 4.8] [--peak-tflops 989] [--bytes 2]
    python scripts/cost_model.py ...          (the same)

Hardware figures (`HARDWARE`, looked up by `stated_hardware`): NVIDIA H200 SXM, 4.8 TB/s HBM3e and
989 TFLOP/s dense bf16 (1,979 with 2:4 sparsity), from NVIDIA's H200 product brief / datasheet (H200
NVL: 4.8 TB/s, 835 TFLOP/s); H100 SXM 3.35 TB/s and 989 TFLOP/s dense bf16, H100 PCIe 2.0 TB/s and
756, H100 NVL 3.9 TB/s and 835 (H100 datasheet); GH200 4.9 TB/s (144 GB HBM3e) and 989, its 96 GB
HBM3 part ("GH200 480GB") 4.0 TB/s. TPU v5e 819 GB/s, 197 TFLOP/s bf16 (Google Cloud TPU docs).

One decode step = one new token for each of B concurrent sequences, every sequence on a different
adapter (B distinct adapters in the batch, i.e. N >= B adapters served). Per step it reads:

  base       every weight once (the embedding table only as the tied / untied LM head: the B looked-up
             rows are negligible) + the KV cache of all B sequences (B x context x layers x 2 x kv_dim)
  all-token  base + each of the B adapters' LoRA A and B for every target projection and layer:
             B x layers x sum over targets of r x (d_in + d_out)
  PreFT      base (prefill-only adapters: decode runs on the base weights alone)

Step time = max(bytes / HBM bandwidth, FLOPs / peak) (roofline; FLOPs = 2 x weights x B + attention
4 x B x context x layers x q_dim, + LoRA 2 x B x layers x sum r (d_in + d_out)). Predicted
PreFT / all-token throughput = all-token step time / PreFT step time. It ignores kernel
inefficiency (a per-token gather of many small matrices rarely reaches streaming bandwidth),
prefill, and scheduling overheads: it is a lower bound on what all-token multi-LoRA costs if
decode is bandwidth bound, not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses

from preft_jax.config import MODEL_PRESETS, ModelConfig, model_preset


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool

    @property
    def q_dim(self):
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    def proj_dims(self) -> dict[str, tuple[int, int]]:
        d, f = self.d, self.ffn
        return {"q": (d, self.q_dim), "k": (d, self.kv_dim), "v": (d, self.kv_dim), "o": (self.q_dim, d),
                "gate": (d, f), "up": (d, f), "down": (f, d)}

    def params(self) -> int:
        """Weights (no biases): projections + norms per layer, embedding, final norm, untied head."""
        per_layer = sum(a * b for a, b in self.proj_dims().values()) + 2 * self.d
        return self.layers * per_layer + self.vocab * self.d * (1 if self.tied else 2) + self.d

    def decode_weight_params(self) -> int:
        """Weights read by one decode step: all but the embedding rows (the LM head is read in full)."""
        return self.params() - (0 if self.tied else self.vocab * self.d)


    @classmethod
    def from_config(cls, name: str, cfg: ModelConfig) -> "Shape":
        return cls(name, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                   cfg.ffn_dim, cfg.tie_embeddings)

    def matmul_params(self) -> int:
        """Weights that multiply every token of a full forward: the projections and the LM head."""
        return self.layers * sum(a * b for a, b in self.proj_dims().values()) + self.vocab * self.d


# The published shapes live in one place, preft_jax.config.MODEL_PRESETS.
QWEN_05B = Shape.from_config("Qwen2.5-0.5B", MODEL_PRESETS["qwen2.5-0.5b"])
LLAMA_8B = Shape.from_config("Llama-3.1-8B", MODEL_PRESETS["llama-3.1-8b"])
LLAMA_70B = Shape.from_config("Llama-3.1-70B", MODEL_PRESETS["llama-3.1-70b"])
SHAPES = (QWEN_05B, LLAMA_8B, LLAMA_70B)
TARGETS = {"q,k,v,o": ("q", "k", "v", "o"), "all 7": ("q", "k", "v", "o", "gate", "up", "down")}


# Random-weight model shapes for the benchmarks (`--model`), as preft_jax ModelConfigs. Qwen2.5's q/k/v
# biases are left out (0.5% of its FLOPs), no stop tokens, no rope scaling; tiny is
# preft_jax.config.tiny_config with a longer context.
MODEL_CONFIGS = {
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                        rope_theta=1e4, rms_eps=1e-5, tie_embeddings=True, max_seq_len=4096),
    **{name: model_preset(name, max_seq_len=4096, bos_token_id=None, eos_token_ids=(), rope_scaling=None,
                          qkv_bias=False) for name in ("smollm2-135m", "qwen2.5-0.5b", "llama-3.1-8b")},
}
MODEL_NAMES = {"tiny": "tiny", "smollm2-135m": "SmolLM2-135M", "qwen2.5-0.5b": "Qwen2.5-0.5B",
               "llama-3.1-8b": "Llama-3.1-8B"}

# Stated peak figures per device kind (a substring of jax's device_kind, the longest that matches:
# "NVIDIA H100 PCIe" is not an SXM part, "NVIDIA GH200 480GB" not an H200): (HBM bytes/s, dense bf16 FLOP/s).
HARDWARE = {"H200": (4.8e12, 989e12), "H200 NVL": (4.8e12, 835e12), "GH200": (4.9e12, 989e12),
            "GH200 480GB": (4.0e12, 989e12),
            "H100": (3.35e12, 989e12), "H100 PCIe": (2.0e12, 756e12), "H100 NVL": (3.9e12, 835e12),
            "TPU v5 lite": (819e9, 197e12)}


def stated_hardware(kind: str) -> tuple[str, tuple[float, float]] | None:
    """(the `HARDWARE` key, its figures) for a device kind: the longest key contained in it; None
    for a kind it does not know."""
    keys = [k for k in HARDWARE if k in kind]
    if not keys:
        return None
    key = max(keys, key=len)
    return key, HARDWARE[key]


def shape(model: str) -> Shape:
    return Shape.from_config(MODEL_NAMES.get(model, model), MODEL_CONFIGS[model])


def lora_params_per_adapter(s: Shape, targets, rank: int) -> int:
    dims = s.proj_dims()
    return s.layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)


def step(s: Shape, batch: int, context: int, targets=(), rank: int = 16, nbytes: int = 2,
         bw: float = 4.8e12, peak: float = 989e12) -> dict:
    """Bytes, FLOPs and roofline time of one decode step; targets=() is the base model (= PreFT)."""
    weights = s.decode_weight_params() * nbytes
    kv = batch * context * s.layers * 2 * s.kv_dim * nbytes
    lora_p = lora_params_per_adapter(s, targets, rank) if targets else 0
    lora = batch * lora_p * nbytes
    flops = 2 * s.params() * batch + 4 * batch * context * s.layers * s.q_dim + 2 * batch * lora_p
    total = weights + kv + lora
    return dict(weights=weights, kv=kv, lora=lora, bytes=total, flops=flops,
                t_mem=total / bw, t_flop=flops / peak, t=max(total / bw, flops / peak))


def decode_cost(s: Shape, batch: int, context: int, nbytes: int = 2, kv_nbytes: int | None = None) -> dict:
    """One decode step of `batch` rows, each attending to `context` cached tokens plus its new one.

    bytes: every weight the step reads once (projections, norms, the LM head; not the embedding
    table's unused rows) + the KV cache read (batch x (context + 1) tokens) + the new K/V written.
    flops: 2 x (projection + LM head weights) x batch + attention 4 x batch x (context + 1) x layers
    x q_dim (q.k and p.v). Activations, sampling and the int32 tables are not counted (< 1%)."""
    kv_nbytes = nbytes if kv_nbytes is None else kv_nbytes
    per_token_kv = s.layers * 2 * s.kv_dim * kv_nbytes
    weights = s.decode_weight_params() * nbytes
    kv_read = batch * (context + 1) * per_token_kv
    kv_write = batch * per_token_kv
    flops = 2 * s.matmul_params() * batch + 4 * batch * (context + 1) * s.layers * s.q_dim
    return dict(weights=weights, kv_read=kv_read, kv_write=kv_write, bytes=weights + kv_read + kv_write,
                flops=flops)


def attention_pairs(rows: int, chunk: int, context: int = 0) -> int:
    """(query, key) pairs of causal attention over `rows` chunks of `chunk` tokens after `context`."""
    return rows * (chunk * context + chunk * (chunk + 1) // 2)


def prefill_cost(s: Shape, rows: int, chunk: int, context: int = 0, nbytes: int = 2, targets=(), rank: int = 16,
                 adapters: int = 0) -> dict:
    """One prefill call: `rows` chunks of `chunk` tokens each after `context` cached tokens, the LM
    head at each row's last token only (as `paged_step` samples), LoRA on `targets` for every token
    with `adapters` distinct adapters in the batch (their weights read once each).

    flops are the useful ones (causal attention pairs, no masked work): 2 x projection weights x
    tokens + 4 x pairs x layers x q_dim + 2 x d x vocab x rows + LoRA 2 x tokens x its params."""
    T = rows * chunk
    proj = s.layers * sum(a * b for a, b in s.proj_dims().values())
    lora_p = lora_params_per_adapter(s, targets, rank) if targets else 0
    flops = (2 * proj * T + 4 * attention_pairs(rows, chunk, context) * s.layers * s.q_dim
             + 2 * s.d * s.vocab * rows + 2 * T * lora_p)
    per_token_kv = s.layers * 2 * s.kv_dim * nbytes
    weights = s.decode_weight_params() * nbytes
    bytes_ = weights + rows * (context + chunk) * per_token_kv + adapters * lora_p * nbytes
    return dict(weights=weights, bytes=bytes_, flops=flops, tokens=T)


def lora_train_flops(s: Shape, batch: int, seq: int, targets, rank: int, logit_positions: int | None = None) -> dict:
    """Model FLOPs of one LoRA training step (forward + backward) on a frozen base, `batch` sequences
    of `seq` tokens, the LM head over `logit_positions` positions per sequence (default seq).

    Convention: the frozen base gets no weight gradients, so its matmuls cost 2 N T forward + 2 N T
    backward (activation gradients only) = 4 N T, not the 6 N T of full training; the adapter's
    cost 6 P T (forward, activation and weight gradients); causal attention 4 x pairs x layers x
    q_dim forward and twice that backward. Rematerialization is not counted (model FLOPs, not
    hardware FLOPs). Returns forward / backward / total."""
    T = batch * seq
    proj = s.layers * sum(a * b for a, b in s.proj_dims().values())
    head = s.d * s.vocab * batch * (seq if logit_positions is None else logit_positions)
    lora_p = lora_params_per_adapter(s, targets, rank)
    attn = 4 * attention_pairs(batch, seq) * s.layers * s.q_dim
    fwd = 2 * proj * T + 2 * head + 2 * lora_p * T + attn
    bwd = 2 * proj * T + 2 * head + 4 * lora_p * T + 2 * attn
    return dict(forward=fwd, backward=bwd, total=fwd + bwd, lora_params=lora_p, tokens=T, head=2 * head)


def table(bw: float, peak: float, nbytes: int, rank: int = 16, batches=(64, 512), contexts=(256, 1024)) -> list[str]:
    out = [f"Model only: H200 HBM {bw / 1e12:.1f} TB/s, {peak / 1e12:.0f} TFLOP/s dense bf16, {8 * nbytes}-bit "
           f"weights/KV/adapters, LoRA rank {rank}, B concurrent sequences each on its own adapter, context = "
           "tokens in each sequence's KV cache.", "",
           "| model | weights GB | LoRA targets | MB / adapter | B | context | base = PreFT GB/step | all-token GB/step "
           "| base step us | all-token step us | bound | predicted PreFT / all-token |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for s in SHAPES:
        for tname, targets in TARGETS.items():
            per_adapter = lora_params_per_adapter(s, targets, rank) * nbytes
            for B in batches:
                for ctx in contexts:
                    base = step(s, B, ctx, (), rank, nbytes, bw, peak)
                    allt = step(s, B, ctx, targets, rank, nbytes, bw, peak)
                    bound = "memory" if allt["t_mem"] >= allt["t_flop"] else "compute"
                    out.append(f"| {s.name} | {s.params() * nbytes / 1e9:.1f} | {tname} | {per_adapter / 1e6:.1f} "
                               f"| {B} | {ctx} | {base['bytes'] / 1e9:.2f} | {allt['bytes'] / 1e9:.2f} "
                               f"| {base['t'] * 1e6:.0f} | {allt['t'] * 1e6:.0f} | {bound} "
                               f"| {allt['t'] / base['t']:.2f}x |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s (H200 SXM: 989)")
    ap.add_argument("--bytes", type=int, default=2, help="bytes per weight / KV / adapter value (bf16: 2)")
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args(argv)
    print("\n".join(table(args.bandwidth_tbs * 1e12, args.peak_tflops * 1e12, args.bytes, args.rank)))
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
