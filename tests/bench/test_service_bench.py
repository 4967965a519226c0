"""The CURVE and API key comparisons' arithmetic in the service benchmark: the order the
stacks take their turns in, and the ratios, intervals and quartiles made of known samples."""

from __future__ import annotations

import itertools

from bench.service_bench import Run, Sample, orders, versus


def test_orders_give_each_stack_each_place_and_each_precedence_equally() -> None:
    names = ["off", "on", "control"]
    turns = orders(names, 12)  # two full turns
    for name in names:
        assert sorted(order.index(name) for order in turns) == [0] * 4 + [1] * 4 + [2] * 4
    for x, y in itertools.permutations(names, 2):
        assert sum(order.index(x) < order.index(y) for order in turns) == 6


def _sample(tokens: int, seconds: float, gateway_cpu_s: float = 0.0) -> Sample:
    return Sample(Run("", seconds, tokens, [], [], []), gateway_cpu_s, 0.0, 0.0)


def test_versus_a_constant_ratio_is_the_total_the_interval_and_every_quartile() -> None:
    # b's pace changes from set to set; a always takes 1 / 0.9 of b's time.
    sets = [{"a": _sample(1000, s / 0.9, 0.002), "b": _sample(1000, s, 0.001)} for s in (0.3, 0.5, 0.31, 0.4, 0.29)]
    v = versus(sets, "a", "b")
    assert abs(v.total - 0.9) < 1e-9
    assert all(abs(x - 0.9) < 1e-9 for x in (*v.ci95, *v.quartiles))
    assert v.cpu_us_per_token["gateway"] == (2.0, 1.0)
    assert all(abs(x - 2.0) < 1e-9 for x in v.gateway_cpu_ci95)  # the same in every resample


def test_versus_one_stalled_run_moves_the_total_not_the_median() -> None:
    sets = [{"a": _sample(1000, 0.3), "b": _sample(1000, 0.3)} for _ in range(20)]
    sets[7]["a"] = _sample(1000, 0.9)  # one run of a stalled for 0.6 s
    v = versus(sets, "a", "b")
    assert v.quartiles == (1.0, 1.0, 1.0)
    assert abs(v.total - 6.0 / 6.6) < 1e-9  # 20 x 0.3 s against 19 x 0.3 + 0.9 s
    assert v.ci95[0] < v.total < v.ci95[1] == 1.0  # resamples without the stalled set: 1.0
