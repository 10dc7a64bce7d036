"""The fault suite, round 2 (issue 23), against a real server process (`python -m serve server
--model tiny`): adapter files that point outside the adapter root, load errors that echo file
contents or server paths, unloading an adapter in constant use (draining), --adapter-dir names,
/health during a SIGTERM drain, slowloris connections and slow bodies, the API docs behind the key."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import select
import signal
import socket
import threading
import time

import httpx
import pytest

from adapter_factory import random_lora
from benchmarks.server_process import ServerProcess
from preft_jax.adapters.peft_io import save_peft_lora
from preft_jax.config import tiny_config
from server_client import stream_completion

pytestmark = pytest.mark.slow        # a real server process / an end-to-end benchmark run

ADMIN = "admin-key-789"
API = "api-key-012"
CFG = tiny_config(max_seq_len=1024)          # what `--model tiny` builds
SECRET = "SECRET-7f3a9c"
AUTH = {"Authorization": f"Bearer {API}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
_stream = functools.partial(stream_completion, headers=AUTH)


def _lora(folder: pathlib.Path, seed: int):
    save_peft_lora(folder, random_lora(CFG, seed, rank=4, targets=("q", "v")), CFG)


def _secret_config(folder: pathlib.Path) -> dict:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    return dict(cfg, peft_type=SECRET, base_model_name_or_path=SECRET)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults2")
    root, adir, outside = base / "root", base / "adapter-dir", base / "outside"
    for d in (root, adir, outside):
        d.mkdir()
    _lora(outside / "lora", 1)
    (outside / "secret.json").write_text(json.dumps(_secret_config(outside / "lora")))
    # files inside an adapter folder that point outside the root
    _lora(root / "sneaky-config", 2)
    (root / "sneaky-config" / "adapter_config.json").unlink()
    os.symlink(outside / "secret.json", root / "sneaky-config" / "adapter_config.json")
    _lora(root / "sneaky-weights", 3)
    (root / "sneaky-weights" / "adapter_model.safetensors").unlink()
    os.symlink(outside / "lora" / "adapter_model.safetensors", root / "sneaky-weights" / "adapter_model.safetensors")
    _lora(root / "sneaky-subdir", 4)
    os.symlink(outside, root / "sneaky-subdir" / "extra")
    # symlinks that stay inside the root (a Hugging Face cache's snapshot -> blob links) are fine
    _lora(root / "blobs", 5)
    (root / "linked-ok").mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        os.symlink(f"../blobs/{f}", root / "linked-ok" / f)
    # a malformed config inside the root: its values are never echoed
    _lora(root / "secret-in-root", 6)
    (root / "secret-in-root" / "adapter_config.json").write_text(json.dumps(_secret_config(root / "secret-in-root")))
    _lora(root / "drain-a", 7)
    # --adapter-dir entries: found by name on first use
    _lora(adir / "dir-ok", 8)
    _lora(adir / "dir-sneaky", 9)
    (adir / "dir-sneaky" / "adapter_config.json").unlink()
    os.symlink(outside / "secret.json", adir / "dir-sneaky" / "adapter_config.json")
    (adir / "dir-broken").mkdir()
    (adir / "dir-broken" / "adapter_config.json").write_text('{"peft_type": "' + SECRET + '", not json')
    return {"base": base, "root": root, "adapter_dir": adir, "outside": outside}


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    srv = ServerProcess(["--model", "tiny", "--warmup", "none", "--max-num-seqs", "4", "--max-model-len", "1024",
                         "--max-prefill-seqs", "2", "--max-num-batched-tokens", "64", "--block-size", "16",
                         "--max-device-adapters", "2", "--lora-rank", "4", "--reft-rank", "4",
                         "--adapter-root", str(dirs["root"]), "--adapter-dir", str(dirs["adapter_dir"]),
                         "--admin-key", ADMIN, "--api-key", API, "--header-timeout", "2", "--body-timeout", "2",
                         "--keep-alive-timeout", "1"], tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    srv.stop()


def _post(srv, path, body, headers=AUTH, timeout=120):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=timeout)


def _error(r, status, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _metric(srv, name: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics", timeout=10).text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    raise KeyError(name)


def _no_leaks_in(message: str, dirs) -> None:
    assert SECRET not in message and str(dirs["base"]) not in message and "/tmp" not in message, message


def test_adapter_files_must_stay_inside_the_root(server, dirs):
    for name in ("sneaky-config", "sneaky-weights", "sneaky-subdir"):
        err = _error(_post(server, "/v1/adapters", {"name": name, "path": name}, ADMIN_AUTH), 400,
                     "adapter_load_failed")
        assert err["message"].startswith(f"cannot load adapter {name!r}: ") and err["param"] == "path"
        assert "resolves outside the adapter root" in err["message"], err
        _no_leaks_in(err["message"], dirs)
    r = _post(server, "/v1/adapters", {"name": "linked-ok", "path": "linked-ok"}, ADMIN_AUTH)
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"model": "linked-ok", "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    # a malformed config: the client learns which file and why, never the values; the operator's log has them
    err = _error(_post(server, "/v1/adapters", {"name": "s", "path": "secret-in-root"}, ADMIN_AUTH), 400,
                 "adapter_load_failed")
    assert err["message"] == ("cannot load adapter 's': 'adapter_config.json' is malformed or does not fit this "
                              "model"), err
    assert SECRET in server.log_text()
    # --adapter-dir entries are held to the adapter directory the same way, and their errors name the
    # adapter, never a server path
    for name in ("dir-sneaky", "dir-broken"):
        err = _error(_post(server, "/v1/completions", {"model": name, "prompt": "abc", "max_tokens": 2}), 400,
                     "adapter_load_failed")
        assert name in err["message"] and str(dirs["adapter_dir"]) not in err["message"], err
        _no_leaks_in(err["message"], dirs)
    assert "resolves outside" in _post(server, "/v1/completions", {"model": "dir-sneaky", "prompt": "a"}).text
    ok = _post(server, "/v1/completions", {"model": "dir-ok", "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_adapter_dir_names_are_managed_on_disk_both_ways(server, dirs):
    """POST of a name an --adapter-dir folder provides and DELETE of it are both 409, same code."""
    assert _post(server, "/v1/completions", {"model": "dir-ok", "prompt": "a", "max_tokens": 1}).status_code == 200
    err = _error(_post(server, "/v1/adapters", {"name": "dir-ok", "path": "drain-a"}, ADMIN_AUTH), 409,
                 "adapter_in_adapter_dir")
    assert "--adapter-dir" in err["message"]
    err = _error(httpx.delete(f"{server.url}/v1/adapters/dir-ok", headers=ADMIN_AUTH), 409, "adapter_in_adapter_dir")
    assert "remove or rename its folder" in err["message"]
    _error(httpx.delete(f"{server.url}/v1/adapters/never-was", headers=ADMIN_AUTH), 404, "model_not_found")


def test_delete_drains_an_adapter_in_constant_use(server):
    """Continuous traffic on an adapter: DELETE answers 202 "draining" at once, new requests get 404,
    a reload under the name is a 409 while it drains, running requests finish with their solo output,
    and the adapter unloads as soon as they end; then it loads again under the same name."""
    assert _post(server, "/v1/adapters", {"name": "drain-a", "path": "drain-a"}, ADMIN_AUTH).status_code == 200
    prompt, long_tokens = "the adapter keeps running", 990
    solo_long = _stream(server.url, "drain-a", prompt, long_tokens)
    solo_short = _stream(server.url, "drain-a", "short", 24)
    stop, codes, short_outputs, lock = threading.Event(), [], [], threading.Lock()

    def traffic():                                       # back-to-back requests until the adapter is gone
        while not stop.is_set():
            r = _post(server, "/v1/completions", {"model": "drain-a", "prompt": "short", "max_tokens": 24,
                                                  "temperature": 0})
            with lock:
                codes.append(r.status_code)
                if r.status_code == 200:
                    short_outputs.append(r.json()["choices"][0]["text"])
            if r.status_code == 404:
                return

    first, long_out = threading.Event(), {}
    long_t = threading.Thread(target=lambda: long_out.setdefault("text", _stream(server.url, "drain-a", prompt,
                                                                               long_tokens, first)))
    long_t.start()
    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for w in workers:
        w.start()
    assert first.wait(120)
    t0 = time.monotonic()
    r = httpx.delete(f"{server.url}/v1/adapters/drain-a", headers=ADMIN_AUTH, timeout=30)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "draining" and body["deleted"] and body["in_use"] >= 1, body
    err = _error(_post(server, "/v1/completions", {"model": "drain-a", "prompt": "x", "max_tokens": 2}), 404,
                 "model_not_found")
    assert "drain-a" in err["message"]
    assert "drain-a" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]]
    err = _error(_post(server, "/v1/adapters", {"name": "drain-a", "path": "drain-a"}, ADMIN_AUTH), 409,
                 "adapter_in_use")
    assert "still draining" in err["message"]
    assert _metric(server, "preft_adapters_draining") == 1
    long_t.join(300)
    running_for = time.monotonic() - t0
    deadline = time.monotonic() + 10
    while (r := httpx.delete(f"{server.url}/v1/adapters/drain-a", headers=ADMIN_AUTH)).status_code == 202:
        assert time.monotonic() < deadline, "still draining 10 s after its last long request ended"
        time.sleep(0.05)
    unloaded_after = time.monotonic() - t0
    _error(r, 404, "model_not_found")
    stop.set()
    for w in workers:
        w.join(120)
    assert long_out["text"] == solo_long
    assert set(short_outputs) <= {solo_short} and set(codes) <= {200, 404} and 404 in codes, (set(codes), short_outputs)
    assert unloaded_after < running_for + 10
    assert _metric(server, "preft_adapters_draining") == 0 and _metric(server, "preft_adapter_references") == 0
    assert _post(server, "/v1/adapters", {"name": "drain-a", "path": "drain-a"}, ADMIN_AUTH).status_code == 200
    assert _stream(server.url, "drain-a", "short", 24) == solo_short
    r = httpx.delete(f"{server.url}/v1/adapters/drain-a", headers=ADMIN_AUTH)
    assert r.status_code == 200 and r.json()["state"] == "unloaded", r.text


def _closed_by_server(socks: list[socket.socket], timeout: float) -> set[int]:
    """Indices of the sockets the server closed (EOF or reset, no response) within `timeout` s."""
    readable, _, _ = select.select(socks, [], [], timeout)
    out = set()
    for s in readable:
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        assert data == b"", data                         # closed without an answer: no request ever started
        out.add(socks.index(s))
    return out


def test_slowloris_and_slow_bodies_are_cut_off(server):
    """200 connections that never finish their headers (some trickling a byte at a time) are closed
    within the header timeout (2 s here); a body that does not arrive in time is a 408; headers
    beyond --max-header-bytes are a 431 (400 when they trickle in); normal clients are served throughout."""
    fds0 = server.open_fds()
    socks = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + (b"X-a: b\r\n" if i % 2 else b""))
        socks.append(s)
    t0 = time.monotonic()
    ok = _post(server, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and httpx.get(f"{server.url}/health").status_code == 200
    closed: set[int] = set()
    while len(closed) < len(socks) and time.monotonic() - t0 < 30:   # 2 s + a loaded CPU's delay
        for i in range(1, len(socks), 4):                # the trickling ones: a header byte every ~0.25 s
            if i not in closed:
                try:
                    socks[i].sendall(b"X")
                except OSError:
                    closed.add(i)
        open_socks = [s for i, s in enumerate(socks) if i not in closed]
        closed |= {socks.index(s) for s in (open_socks[j] for j in _closed_by_server(open_socks, 0.25))}
    waited = time.monotonic() - t0
    for s in socks:
        s.close()
    assert len(closed) == len(socks) and waited < 30, (len(closed), waited)   # not held for good
    # a slow body: complete headers, then 10 of 100 bytes
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
              + f"Authorization: Bearer {API}\r\n\r\n".encode() + b'{"model": ')
    s.settimeout(40)
    t1 = time.monotonic()
    answer = s.recv(65536)
    while answer and b"request_timeout" not in answer:     # the body may come in a later packet
        more = s.recv(65536)
        if not more:
            break
        answer += more
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer
    assert 1.5 < time.monotonic() - t1 < 30
    s.close()
    # oversized headers: 431 when they arrive at once, 400 from h11 when they trickle in past the limit
    _error(httpx.get(f"{server.url}/health", headers={"X-Big": "a" * 20000}), 431, "headers_too_large")
    s = socket.create_connection(("127.0.0.1", server.port))
    s.settimeout(10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    for _ in range(3):
        s.sendall(b"X-Big: " + b"a" * 8000 + b"\r\n")
        time.sleep(0.05)
    assert s.recv(65536).startswith(b"HTTP/1.1 400 ")
    s.close()
    deadline = time.monotonic() + 10
    while server.open_fds() > fds0 + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.open_fds() <= fds0 + 4, (fds0, server.open_fds())
    assert _post(server, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 4}).status_code == 200


def test_api_docs_need_the_key(server):
    for path in ("/docs", "/redoc"):
        assert httpx.get(server.url + path).status_code == 404
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert httpx.get(server.url + "/health").status_code == 200                  # probes stay open


def test_sigterm_drains_with_health_503_until_exit(tmp_path):
    """SIGTERM with streams running: /health answers 503 "shutting_down" (never connection refused)
    and new requests 503 until the streams have finished; then the process exits cleanly."""
    srv = ServerProcess(["--model", "tiny", "--warmup", "none", "--max-num-seqs", "4", "--max-model-len", "1024",
                         "--max-num-batched-tokens", "64", "--block-size", "64", "--shutdown-grace", "120",
                         "--log-level", "info"], tmp_path / "server.log")
    try:
        _stream(srv.url, "tiny", "warm", 8)
        # 3 requests x n=4 sequences x 1000 tokens on 4 decode rows: three waves to drain (the tiny model
        # decodes 1000 tokens in about a second)
        # (ignore_eos: about 1 random prompt in 100 leads the tiny model's greedy path to its EOS)
        body = {"model": "tiny", "prompt": "p", "max_tokens": 1000, "n": 4, "temperature": 0, "stream": True,
                "ignore_eos": True}
        finishes, started = [], [threading.Event() for _ in range(3)]

        def stream(ev):
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(body, prompt=f"p{id(ev)}"),
                              timeout=300) as r:
                # the response has started: the request is queued in the engine (the server submits
                # before it answers). Waiting for a stream's first token instead would send SIGTERM only
                # once the first two waves had run, leaving one short wave to drain: under load, only 2
                # polls seen (the third request's sequences decode after the first two's)
                if r.status_code == 200:
                    ev.set()
                for line in r.iter_lines():
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"] if line.startswith("data: {") else None
                    if reason is not None:
                        finishes.append(reason)
        threads = [threading.Thread(target=stream, args=(ev,)) for ev in started]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(120)
        srv.signal(signal.SIGTERM)
        seen = []
        # the engine drains until the streams end: no refused connection (the loop runs while ANY stream
        # runs)
        while any(t.is_alive() for t in threads) and len(finishes) < 12:
            try:
                h = httpx.get(f"{srv.url}/health", timeout=10)
                r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
            except httpx.TransportError:     # refused only once every stream has ended (the process exits then)
                for t in threads:
                    t.join(timeout=30)
                assert len(finishes) == 12, (seen, finishes)
                break
            seen.append(h.status_code)
            assert h.status_code == 503 and h.json()["status"] == "shutting_down", h.text
            assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert len(seen) >= 3 and finishes.count("length") == 12, (seen, finishes)
        assert srv.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = srv.log_text()
        assert "received SIGTERM: draining" in log and "Traceback" not in log, log[-3000:]
    finally:
        srv.stop()
