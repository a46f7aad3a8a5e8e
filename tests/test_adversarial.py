"""The rule user against an optimiser: degenerate strategies over whole dialogues (tests/adversarial.py)
must end below the start and never reach 100, the warm style must hold its bars, and good first replies
written independently of the rules must beat a neutral reply."""
import asyncio
import json
import statistics
from pathlib import Path

import pytest
from adversarial import NEUTRAL, PROTOCOLS, STRATEGIES, finals, format_table, table

import simulator

# 64 first replies (48 training, 16 benchmark profiles), written by a separate writer who read only the
# users' opening messages, never the rule user's code or cue lists: replies the rules did not shape.
INDEPENDENT_REPLIES = Path(__file__).resolve().parent / "data" / "independent_replies.jsonl"


@pytest.fixture(scope="module")
def results():
    return table()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("variant", simulator.VARIANTS)
def test_every_degenerate_strategy_ends_below_the_start_and_never_reaches_100(results, variant, protocol):
    start = PROTOCOLS[protocol][1]
    for name in STRATEGIES:
        values = results[(name, variant, protocol)]
        assert statistics.mean(values) < start, f"{name}: {statistics.mean(values):.1f}"
        assert max(values) < simulator.MAX_EMOTION, name
    assert "| cue-phrase salad, 8 rotating templates |" in format_table(results)


def test_the_warm_style_holds_its_bars_on_the_training_profiles(results):
    warm = "warm and specific (tests/reply_styles.py)"
    assert statistics.mean(results[(warm, "vanilla", "train")]) >= 90
    assert statistics.mean(results[(warm, "challenging", "train")]) >= 75


def first_change(profile, reply: str, variant: str) -> int:
    user = simulator.make_simulator(profile, variant=variant)
    asyncio.run(user.open(profile.first_talk))
    return asyncio.run(user.respond(reply)).change


@pytest.mark.parametrize("variant", simulator.VARIANTS)
def test_independently_written_good_replies_beat_a_neutral_one_by_5_and_never_lose_to_it(variant):
    replies = {row["id"]: row["reply"] for row in map(json.loads, INDEPENDENT_REPLIES.read_text().splitlines())}
    profiles = [p for path in (simulator.DEFAULT_PROFILES, simulator.DEFAULT_BENCHMARK_PROFILES)
                for p in simulator.load_profiles(path)]
    assert sorted(replies) == sorted(p.id for p in profiles)
    gains = {p.id: first_change(p, replies[p.id], variant) - first_change(p, NEUTRAL, variant) for p in profiles}
    assert statistics.mean(gains.values()) >= 5
    assert min(gains.values()) >= 0, {k: v for k, v in gains.items() if v < 0}


def test_a_strategy_is_played_to_the_end_of_its_dialogue():
    values = finals(lambda p, m, t, r: NEUTRAL, "vanilla", "train")
    assert len(values) == 48 and all(v < 10 for v in values)  # -5 a turn from 30: gone below 10 by turn 5
