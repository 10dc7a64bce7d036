"""Activated LoRA (aLoRA) against HF PEFT: PEFT-made adapters load with their invocation sequence,
save back as PEFT aLoRA, generate like PEFT's `generate` in one batch mixed with PreFT and base
requests, and train with the loss PEFT's forward gives (train.sft --mode activated)."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.peft_io import AdapterFormatError, POLICY_NAME, load_peft_lora, save_peft_lora
from preft_jax.adapters.policy import MissingInvocationError, PositionPolicy
from preft_jax.adapters.trainable import init_adapter
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.hf_reference, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_NEW = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama-3 HF folder: (folder, special ids, our cfg, ModelRunner)."""
    from hf_tiny import tiny_llama3
    from preft_jax.loading import load_hf_folder
    folder = tmp_path_factory.mktemp("alora") / "base"
    folder.mkdir()
    _, ids = tiny_llama3(folder, max_positions=512)
    cfg, params, _ = load_hf_folder(folder)
    return folder, ids, cfg, ModelRunner(Llama.from_params(cfg, params))


def _hf(folder):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    model.generation_config.eos_token_id = None            # generate exactly N_NEW tokens
    return model


def _peft_adapter(tiny, out, seed, invocation=None):
    """A random non-zero PEFT LoRA (aLoRA when `invocation` is given), saved to `out`."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(_hf(tiny[0]), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=PROJ, init_lora_weights=False, alora_invocation_tokens=invocation,
        task_type="CAUSAL_LM"))
    pm.save_pretrained(out)
    return out


def _peft_generate(tiny, folder, prompt):
    pm = peft.PeftModel.from_pretrained(_hf(tiny[0]), folder).eval()
    with torch.no_grad():
        out = pm.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _hf_preft_generate(tiny, folder, prompt):
    """PreFT by hand in torch: the prompt prefilled with the LoRA, every generated token on the base
    weights attending to that adapted KV cache."""
    pm = peft.PeftModel.from_pretrained(_hf(tiny[0]), folder).eval()
    toks = []
    with torch.no_grad():
        out = pm(input_ids=torch.tensor([prompt]), use_cache=True)
        past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
        with pm.disable_adapter():
            for _ in range(N_NEW - 1):
                toks.append(nxt)
                out = pm(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
    return toks + [nxt]


def _hf_base_generate(tiny, prompt):
    with torch.no_grad():
        out = _hf(tiny[0]).generate(input_ids=torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_peft_alora_generate_parity_mixed_batch(tiny, tmp_path):
    """Three PEFT aLoRA adapters (invocation in the middle of the prompt, at its end, twice in it), a
    PreFT LoRA and the base model, one `generate` batch: each row's greedy tokens equal PEFT's."""
    folder, ids, cfg, runner = tiny
    rng = np.random.default_rng(0)
    r = lambda n: rng.integers(0, 300, n).tolist()
    h = ids["<|start_header_id|>"]
    invs = {"middle": [h, 65, 66], "end": [40, 41], "twice": [h, 7, 8, 9]}
    prompts = {"middle": r(10) + invs["middle"] + r(6), "end": r(14) + invs["end"],
               "twice": r(4) + invs["twice"] + r(5) + invs["twice"] + r(3), "preft": r(12), "base": r(9)}
    folders = {k: _peft_adapter(tiny, tmp_path / k, seed, inv) for seed, (k, inv) in enumerate(invs.items(), 1)}
    folders["preft"] = _peft_adapter(tiny, tmp_path / "preft", 7)
    weights = {k: load_peft_lora(f, cfg) for k, f in folders.items()}
    for k, inv in invs.items():
        assert weights[k].config.policy == PositionPolicy.activated(inv)
    assert weights["preft"].config.policy == PositionPolicy()

    want = {k: _peft_generate(tiny, folders[k], prompts[k]) for k in invs}
    want["preft"] = _hf_preft_generate(tiny, folders["preft"], prompts["preft"])
    want["base"] = _hf_base_generate(tiny, prompts["base"])
    for k in ("middle", "end", "twice", "preft"):
        assert want[k] != want["base"] and want[k] != _hf_base_generate(tiny, prompts[k])   # adapters matter

    order = ["middle", "preft", "end", "base", "twice"]
    slot = {"middle": 1, "end": 2, "twice": 3, "preft": 4, "base": 0}
    bank = build_bank(cfg, [weights[k] for k in ("middle", "end", "twice", "preft")])
    got = runner.generate([prompts[k] for k in order], SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(-1,)),
                          bank=bank, adapter_ids=[slot[k] for k in order])
    for k, g in zip(order, got):
        assert g.tokens == want[k], k

    # the activation start is the LAST occurrence: prompt logits match PEFT's forward with it, not with the first
    pm = peft.PeftModel.from_pretrained(_hf(folder), folders["twice"]).eval()
    p = prompts["twice"]
    with torch.no_grad():
        ref = pm(input_ids=torch.tensor([p])).logits[0].numpy()
    one = build_bank(cfg, [weights["twice"]])

    def ours(start):
        return np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([p]), jnp.asarray([len(p)]),
                                          one, jnp.asarray([1]), jnp.asarray([start])))[0]
    last, first = 4 + 4 + 5, 4
    assert np.abs(ours(last) - ref).max() < 1e-3 * np.abs(ref).max()
    assert np.abs(ours(first) - ref).max() > 1e-2 * np.abs(ref).max()


def test_prompt_without_invocation_is_refused(tiny, tmp_path):
    folder, ids, cfg, runner = tiny
    w = load_peft_lora(_peft_adapter(tiny, tmp_path / "a", 1, [40, 41]), cfg)
    bank = build_bank(cfg, [w])
    with pytest.raises(MissingInvocationError) as e:
        runner.generate([[40, 41, 5], [41, 40, 6]], SamplingParams(max_new_tokens=2), bank=bank, adapter_ids=[1, 1])
    assert str(e.value) == (
        "the prompt (3 tokens) does not contain the invocation sequence [40, 41] of the activated (aLoRA) adapter "
        "in bank slot 1 (prompt 1); an activated adapter acts from the last occurrence of its invocation sequence "
        "in the prompt, so the prompt must contain it")


def test_alora_folder_round_trip_and_errors(tiny, tmp_path):
    """Load -> save -> PEFT loads it as aLoRA with identical outputs; malformed aLoRA configs refused."""
    folder, ids, cfg, runner = tiny
    src = _peft_adapter(tiny, tmp_path / "src", 3, [ids["<|eot_id|>"], 12])
    w = load_peft_lora(src, cfg)
    save_peft_lora(tmp_path / "out", w, cfg)
    saved = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert saved["alora_invocation_tokens"] == [ids["<|eot_id|>"], 12]
    assert load_peft_lora(tmp_path / "out", cfg).config == w.config
    prompt = np.random.default_rng(1).integers(0, 300, 9).tolist() + [ids["<|eot_id|>"], 12, 3, 4]
    a = peft.PeftModel.from_pretrained(_hf(folder), src).eval()
    b = peft.PeftModel.from_pretrained(_hf(folder), tmp_path / "out").eval()
    assert b.peft_config["default"].alora_invocation_tokens == [ids["<|eot_id|>"], 12]
    with torch.no_grad():
        la, lb = (m(input_ids=torch.tensor([prompt])).logits[0].numpy() for m in (a, b))
    np.testing.assert_allclose(lb, la, rtol=1e-5, atol=1e-5)
    # an explicit policy overrides; a sidecar that contradicts the PEFT config is refused
    assert load_peft_lora(src, cfg, policy=PositionPolicy(mode="all")).config.policy.mode == "all"
    (src / POLICY_NAME).write_text(json.dumps({"format_version": 1, "policy": {"mode": "prefill"}}))
    with pytest.raises(AdapterFormatError) as e:
        load_peft_lora(src, cfg)
    assert str(e.value) == (f"{src / POLICY_NAME} holds position policy 'prefill', but {src / 'adapter_config.json'} "
                            f"makes it an aLoRA adapter (activated from invocation [{ids['<|eot_id|>']}, 12])")
    (src / POLICY_NAME).unlink()
    for value, msg in (([], "alora_invocation_tokens must be a non-empty list of token ids, got []"),
                       ([1, "x"], "alora_invocation_tokens must be a non-empty list of token ids, got [1, 'x']"),
                       ([5, cfg.vocab_size], f"alora_invocation_tokens [{cfg.vocab_size}] are outside this model's "
                                             f"vocabulary (0..{cfg.vocab_size - 1})")):
        conf = json.loads((src / "adapter_config.json").read_text())
        conf["alora_invocation_tokens"] = value
        (src / "adapter_config.json").write_text(json.dumps(conf))
        with pytest.raises(AdapterFormatError) as e:
            load_peft_lora(src, cfg)
        assert str(e.value) == f"{src / 'adapter_config.json'}: {msg}"


def test_sft_activated_loss_equals_peft_forward(tiny, tmp_path):
    """The SFT loss of an activated adapter == HF PEFT's forward loss (labels on the response) on the
    same batch, with the adapter exported as a PEFT aLoRA folder."""
    from train.checkpoint import export_adapter
    from train.config import AdapterSpec
    from train.data import append_invocation, pad_batch
    from train.sft import batch_arrays, sft_loss
    folder, ids, cfg, runner = tiny
    inv = (ids["<|start_header_id|>"], 50, 51)
    acfg = AdapterSpec(rank=4, mode="activated", invocation=inv, targets=("q", "k", "v", "o", "gate", "up", "down"),
                       layers=(0, 2)).build(cfg)
    params = init_adapter(cfg, acfg, jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
    rng = np.random.default_rng(2)
    r = lambda n: rng.integers(0, 300, n).tolist()
    prompts = [append_invocation(r(7), inv), r(3) + list(inv) + r(4) + list(inv), r(2) + list(inv) + r(5)]
    assert prompts[2] == append_invocation(prompts[2], inv)        # present already: left as it is
    responses = [r(5), r(3), r(6)]
    b = pad_batch(prompts, responses, 0, 32)
    arrays = batch_arrays(b, acfg.policy)
    assert arrays["adapter_starts"].tolist() == [7, 10, 2]
    loss = float(jax.jit(sft_loss, static_argnums=(0, 1, 2))(cfg, acfg, runner.graphdef, runner.state, params,
                                                            {k: jnp.asarray(v) for k, v in arrays.items()}))
    export_adapter(tmp_path / "adapter", cfg, acfg, params)
    pm = peft.PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter").eval()
    assert pm.peft_config["default"].alora_invocation_tokens == list(inv)
    labels = np.where(b.loss_mask > 0, b.tokens, -100)
    attn = (np.arange(32)[None] < b.lengths[:, None]).astype(np.int64)
    with torch.no_grad():
        kw = dict(input_ids=torch.tensor(b.tokens, dtype=torch.long), attention_mask=torch.tensor(attn),
                  labels=torch.tensor(labels, dtype=torch.long))
        want = float(pm(**kw).loss)
        with pm.disable_adapter():
            base = float(pm(**kw).loss)
    assert abs(want - base) > 1e-3                                  # the adapter matters
    np.testing.assert_allclose(loss, want, rtol=2e-5)


@pytest.mark.slow
def test_train_sft_activated_cli_exports_peft_alora(tiny, tmp_path):
    """`python -m train.sft --mode activated --invocation TEXT` trains; HF PEFT loads the exported folder
    as aLoRA and generates what `ModelRunner.generate` does with it."""
    from preft_jax.loading import load_hf_folder
    from train.data import encode_prompt, load_split, write_dataset
    folder, ids, cfg, runner = tiny
    write_dataset(tmp_path / "data", 8, 2, seed=0, tasks=("arithmetic",), max_ops=1)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.sft", "--model", str(folder), "--data", str(tmp_path / "data"),
           "--mode", "activated", "--invocation", "<|start_header_id|>check", "--steps", "3", "--batch-size", "4",
           "--eval-batch-size", "2", "--rank", "4", "--lr", "5e-2", "--warmup-steps", "0", "--out", str(out),
           "--quiet"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(pathlib.Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert np.isfinite(summary["final_loss"])
    _, _, tok = load_hf_folder(folder)
    inv = tok.encode("<|start_header_id|>check")
    assert inv[0] == ids["<|start_header_id|>"] and len(inv) > 1
    adapter = pathlib.Path(summary["adapter"])
    assert json.loads((adapter / "adapter_config.json").read_text())["alora_invocation_tokens"] == inv
    w = load_peft_lora(adapter, cfg)
    assert w.config.policy == PositionPolicy.activated(inv)
    question = load_split(tmp_path / "data", "eval")[0]["question"]
    prompt = encode_prompt(tok, question) + inv
    want = _peft_generate(tiny, adapter, prompt)
    assert want != _hf_base_generate(tiny, prompt)                     # the trained adapter matters
    got = runner.generate([prompt], SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(-1,)),
                          bank=build_bank(cfg, [w]), adapter_ids=[1])
    assert got[0].tokens == want


@pytest.mark.slow
def test_peft_alora_served_by_the_engine_in_a_mixed_batch(tiny, tmp_path):
    """The serving engine (prefix cache on, PEFT folders loaded by the registry, prefill mode: the aLoRA
    adapters keep their own policy): three PEFT aLoRA adapters (invocation in the middle, at the end,
    twice), a PreFT LoRA and the base model submitted together and stepped in one batch; each
    request's greedy tokens equal PEFT's `generate` (PreFT: the torch PreFT reference). Then the
    same aLoRA requests again after a shared base conversation: prefix hits, same tokens."""
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    from serve.step_runner import CHUNK, DecodeCall
    folder, ids, cfg, runner = tiny
    rng = np.random.default_rng(3)
    r = lambda n: rng.integers(0, 300, n).tolist()                       # noqa: E731
    h = ids["<|start_header_id|>"]
    invs = {"middle": [h, 65, 66], "end": [40, 41], "twice": [h, 7, 8, 9]}
    conv = r(16)
    prompts = {"middle": conv + r(3) + invs["middle"] + r(6), "end": conv + r(6) + invs["end"],
               "twice": conv + invs["twice"] + r(5) + invs["twice"] + r(3), "preft": conv + r(5), "base": conv + r(4)}
    folders = {k: _peft_adapter(tiny, tmp_path / k, seed, inv) for seed, (k, inv) in enumerate(invs.items(), 11)}
    folders["preft"] = _peft_adapter(tiny, tmp_path / "preft", 17)
    want = {k: _peft_generate(tiny, folders[k], prompts[k]) for k in invs}
    want["preft"] = _hf_preft_generate(tiny, folders["preft"], prompts["preft"])
    want["base"] = _hf_base_generate(tiny, prompts["base"])
    for k in ("middle", "end", "twice", "preft"):
        assert want[k] != _hf_base_generate(tiny, prompts[k])                  # adapters matter

    reg = AdapterRegistry(cfg, capacity=4, lora_rank=4)
    for k, f in folders.items():
        reg.load(k, f)
    eng = Engine(runner, reg, EngineConfig(max_num_seqs=5, max_prefill_seqs=4, max_model_len=96,
                                           max_num_batched_tokens=128, block_size=4))
    assert {k: p.mode for k, p in reg.policies().items()} == {**{k: "activated" for k in invs}, "preft": "prefill"}
    sp = SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(-1,))
    order = ["middle", "preft", "end", "base", "twice"]
    live = []

    def hook(call, run):                     # rows per decode call: the five decode together
        if isinstance(call, DecodeCall):
            live.append(int((np.asarray(call.packed)[:, CHUNK] > 0).sum()))
        return run(call)
    eng.step_runner.add_call_hook(hook)
    reqs = {k: eng.submit(prompts[k], None if k == "base" else k, sp) for k in order}
    while eng.busy:
        eng.step()
    assert max(live) == 5
    for k, q in reqs.items():
        assert q.result.tokens == want[k], k
    hits = eng.pool.stats.hits
    again = {k: eng.submit(prompts[k], k, sp) for k in invs}
    while eng.busy:
        eng.step()
    assert eng.pool.stats.hits - hits >= 3 * (len(conv) // 4)                # at least the conversation's blocks
    for k, q in again.items():
        assert q.result.tokens == want[k], k
