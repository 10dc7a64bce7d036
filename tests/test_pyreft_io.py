"""pyreft interop: interventions saved by pyreft load into ReftWeights and reproduce pyreft's own outputs
(prefill mode = pyreft's intervene_on_prompt=True generate on the prompt positions); save_pyreft folders
load in pyreft; torch checkpoints are read / written without torch; unsupported folders are named."""
from __future__ import annotations

import collections
import json
import pickle
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from adapter_factory import random_reft
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.adapters.peft_io import AdapterFormatError, UnsupportedAdapterError
from preft_jax.adapters.pyreft_io import (_orthogonal_forward, load_pyreft, parse_positions, positions_string,
                                          save_pyreft)
from preft_jax.adapters.reft_io import adapter_kind, load_adapter
from preft_jax.adapters.torch_pickle import TorchFileError, load_torch_file, save_torch_file
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams

pytestmark = pytest.mark.hf_reference
torch = pytest.importorskip("torch", reason="HF reference: torch not installed (pip install -e '.[test]')")
_logits = jax.jit(sequence_logits, static_argnums=0)


# ------------------------------------------------------------------------------------ torch files
def test_torch_file_round_trips(tmp_path):
    base = torch.randn(6, 5)
    sd = collections.OrderedDict(w=base, wt=base.T, sub=base[1:4, ::2], bf=torch.randn(7).to(torch.bfloat16),
                                 half=torch.randn(3).half(), scalar=torch.tensor(3), p=torch.nn.Parameter(torch.ones(2)))
    torch.save(sd, tmp_path / "t.bin")
    got = load_torch_file(tmp_path / "t.bin")
    assert list(got) == list(sd)
    for k, v in sd.items():
        want = v.detach().float().numpy() if v.dtype == torch.bfloat16 else v.detach().numpy()
        assert got[k].shape == want.shape and got[k].dtype == want.dtype, k
        np.testing.assert_array_equal(got[k], want, err_msg=k)

    ours = {"a": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), "i": np.array(7, np.int64),
            "h": np.arange(5, dtype=np.float16), "e": np.zeros((0, 2), np.float32)}
    save_torch_file(tmp_path / "o.bin", ours)
    back = torch.load(tmp_path / "o.bin", weights_only=True)
    for k, v in ours.items():
        assert tuple(back[k].shape) == v.shape
        np.testing.assert_array_equal(back[k].numpy(), v)
    assert set(load_torch_file(tmp_path / "o.bin")) == set(ours)


