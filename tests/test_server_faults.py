"""The fault suite: a real server (`python -m serve server --model tiny`, its own process, on
127.0.0.1) is sent every class of bad input while well-formed requests stream. For each class:
the bad request gets the right 4xx/429/503 with a clear message, the streaming requests finish with
exactly the output they have when run alone, no adapter reference leaks (unload succeeds
afterwards), /health stays truthful, and the server's RSS stays bounded."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from adapter_factory import random_lora, random_reft
from server_client import stream_completion as _stream
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.adapters.reft_io import save_reft
from benchmarks.server_process import ServerProcess
from preft_jax.config import tiny_config

pytestmark = pytest.mark.usefixtures("cheap_codegen")     # conftest: many small programs, run briefly

ADMIN = "admin-key-123"
API = "api-key-456"
CFG = tiny_config(max_seq_len=1024)          # what `--model tiny` builds
GOOD = [("lora-a", "the quick brown fox", 48), ("reft-b", "hello there", 48), ("tiny", "abc", 48)]


class Server(ServerProcess):
    """The tiny model's server (benchmarks/server_process.py), healthy within 240 s."""

    def __init__(self, args: list[str], log_path: pathlib.Path):
        super().__init__(["--model", "tiny", *args], log_path, startup_timeout=240)


def _save_adapters(root: pathlib.Path):
    save_peft_lora(root / "lora-a", random_lora(CFG, 1, rank=4), CFG)
    save_reft(root / "reft-b", random_reft(CFG, 2, rank=4))
    save_peft_lora(root / "lora-c", random_lora(CFG, 3, rank=2, targets=("q", "v")), CFG)
    nan = random_lora(CFG, 4, rank=4)
    nan.B["v"][1, 0, 3] = np.nan
    save_peft_lora(root / "lora-nan", nan, CFG)
    inf = random_reft(CFG, 5, rank=4)
    inf.W[2, 0, 1] = np.inf
    save_reft(root / "reft-inf", inf)
    outside = root.parent / "outside"
    save_peft_lora(outside / "lora-out", random_lora(CFG, 6, rank=4), CFG)
    os.symlink(outside / "lora-out", root / "escape")
    _malformed(root)


def _malformed(root: pathlib.Path):
    """Adapter folders that used to give 500s: each must be a 400 with a clear message."""
    def peft(name, mutate_cfg=None, mutate_file=None):
        folder = root / name
        save_peft_lora(folder, random_lora(CFG, 7, rank=4, targets=("q",)), CFG)
        cfg_path = folder / "adapter_config.json"
        if mutate_cfg:
            text = mutate_cfg(json.loads(cfg_path.read_text()))
            cfg_path.write_text(text if isinstance(text, str) else json.dumps(text))
        if mutate_file:
            mutate_file(folder / "adapter_model.safetensors")

    peft("bad-nested", lambda c: "[" * 50000 + "]" * 50000)
    peft("bad-r-inf", lambda c: json.dumps(c).replace('"r": 4', '"r": Infinity'))
    peft("bad-r-huge", lambda c: dict(c, r=10 ** 7))
    peft("bad-rank-pattern", lambda c: dict(c, rank_pattern={"q_proj[": 8}))
    peft("bad-alpha-nan", lambda c: json.dumps(c).replace('"lora_alpha": 8', '"lora_alpha": NaN'))
    peft("bad-r-digits", lambda c: json.dumps(c).replace('"r": 4', '"r": ' + "9" * 5000))

    def float_offsets(path):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0.0, float(header[name]["data_offsets"][1])]
        new = json.dumps(header).encode()
        path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])

    peft("bad-float-offsets", mutate_file=float_offsets)
    peft("bad-truncated", mutate_file=lambda p: p.write_bytes(p.read_bytes()[:-100]))
    peft("bad-not-json", lambda c: "{not json")


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fault") / "adapters"
    root.mkdir()
    _save_adapters(root)
    return root


