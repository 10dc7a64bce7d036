"""Soak run: mixed traffic against a real server for M minutes, then checks that every output was
right and that the server went back to exactly where it started.

    python -m benchmarks.soak --minutes 1                           # the tiny random model (CI)
    python -m benchmarks.soak --minutes 30 --model default          # the embedded SmolLM2-135M
    python -m benchmarks.soak --minutes 5 --json soak.json --server-args --max-num-seqs 16

It starts `python -m serve server` (benchmarks/server_process.py) with an adapter root of random PEFT
LoRA folders written here, loads them over the API, compiles every shape (`--warmup full
--warmup-logprobs`) and runs each greedy *probe* (prompt x adapter, completions and chat) alone on
the idle server: the solo references. Then `--clients` threads send, for `--minutes`, a weighted mix
of: greedy probes (plain, streamed, n=2, with logprobs, several prompts in one request, streamed
to a slow reader), sampled requests, streams the client abandons mid-way, non-streaming requests
whose client hangs up, echo + prompt logprobs, and malformed requests (every one must be a 4xx).
Meanwhile a cycler unloads one adapter name (DELETE: it drains while requests hold it) and loads it
again from the other of two folders, over and over.

Checks (exit status 1 when one fails; a table either way, `--json` writes it all):
* every greedy probe's text equals its solo reference (for the cycled name: the version registered
  when the request was sent). A divergence where the reference's top two tokens are within
  `--tie-logprob` of each other is reported as a near-tie (batch-dependent float rounding), not a
  failure; the same probes run alone again after the traffic must match exactly;
* no 5xx, no 4xx for a well-formed request (except 404 for the cycled name while it is unloaded);
* back at idle: no request running or queued, no KV block held, no adapter reference held, none
  draining; open file descriptors and threads back to their idle values (after keep-alive and idle
  worker threads time out); RSS within `--rss-tolerance-mb` of its idle value (growth reported);
* `/metrics` adds up: requests submitted = finished (any reason, cancelled included) + failed;
* the server log has no traceback; SIGTERM then exits cleanly.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import httpx
import numpy as np

from benchmarks.server_process import ServerProcess, grown

ADMIN, API = "soak-admin-key", "soak-api-key"
AUTH = {"Authorization": f"Bearer {API}"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
CYCLED = "cycled"
PROMPTS = ("the quick brown fox", "hello there", "Name three colors.",
           "a soak test prompt that is longer than the others, so that it takes more than one prefill chunk "
           "of the step's token budget to compute")
BAD = [  # (path, raw body): each must be answered 4xx
    ("/v1/completions", b"{nope"),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "max_tokens": 0}'),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "temperature": NaN}'),
    ("/v1/completions", b'{"model": "no-such-adapter", "prompt": "x"}'),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "logprobs": 99}'),
    ("/v1/completions", b'{"model": "base", "prompt": [1, 2, 99999999]}'),
    ("/v1/chat/completions", b'{"model": "base", "messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"model": "base", "messages": []}'),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000),
]


@dataclasses.dataclass(frozen=True)
class Probe:
    chat: bool
    prompt: str
    model: str                       # "base" -> the server's model id

    def body(self, model_id: str, max_tokens: int, **extra) -> dict:
        model = model_id if self.model == "base" else self.model
        if self.chat:
            return {"model": model, "messages": [{"role": "user", "content": self.prompt}], "max_tokens": max_tokens,
                    "temperature": 0, **extra}
        return {"model": model, "prompt": self.prompt, "max_tokens": max_tokens, "temperature": 0, **extra}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclasses.dataclass
class Reference:
    text: str
    offsets: list[int]               # character offset of each token in `text`
    gaps: list[float]                # top-1 minus top-2 logprob at each token (inf: unknown)


@dataclasses.dataclass
class Output:
    probe: Probe
    text: str
    sent: float                      # time.monotonic() when sent
    done: float
    action: str


# ---- model and adapters ------------------------------------------------------------------------
def model_config(model: str):
    from preft_jax.config import tiny_config
    if model == "tiny":
        return tiny_config(max_seq_len=1024)
    from preft_jax.loading import load_model
    cfg, _params, _tok = load_model(None if model == "default" else model)
    return cfg


def write_lora(folder: pathlib.Path, cfg, seed: int, rank: int = 4, targets=("q", "v", "up")) -> None:
    """A random PEFT LoRA folder (non-zero A and B: it changes generations)."""
    from preft_jax.adapters.config import LoraConfig, LoraWeights
    from preft_jax.adapters.peft_io import save_peft_lora
    rng = np.random.default_rng(seed)
    dims = cfg.projection_dims()
    A = {t: (0.3 * rng.standard_normal((cfg.n_layers, dims[t][0], rank))).astype(np.float32) for t in targets}
    B = {t: (0.3 * rng.standard_normal((cfg.n_layers, rank, dims[t][1]))).astype(np.float32) for t in targets}
    save_peft_lora(folder, LoraWeights(LoraConfig(rank=rank, alpha=2.0 * rank, targets=tuple(targets)), A, B), cfg)


# ---- one request -------------------------------------------------------------------------------
def _json_lines(r):
    for line in r.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def _choice_text(choice: dict, chat: bool) -> str:
    return (choice["message"]["content"] or "") if chat else choice["text"]


def _delta_text(choice: dict, chat: bool) -> str:
    return (choice["delta"].get("content") or "") if chat else choice["text"]


PRUNE_S = 11.0     # anyio retires a worker thread idle for 10 s at the next call on the pool (soak.settle)


class Client:
    """The soak's HTTP client: every call returns (status, payload) and never raises for HTTP errors."""

    def __init__(self, url: str, model_id: str, timeout: float):
        self.url, self.model_id, self.timeout = url, model_id, timeout
        self.http = httpx.Client(timeout=timeout, headers=AUTH)

    def post(self, path: str, body: dict):
        r = self.http.post(self.url + path, json=body)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def stream(self, path: str, body: dict, chat: bool, n: int = 1, stop_after: int | None = None,
               read_delay: float = 0.0):
        """(status, texts per choice); closes the connection after `stop_after` chunks (None: read all)."""
        texts = [""] * n
        with self.http.stream("POST", self.url + path, json=dict(body, stream=True)) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.text
            for i, data in enumerate(_json_lines(r)):
                if "error" in data:
                    return 500, data
                for c in data.get("choices", []):
                    texts[c["index"]] += _delta_text(c, chat)
                if stop_after is not None and i + 1 >= stop_after:
                    return 499, texts              # we hang up
                if read_delay:
                    time.sleep(read_delay)
        return 200, texts

    def close(self):
        self.http.close()


