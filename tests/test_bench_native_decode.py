"""benchmarks/native_decode.py on the tiny model: a table row per `--rows` value, and the two engines'
greedy outputs equal request for request (the independent check: XLA's step)."""
import re

import pytest

from benchmarks import native_decode
from pallas_kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="native CPU decode unavailable")


@pytest.mark.slow
def test_native_decode_bench_prints_a_row_and_equal_outputs(capsys):
    assert native_decode.main(["--model", "tiny", "--rows", "5", "--repeats", "1", "--calls", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| 5 \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+ \([\d.]+-[\d.]+\) \| [\d.]+x \(", out, re.M), out
    assert "# 5 rows: greedy outputs equal, native vs XLA: 5 of 5 requests" in out, out