@pytest.fixture(scope="module")
def server(adapter_root, tmp_path_factory):
    srv = Server(["--max-num-seqs", "4", "--max-model-len", "1024", "--max-prefill-seqs", "2",
                  "--max-num-batched-tokens", "64", "--max-device-adapters", "4", "--block-size", "64",
                  "--lora-rank", "4", "--reft-rank", "4", "--adapter-root", str(adapter_root), "--admin-key", ADMIN,
                  "--adapter", f"lora-a={adapter_root / 'lora-a'}", "--adapter", f"reft-b={adapter_root / 'reft-b'}",
                  "--max-queued", "64", "--warmup", "none"], tmp_path_factory.mktemp("logs") / "server.log")
    yield srv          # no warm-up (the fast loop's time): programs compile on first use (`alone` below)
    srv.stop()


@pytest.fixture(scope="module")
def alone(server):
    """Each good request run by itself on the idle server. The memory baseline is taken after them:
    the programs they compile on first use (the server runs without warm-up) are not a leak."""
    out = {g: _stream(server.url, *g) for g in GOOD}
    server.rss_start = server.rss_mb()
    return out


@contextlib.contextmanager
def streaming(server, alone):
    """Runs every GOOD request as a stream in the background; the body runs while they are in flight;
    on exit each must have produced exactly its alone output."""
    results, threads, started = {}, [], []
    for g in GOOD:
        ev = threading.Event()
        t = threading.Thread(target=lambda g=g, ev=ev: results.setdefault(g, _stream(server.url, *g, first=ev)))
        t.start()
        threads.append(t)
        started.append(ev)
    for ev in started:
        assert ev.wait(120)
    yield
    for t in threads:
        t.join(120)
    assert results == alone


def _post(server, path, body=None, raw: bytes | None = None, headers=None, timeout=60):
    if raw is not None:
        return httpx.post(server.url + path, content=raw, timeout=timeout,
                          headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(server.url + path, json=body, timeout=timeout, headers=headers)


def _assert_error(r, status, *needles):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"]
    for n in needles:
        assert n in err["message"] or n == err.get("param") or n == err.get("code"), (n, err)
    for leak in ("Traceback", "allocate", "File \"", "GiB"):
        assert leak not in err["message"]
    return err


def _health(server):
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = _health(server)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"server not idle: {h}")


