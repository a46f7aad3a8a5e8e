"""Blind live play (tests/live_play.py): the driver shows a player only what a policy sees, and the dialogues
played blind after the last change to the rules replay as their players saw them and hold the bars that
docs/rule_user.md reports (the rule user judged from the listener's side)."""
import argparse
import asyncio
import json
import statistics

import pytest
from live_play import MEASURED_ROUND, TRAJECTORIES, new, recorded, replay, say, set_table

import simulator


@pytest.fixture(scope="module")
def measured():
    """{path: (header, turns, replayed)} of every dialogue of the measuring round."""
    return {path: (header, turns, asyncio.run(replay(header, [t["reply"] for t in turns])))
            for path, (header, turns) in recorded().items() if header["round"] == MEASURED_ROUND}


def finals(measured, style: str, variant: str) -> dict[str, int]:
    return {header["profile"]: played["emotions"][-1] for header, _, played in measured.values()
            if (header["style"], header["variant"]) == (style, variant)}


@pytest.mark.slow
def test_every_measured_dialogue_replays_as_its_player_saw_it(measured):
    # The tolerance is none: the rule user is deterministic, so every message the player saw comes back.
    assert len(measured) == 16 + 8 + 8 + 8
    for path, (header, turns, played) in measured.items():
        assert played["messages"] == [t["message"] for t in turns], path
        assert played["unplayed"] == 0 and (played["done"] or len(turns) == simulator.BENCHMARK_MAX_TURNS), path


@pytest.mark.slow
def test_no_user_message_is_empty_in_any_measured_dialogue(measured):
    assert all(message.strip() for _, _, played in measured.values() for message in played["messages"])


@pytest.mark.slow
def test_the_recorded_emotions_come_back(measured):
    kept = json.loads(TRAJECTORIES.read_text(encoding="utf-8"))
    for path, (_, _, played) in measured.items():
        assert played["emotions"] == kept[f"{path.parent.name}/{path.name}"], path


@pytest.mark.slow
def test_a_skilled_listener_is_paid_and_an_ordinary_friend_and_a_cold_one_less(measured):
    skilled, friend = finals(measured, "skilled", "vanilla"), finals(measured, "friend", "vanilla")
    assert statistics.mean(skilled.values()) >= 65 and sum(f >= 90 for f in skilled.values()) >= 5
    assert statistics.mean(finals(measured, "skilled", "challenging").values()) >= 50
    assert statistics.mean(skilled[p] for p in friend) - statistics.mean(friend.values()) >= 25
    assert statistics.mean(finals(measured, "cold", "vanilla").values()) <= 10


@pytest.mark.slow
def test_few_skilled_replies_are_told_they_were_not_heard(measured):
    rows = set_table({path: (header, played) for path, (header, _, played) in measured.items()})
    skilled = rows[f"{MEASURED_ROUND}: skilled, vanilla"]
    assert skilled["unheard"] <= 0.10 * skilled["later_replies"]  # the bar; 11 of 124 when measured


def test_a_dialogue_is_never_started_over_another(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    brief = tmp_path / "brief.txt"
    brief.write_text("Listen well.")
    (tmp_path / "rules.txt").write_text("Play turn by turn.")
    args = argparse.Namespace(file=str(path), profile="en-bench-14", variant="vanilla", style="skilled",
                              player="t", round="test", brief=str(brief))
    new(args)
    opening = capsys.readouterr().out
    assert opening.startswith("[user] My first marathon") and "emotion" not in opening.lower()
    with pytest.raises(SystemExit, match="never started over another"):
        new(args)
    header = json.loads(path.read_text().splitlines()[0])
    assert (header["brief"], header["rules"]) == ("Listen well.", "Play turn by turn.")


def test_a_player_sees_the_users_message_and_never_the_emotion_or_the_reasons(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"profile": "en-bench-10", "variant": "vanilla", "style": "cold", "player": "t",
                                "round": "test", "brief": "", "rules": ""}) + "\n")
    for _ in range(simulator.BENCHMARK_MAX_TURNS):  # a cold reply each turn: the user leaves well before 9
        say(argparse.Namespace(file=str(path), reply="Whatever, it's not a big deal. Get over it."))
        shown = capsys.readouterr().out
        assert shown.startswith("[user] ") and "dismissive" not in shown and "(-" not in shown
        if "left the conversation" in shown:
            break
    assert "left the conversation" in shown
    with pytest.raises(SystemExit, match="it is over"):
        say(argparse.Namespace(file=str(path), reply="Hello?"))