def test_torch_file_refuses_foreign_globals(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with zipfile.ZipFile(tmp_path / "evil.bin", "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}, protocol=2))
    with pytest.raises(TorchFileError, match=r"refusing to load global .*print"):
        load_torch_file(tmp_path / "evil.bin")
    (tmp_path / "plain.bin").write_bytes(b"not a zip")
    with pytest.raises(TorchFileError, match="not a torch zip"):
        load_torch_file(tmp_path / "plain.bin")


@pytest.mark.parametrize("shape", [(12, 3), (5, 5), (3, 12)])
def test_orthogonal_parametrization_matches_torch(shape):
    lin = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(shape[1], shape[0], bias=False))
    with torch.no_grad():
        orig = lin.parametrizations.weight.original
        orig.add_(0.3 * torch.randn_like(orig))             # as after some training steps
    sd = lin.state_dict()
    base = sd.get("parametrizations.weight.0.base")
    got = _orthogonal_forward(sd["parametrizations.weight.original"].numpy(), None if base is None else base.numpy())
    np.testing.assert_allclose(got, lin.weight.detach().numpy(), atol=2e-5)


def test_positions_strings():
    assert parse_positions("f1+l1") == PositionPolicy(first_k=1, last_k=1)
    assert parse_positions("l3") == PositionPolicy(last_k=3)
    assert parse_positions("f7") == PositionPolicy(first_k=7)
    assert parse_positions("all_prompt") == PositionPolicy()
    assert parse_positions("all") == PositionPolicy(mode="all")
    for p in (PositionPolicy(first_k=2, last_k=5), PositionPolicy(last_k=1), PositionPolicy(), PositionPolicy("all")):
        assert parse_positions(positions_string(p)) == p
    for bad in ("", "x1", "f0+l0", "l1+f1", "first"):
        with pytest.raises(ValueError):
            parse_positions(bad)


# ------------------------------------------------------------------------------- tiny Llama parity
pyreft = pytest.importorskip("pyreft", reason="pyreft reference not installed (scripts/install.sh)")


def _reft_model(hf_model, kind, layers, rank, seed):
    """A pyreft model with random non-zero interventions (rotation perturbed as if trained)."""
    torch.manual_seed(seed)
    cls = pyreft.LoreftIntervention if kind == "loreft" else pyreft.DireftIntervention
    d = hf_model.config.hidden_size
    rc = pyreft.ReftConfig(representations=[
        {"layer": i, "component": "block_output", "low_rank_dimension": rank,
         "intervention": cls(embed_dim=d, low_rank_dimension=rank, dtype=torch.float32)} for i in layers])
    rm = pyreft.get_reft_model(hf_model, rc, set_device=False)
    with torch.no_grad():
        for iv in rm.interventions.values():
            iv.learned_source.weight.normal_(0, 0.3)
            iv.learned_source.bias.normal_(0, 0.5)
            orig = iv.rotate_layer.parametrizations.weight.original
            orig.add_(0.3 * torch.tril(torch.randn_like(orig), -1))
    rm.eval()
    return rm


def _locations(rm, prompt_len, policy):
    pos = [p for p in range(prompt_len) if policy.first_k is None and policy.last_k is None
           or (policy.first_k is not None and p < policy.first_k)
           or (policy.last_k is not None and p >= prompt_len - policy.last_k)]
    return {"sources->base": (None, [[pos]] * len(rm.interventions))}


def _pyreft_generate(rm, prompt, policy, n_new):
    with torch.no_grad():
        _, out = rm.generate({"input_ids": torch.tensor([prompt]),
                              "attention_mask": torch.ones(1, len(prompt), dtype=torch.long)},
                             unit_locations=_locations(rm, len(prompt), policy), intervene_on_prompt=True,
                             max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _pyreft_logits(rm, ids, policy):
    with torch.no_grad():
        _, cf = rm({"input_ids": torch.tensor([ids])}, unit_locations=_locations(rm, len(ids), policy))
    return cf.logits[0].numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    from preft_jax.loading import load_hf_folder
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
    hf_model = LlamaForCausalLM(hf_cfg).eval()
    folder = tmp_path_factory.mktemp("tiny_llama")
    hf_model.save_pretrained(folder)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(folder / "tokenizer.json"))
    cfg, params, _ = load_hf_folder(folder)
    return hf_model, cfg, ModelRunner(Llama.from_params(cfg, params))


def _pyreft_load_float32(folder, hf_model):
    """pyreft.ReftModel.load builds learned_source in bfloat16 (its default dtype); cast the interventions to
    float32 and load each intervention's state again, through pyreft's own load_state_dict."""
    rm = pyreft.ReftModel.load(str(folder), hf_model)
    for key, iv in rm.interventions.items():
        iv.to(torch.float32)
        iv.load_state_dict(torch.load(folder / f"intkey_{key}.bin", weights_only=True))
    rm.eval()
    return rm


def _ours_generate(runner, cfg, weights, prompt, n_new):
    bank = build_bank(cfg, [weights])
    return runner.generate([prompt], SamplingParams(max_new_tokens=n_new, stop_token_ids=(-1,)),
                           bank=bank, adapter_ids=[1])[0].tokens


@pytest.mark.parametrize("kind,positions", [("loreft", "all_prompt"), ("direft", "all_prompt"),
                                            ("loreft", "f2+l3"), ("direft", "l1")])
def test_pyreft_folder_matches_pyreft(tiny, tmp_path, kind, positions):
    hf_model, cfg, runner = tiny
    rm = _reft_model(hf_model, kind, layers=(0, 2), rank=4, seed=7)
    rm.save(str(tmp_path / "pyreft"))
    assert adapter_kind(tmp_path / "pyreft") == "pyreft"
    w = load_pyreft(tmp_path / "pyreft", cfg, positions=positions)
    policy = parse_positions(positions)
    assert w.config.kind == kind and w.config.layers == (0, 2) and w.config.rank == 4 and w.config.policy == policy
    assert not np.any(w.R[[1, 3]]) and np.all(np.abs(w.R[[0, 2]]).sum(-1) > 0)
    np.testing.assert_allclose(w.R[0] @ w.R[0].T, np.eye(4), atol=1e-5)

    prompt = np.random.default_rng(1).integers(0, 256, 14).tolist()
    # prompt logits with the intervention on the policy's positions
    want = _pyreft_logits(rm, prompt, policy)
    with torch.no_grad():
        base = hf_model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(want - base).max() > 0.05 * np.abs(base).max()
    bank = build_bank(cfg, [w])
    got = np.asarray(_logits(runner.graphdef, runner.state, jnp.asarray([prompt]), jnp.asarray([len(prompt)]),
                             bank, jnp.asarray([1])))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    # greedy generation: pyreft intervenes on the prompt only (intervene_on_prompt=True) == prefill mode
    assert _ours_generate(runner, cfg, w, prompt, 12) == _pyreft_generate(rm, prompt, policy, 12)


@pytest.mark.parametrize("kind", ["loreft", "direft"])
def test_save_pyreft_loads_in_pyreft(tiny, tmp_path, kind):
    hf_model, cfg, runner = tiny
    src = _reft_model(hf_model, kind, layers=(1, 3), rank=3, seed=11)
    src.save(str(tmp_path / "a"))
    w = load_pyreft(tmp_path / "a", cfg, positions="f2+l2")
    save_pyreft(tmp_path / "b", w, cfg)
    w2 = load_pyreft(tmp_path / "b", cfg)                         # policy recorded in config.json
    assert w2.config == w.config
    for x, y in ((w.R, w2.R), (w.W, w2.W), (w.b, w2.b)):
        np.testing.assert_allclose(y, x, atol=1e-6)
    rm = _pyreft_load_float32(tmp_path / "b", hf_model)          # pyreft reads our folder
    prompt = np.random.default_rng(2).integers(0, 256, 12).tolist()
    assert _pyreft_generate(rm, prompt, w.config.policy, 10) == _ours_generate(runner, cfg, w, prompt, 10)
    np.testing.assert_allclose(_pyreft_logits(rm, prompt, w.config.policy), _pyreft_logits(src, prompt, w.config.policy),
                               atol=1e-4)


def test_save_pyreft_from_preft_weights(tiny, tmp_path):
    hf_model, cfg, runner = tiny
    w = random_reft(cfg, 5, rank=2, layers=(0, 3), kind="loreft", policy=PositionPolicy(last_k=4))
    save_pyreft(tmp_path / "p", w, cfg)
    assert load_adapter(tmp_path / "p", cfg).config == w.config
    rm = _pyreft_load_float32(tmp_path / "p", hf_model)
    prompt = np.random.default_rng(3).integers(0, 256, 10).tolist()
    assert _pyreft_generate(rm, prompt, w.config.policy, 8) == _ours_generate(runner, cfg, w, prompt, 8)


# ------------------------------------------------------------------------------------------ errors
def test_unsupported_pyreft_folders_are_named(tiny, tmp_path):
    hf_model, cfg, _ = tiny
    rm = _reft_model(hf_model, "loreft", layers=(0, 2), rank=4, seed=3)
    rm.save(str(tmp_path / "ok"))
    conf = json.loads((tmp_path / "ok" / "config.json").read_text())

    def variant(name, **changes):
        import shutil
        folder = tmp_path / name
        shutil.copytree(tmp_path / "ok", folder)
        (folder / "config.json").write_text(json.dumps({**conf, **changes}))
        return folder

    noreft = variant("noreft", intervention_types=["<class 'pyreft.interventions.NoreftIntervention'>"] * 2)
    with pytest.raises(UnsupportedAdapterError, match="NoreftIntervention.*LoreftIntervention.*DireftIntervention"):
        load_pyreft(noreft, cfg)
    reps = [list(r) for r in conf["representations"]]
    reps[1][1] = "mlp_output"
    with pytest.raises(UnsupportedAdapterError, match="mlp_output"):
        load_pyreft(variant("mlp", representations=reps), cfg)
    reps = [list(r) for r in conf["representations"]]
    reps[1][0] = 0                                     # two interventions on layer 0 (share_weights=False)
    with pytest.raises(UnsupportedAdapterError, match="more than one intervention"):
        load_pyreft(variant("dup", representations=reps), cfg)
    reps[1][0] = 9
    with pytest.raises(AdapterFormatError, match="out of range"):
        load_pyreft(variant("range", representations=reps), cfg)
    with pytest.warns(UserWarning, match="positions"):
        load_pyreft(tmp_path / "ok", cfg)
    bad = random_reft(cfg, 1, kind="direft", layers=(1,))   # DiReFT R from preft_jax is not orthonormal
    with pytest.raises(ValueError, match="orthonormal"):
        save_pyreft(tmp_path / "bad", bad, cfg)


# ------------------------------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.hf_reference
def test_pyreft_loreft_on_smollm2_greedy(default_model, hf_reference, tmp_path):
    import copy
    cfg, params, tok = default_model
    hf_model, _ = hf_reference
    rm = _reft_model(copy.deepcopy(hf_model), "loreft", layers=(3, 12), rank=4, seed=21)
    rm.save(str(tmp_path / "smol"))
    w = load_pyreft(tmp_path / "smol", cfg, positions="all_prompt")
    runner = ModelRunner(Llama.from_params(cfg, params))
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ours = _ours_generate(runner, cfg, w, prompt, 12)
    assert ours == _pyreft_generate(rm, prompt, w.config.policy, 12)
    with torch.no_grad():
        base = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ours != base[0, len(prompt):].tolist()        # the intervention really changes the answer