def _no_leak(server, name="lora-a"):
    """Every reference on `name` was released: it unloads (and is loaded back)."""
    _idle(server)
    h = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.delete(f"{server.url}/v1/adapters/{name}", headers=h, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v1/adapters", json={"name": name, "path": name}, headers=h, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_server_matches_an_in_process_reference(server, alone):
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.sampling import SamplingParams
    from serve.byte_tokenizer import ByteTokenizer
    from serve.tiny_model import tiny_params
    tok = ByteTokenizer()
    runner = ModelRunner(Llama.from_params(CFG, tiny_params(CFG)))
    gen = runner.generate([tok.encode("abc")], SamplingParams(max_new_tokens=48, stop_token_ids=tok.eos_token_ids))
    assert alone[GOOD[2]] == tok.decode(gen[0].tokens) and len(alone[GOOD[2]]) > 0
    assert len({alone[g] for g in GOOD}) == 3


def test_ignore_eos_generates_past_the_models_eos(server, alone):
    """`ignore_eos` (vLLM's extension): the prompt [140] makes the tiny model's first greedy token its
    EOS (2); without the field the choice ends there ("stop", no token), with it the server generates
    max_tokens tokens, EOS included, as the in-process reference told to stop at nothing. (The chat
    path reads the same field: INVALID below has its 400; no chat prompt of the tiny model reaches EOS
    soon enough to show the difference.)"""
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.sampling import SamplingParams
    from serve.byte_tokenizer import ByteTokenizer
    from serve.tiny_model import tiny_params
    runner = ModelRunner(Llama.from_params(CFG, tiny_params(CFG)))
    ref = runner.generate([[140]], SamplingParams(max_new_tokens=6, stop_token_ids=(-1,)))[0].tokens
    assert ref[0] == 2 and len(ref) == 6
    body = {"model": "tiny", "prompt": [140], "max_tokens": 6, "temperature": 0, "logprobs": 0}
    stopped = _post(server, "/v1/completions", body).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1  # EOS
    # the EOS is listed in logprobs (as vLLM lists the stop token), never in the text
    assert stopped["choices"][0]["text"] == "" and stopped["choices"][0]["logprobs"]["tokens"] == ["\x02"]
    assert stopped["choices"][0]["logprobs"]["text_offset"] == [0]
    r = _post(server, "/v1/completions", dict(body, ignore_eos=True)).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6, r
    assert r["choices"][0]["text"] == ByteTokenizer().decode(ref) and len(r["choices"][0]["logprobs"]["tokens"]) == 6


INVALID = [  # (body or raw bytes, path, param or text in the message)
    ({"model": "tiny", "prompt": "x", "top_k": 2 ** 31}, "top_k"),
    ({"model": "tiny", "prompt": "x", "top_k": 257}, "top_k"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    ({"model": "tiny", "prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2 ** 40}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "cannot be represented"),
    (b'{"model": "tiny", "prompt": "ab\\ud800cd"}', "prompt"),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', "stop"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "tiny", "prompt": "x", "n": 5}, "n"),                         # > --max-num-seqs 4
    ({"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ({"model": "tiny", "prompt": ["x"] * 40, "n": 4}, "n"),                  # 160 choices > 128
    ({"model": "tiny", "prompt": ["x"] * 65}, "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "tiny", "prompt": "x", "seed": "7"}, "seed"),
    ({"model": "tiny", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": 1}, "ignore_eos"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "prompt": [1, 2, 10 ** 12]}, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 999]}, "prompt"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi\\ud800"}]}', "messages[0].content"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages"),
    (b"{nope", "JSON"),
]


def test_invalid_fields_are_400s_and_touch_nobody(server, alone):
    with streaming(server, alone):
        for body, needle in INVALID:
            raw = body if isinstance(body, bytes) else None
            is_chat = b"messages" in raw if raw else "messages" in body
            r = _post(server, "/v1/chat/completions" if is_chat else "/v1/completions",
                      None if raw else body, raw)
            _assert_error(r, 400, needle)
        ok = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0,
                                               "some_future_field": {"a": 1}, "user": "u", "seed": 3})
        assert ok.status_code == 200, ok.text          # unknown harmless fields are ignored
    _no_leak(server)


def test_bad_adapters_are_refused_before_the_bank(server, alone):
    h = {"Authorization": f"Bearer {ADMIN}"}
    with streaming(server, alone):
        for name in ("lora-nan", "reft-inf"):
            r = _post(server, "/v1/adapters", {"name": name, "path": name}, headers=h)
            _assert_error(r, 400, "NaN or Inf")
        for name in ("bad-nested", "bad-r-inf", "bad-r-huge", "bad-rank-pattern", "bad-alpha-nan", "bad-r-digits",
                     "bad-float-offsets", "bad-truncated", "bad-not-json"):
            r = _post(server, "/v1/adapters", {"name": name, "path": name}, headers=h)
            err = _assert_error(r, 400, "adapter_load_failed")
            assert name in err["message"] and str(server.url) not in err["message"]
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert {m["id"] for m in models} == {"tiny", "lora-a", "reft-b"}
    _no_leak(server)


def test_access_control_and_adapter_root(server, alone, adapter_root):
    h = {"Authorization": f"Bearer {ADMIN}"}
    with streaming(server, alone):
        _assert_error(_post(server, "/v1/adapters", {"name": "x", "path": "lora-c"}), 401, "invalid_api_key")
        _assert_error(_post(server, "/v1/adapters", {"name": "x", "path": "lora-c"},
                            headers={"Authorization": "Bearer wrong"}), 401)
        assert httpx.delete(f"{server.url}/v1/adapters/lora-a").status_code == 401
        outside = []
        for path in ("/etc", "/nonexistent-dir-xyz", "../outside/lora-out", "escape", str(adapter_root.parent),
                     "/root", "../../../../../../etc/passwd"):
            r = _post(server, "/v1/adapters", {"name": "x", "path": path}, headers=h)
            outside.append(_assert_error(r, 400, "path")["message"])
        assert len(set(outside)) == 1 and "adapter root" in outside[0]   # no existence oracle
        for path in ("no-such", "~/x"):                 # inside the root; '~' is not expanded
            missing = _assert_error(_post(server, "/v1/adapters", {"name": "x", "path": path}, headers=h), 400)
            assert str(adapter_root) not in missing["message"] and os.path.expanduser("~") not in missing["message"]
        for name in ("a/b", "", "x" * 65, "..", "bad name"):
            _assert_error(_post(server, "/v1/adapters", {"name": name, "path": "lora-c"}, headers=h), 400, "name")
        r = _post(server, "/v1/adapters", {"name": "lora-c", "path": "lora-c"}, headers=h)
        assert r.status_code == 200 and r.json()["path"] == "lora-c"
    assert httpx.delete(f"{server.url}/v1/adapters/lora-c", headers=h).status_code == 200
    _no_leak(server)


def test_oversized_input_is_refused_fast(server, alone):
    with streaming(server, alone):
        t0 = time.monotonic()
        big = b'{"model": "tiny", "prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}'
        _assert_error(_post(server, "/v1/completions", raw=big), 413, "payload_too_large")
        long_prompt = {"model": "tiny", "prompt": "b" * 300_000, "max_tokens": 4}
        _assert_error(_post(server, "/v1/completions", long_prompt), 400, "context_length_exceeded")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "c" * 300_000}]}
        _assert_error(_post(server, "/v1/chat/completions", chat), 400, "context_length_exceeded")
        assert time.monotonic() - t0 < 10
        t1 = time.monotonic()
        _health(server)
        assert time.monotonic() - t1 < 2
    _no_leak(server)


def test_disconnects_cancel_and_free_their_slot(server, alone):
    before = httpx.get(f"{server.url}/metrics").text
    n0 = _metric(before, "preft_client_disconnects_total")
    body = {"model": "lora-a", "prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
    for _ in range(12):                                  # opened-and-closed streams
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
    raw = json.dumps({"model": "lora-a", "prompt": "y", "max_tokens": 1000, "temperature": 0}).encode()
    for _ in range(4):                                   # non-streaming clients that hang up
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        time.sleep(0.1)
        s.close()
    t0 = time.monotonic()
    _idle(server, timeout=10)                            # every cancelled request freed its slot
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and time.monotonic() - t0 < 10
    after = httpx.get(f"{server.url}/metrics").text
    assert _metric(after, "preft_client_disconnects_total") - n0 == 16
    _no_leak(server)
    with streaming(server, alone):
        pass


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    return 0.0


def test_health_metrics_and_memory(server, alone):
    h = _idle(server)
    assert h["status"] == "ok" and not h["wedged"] and h["loop_running"] and h["decode_rows"] == 4
    assert h["last_step_age_s"] is not None
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("preft_http_responses_total", "preft_queue_depth", "preft_generated_tokens_total",
                 "preft_generation_tokens_per_second", "preft_time_to_first_token_seconds_bucket",
                 "preft_requests_finished_total"):
        assert name in text
    assert _metric(text, "preft_generated_tokens_total") > 0
    assert 'code="400"' in text and 'code="413"' in text
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
              headers={"X-Request-ID": "my-trace-1"})
    assert r.headers["x-request-id"] == "my-trace-1"
    assert len(httpx.get(f"{server.url}/health").headers["x-request-id"]) > 8
    assert server.rss_mb() - server.rss_start < 300, (server.rss_start, server.rss_mb())


@pytest.mark.slow
def test_queue_limit_api_key_deadline_and_sigterm(adapter_root, tmp_path):
    srv = Server(["--max-num-seqs", "1", "--max-model-len", "512", "--max-prefill-seqs", "1",
                  "--max-num-batched-tokens", "32", "--max-device-adapters", "1", "--lora-rank", "4", "--block-size", "64",
                  "--max-queued", "1", "--api-key", API, "--request-timeout", "20", "--shutdown-grace", "1"],
                 tmp_path / "server2.log")
    auth = {"Authorization": f"Bearer {API}"}
    try:
        _assert_error(_post(srv, "/v1/completions", {"model": "tiny", "prompt": "x"}), 401, "invalid_api_key")
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200      # probes stay open
        ok = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, headers=auth)
        assert ok.status_code == 200
        # two prompts in one request where the queue holds one: refused whole (400: no retry fits it), none runs
        two = _post(srv, "/v1/completions", {"model": "tiny", "prompt": ["x", "y"], "max_tokens": 2}, headers=auth)
        _assert_error(two, 400, "prompt")
        assert two.json()["error"]["message"] == ("this submission brings 2 prompts; the request queue holds at most "
                                                  "1 (max_queued; the server's --max-queued)")
        assert httpx.get(f"{srv.url}/health").json()["queued"] == 0
        # one running + one queued fill the server: the rest get 429 with Retry-After
        body = {"model": "tiny", "prompt": "q", "max_tokens": 400, "temperature": 0}
        results = []
        threads = [threading.Thread(target=lambda: results.append(_post(srv, "/v1/completions", body, headers=auth)))
                   for _ in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(120)
        codes = sorted(r.status_code for r in results)
        assert 429 in codes and 200 in codes, codes
        full = next(r for r in results if r.status_code == 429)
        assert full.headers["retry-after"] == "1" and full.json()["error"]["code"] == "queue_full"
        # SIGTERM with a long stream in flight: the process exits within its grace and the stream ends
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", _stream_raw(srv.url, body, auth)))
        t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
        t.join(30)
        assert "r" in got
    finally:
        srv.stop()


def _stream_raw(url, body, headers) -> str:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=60) as r:
            return "".join(r.iter_text())
    except httpx.HTTPError as e:
        return f"closed: {type(e).__name__}"


