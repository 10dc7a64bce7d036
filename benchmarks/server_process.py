"""A real `python -m serve server` in its own process on 127.0.0.1, for drivers and tests that need
one (signals, shutdown, slowloris, soak): start it, wait until /health answers 200, read its RSS,
open file descriptors and threads from /proc, stop it with a signal.

    with ServerProcess(["--model", "tiny", "--max-num-seqs", "4"], log_path) as srv:
        httpx.get(f"{srv.url}/health")
"""
from __future__ import annotations

import collections
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str | os.PathLike, startup_timeout: float = 600.0,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = pathlib.Path(log_path)
        self.log = open(self.log_path, "w")
        env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), PYTHONUNBUFFERED="1",
                   **(env or {}))
        if "--log-level" not in args:
            args = [*args, "--log-level", "warning"]
        self.proc = subprocess.Popen([sys.executable, "-m", "serve", "server", "--port", str(self.port), *args],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {startup_timeout:.0f} s: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _status(self, key: str) -> int:
        for line in open(f"/proc/{self.proc.pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
        return 0

    def rss_mb(self) -> float:
        return self._status("VmRSS") / 1024

    def threads(self) -> int:
        return self._status("Threads")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def thread_names(self) -> collections.Counter:
        """How many of the server's threads have each name (/proc/<pid>/task/*/comm): the runtime's
        native threads by their own names (XLA's pools, OpenMP's team); a Python thread is named
        after the process before Python 3.14, which names it after the thread."""
        return collections.Counter(_read(f"/proc/{self.proc.pid}/task/{t}/comm")
                                   for t in _listdir(f"/proc/{self.proc.pid}/task"))

    def fd_targets(self) -> collections.Counter:
        """How many of the server's open descriptors point at each kind of target ("socket",
        "anon_inode:[eventfd]", a file's path, ...; /proc/<pid>/fd/*)."""
        out = collections.Counter()
        for fd in _listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.proc.pid}/fd/{fd}")
            except OSError:                                  # closed since it was listed
                continue
            out[target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else target] += 1
        return out

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:                                          # the process has exited
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:                                          # the thread has exited
        return "?"


def grown(before: collections.Counter, after: collections.Counter) -> str:
    """What `after` has more of than `before` ("name x2, other x1"), "" when nothing."""
    more = after - before
    return ", ".join(f"{k} x{n}" for k, n in sorted(more.items()))
