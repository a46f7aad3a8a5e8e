"""The rule user against an optimiser: degenerate strategies over whole dialogues (tests/adversarial.py) and
the best policy a black-box search finds (tests/search.py) must end at or below the start and never reach
100, the warm style and the policy that reads the need from the dialogue must hold their bars, the best
need-blind strategy may gain at most a quarter of what the warm style gains, and good first replies written
independently of the rules must gain and never lose to a neutral reply."""
import statistics

import pytest
from adversarial import NEUTRAL, PROTOCOLS, STRATEGIES, finals, format_table, table
from independent_replies import INDEPENDENT_REPLIES, every_profile, first_change, read_replies
from search import protocols, search

import simulator

WARM = "warm and specific (tests/reply_styles.py)"
READS = "reads the need from the dialogue (tests/reply_styles.py)"


@pytest.fixture(scope="module")
def results():
    return table()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("variant", simulator.VARIANTS)
def test_every_degenerate_strategy_ends_at_or_below_the_start_and_never_reaches_100(results, variant, protocol):
    start = PROTOCOLS[protocol][1]
    for name in STRATEGIES:
        values = results[(name, variant, protocol)]
        assert statistics.mean(values) <= start, f"{name}: {statistics.mean(values):.1f}"
        assert max(values) < simulator.MAX_EMOTION, name
    assert "| cue-phrase salad, 8 rotating templates |" in format_table(results)


@pytest.mark.parametrize("protocol", ["train", "benchmark"])
def test_the_warm_style_holds_its_bars(results, protocol):
    assert statistics.mean(results[(WARM, "vanilla", protocol)]) >= 90
    assert statistics.mean(results[(WARM, "challenging", protocol)]) >= 75


def test_a_policy_that_reads_the_need_from_the_dialogue_climbs_on_the_benchmark(results):
    assert statistics.mean(results[(READS, "vanilla", "benchmark")]) >= 60
    assert statistics.mean(results[(READS, "challenging", "benchmark")]) >= 45


@pytest.mark.slow
@pytest.mark.parametrize("variant", simulator.VARIANTS)
def test_the_best_need_blind_strategy_gains_at_most_a_quarter_of_the_warm_gain(results, variant):
    neutral = statistics.mean(results[("neutral", variant, "benchmark")])
    warm_gain = statistics.mean(results[(WARM, variant, "benchmark")]) - neutral
    best = max(statistics.mean(results[(name, variant, "benchmark")]) for name in STRATEGIES)
    assert best - neutral <= warm_gain / 4


@pytest.mark.slow
def test_the_best_policy_a_black_box_search_finds_ends_at_or_below_the_start_and_never_at_100():
    best, best_fitness, evaluated = search(generations=5, population=8)  # the suite's budget: 28 policies
    assert evaluated == 28
    starts = {"train, 2 turns": simulator.TRAIN_START_EMOTION, "train, 8 turns": simulator.TRAIN_START_EMOTION,
              "benchmark": simulator.BENCHMARK_START_EMOTION}
    for (protocol, variant), values in protocols(best).items():
        assert statistics.mean(values) <= starts[protocol], (protocol, variant, best)
        assert max(values) < simulator.MAX_EMOTION, (protocol, variant, best)


@pytest.mark.parametrize("path", INDEPENDENT_REPLIES, ids=lambda path: path.name)
@pytest.mark.parametrize("variant, mean_change", [("vanilla", 5), ("challenging", 3)])
def test_independently_written_good_replies_gain_and_never_lose_to_a_neutral_one(path, variant, mean_change):
    replies, profiles = read_replies(path), every_profile()
    assert sorted(replies) == sorted(p.id for p in profiles)
    changes = {p.id: first_change(p, replies[p.id], variant) for p in profiles}
    assert statistics.mean(changes.values()) >= mean_change
    below = {p.id: changes[p.id] for p in profiles if changes[p.id] < first_change(p, NEUTRAL, variant)}
    assert not below


def test_a_strategy_is_played_to_the_end_of_its_dialogue():
    values = finals(lambda p, m, t, r: NEUTRAL, "vanilla", "train")
    assert len(values) == 48 and all(v < 10 for v in values)  # -5 a turn from 30: gone below 10 by turn 5
