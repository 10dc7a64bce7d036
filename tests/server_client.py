"""Client helpers for tests that talk to a real server process."""
from __future__ import annotations

import json
import threading

import httpx


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, first: threading.Event | None = None,
                      headers=None) -> str:
    """The text of a greedy streamed completion (asserting 200 and no error event); `first` is set at
    the first chunk."""
    out = []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                assert "error" not in data, data
                out.append(data["choices"][0]["text"])
                if first is not None:
                    first.set()
    return "".join(out)
