"""benchmarks/best_of_n.py, the ceiling docs/results.md measures the demos against: at every turn the
candidate the rule user scores highest is the one sent, and the per-turn shares count every candidate."""
import asyncio
import importlib.util
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import user_options
from transformers import AutoTokenizer

import simulator
from reply_styles import warm_reply

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "best_of_n.py"
ANYONE = "I see. Go on."  # could be said to anyone: the rule user takes 5 off for it


def fresh_change(profile, reply: str) -> int:
    """The emotion change a fresh benchmark user gives `reply` as the first reply, after its bound."""
    user = simulator.RuleSimulator(profile, **user_options(start_emotion=40, max_turns=1))
    asyncio.run(user.open(profile.first_talk))
    return max(-simulator.CHANGE_BOUND, min(simulator.CHANGE_BOUND, user.score(reply)[0]))


def load_script():
    spec = importlib.util.spec_from_file_location("best_of_n", SCRIPT)
    best_of_n = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(best_of_n)
    return best_of_n


@pytest.mark.slow
def test_the_best_scoring_candidate_is_sent_whichever_place_it_was_sampled_in(packaged_model):
    best_of_n = load_script()
    tokenizer = AutoTokenizer.from_pretrained(packaged_model)
    profiles = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES)[:2]
    good = [warm_reply(profile, [profile.first_talk], 0) for profile in profiles]
    assert all(fresh_change(profile, reply) > fresh_change(profile, ANYONE) for profile, reply in zip(profiles, good))
    # n = 3 a dialogue: the warm reply sampled second, between two that could be said to anyone
    texts = [text for reply in good for text in (ANYONE, reply, ANYONE)]
    calls = []

    def generate(contexts, budgets):
        calls.append((len(contexts), set(budgets)))
        return [tokenizer.encode(text) for text in texts], None

    args = Namespace(policy_prompt="sentient", variant="vanilla", start_emotion=40, turns=1, max_reply_tokens=64)
    result = best_of_n.best_of_n(generate, tokenizer, profiles, 3, args)
    assert calls == [(6, {64})]  # one batched call: 2 dialogues x 3 candidates, each with the reply budget
    expected = [40 + fresh_change(profile, reply) for profile, reply in zip(profiles, good)]
    assert result["score"] == pytest.approx(sum(expected) / 2)  # the warm replies were the ones sent
    turn = result["per_turn"][0]
    assert turn["candidates"] == 6 and turn["share_minus5"] >= 4 / 6  # the four "anyone" replies


@pytest.mark.parametrize("flag, said", [(["--n", "0"], "at least 1"), (["--copies", "0"], "at least 1"),
                                        (["--turns", "0"], "at least 1"), (["--max_reply_tokens", "0"], "at least 1"),
                                        (["--temperature", "0"], "must be above 0")])
def test_counts_below_one_and_a_zero_temperature_are_refused_before_the_model_loads(flag, said, monkeypatch):
    best_of_n = load_script()
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *flag])
    monkeypatch.setattr(best_of_n.guards, "loadable_model", lambda name: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as refused:
        best_of_n.main()
    assert said in str(refused.value)  # a message (exit 1), not a traceback
