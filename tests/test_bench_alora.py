"""benchmarks/alora.py on the tiny model: the aLoRA burst reuses every block of the base conversation
(each adapter's request prefills only its invocation), the all-token burst reuses none."""
import json

import pytest

from benchmarks import alora

pytestmark = pytest.mark.slow        # an end-to-end benchmark run


def test_alora_benchmark_reuses_the_base_conversation(tmp_path, capsys):
    out = tmp_path / "alora.json"
    assert alora.main(["--model", "tiny", "--conversation", "32", "--adapters", "2", "--max-tokens", "3",
                       "--repeats", "1", "--block-size", "8", "--prefill-tokens", "128", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    # 32 + 4 tokens: the conversation's 4 blocks of 8 are base blocks (the invocation starts at 32)
    assert [(r["block_hits"], r["block_misses"]) for r in runs["aLoRA (activated)"]] == [(8, 0)]
    assert [(r["block_hits"], r["block_misses"]) for r in runs["all-token LoRA"]] == [(0, 8)]
    table = capsys.readouterr().out
    assert "| aLoRA (activated) |" in table and "| all-token LoRA |" in table
