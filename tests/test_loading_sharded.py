"""Streaming an HF folder straight into mesh shardings (preft_jax.loading.load_model_sharded): the same
parameters as the host loader, placed where the model declares them, each device's slice read once
and alone, and host memory bounded by the largest tensor, not the model.

Multi-device and RSS checks run in subprocesses (fake CPU devices are fixed when jax starts; a fresh
process has a clean peak-RSS mark)."""
from __future__ import annotations

import json
import pathlib
import textwrap

import numpy as np
import pytest
from fake_devices import run_on_fake_devices

from preft_jax.loading.hf_safetensors import HFCheckpoint, SafetensorsFile, load_hf_folder
from tiny_hf_model import write_tiny_hf_model

HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
      "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def write_safetensors(path, tensors: dict):
    """A safetensors file from {name: (dtype tag, shape, raw bytes)}, written tensor by tensor."""
    header, offset = {}, 0
    for name, (dt, shape, raw) in tensors.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for _, _, raw in tensors.values():
            f.write(raw)


def write_sharded_llama(folder, *, d, ffn, layers, heads, kv_heads, head_dim, vocab, seed=0, dtype="BF16"):
    """A random untied Llama HF folder, one safetensors shard per layer (+ one for the embeddings) and
    its model.safetensors.index.json; generated tensor by tensor (never the whole model in memory)."""
    folder = pathlib.Path(write_tiny_hf_model(folder))
    (folder / "model.safetensors").unlink()
    rng = np.random.default_rng(seed)
    item = 2 if dtype == "BF16" else 4

    def rand(*shape):
        x = (rng.standard_normal(shape, np.float32) * 0.02)
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes() if dtype == "BF16" else x.tobytes()

    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q), "w_gate": (ffn, d), "w_up": (ffn, d),
              "w_down": (d, ffn)}
    weight_map = {}
    for i in range(layers):
        t = {f"model.layers.{i}.input_layernorm.weight": (dtype, (d,), rand(d)),
             f"model.layers.{i}.post_attention_layernorm.weight": (dtype, (d,), rand(d))}
        for ours, hf in HF.items():
            t[f"model.layers.{i}.{hf}.weight"] = (dtype, shapes[ours], rand(*shapes[ours]))
        name = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        write_safetensors(folder / name, t)
        weight_map.update({k: name for k in t})
    t = {"model.embed_tokens.weight": (dtype, (vocab, d), rand(vocab, d)), "model.norm.weight": (dtype, (d,), rand(d)),
         "lm_head.weight": (dtype, (vocab, d), rand(vocab, d))}
    name = f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"
    write_safetensors(folder / name, t)
    weight_map.update({k: name for k in t})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf = json.loads((folder / "config.json").read_text())
    hf.update(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn, tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(hf))
    params = layers * (sum(a * b for a, b in shapes.values()) + 2 * d) + 2 * vocab * d + d
    largest = max(layers * ffn * d, vocab * d)
    return folder, params * item, largest * item


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory):
    """A small multi-shard BF16 folder whose head counts split over tensor=2."""
    folder, _, _ = write_sharded_llama(tmp_path_factory.mktemp("sharded"), d=64, ffn=96, layers=3, heads=4,
                                       kv_heads=2, head_dim=16, vocab=300, seed=1)
    return folder


def test_read_slices_equal_numpy_slices(sharded_folder):
    """HFCheckpoint.read of any region (transposed weights read as their [out, in] region) equals
    the slice of the whole parameter, in float32 and in bfloat16."""
    import ml_dtypes
    ckpt = HFCheckpoint(sharded_folder)
    _, whole, _ = load_hf_folder(sharded_folder)
    rng = np.random.default_rng(0)
    for name, shape in ckpt.shapes.items():
        for _ in range(3):
            index = tuple(slice(int(a), int(b)) for a, b in
                          (sorted(rng.integers(0, n + 1, 2)) for n in shape))
            index = tuple(sl if sl.stop > sl.start else slice(0, n) for sl, n in zip(index, shape))
            np.testing.assert_array_equal(ckpt.read(name, index), whole[name][index], err_msg=name)
    bf = ckpt.read("w_down", (slice(1, 3), slice(5, 50), slice(7, 9)), ml_dtypes.bfloat16)
    assert bf.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bf.astype(np.float32), whole["w_down"][1:3, 5:50, 7:9])   # BF16 bits kept


