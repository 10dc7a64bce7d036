"""Decode cost model (a model, not a measurement): bytes moved and FLOPs per decode step for the base
model, all-token multi-LoRA and PreFT (= base), and the throughput ratio that predicts on one H200.

    python scripts/cost_model.py [--bandwidth-tbs 4.8] [--peak-tflops 989] [--bytes 2] [--markdown]

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
import sys


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


QWEN_05B = Shape("Qwen2.5-0.5B", 151936, 896, 24, 14, 2, 64, 4864, True)
LLAMA_8B = Shape("Llama-3.1-8B", 128256, 4096, 32, 32, 8, 128, 14336, False)
LLAMA_70B = Shape("Llama-3.1-70B", 128256, 8192, 80, 64, 8, 128, 28672, False)
SHAPES = (QWEN_05B, LLAMA_8B, LLAMA_70B)
TARGETS = {"q,k,v,o": ("q", "k", "v", "o"), "all 7": ("q", "k", "v", "o", "gate", "up", "down")}


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
    sys.exit(main())