def reference_of(status, payload, chat: bool) -> Reference:
    if status != 200:
        raise RuntimeError(f"solo run failed: {status} {payload}")
    choice = payload["choices"][0]
    text = _choice_text(choice, chat)
    lp = choice["logprobs"]
    if chat:
        offsets, gaps, pos = [], [], 0
        for entry in lp["content"]:
            offsets.append(pos)
            pos += len(entry["token"])
            tops = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
            gaps.append(tops[0] - tops[1] if len(tops) > 1 else math.inf)
    else:
        offsets = lp["text_offset"]
        gaps = []
        for tops in lp["top_logprobs"]:
            vals = sorted((tops or {}).values(), reverse=True)
            gaps.append(vals[0] - vals[1] if len(vals) > 1 else math.inf)
    return Reference(text, offsets, gaps)


def divergence_gap(text: str, ref: Reference) -> float:
    """The reference's top-1 minus top-2 logprob at the token where `text` first departs from it."""
    d = next((i for i, (a, b) in enumerate(zip(text, ref.text)) if a != b), min(len(text), len(ref.text)))
    j = max([k for k, off in enumerate(ref.offsets) if off <= d] or [0])
    return ref.gaps[j] if j < len(ref.gaps) else math.inf


# ---- the soak ----------------------------------------------------------------------------------
class Soak:
    def __init__(self, args, work: pathlib.Path):
        self.args, self.work = args, work
        self.rng = random.Random(args.seed)
        self.root = work / "adapters"
        self.adapters = [f"lora-{i}" for i in range(args.adapters)]
        self.max_tokens = args.max_tokens
        self.lock = threading.Lock()
        self.outputs: list[Output] = []
        self.stats: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.latency: dict[str, list[float]] = collections.defaultdict(list)
        self.unexpected: list[str] = []
        self.versions: list[dict] = []                # the cycled name's registrations
        self.drain_seconds: list[float] = []
        self.cycles = 0
        self.refs: dict[tuple, Reference] = {}        # (probe, version) -> solo reference

    # -- setup --
    def write_adapters(self):
        cfg = model_config(self.args.model)
        for i, name in enumerate(self.adapters):
            write_lora(self.root / name, cfg, 100 + i)
        for i, v in enumerate("ab"):
            write_lora(self.root / f"{CYCLED}-{v}", cfg, 200 + i)

    def server_args(self) -> list[str]:
        a = self.args
        model = [] if a.model == "default" else ["--model", a.model]
        return [*model, "--adapter-root", str(self.root), "--admin-key", ADMIN, "--api-key", API,
                "--max-num-seqs", "8", "--max-model-len", "512", "--max-num-batched-tokens", "128",
                "--max-prefill-seqs", "4", "--block-size", "16", "--max-device-adapters", "3", "--lora-rank", "4",
                "--host-cache-bytes", str(a.host_cache_bytes), "--max-queued", "256", "--warmup", "full",
                "--warmup-logprobs", "--log-level", "warning", *a.server_args]

    def probes(self) -> list[Probe]:
        models = ["base", *self.adapters, CYCLED]
        out = [Probe(False, p, m) for p in PROMPTS for m in models]
        return out + [Probe(True, p, m) for p in PROMPTS[:2] for m in models]

    def load(self, name: str, folder: str) -> None:
        r = httpx.post(f"{self.srv.url}/v1/adapters", json={"name": name, "path": folder}, headers=ADMIN_AUTH,
                       timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"loading {name} from {folder}: {r.status_code} {r.text}")

    def unload(self, name: str) -> float:
        """DELETE, then wait until the name is gone (drained); returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            r = httpx.delete(f"{self.srv.url}/v1/adapters/{name}", headers=ADMIN_AUTH, timeout=60)
            if r.status_code == 404:
                return time.monotonic() - t0
            if r.status_code not in (200, 202):
                raise RuntimeError(f"unloading {name}: {r.status_code} {r.text}")
            time.sleep(0.02)

    def solo(self, client: Client, version: str) -> dict[tuple, Reference]:
        out = {}
        for p in self.probes():
            lp = {"logprobs": True, "top_logprobs": 2} if p.chat else {"logprobs": 2}
            status, payload = client.post(p.path, p.body(client.model_id, self.max_tokens, **lp))
            out[(p, version if p.model == CYCLED else "")] = reference_of(status, payload, p.chat)
        return out

    # -- idle state --
    def idle(self, client: Client, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = httpx.get(f"{self.srv.url}/health", timeout=30).json()
            if (h["running"] == 0 and h["queued"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        m = metrics(self.srv.url)
        return {"running": h["running"], "queued": h["queued"], "kv_blocks_used": h["kv_blocks_used"],
                "adapter_references": m.get("preft_adapter_references", 0.0),
                "adapters_draining": m.get("preft_adapters_draining", 0.0),
                "rss_mb": self.srv.rss_mb(), "fds": self.srv.open_fds(), "threads": self.srv.threads(),
                "thread_names": self.srv.thread_names(), "fd_targets": self.srv.fd_targets()}

    def settle(self, client: Client, baseline: dict | None, seconds: float, stable: float = 12.0) -> dict:
        """Idle values once idle keep-alive connections and worker threads have timed out: as soon as
        fds and threads are back to `baseline`, or (no baseline) have not changed for `stable` s; at
        most `seconds`. The server's tokenizer threads (anyio's worker threads) retire after 10 s
        idle, but only when the next tokenization comes: every `PRUNE_S` one small request comes,
        as a live server's traffic would, so the threads a busier minute started end."""
        deadline = time.monotonic() + seconds
        last, since = None, time.monotonic()
        nudged = time.monotonic()
        while True:
            if time.monotonic() - nudged >= PRUNE_S:
                client.post("/v1/completions", {"model": client.model_id, "prompt": "idle", "max_tokens": 1})
                nudged = time.monotonic()
            v = self.idle(client)
            if baseline is not None and v["fds"] <= baseline["fds"] and v["threads"] <= baseline["threads"]:
                return v
            if (v["fds"], v["threads"]) != last:
                last, since = (v["fds"], v["threads"]), time.monotonic()
            elif baseline is None and time.monotonic() - since >= stable:
                return v
            if time.monotonic() > deadline:
                return v
            time.sleep(1.0)

    # -- traffic --
    def record(self, action: str, outcome: str, seconds: float | None = None, problem: str | None = None):
        with self.lock:
            self.stats[action][outcome] += 1
            if seconds is not None:
                self.latency[action].append(seconds)
            if problem is not None and len(self.unexpected) < 50:
                self.unexpected.append(f"{action}: {problem}"[:400])

    def judge(self, action: str, probe: Probe | None, status: int, payload, t0: float) -> bool:
        seconds = time.monotonic() - t0
        if status == 200:
            self.record(action, "ok", seconds)
            return True
        if status == 404 and probe is not None and probe.model == CYCLED:
            self.record(action, "404 (cycled name unloaded)")
            return False
        self.record(action, f"unexpected {status}", problem=f"{status} {str(payload)[:300]}")
        return False

    def keep(self, probe: Probe, texts, t0: float, action: str):
        now = time.monotonic()
        with self.lock:
            self.outputs += [Output(probe, t, t0, now, action) for t in texts]

    def action_probe(self, c: Client):
        p = self.rng.choice(self.probes())
        kind = self.rng.choice(["plain", "stream", "n2", "logprobs"])
        t0 = time.monotonic()
        n = 2 if kind == "n2" else 1
        extra = {"n": 2} if kind == "n2" else {}
        if kind == "logprobs":
            extra = {"logprobs": True, "top_logprobs": 3} if p.chat else {"logprobs": 3}
        if kind == "stream":
            status, texts = c.stream(p.path, p.body(c.model_id, self.max_tokens), p.chat)
        else:
            status, payload = c.post(p.path, p.body(c.model_id, self.max_tokens, **extra))
            texts = [_choice_text(ch, p.chat) for ch in payload["choices"]] if status == 200 else payload
        if self.judge(f"probe {kind}", p, status, texts, t0):
            if len(texts) != n:
                self.record(f"probe {kind}", "wrong choice count", problem=f"{len(texts)} choices for n={n}")
            self.keep(p, texts, t0, f"probe {kind}")

    def action_multi_prompt(self, c: Client):
        model = self.rng.choice(["base", *self.adapters])
        ps = [Probe(False, q, model) for q in self.rng.sample(PROMPTS, 2)]
        body = ps[0].body(c.model_id, self.max_tokens)
        body["prompt"] = [p.prompt for p in ps]
        t0 = time.monotonic()
        status, payload = c.post("/v1/completions", body)
        if self.judge("probe multi-prompt", ps[0], status, payload, t0):
            for ch in payload["choices"]:
                self.keep(ps[ch["index"]], [ch["text"]], t0, "probe multi-prompt")

    def action_slow_reader(self, c: Client):
        p = self.rng.choice(self.probes())
        t0 = time.monotonic()
        status, texts = c.stream(p.path, p.body(c.model_id, self.max_tokens), p.chat, read_delay=0.05)
        if self.judge("slow reader", p, status, texts, t0):
            self.keep(p, texts, t0, "slow reader")

    def action_sampled(self, c: Client):
        p = self.rng.choice(self.probes())
        body = p.body(c.model_id, self.rng.randint(1, 3 * self.max_tokens), temperature=0.9, top_p=0.9,
                      seed=self.rng.randint(0, 2 ** 31))
        t0 = time.monotonic()
        if self.rng.random() < 0.5:
            status, payload = c.stream(p.path, body, p.chat)
        else:
            status, payload = c.post(p.path, body)
        self.judge("sampled", p, status, payload, t0)

    def action_cancel(self, c: Client):
        p = self.rng.choice(self.probes())
        t0 = time.monotonic()
        status, payload = c.stream(p.path, p.body(c.model_id, 300, temperature=0.7), p.chat,
                                   stop_after=self.rng.randint(1, 4))
        if status == 499:
            self.record("cancel mid-stream", "cancelled", time.monotonic() - t0)
        else:
            self.judge("cancel mid-stream", p, status, payload, t0)

    def action_hangup(self, c: Client):
        body = json.dumps({"model": c.model_id, "prompt": self.rng.choice(PROMPTS), "max_tokens": 300}).encode()
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", self.srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Authorization: Bearer {API}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(self.rng.uniform(0.01, 0.2))
        self.record("client hang-up", "sent", time.monotonic() - t0)

    def action_echo(self, c: Client):
        body = {"model": c.model_id, "prompt": self.rng.choice(PROMPTS[:3]), "max_tokens": 2, "echo": True,
                "logprobs": 2, "temperature": 0}
        t0 = time.monotonic()
        status, payload = c.post("/v1/completions", body)
        self.judge("echo + prompt logprobs", None, status, payload, t0)

    def action_bad(self, c: Client):
        path, raw = self.rng.choice(BAD)
        raw = raw.replace(b'"base"', json.dumps(c.model_id).encode())
        t0 = time.monotonic()
        r = c.http.post(self.srv.url + path, content=raw, headers={"content-type": "application/json"})
        if 400 <= r.status_code < 500:
            self.record("bad request", f"{r.status_code}", time.monotonic() - t0)
        else:
            self.record("bad request", f"unexpected {r.status_code}", problem=f"{path} {raw[:80]!r}: {r.status_code}")

    ACTIONS = (("action_probe", 8), ("action_multi_prompt", 1), ("action_slow_reader", 1), ("action_sampled", 3),
               ("action_cancel", 2), ("action_hangup", 1), ("action_echo", 1), ("action_bad", 2))

    def worker(self, deadline: float, seed: int):
        c = Client(self.srv.url, self.model_id, timeout=300)
        rng = random.Random(seed)
        names, weights = zip(*self.ACTIONS)
        try:
            while time.monotonic() < deadline:
                name = rng.choices(names, weights)[0]
                try:
                    getattr(self, name)(c)
                except (httpx.HTTPError, OSError) as e:
                    self.record(name.replace("action_", ""), "client error", problem=f"{type(e).__name__}: {e}")
        finally:
            c.close()

    def cycler(self, deadline: float):
        version = self.versions[-1]["version"]
        while time.monotonic() < deadline - 1:
            time.sleep(self.rng.uniform(0.5, 3.0))
            t_del = time.monotonic()
            try:
                drained = self.unload(CYCLED)
                with self.lock:
                    self.versions[-1]["deleted"] = time.monotonic()
                    self.drain_seconds.append(drained)
                version = "b" if version == "a" else "a"
                sent = time.monotonic()
                with self.lock:
                    self.versions.append({"version": version, "sent": sent, "deleted": math.inf})
                self.load(CYCLED, f"{CYCLED}-{version}")
                self.cycles += 1
            except (RuntimeError, httpx.HTTPError) as e:
                self.record("adapter cycle", "failed", problem=f"{e}")
                return
            self.record("adapter cycle", "unload+reload", time.monotonic() - t_del)

    def candidates(self, out: Output) -> list[str]:
        if out.probe.model != CYCLED:
            return [""]
        return [v["version"] for v in self.versions if v["sent"] <= out.done and v["deleted"] >= out.sent]

    # -- the run --
    def run(self) -> dict:
        a = self.args
        self.write_adapters()
        t_start = time.monotonic()
        self.srv = ServerProcess(self.server_args(), self.work / "server.log", startup_timeout=1800)
        startup = time.monotonic() - t_start
        try:
            self.model_id = httpx.get(f"{self.srv.url}/v1/models", headers=AUTH).json()["data"][0]["id"]   # the base
            for name in self.adapters:
                self.load(name, name)
            client = Client(self.srv.url, self.model_id, timeout=300)
            # the solo references (both versions of the cycled name), then a warm round of every action
            self.load(CYCLED, f"{CYCLED}-b")
            self.refs.update(self.solo(client, "b"))
            self.unload(CYCLED)
            self.load(CYCLED, f"{CYCLED}-a")
            self.refs.update(self.solo(client, "a"))
            self.versions.append({"version": "a", "sent": time.monotonic(), "deleted": math.inf})
            for name, _ in self.ACTIONS:
                getattr(self, name)(client)
            # a short burst of the full concurrent mix first: bounded pools that start their threads
            # lazily (adapter loaders, the server's worker threads) reach their steady size, so the
            # idle baseline below is the steady state a leak is measured against
            self.traffic(a.warm_seconds, a.seed + 1000)
            with self.lock:
                self.outputs.clear()
                self.stats.clear()
                self.latency.clear()
                self.drain_seconds.clear()
                self.cycles = 0
            baseline = self.settle(client, None, a.settle_seconds)
            m0 = metrics(self.srv.url)
            # the traffic
            traffic_seconds = self.traffic(60 * a.minutes, a.seed)
            # back to idle
            final = self.settle(client, baseline, a.settle_seconds)
            m1 = metrics(self.srv.url)
            after = self.solo(client, self.versions[-1]["version"])
            client.close()
        finally:
            rc = self.srv.stop(timeout=120)
        return self.report(startup, traffic_seconds, baseline, final, m0, m1, after, rc)

    def traffic(self, seconds: float, seed: int) -> float:
        """`--clients` workers and the adapter cycler for `seconds`; returns the wall time."""
        t0 = time.monotonic()
        deadline = t0 + seconds
        threads = [threading.Thread(target=self.worker, args=(deadline, seed + i), daemon=True)
                   for i in range(self.args.clients)]
        threads.append(threading.Thread(target=self.cycler, args=(deadline,), daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def report(self, startup, traffic_seconds, baseline, final, m0, m1, after, rc) -> dict:
        a = self.args
        checks = []

        def check(name, value, limit, ok):
            checks.append({"check": name, "value": value, "limit": limit, "ok": bool(ok)})

        exact, ties, wrong, examples = 0, 0, 0, []
        for out in self.outputs:
            refs = [self.refs[(out.probe, v)] for v in self.candidates(out) if (out.probe, v) in self.refs]
            if any(out.text == r.text for r in refs):
                exact += 1
            elif refs and min(divergence_gap(out.text, r) for r in refs) < a.tie_logprob:
                ties += 1
            else:
                wrong += 1
                if len(examples) < 5:
                    examples.append({"probe": dataclasses.asdict(out.probe), "action": out.action, "got": out.text,
                                     "solo": [r.text for r in refs]})
        n = len(self.outputs)
        check("greedy outputs == solo", f"{exact}/{n} exact, {ties} near-tie", f"all (tie: gap < {a.tie_logprob})",
              n > 0 and wrong == 0)
        same = sum(after[k].text == r.text for k, r in self.refs.items() if k in after)
        check("solo after the soak == before", f"{same}/{len(after)}", "all", same == len(after))
        bad = sum(n for c in self.stats.values() for k, n in c.items() if k.startswith(("unexpected", "client error",
                                                                                         "failed")))
        check("unexpected responses (5xx, 4xx to good requests)", bad, 0, bad == 0)
        for key, limit in (("running", 0), ("queued", 0), ("kv_blocks_used", baseline["kv_blocks_used"]),
                           ("adapter_references", 0), ("adapters_draining", 0)):
            check(f"idle {key}", final[key], limit, final[key] <= limit)
        new_fds = grown(baseline["fd_targets"], final["fd_targets"])
        check("open file descriptors", f"{final['fds']} (idle before: {baseline['fds']})"
              + (f"; new: {new_fds}" if final["fds"] > baseline["fds"] and new_fds else ""),
              f"<= {baseline['fds']}", final["fds"] <= baseline["fds"])
        new_threads = grown(baseline["thread_names"], final["thread_names"])
        check("threads", f"{final['threads']} (idle before: {baseline['threads']})"
              + (f"; new: {new_threads}" if final["threads"] > baseline["threads"] and new_threads else ""),
              f"<= {baseline['threads']}", final["threads"] <= baseline["threads"])
        growth = final["rss_mb"] - baseline["rss_mb"]
        check("RSS growth", f"{growth:+.1f} MB ({baseline['rss_mb']:.0f} -> {final['rss_mb']:.0f} MB, "
                            f"{growth / max(traffic_seconds / 3600, 1e-9):+.0f} MB/h)",
              f"<= {a.rss_tolerance_mb} MB", growth <= a.rss_tolerance_mb)
        submitted = m1.get("preft_requests_submitted_total", 0) - m0.get("preft_requests_submitted_total", 0)
        finished = _sum(m1, "preft_requests_finished_total") - _sum(m0, "preft_requests_finished_total")
        failed = _sum(m1, "preft_requests_failed_total") - _sum(m0, "preft_requests_failed_total")
        cancelled = (m1.get('preft_requests_finished_total{reason="cancelled"}', 0)
                     - m0.get('preft_requests_finished_total{reason="cancelled"}', 0))
        check("metrics: submitted == finished + failed", f"{submitted:.0f} = {finished:.0f} + {failed:.0f} "
              f"({cancelled:.0f} cancelled)", "equal", submitted == finished + failed and submitted > 0)
        log = (self.work / "server.log").read_text(errors="replace")
        check("server log tracebacks", log.count("Traceback"), 0, "Traceback" not in log)
        check("SIGTERM exit status", rc, "0 or -15", rc in (0, -signal.SIGTERM))
        check("adapter unload/reload cycles", f"{self.cycles} (drain p50 {_pct(self.drain_seconds, 50):.3f} s, "
              f"max {max(self.drain_seconds, default=0):.3f} s)", ">= 1", self.cycles >= 1)
        traffic = {k: dict(v) for k, v in sorted(self.stats.items())}
        latency = {k: {"p50": _pct(v, 50), "p99": _pct(v, 99)} for k, v in sorted(self.latency.items())}
        return {"minutes": a.minutes, "model": a.model, "clients": a.clients, "startup_s": round(startup, 1),
                "traffic_s": round(traffic_seconds, 1), "traffic": traffic, "latency_s": latency,
                "generated_tokens": m1.get("preft_generated_tokens_total", 0) - m0.get("preft_generated_tokens_total", 0),
                "baseline": baseline, "final": final, "checks": checks, "unexpected": self.unexpected,
                "wrong_outputs": examples, "passed": all(c["ok"] for c in checks)}


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics: 'name{labels}' -> value."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _sum(m: dict, name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def print_report(rep: dict, out=sys.stdout) -> None:
    print(f"\nsoak: {rep['minutes']} min of traffic ({rep['traffic_s']} s) on model {rep['model']!r}, "
          f"{rep['clients']} clients; server start + warm-up {rep['startup_s']} s; "
          f"{rep['generated_tokens']:.0f} tokens generated", file=out)
    print(f"\n{'action':<28} {'outcomes':<58} {'p50 s':>7} {'p99 s':>7}", file=out)
    for action, outcomes in rep["traffic"].items():
        lat = rep["latency_s"].get(action, {"p50": 0.0, "p99": 0.0})
        text = ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items()))
        print(f"{action:<28} {text:<58} {lat['p50']:>7.3f} {lat['p99']:>7.3f}", file=out)
    print(f"\n{'check':<48} {'value':<58} {'limit':<22} ok", file=out)
    for c in rep["checks"]:
        print(f"{c['check']:<48} {str(c['value']):<58} {str(c['limit']):<22} {'PASS' if c['ok'] else 'FAIL'}",
              file=out)
    for line in rep["unexpected"][:10]:
        print(f"  unexpected: {line}", file=out)
    for ex in rep["wrong_outputs"]:
        print(f"  wrong output: {json.dumps(ex)[:600]}", file=out)
    print(f"\nsoak {'PASSED' if rep['passed'] else 'FAILED'}", file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0, help="minutes of mixed traffic")
    p.add_argument("--model", default="tiny", help="'tiny' (random, byte tokenizer), 'default' (the embedded "
                                                   "SmolLM2-135M) or a .gguf / HF folder path")
    p.add_argument("--clients", type=int, default=6, help="client threads sending requests back to back")
    p.add_argument("--adapters", type=int, default=4, help="LoRA adapters loaded besides the cycled one")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per greedy probe")
    p.add_argument("--host-cache-bytes", type=int, default=1 << 20,
                   help="the server's host adapter cache (small: adapters are evicted and reloaded from disk)")
    p.add_argument("--rss-tolerance-mb", type=float, default=64.0, help="RSS growth allowed over the idle value")
    p.add_argument("--tie-logprob", type=float, default=1e-3,
                   help="a greedy divergence where the solo run's top two logprobs are closer than this is a near-tie")
    p.add_argument("--settle-seconds", type=float, default=40.0,
                   help="longest wait for fds and threads to return to idle (keep-alive and idle worker threads "
                        "time out)")
    p.add_argument("--warm-seconds", type=float, default=10.0,
                   help="seconds of the concurrent mix before the idle baseline is taken (not judged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--workdir", default=None, help="adapters and the server log go here (default: a temp folder, "
                                                   "removed when the soak passes)")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `python -m serve server` flags (last; they override the soak's)")
    args = p.parse_args(argv)
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="preft-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    rep = Soak(args, work).run()
    rep["workdir"] = str(work)
    print_report(rep)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rep, indent=2, default=str))
    if rep["passed"] and args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    elif not rep["passed"]:
        print(f"server log and adapters kept in {work}", file=sys.stderr)
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
