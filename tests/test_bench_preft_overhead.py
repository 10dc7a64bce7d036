"""benchmarks/preft_overhead.py: PreFT's cost over base split into prefill device, decode device and
host time. The replayed calls are exactly the engine's own (PreFT decode carries no bank: it is the
base decode), and a breakdown's recording stops with it."""
import pytest

from benchmarks import preft_overhead as po
from benchmarks.common import load_runner, random_prompts


@pytest.fixture(scope="module")
def engines():
    import argparse
    runner = load_runner("tiny")
    args = argparse.Namespace(adapters=3, requests=4, prompt_len=8, max_tokens=4, slots=0, cpu_decode="xla")
    return runner, args, po.variants(runner, args)


def test_breakdown_replays_the_engines_own_calls_and_recording_stops(engines):
    runner, args, variants = engines
    prompts = random_prompts(args.requests, args.prompt_len, runner.cfg.vocab_size, 3)
    parts = {}
    for label, (eng, picks) in variants.items():
        served = []

        def run(eng=eng, picks=picks, served=served):
            from benchmarks.common import serve
            s = serve(eng, prompts, picks, args.max_tokens)
            served.append(s)
            return s.wall
        parts[label] = p = po.breakdown(eng, run)
        assert len(served) == 1 and p["wall_s"] == served[0].wall       # the run it was handed, once
        assert p["prefill_s"] > 0 and p["decode_s"] > 0
        # every device call of the run: prefill calls (at least one; 4 prompts) and one decode call
        # per generated token after the first (4 tokens: 3 decode steps, fused or not)
        assert p["prefill_calls"] >= 1 and 1 <= p["decode_calls"] <= args.max_tokens - 1
        assert p["decode_calls_with_bank"] == 0                   # PreFT: decode is the base decode
        calls = []                                               # the hook is off again: a new hook sees
        remove = eng.step_runner.add_call_hook(lambda call, run: calls.append(call) or run(call))
        try:                                                     # this run's calls, no recorder keeps them
            run()
        finally:
            remove()
        assert len(calls) == p["prefill_calls"] + p["decode_calls"]
    text = "\n".join(po.breakdown_lines(parts))
    assert text.startswith("| variant | wall ms | prefill device ms | decode device ms | host ms |")
    for label in ("PreFT-LoRA", "PreFT-ReFT"):
        d = {f: (parts[label][f] - parts["base"][f]) * 1e3 for f in ("wall_s", "prefill_s", "decode_s", "host_s")}
        assert (f"- {label} - base: wall {d['wall_s']:+.1f} ms = prefill {d['prefill_s']:+.1f} "
                f"+ decode {d['decode_s']:+.1f} + host {d['host_s']:+.1f}") in text


def test_call_hooks_come_off_in_reverse_order(engines):
    _, _, variants = engines
    runner = variants["base"][0].step_runner
    first = runner.add_call_hook(lambda call, run: run(call))
    second = runner.add_call_hook(lambda call, run: run(call))
    with pytest.raises(RuntimeError, match="^call hooks are removed in the reverse order of adding$"):
        first()
    second()
    first()
