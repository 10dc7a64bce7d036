"""The soak run CI can afford: benchmarks.soak for half a minute of mixed traffic against a real server
(tiny random model). Its own checks are the assertions: greedy outputs equal solo runs, no
unexpected status, KV blocks / adapter references / fds / threads back to idle, RSS bounded,
/metrics adding up, a clean SIGTERM exit. docs/serving.md has the 30-minute run."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from fake_devices import ROOT


@pytest.mark.slow
def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # 32-token steps: the server's full warm-up compiles 70 programs, not the default 128-token budget's
    # 137 (80% of this test's time went to them), and every prompt but the shortest is prefilled in chunks
    # the soak's own 10 s of warm traffic before its idle baseline (5 s: on a loaded 2-core machine too
    # few first uses happened before it - RSS +66.8 MB against the 64 MB limit once, run beside
    # test_env_faults; alone it passed)
    r = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--minutes", "0.5", "--clients", "4",
                        "--warm-seconds", "10", "--json", str(out), "--server-args", "--max-num-batched-tokens", "32"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["passed"]
    checks = {c["check"]: c for c in rep["checks"]}
    assert all(c["ok"] for c in checks.values()), [c for c in checks.values() if not c["ok"]]
    # the traffic really happened: greedy probes judged, adapters cycled through draining
    assert not checks["greedy outputs == solo"]["value"].startswith("0/")
    assert "PASS" in r.stdout and "soak PASSED" in r.stdout


def test_leak_lines_name_what_is_new(tmp_path):
    """The soak's fd and thread checks say what is new when they fail: the server's threads by
    name and its descriptors by target, counted against the idle baseline (here this process)."""
    import collections
    import threading
    import types

    from benchmarks.server_process import ServerProcess, grown
    srv = object.__new__(ServerProcess)                  # its /proc readers only: this process as the server
    srv.proc = types.SimpleNamespace(pid=os.getpid())
    names0, fds0 = srv.thread_names(), srv.fd_targets()
    assert sum(names0.values()) == srv.threads()          # (listing its own fds adds the listing's, here)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    path = tmp_path / "held-open.txt"
    path.write_text("x")
    f = open(path)
    try:
        comm = pathlib.Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip()
        assert grown(names0, srv.thread_names()) == f"{comm} x1"
        assert grown(fds0, srv.fd_targets()) == f"{path} x1"
    finally:
        f.close()
        stop.set()
        t.join()
    assert grown(fds0, srv.fd_targets()) == ""
    assert grown(collections.Counter(a=1), collections.Counter(a=3, b=1)) == "a x2, b x1"
