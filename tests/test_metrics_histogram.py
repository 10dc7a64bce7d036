"""`LatencyHistogram.observe_many` (one decode call's inter-token gaps at once) against one
`observe` per value: the same buckets (values on a bound fall in it, as bisect_left) and sum."""
import math

import numpy as np

from serve.metrics import INTER_TOKEN_BUCKETS, LatencyHistogram


def test_observe_many_equals_one_observe_per_value():
    rng = np.random.default_rng(0)
    bounds = [float(b) for b in INTER_TOKEN_BUCKETS]
    values = np.concatenate([rng.exponential(0.02, 300), rng.choice(bounds, 40), [0.0, 1e9]]).tolist()
    rng.shuffle(values)
    one, many = (LatencyHistogram("h", "doc", INTER_TOKEN_BUCKETS) for _ in range(2))
    for v in values:
        one.observe(v)
    for i in range(0, len(values), 64):
        many.observe_many(values[i:i + 64])
    many.observe_many([])
    for v, n in ((values[3], 5), (bounds[2], 7), (0.0, 3)):   # one distinct value: observe_many's fast path,
        for _ in range(n):                                  # and observe_n
            one.observe(v)
        many.observe_many([v] * (n - 1))
        many.observe_n(v, 1)
    values += [values[3]] * 5 + [bounds[2]] * 7 + [0.0] * 3
    assert many.counts == one.counts and sum(one.counts) == len(values)
    assert math.isclose(many.sum, one.sum, rel_tol=1e-12)
    assert one.counts[-1] >= 1 and any(one.counts[bounds.index(b)] for b in bounds[:3])
