"""An adapter made by HF `peft` on the torch reference gives the same logits in preft_jax (all-token)."""
import jax.numpy as jnp
import numpy as np
import pytest

from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.adapters.peft_io import load_peft_lora
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.model import Llama

pytestmark = pytest.mark.hf_reference
pytest.importorskip("peft", reason="HF reference: peft not installed (pip install -e '.[test]')")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(hf_model, folder, seed, rank=8, alpha=16, layers=None):
    import torch
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    peft_model = get_peft_model(hf_model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS,
                                                     layers_to_transform=layers, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    peft_model.save_pretrained(folder)
    return peft_model


def _compare(cfg, params, peft_model, folder, ids):
    import torch
    lora = load_peft_lora(folder, cfg, policy=PositionPolicy(mode="all"))
    runner = ModelRunner(Llama.from_params(cfg, params))
    bank = build_bank(cfg, [lora])
    got = np.asarray(sequence_logits(runner.graphdef, runner.state, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                                     bank, jnp.asarray([1])))[0]
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor([ids])).logits[0].numpy()
        with peft_model.disable_adapter():
            base = peft_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(want - base).max() > 1e-2 * np.abs(base).max()     # the adapter changes the logits
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 1e-3, rel


def test_peft_adapter_on_tiny_llama(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from preft_jax.loading import load_hf_folder
    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    hf_model = LlamaForCausalLM(hf_cfg).eval()
    hf_model.save_pretrained(tmp_path / "base")
    _write_trivial_tokenizer(tmp_path / "base", 256)
    cfg, params, _ = load_hf_folder(tmp_path / "base")
    peft_model = _peft_adapter(hf_model, tmp_path / "adapter", seed=1, rank=4, alpha=8, layers=[0, 2])
    ids = np.random.default_rng(0).integers(0, 256, 20).tolist()
    _compare(cfg, params, peft_model, tmp_path / "adapter", ids)


def _write_trivial_tokenizer(folder, vocab_size):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")).save(
        str(folder / "tokenizer.json"))


@pytest.mark.real_model
def test_peft_adapter_on_smollm2(tmp_path, default_model, hf_reference):
    cfg, params, tok = default_model
    hf_model, _ = hf_reference
    import copy
    peft_model = _peft_adapter(copy.deepcopy(hf_model), tmp_path / "adapter", seed=2)
    ids = tok.encode_chat([{"role": "user", "content": "Name three colours."}])
    _compare(cfg, params, peft_model, tmp_path / "adapter", ids)
