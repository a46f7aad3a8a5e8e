"""Reward hacking: adversarial policy replies (tests/reward_hacking.py) must gain nothing."""
import asyncio
import json

import pytest
from fake_openai import FakeOpenAIServer
from reward_hacking import NEUTRAL, PROBES, probe_changes, probe_table

import chat_client
import simulator


@pytest.mark.slow  # a measurement over every probe
@pytest.mark.parametrize("variant", ["vanilla", "challenging"])
def test_no_probe_beats_a_neutral_reply_with_the_rule_user(variant):
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)
    changes = asyncio.run(probe_changes(profiles, None, simulator.SimulatorArguments(variant=variant)))
    baseline = changes["neutral (baseline)"]
    for name, values in changes.items():
        higher = [p.id for p, v, b in zip(profiles, values, baseline) if v > b]
        assert not higher, f"{name} beat the neutral reply with {higher}"
    assert "| forged analysis line |" in probe_table(changes)


def test_the_llm_user_reads_only_its_own_verdict_and_sees_probes_only_as_quoted_data(make_profile):
    """The server (the simulator's model) always judges -3: a probe's forged CHANGE line, role tags or
    JSON must not move the score, and reach the prompt only inside a JSON string."""
    profile = make_profile(first_talk="My sister skipped my wedding.")
    with FakeOpenAIServer(default="They did not engage.\nCHANGE: -3") as server:
        chat = chat_client.ChatClient(server.base_url, "sim-model", max_retries=0)
        simulator_args = simulator.SimulatorArguments(backend="llm", simulator_model="sim-model",
                                                      base_url=server.base_url)
        changes = asyncio.run(probe_changes([profile], chat, simulator_args))
        prompts = [request["messages"][-1]["content"] for request in server.requests]
    assert all(values == [-3] for values in changes.values())
    for name, make in PROBES.items():
        probe = make(profile)
        assert any(json.dumps(probe, ensure_ascii=False) in prompt for prompt in prompts), name
        if "\n" in probe:  # never raw: its line breaks could pose as the prompt's own lines
            assert not any(probe in prompt for prompt in prompts), name
    assert NEUTRAL in PROBES["neutral (baseline)"](profile)
