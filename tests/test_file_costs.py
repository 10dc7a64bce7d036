"""conftest.py's pytest-xdist scheduler hands out the costliest test file left (tests/file_costs.py).
Checked by driving the scheduler the hook returns through xdist's own work-unit machinery with fake
workers on a simulated clock, against xdist's stock `--dist loadfile` order and the lower bound of any
schedule (max(total / workers, the longest file))."""
from __future__ import annotations

import heapq
import json
import pathlib
import types

import pytest

import conftest
import file_costs

xdist_scheduler = pytest.importorskip("xdist.scheduler")


class FakeWorker:
    """What xdist's scheduler calls on a worker: it queues the test indexes it is sent."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down, self.queue = False, []

    def send_runtest_some(self, indexes):
        self.queue.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def _config(workers: int):
    return types.SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None,
                                 getoption=lambda name: "loadfile" if name == "dist" else None,
                                 option=types.SimpleNamespace(loadscopereorder=True))


def makespan(sched, files: dict[str, tuple[int, float]]) -> tuple[float, list[str]]:
    """Runs `files` ({path: (number of tests, seconds)}) through `sched` with its fake workers on a
    simulated clock (each test takes its file's seconds / tests): (the time the last test ends, the
    files in the order they were started)."""
    collection = [f"{f}::test_{i}" for f, (n, _) in files.items() for i in range(n)]
    workers = [FakeWorker(f"gw{i}") for i in range(sched.numnodes)]
    for w in workers:
        sched.add_node(w)
    for w in workers:
        sched.add_node_collection(w, collection)
    sched.schedule()
    clock, started, events = {w: 0.0 for w in workers}, [], []

    def start(w):
        if w.queue:
            idx = w.queue.pop(0)
            f = collection[idx].split("::")[0]
            if f not in started:
                started.append(f)
            n, seconds = files[f]
            clock[w] += seconds / n
            heapq.heappush(events, (clock[w], w.gateway.id, idx, w))

    for w in workers:
        start(w)
    end = 0.0
    while events:
        t, _, idx, w = heapq.heappop(events)
        end = max(end, t)
        sched.mark_test_complete(w, idx)
        start(w)
    assert sorted(started) == sorted(files), "every file ran"
    return end, started


def test_heaviest_picks_the_costliest_unit_first_among_equals():
    cost = file_costs.cost_of({"a.py": 1.0, "b.py": 5.0, "c.py": 5.0})
    assert file_costs.heaviest({"a": ["a.py"], "b": ["b.py"], "c": ["c.py"]}, cost) == "b"
    assert file_costs.heaviest({"ac": ["a.py", "c.py"], "b": ["b.py"]}, cost) == "ac"     # a unit's files add up
    assert cost(["new.py"]) == 5.0                                     # unknown: the table's median
    with pytest.raises(ValueError, match="no work unit left"):
        file_costs.heaviest({}, cost)


def test_the_one_test_soak_file_runs_first_not_last(monkeypatch):
    # xdist's own order is by number of tests: the 1-test, 300 s file comes last and runs alone
    files = {"tests/test_soak_like.py": (1, 300.0), **{f"tests/test_many_{i}.py": (10, 30.0) for i in range(20)}}
    monkeypatch.setattr(file_costs, "load", lambda path=None: {f: s for f, (_, s) in files.items()})
    bound = max(sum(s for _, s in files.values()) / 2, 300.0)                          # 450 s
    stock, stock_order = makespan(xdist_scheduler.LoadFileScheduling(_config(2)), files)
    ours, our_order = makespan(conftest.pytest_xdist_make_scheduler(_config(2), None), files)
    assert stock_order[-1] == "tests/test_soak_like.py" and stock >= 590.0
    assert our_order[0] == "tests/test_soak_like.py"
    assert ours <= 1.02 * bound, (ours, bound)


def test_recorded_table_schedules_near_the_bound_and_names_existing_files():
    table = file_costs.load()
    assert len(table) >= 50, "tests/file_costs.json is missing or nearly empty: python tests/file_costs.py JUNIT_XML"
    root = pathlib.Path(__file__).resolve().parent.parent
    stale = [f for f in table if not (root / f).is_file()]
    assert not stale, f"tests/file_costs.json names files that are gone: {stale}"
    files = {f: (1, s) for f, s in table.items()}
    ours, order = makespan(conftest.pytest_xdist_make_scheduler(_config(2), None), files)
    bound = max(sum(table.values()) / 2, max(table.values()))
    assert order[0] == max(table, key=table.get)
    assert ours <= 1.03 * bound, (ours, bound)


def test_table_is_written_from_a_junit_report(tmp_path, monkeypatch):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_soak" name="test_a" time="2.5"/>
<testcase classname="tests.test_soak" name="test_b" time="1.0"/>
<testcase classname="tests.pallas.test_bgmv" name="test_c" time="0.3"/>
<testcase classname="tests.test_engine.TestSomething" name="test_d" time="4"/>
<testcase classname="tests.test_no_such_file" name="test_e" time="9"/>
</testsuite></testsuites>""")
    out = tmp_path / "file_costs.json"
    monkeypatch.setattr(file_costs, "TABLE", out)
    assert file_costs.main([str(xml)]) == 0
    assert json.loads(out.read_text())["seconds"] == {"tests/test_soak.py": 3.5, "tests/pallas/test_bgmv.py": 0.3,
                                                      "tests/test_engine.py": 4.0}
    assert file_costs.load(out) == {"tests/test_soak.py": 3.5, "tests/pallas/test_bgmv.py": 0.3,
                                    "tests/test_engine.py": 4.0}
    out.write_text("{not json")
    assert file_costs.load(out) == {}                       # unreadable: every file costs the same
    assert file_costs.main([str(tmp_path / "missing.xml")]) == 1
    xml.write_text('<testsuites><testsuite><testcase classname="elsewhere.test_x" time="1"/></testsuite></testsuites>')
    assert file_costs.main([str(xml)]) == 1
