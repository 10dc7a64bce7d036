"""Which test file a pytest-xdist worker takes next: the heaviest one left (conftest.py's scheduler).

With `--dist loadfile` a worker that runs low on tests takes the next whole file from a queue that
pytest-xdist orders by number of tests, so one-test files come last - among them the half-minute soak
(tests/test_soak.py, ~4.8 min with its server's warm-up): on the suite of 2026-12-06 it started after
every other file and ran alone for minutes while the other worker sat idle (1603 s wall for 2835 s of
tests on two workers). Taking the longest file left first (longest-processing-time-first list
scheduling) ends both workers at nearly the same time.

The costs are the files' seconds in a recorded full run (file_costs.json: each test's setup + call +
teardown, from a JUnit XML report). A file missing from the table (new) costs the table's median;
a stale table only schedules worse, never runs fewer tests. Rewrite it after a full run:

    JAX_PLATFORMS=cpu python -m pytest -q -p no:cacheprovider --junitxml=/tmp/junit.xml
    python tests/file_costs.py /tmp/junit.xml          # writes tests/file_costs.json
"""
from __future__ import annotations

import json
import pathlib
import statistics
import sys
from typing import Callable, Iterable

TABLE = pathlib.Path(__file__).with_name("file_costs.json")


def load(path: pathlib.Path = TABLE) -> dict[str, float]:
    """{test file path relative to the repository (as in a pytest node id): seconds}; {} when the table
    is missing or unreadable (then every file costs the same and the queue keeps xdist's order)."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        return {str(k): float(v) for k, v in table["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def cost_of(table: dict[str, float]) -> Callable[[Iterable[str]], float]:
    """cost(files): the summed seconds of a work unit's files (a unit may group several files), a
    file not in `table` at the table's median."""
    default = statistics.median(table.values()) if table else 1.0
    return lambda files: sum(table.get(f, default) for f in files)


def heaviest(units: dict[str, Iterable[str]], cost: Callable[[Iterable[str]], float]) -> str:
    """The unit to hand out next: the costliest; among equal costs the first in `units`' order."""
    if not units:
        raise ValueError("no work unit left")
    return max(units, key=lambda name: cost(units[name]))          # max keeps the first of equals


def from_junit(xml_path: str) -> dict[str, float]:
    """{file: seconds} summed over a JUnit XML report's test cases (pytest's classname is the dotted
    module path, plus the class for tests in a class)."""
    import xml.etree.ElementTree as ET
    root = pathlib.Path(__file__).resolve().parent.parent
    out: dict[str, float] = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for n in range(len(parts), 0, -1):                    # the longest prefix that is a file
            rel = "/".join(parts[:n]) + ".py"
            if (root / rel).is_file():
                out[rel] = out.get(rel, 0.0) + float(case.get("time") or 0.0)
                break
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python tests/file_costs.py JUNIT_XML  (writes tests/file_costs.json)", file=sys.stderr)
        return 2
    try:
        seconds = from_junit(argv[0])
    except (OSError, ValueError) as e:                         # ET.ParseError is a ValueError
        print(f"error: {argv[0]}: {e}", file=sys.stderr)
        return 1
    if not seconds:
        print(f"error: {argv[0]}: no test case of a file in this checkout", file=sys.stderr)
        return 1
    TABLE.write_text(json.dumps({"about": "seconds per test file in one full run; tests/file_costs.py",
                                 "seconds": {k: round(v, 1) for k, v in sorted(seconds.items())}},
                                indent=1) + "\n", encoding="utf-8")
    print(f"{TABLE}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