STREAM = textwrap.dedent(r"""
    import json, sys
    import jax, numpy as np
    from preft_jax import sharding as shd
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model_sharded
    from preft_jax.loading.hf_safetensors import SafetensorsFile, load_hf_folder
    from preft_jax.loading.placement import param_shardings
    from preft_jax.model import Llama
    reads = []
    original = SafetensorsFile.read
    def counting(self, name, index=None, dtype=np.float32):
        out = original(self, name, index, dtype)
        reads.append((name, out.size))
        return out
    SafetensorsFile.read = counting
    _, host, _ = load_hf_folder(FOLDER)
    reads.clear()
    out = {}
    mesh = shd.make_mesh(1, 2, 2)
    cfg, params, tok = load_model_sharded(FOLDER, mesh)
    want = param_shardings(cfg, mesh)
    out["equal"] = {k: bool(np.array_equal(np.asarray(v), host[k])) for k, v in params.items()}
    out["placed"] = {k: v.sharding == want[k] for k, v in params.items()}
    out["specs"] = {k: str(v.sharding.spec) for k, v in params.items()}
    read = {}
    for name, n in reads:
        read[name] = read.get(name, 0) + n
    out["read_elements"] = read
    out["shapes"] = {k: list(v.shape) for k, v in params.items()}
    model = Llama.from_params(cfg, params)
    out["kept_placement"] = model.layers.wq[...] is params["wq"] and model.embed[...] is params["embed"]
    runner = ModelRunner(model, mesh=mesh)
    out["runner_placed"] = all(a.sharding == b for a, b in zip(
        jax.tree.leaves(runner.state), jax.tree.leaves(shd.model_state_shardings(runner.state, mesh, cfg))))
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def streamed(sharded_folder):
    return run_on_fake_devices(f"FOLDER = {str(sharded_folder)!r}\n" + STREAM, n_devices=4)


def test_streamed_params_equal_host_loader_and_sit_in_their_shardings(streamed):
    assert all(streamed["equal"].values()), streamed["equal"]
    assert all(streamed["placed"].values()), streamed["placed"]
    assert streamed["specs"]["wq"] == "P(None, 'fsdp', 'tensor')"
    assert streamed["specs"]["lm_head"] == "P('fsdp', 'tensor')"
    assert streamed["kept_placement"] and streamed["runner_placed"]


def test_each_slice_is_read_once(streamed):
    """On fsdp=2 x tensor=2 every element is read exactly once: a split weight as four quarter slices,
    a replicated norm once for the four devices that hold it (never the whole tensor per device)."""
    hf = {"model.embed_tokens.weight": "embed", "lm_head.weight": "lm_head", "model.norm.weight": "final_norm"}
    per_param = {}
    for name, n in streamed["read_elements"].items():
        key = hf.get(name) or next(k for k, v in {**HF, "attn_norm": "input_layernorm",
                                                  "mlp_norm": "post_attention_layernorm"}.items() if v in name)
        per_param[key] = per_param.get(key, 0) + n
    for key, shape in streamed["shapes"].items():
        assert per_param[key] == int(np.prod(shape)), (key, per_param[key], shape)


def test_tiny_model_sharded_equals_host(tmp_path):
    """tests/tiny_hf_model.py's folder (one float32 file, tied embeddings) through both loaders."""
    folder = write_tiny_hf_model(tmp_path / "tiny")
    r = run_on_fake_devices(f"FOLDER = {str(folder)!r}\n" + STREAM, n_devices=4)
    assert all(r["equal"].values()) and all(r["placed"].values()), r
    assert "lm_head" not in r["shapes"]


RSS = textwrap.dedent(r"""
    import json, re
    import jax
    jax.devices()
    from preft_jax.loading import load_model_sharded
    def status(key):
        return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    cfg, params, _ = load_model_sharded(FOLDER, None, "bfloat16")
    jax.block_until_ready(params)
    peak = status("VmHWM")
    print("RESULT" + json.dumps({"peak_growth": peak - before,
                                 "device_bytes": sum(int(v.nbytes) for v in params.values()),
                                 "dtypes": sorted({str(v.dtype) for v in params.values()})}))
""")


@pytest.mark.slow
def test_streaming_load_peak_rss_is_bounded_by_the_largest_tensor(tmp_path):
    """A 1.3 GB BF16 Llama in 13 shards, loaded in bfloat16 onto one CPU device: beyond the loaded
    weights themselves (on a CPU the device memory is this process's), the peak RSS growth stays
    within a small multiple of the largest stacked tensor (one device shard in flight) - far below
    the model, which the host loader holds on top of the placed copy."""
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here (the peak-RSS mark cannot be reset)")
    folder, model_bytes, largest = write_sharded_llama(tmp_path / "big", d=2048, ffn=5632, layers=12, heads=16,
                                                       kv_heads=4, head_dim=128, vocab=32000)
    assert model_bytes > 1.2e9 and largest < model_bytes / 4
    r = run_on_fake_devices(f"FOLDER = {str(folder)!r}\n" + RSS, n_devices=1, timeout=1200)
    assert r["dtypes"] == ["bfloat16"] and r["device_bytes"] == model_bytes
    # measured (shared 2-core CPU): growth 1.83 GB = 1.34 GB of weights + 0.49 GB = one host shard of the
    # largest tensor (0.28 GB, its device copy is among the weights) + ~0.2 GB the allocator keeps; the
    # host loader + Llama.from_params peaks at 4.54 GB. Once, in a full run beside another pytest-xdist
    # worker, 0.76 GB (2.7x the largest tensor; not reproduced alone or beside the same tests): the bound
    # is 3x the largest tensor, still well under the model (4.9x the largest here)
    transient = r["peak_growth"] - r["device_bytes"]
    assert transient < 3 * largest, (transient / 1e6, largest / 1e6, model_bytes / 1e6)
    assert r["peak_growth"] < 1.5 * model_bytes, r


def test_missing_shard_tensor_is_named(sharded_folder, tmp_path):
    """Checks run before any weight is read: a tensor missing from its shard is named."""
    import shutil
    folder = tmp_path / "broken"
    shutil.copytree(sharded_folder, folder)
    import ml_dtypes
    st = SafetensorsFile(folder / "model-00002-of-00004.safetensors")       # layer 1's tensors
    keep = {k: ("BF16", st.shape(k), st.read(k, dtype=ml_dtypes.bfloat16).tobytes())
            for k in st.keys() if "k_proj" not in k}
    write_safetensors(folder / "model-00002-of-00004.safetensors", keep)
    from preft_jax.loading import MissingWeightError
    with pytest.raises(MissingWeightError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight"):
        HFCheckpoint(folder)