@pytest.mark.slow
def test_first_adapter_request_and_sigterm_during_background_warmup(adapter_root, tmp_path):
    """Issue 23: the first adapter request during the background warm-up (its upload donates the
    bank) leaves the warm-up running to the end; SIGTERM during the warm-up (exit handler and
    lifespan hook both shut the engine down) exits cleanly, every time."""
    args = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-prefill-seqs", "1", "--max-num-batched-tokens", "16",
            "--block-size", "16", "--lora-rank", "4", "--reft-rank", "4", "--max-device-adapters", "2",
            "--adapter", f"lora-a={adapter_root / 'lora-a'}"]
    srv = Server(args, tmp_path / "warm.log")
    try:
        assert _health(srv)["warmup_pending"] > 0                          # still warming up
        r = _post(srv, "/v1/completions", {"model": "lora-a", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 600
        while (h := _health(srv))["warmup_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert h["warmup_pending"] == 0 and h["warmup_failed"] == 0, h
    finally:
        srv.stop()
    log = (tmp_path / "warm.log").read_text()
    assert "warm-up" not in log and "Traceback" not in log, log[-3000:]
    for i in range(2):
        srv = Server(args, tmp_path / f"term{i}.log")
        assert _health(srv)["warmup_pending"] > 0
        srv.stop()                                                         # SIGTERM, mid warm-up
        log = (tmp_path / f"term{i}.log").read_text()
        assert srv.proc.returncode in (0, -signal.SIGTERM), (srv.proc.returncode, log[-3000:])   # uvicorn re-raises it
        for bad in ("Traceback", "AttributeError", "shutdown failed"):
            assert bad not in log, log[-3000:]
