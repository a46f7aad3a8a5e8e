"""Properties of the simulated user that hold for any input: the official analysis parsers read what the released
code reads, the rule user's bookkeeping obeys its bounds and termination rules, the clamped change is what the
user's reply prompt shows, retries stop at `parse_attempts`, and a bad profile names its file and line.

The official files are third-party code, never committed: the tests that compare with them read a checkout of
github.com/Tencent/digitalhuman from $RLVER_OFFICIAL_REPO (SAGE/ and RLVER/ at its top) and are skipped without it.
"""
import asyncio
import functools
import importlib.util
import os
import re
import types
from pathlib import Path

import pytest
from conftest import OWN_WORDS, llm_user_options, official_user_options, profile_row, user_options, write_jsonl
from hypothesis import example, given
from hypothesis import strategies as st

import common
import llm_user
import official
import rule_user
import rollout
import simulator
from llm_user import LLMSimulator
from simulator import ProfileError, SimulatorError
from test_official_prompts import REPO, ZH_TASK, Exhausted, needs_repo
from test_official_prompts import Recorder as Script

def run(coroutine):
    return asyncio.run(coroutine)


# --------------------------------------------------------------------------------------------
# The released planning_reply, run with its LLM call replaced by a script
# --------------------------------------------------------------------------------------------

NO_SLEEP = types.SimpleNamespace(sleep=lambda seconds: None)  # the official loops sleep 3 s before asking again


@functools.cache
def sage_module():
    spec = importlib.util.spec_from_file_location("official_sage_properties", REPO / official.SAGE_USER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.time = NO_SLEEP
    return module


@functools.cache
def rlver_module():
    """RLVER's simulator. As released it does not compile (call_api's body is not indented) and imports its
    prompts from verl: the docstring is indented and the prompts file run in its namespace, nothing else."""
    folder = REPO / Path(official.RLVER_USER).parent
    module = types.ModuleType("official_rlver_properties")
    exec(compile((folder / "system_prompt.py").read_text(encoding="utf-8"), "system_prompt.py", "exec"),
         module.__dict__)
    source = (REPO / official.RLVER_USER).read_text(encoding="utf-8")
    stub, star_import = 'def call_api(prompt,mode="dsv3"):\n\'\'\'', "from verl.workers.rollout.vllm_rollout.system_prompt import *\n"
    assert source.count(stub) == 1 and source.count(star_import) == 1
    source = source.replace(stub, stub.replace("\n'''", "\n    '''")).replace(star_import, "")
    exec(compile(source, official.RLVER_USER, "exec"), module.__dict__)
    module.time = NO_SLEEP
    return module


def official_reading(source: str, output: str):
    """(change, planning) as the released planning_reply reads `output`, or None where it would ask again."""
    script = Script([output])
    data = {"id": "p", "emo_point": 40, "emo_state": "Emotion-B", "player": "玩家", "scene": "场景",
            "history": [{"role": "user", "content": "唉。"}, {"role": "assistant", "content": "我在听。"}]}
    if source == "sage":
        module = sage_module()
        module.call_llm = script
        call = lambda: module.planning_reply({**data, "target": 0})  # noqa: E731 (see test_official_prompts.py)
    else:
        module = rlver_module()
        module.call_api = script
        player = module.PlayerSimulator.__new__(module.PlayerSimulator)  # its __init__ reads files and calls the API
        player.emo_point, player.emo_state, player.header = 40, "Emotion-B", {}
        player.emo_count = {"Emotion-S": 100, "Emotion-A": 70, "Emotion-B": 40, "Emotion-C": 10}
        call = lambda: player.planning_reply({**data, "target": "eq"})  # noqa: E731
    try:
        _, planning = call()
    except Exhausted:
        return None
    return int(planning["change"]), planning


def our_reading(source: str, output: str):
    try:
        return official.load(source, str(REPO)).parse_analysis(output)
    except ValueError:
        return None


def sections(change: str, colon=":") -> str:
    return "\n".join(f"{header}{colon}\n[{value}]" for header, value in (
        ("Content", "他在安慰我"), ("TargetCompletion", "部分"), ("Reason", "贴合"), ("Activity", "有点被理解"),
        ("Analyse", "还行"))) + f"\nChange{colon}\n{change}"


# (output, what SAGE reads, what RLVER reads); None: the official code asks again. Every row has two integers
# or a sign apart from its digits, so a parser that took the last one, or kept a lone sign, reads another value.
SEVERAL_INTEGERS = [
    (sections("[-3]，本来想给+8"), -3, None),  # SAGE: the first signed integer; RLVER: int() of the line refuses
    (sections("-3\n+8"), -3, -3),  # RLVER: the first line
    (sections("情绪变化：-3\n+8"), -3, 8),  # RLVER: the last line when the text says 变化
    (sections("4 或者 -9"), 4, None),
    (sections("- 6"), 6, None),  # SAGE's regex reads the digits without the detached sign
    (sections(" +7 \n-2"), 7, 7),  # int() allows the spaces around it
    (sections("[+25]\n-1"), 10, 25),  # SAGE clamps to +-10, RLVER does not
    (sections("[-31]\n+2"), -10, -31),
    (sections("−5\n+4"), 5, None),  # a Unicode minus is no sign to either: SAGE reads +5
    ("Content:\n第3次了，不是第7次\nAnalyse:\n烦", 3, None),  # no Change section: SAGE takes the first integer anywhere
    (sections("＋2"), 2, None),
]


@needs_repo
@pytest.mark.parametrize("output, sage, rlver", SEVERAL_INTEGERS)
def test_the_official_parsers_take_the_integer_the_released_code_takes(output, sage, rlver):
    for source, change in (("sage", sage), ("rlver", rlver)):
        expected = official_reading(source, output)
        assert (expected and expected[0]) == change, (source, output)  # the table says what the released code does
        assert our_reading(source, output) == expected, (source, output)


HEADERS = ("Content", "TargetCompletion", "Reason", "Activity", "Analyse")
WORDS = st.text(alphabet="ab 我变化[]“”*+-−0123456789\n", max_size=10)
INTEGER = st.builds(lambda sign, digits: sign + digits,
                    st.sampled_from(["", "+", "-", "−", "+ ", "- ", "＋"]), st.integers(0, 120).map(str))
SEPARATOR = st.sampled_from([" ", "\n", "，", " 或者 ", "\n变化\n", "\n变化：", "变化", "\n\n", "]\n["])


@st.composite
def plain_change_values(draw):
    """A signed integer on its own line, maybe bracketed, maybe followed by another integer (on its own line,
    after 变化, or on the same line)."""
    first, second = (draw(st.sampled_from(["", "+", "-"])) + str(draw(st.integers(0, 40))) for _ in range(2))
    opening, closing = draw(st.sampled_from([("", ""), ("[", "]"), ("“", "”")]))
    after = draw(st.sampled_from(["", "\n{}", "\n变化\n{}", "\n情绪变化：{}", " 或 {}"]))
    return opening + first + closing + after.format(second)


@st.composite
def messy_change_values(draw):
    """Up to three integers, separated, bracketed, quoted, labelled, or no integer at all."""
    integers = draw(st.lists(INTEGER, min_size=1, max_size=3)) if draw(st.integers(0, 5)) else []
    text = draw(SEPARATOR).join(integers) if integers else draw(WORDS)
    opening, closing = draw(st.sampled_from([("", ""), ("[", "]"), ("“", "”"), ("[", ""), ("情绪变化：", "")]))
    return (draw(st.sampled_from(["", "\n", " "])) + opening + text + closing
            + draw(st.sampled_from(["", "\n", " ", "\n我"])))


@st.composite
def analysis_texts(draw, plain: bool):
    """Analysis outputs as models write them: sections present or missing, full-width colons, bold headers,
    a value on the header's line or the next, values with digits in them. `plain`: sections in order, ending
    with a Change section of plain integers; else also sections out of order, no Change section, messy values."""
    colon = draw(st.sampled_from([":", "："]))
    bold = draw(st.sampled_from(["", "**"]))
    gap = st.sampled_from(["\n", "\n", " "])
    parts = [f"{bold}{header}{colon}{bold}{draw(gap)}{draw(WORDS)}" for header in HEADERS if draw(st.booleans())]
    if plain:
        return "\n".join(parts + [f"{bold}Change{colon}{bold}{draw(gap)}{draw(plain_change_values())}"])
    if draw(st.integers(0, 4)):
        value = draw(st.one_of(plain_change_values(), messy_change_values()))
        parts.append(f"{bold}Change{colon}{bold}{draw(gap)}{value}")
    return "\n".join(draw(st.permutations(parts)) if draw(st.booleans()) else parts)


ANALYSIS_TEXTS = st.one_of(analysis_texts(plain=True), analysis_texts(plain=False))


@needs_repo
@example(output="Content:\n][他在安慰我]\nActivity:\n“有点”]\nChange:\n+3")  # brackets stripped one kind at a time
@given(output=ANALYSIS_TEXTS)
def test_any_sage_analysis_is_read_as_the_released_code_reads_it(output):
    assert our_reading("sage", output) == official_reading("sage", output)


@needs_repo
@example(output="Content:\n][他在安慰我]\nReason:\n[a\n\nb]\nChange:\n”“-4”")
@given(output=ANALYSIS_TEXTS)
def test_any_rlver_analysis_is_read_as_the_released_code_reads_it(output):
    assert our_reading("rlver", output) == official_reading("rlver", output)


def official_reply_message(output: str) -> str:
    """The user's message as the released player_reply cuts it from the reply call's output."""
    module = sage_module()
    module.call_llm = Script([output])
    data = {"id": "p", "emo_point": 40, "emo_state": "Emotion-B", "player": "玩家", "scene": "场景", "history": []}
    return module.player_reply(data, {})["history"][-1]["content"]


@needs_repo
@example(output="Response:\n][嗯]")  # "[", then "]": the one left inside stays
@example(output="Thinking:\n想\nResponse:\n”“好”")
@given(output=st.lists(st.one_of(st.sampled_from(["Thinking:\n", "Response:", "Response:\n", "\n", "[", "]", "“", "”"]),
                                 st.text(alphabet="ab 嗯好\n", max_size=6)), max_size=8).map("".join))
def test_any_reply_output_is_cut_as_the_released_code_cuts_it(output):
    assert official.reply_message(output) == official_reply_message(output)


# --------------------------------------------------------------------------------------------
# The rule user: bounds, reasons, determinism and termination, for any replies and options
# --------------------------------------------------------------------------------------------

WARM = ("It sounds like Dana skipping your wedding in Lisbon left you so hurt. "
        "No wonder you can't stop thinking about it. What was that day like for you?")
DISMISSIVE = "Calm down, it's not a big deal."
# About the story in words of its own (grounded, no echo), doing nothing a need asks or minds: flat for every need.
ON_TOPIC_FLAT = "Dana and the wedding in Lisbon were the main topic at family dinners that spring."
REPLY_SENTENCES = [
    WARM, DISMISSIVE, ON_TOPIC_FLAT,
    "It wasn't your fault that Dana missed the Lisbon wedding.",
    "One option: write Dana a short message this week about the Lisbon wedding.",
    "I understand how you feel. That must be hard. I'm here for you.",
    "So you saw her concert photos right after hearing the flight was cancelled.",
    "Maybe she was afraid of the family after the Lisbon plans.",
    "You handled the wedding with real courage, and Dana's absence doesn't change that.",
    "Tell me more about that morning.", "Okay.", "xqzv brtlk mnpq wrrt", "<think>hmm</think>",
    "Looking back, what do you notice about your own part in it?",
]
REPLIES = st.one_of(st.just(WARM), st.sampled_from(REPLY_SENTENCES),
                    st.lists(st.sampled_from(REPLY_SENTENCES), min_size=2, max_size=3).map(" ".join),
                    st.text(max_size=40))
START_EMOTIONS = st.one_of(st.sampled_from([9, 10, 11, 90, 95, 99, 100]), st.integers(0, 100))  # near the ends, or any
POINTS_IN_REASONING = re.compile(r"\(([+-]\d+)\)(?=; |$)")


def play_rule_dialogue(profile, replies, **options):
    """Every turn of a rule-user dialogue (made as the trainers make it: make_simulator with no chat)."""
    async def go():
        user = simulator.RuleSimulator(profile, **user_options(**options))
        await user.open()
        turns = []
        for reply in replies:
            turns.append(await user.respond(reply))
            if turns[-1].done:
                break
        return turns
    return run(go())


def expected_end(emotion: int, turns: int, max_turns: int):
    """The paper's termination rules, in their order; the rule user's own messages never say goodbye."""
    if emotion >= 100:
        return "farewell"
    if emotion < 10:
        return "gave_up"
    return "turn_limit" if turns >= max_turns else None


@example(intention="venting", variant="vanilla", start=95, bound=12, max_turns=3, replies=[WARM])  # capped at 100
@example(intention="venting", variant="challenging", start=3, bound=15, max_turns=3, replies=[DISMISSIVE])  # floored
@given(intention=st.sampled_from(sorted(simulator.INTENTIONS)), variant=st.sampled_from(simulator.VARIANTS),
       start=START_EMOTIONS, bound=st.integers(1, 15), max_turns=st.integers(1, 5),
       replies=st.lists(REPLIES, min_size=1, max_size=5))
def test_any_rule_dialogue_keeps_its_bounds_and_its_rules(intention, variant, start, bound, max_turns, replies):
    profile = simulator.parse_profile(profile_row(intention))
    options = dict(variant=variant, start_emotion=start, change_bound=bound, max_turns=max_turns)
    turns = play_rule_dialogue(profile, replies, **options)
    emotion = start
    for number, turn in enumerate(turns, start=1):
        points = [int(p) for p in POINTS_IN_REASONING.findall(turn.reasoning)]
        assert points and sum(points) == turn.raw_change, turn.reasoning  # every change comes with its reasons
        assert turn.change == max(-bound, min(bound, turn.raw_change))
        emotion = max(0, min(100, emotion + turn.change))
        assert turn.emotion == emotion
        assert turn.end_reason == expected_end(emotion, number, max_turns) and turn.done == (turn.end_reason is not None)
        assert turn.message.strip()
        if turn.end_reason in ("farewell", "gave_up"):
            assert turn.message == {"farewell": rule_user.FAREWELL_MESSAGE,
                                    "gave_up": rule_user.GIVE_UP_MESSAGE}[turn.end_reason]
    assert len(turns) == min(len(replies), max_turns) or turns[-1].end_reason in ("farewell", "gave_up")
    assert play_rule_dialogue(profile, replies, **options) == turns  # the same inputs, the same dialogue


PLAY_IN_ANOTHER_PROCESS = """
import asyncio, json, sys
sys.path[:0] = sys.argv[1:3]
from conftest import profile_row, user_options
import simulator

async def play():
    user = simulator.RuleSimulator(simulator.parse_profile(profile_row("venting")), **user_options())
    await user.open()
    return [[turn.change, turn.reasoning, turn.message] for turn in
            [await user.respond(reply) for reply in json.loads(sys.argv[3])]]

print(json.dumps(asyncio.run(play())))
"""


@pytest.mark.slow  # a measurement over many dialogues or sentences, or a process of its own
def test_a_rule_dialogue_is_the_same_in_another_process_with_another_hash_seed(make_profile):
    # Python salts hash() per process: the user's choice among phrasings must not depend on it.
    import json
    import subprocess
    import sys

    replies = [ON_TOPIC_FLAT, WARM, DISMISSIVE, "Tell me more about that morning."]
    here = [[t.change, t.reasoning, t.message] for t in play_rule_dialogue(make_profile("venting"), replies)]
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", PLAY_IN_ANOTHER_PROCESS, str(tests.parent), str(tests),
                           json.dumps(replies)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == here


def test_a_rule_change_beyond_a_non_default_bound_is_clamped_both_ways(make_profile):
    # Bound 7, distinct from the default 10 and from the rule user's steps of 5: +10 and -10 become +7 and -7.
    gain, loss = play_rule_dialogue(make_profile("venting"), [WARM, DISMISSIVE], change_bound=7, start_emotion=50)
    assert [(t.raw_change, t.change, t.emotion) for t in (gain, loss)] == [(10, 7, 57), (-10, -7, 50)]


@pytest.mark.parametrize("start, emotion, end_reason", [
    (92, 99, None), (93, 100, "farewell"),  # a +10 clamped to +7 reaches 100 from 93, not from 92
    (17, 10, None), (16, 9, "gave_up"),  # a -10 clamped to -7: 10 stays, 9 leaves
])
def test_the_rule_user_leaves_exactly_at_the_thresholds(make_profile, start, emotion, end_reason):
    reply = WARM if emotion > start else DISMISSIVE
    [turn] = play_rule_dialogue(make_profile("venting"), [reply], change_bound=7, start_emotion=start, max_turns=4)
    assert (turn.emotion, turn.end_reason, turn.done) == (emotion, end_reason, end_reason is not None)
    goodbye = {"farewell": rule_user.FAREWELL_MESSAGE, "gave_up": rule_user.GIVE_UP_MESSAGE}.get(end_reason)
    assert (turn.message == goodbye) if goodbye else ("Goodbye" not in turn.message)


def test_the_rule_user_stops_at_max_turns_not_at_the_replies_it_was_given(make_profile):
    # 3 turns of 5 replies, from 55: flat replies keep the emotion away from both thresholds.
    turns = play_rule_dialogue(make_profile("venting", "passive"), [ON_TOPIC_FLAT] * 5, start_emotion=55, max_turns=3)
    assert [t.end_reason for t in turns] == [None, None, "turn_limit"]
    assert all(10 <= t.emotion < 100 for t in turns)


def test_a_flat_reply_still_earns_the_next_line_of_the_story(make_profile):
    # A reply that did not hurt (change 0) earns more of the story, as a gain does; a loss does not.
    [flat] = play_rule_dialogue(make_profile("venting", "passive"), [ON_TOPIC_FLAT])
    assert flat.change == 0 and OWN_WORDS[1] in flat.message
    assert any(flat.message.startswith(r) for r in rule_user.REACTIONS["flat"])  # a shrug, not "not what I need"
    [loss] = play_rule_dialogue(make_profile("venting", "passive"), [DISMISSIVE])
    assert loss.change < 0 and not any(line in loss.message for line in OWN_WORDS)


@pytest.mark.parametrize("start, state, moody", [(35, "C", True), (45, "B", False), (10, "C", True)])
def test_a_negative_user_adds_its_mood_line_only_in_state_c(make_profile, start, state, moody):
    [turn] = play_rule_dialogue(make_profile("venting", "negative"), [ON_TOPIC_FLAT], start_emotion=start)
    assert turn.change == 0 and simulator.emotion_state(turn.emotion) == state
    assert (rule_user.MOOD_LINES["negative"] in turn.message) == moody
    [passive] = play_rule_dialogue(make_profile("venting", "passive"), [ON_TOPIC_FLAT], start_emotion=start)
    assert not any(line in passive.message for line in rule_user.MOOD_LINES.values())  # passive has none


def test_the_mood_line_is_said_once_not_twice_in_a_row(make_profile):
    """New with the measured rules: the mood line is skipped right after a message that ended with it, and comes
    back the message after (state C throughout: 35, 30, 20)."""
    turns = play_rule_dialogue(make_profile("venting", "negative"), [
        ON_TOPIC_FLAT, "Tell me more about that morning.",
        "Lisbon in June must have been lovely for a wedding, whatever Dana did."], start_emotion=35)
    assert [simulator.emotion_state(t.emotion) for t in turns] == ["C"] * 3
    assert [t.message.endswith(rule_user.MOOD_LINES["negative"]) for t in turns] == [True, False, True]


def test_replies_that_do_not_hurt_earn_the_story_line_by_line(make_profile):
    # The second reply reflects (what a venting user asks for) and is heard beside it, tying five details of the
    # story in one sentence with words of its own: specific, so a big gain (measured rules: +10; a reflection in
    # the story's words alone would be hollow, 0).
    flat, gain = play_rule_dialogue(make_profile("venting", "passive"), [
        ON_TOPIC_FLAT, "So you saw her concert photos right after she told you the flight was cancelled, "
                       "on the morning you had waited a whole year for."])
    assert (flat.change, gain.change) == (0, 10) and "gave reflects" in gain.reasoning
    assert OWN_WORDS[1] in flat.message and OWN_WORDS[2] in gain.message


@pytest.mark.parametrize("reply, change", [
    (DISMISSIVE, "loss"), (ON_TOPIC_FLAT, "flat"), (WARM, "gain")])
def test_the_challenging_user_withdraws_only_after_a_loss(make_profile, reply, change):
    [turn] = play_rule_dialogue(make_profile("venting", "passive"), [reply], variant="challenging")
    assert {"loss": turn.change < 0, "flat": turn.change == 0, "gain": turn.change > 0}[change]
    assert any(turn.message.startswith(line) for line in rule_user.WITHDRAWN) == (change == "loss")
    if change != "loss":
        assert turn.message.startswith(OWN_WORDS[1])  # no reaction in words, just more of the story


@pytest.mark.parametrize("reply, unwelcome, change", [
    ("Maybe Dana was afraid of the family at the Lisbon wedding.", "reasons", -5),
    ("Maybe Dana was afraid of the family at the Lisbon wedding. One option is to write to her. "
     "You did nothing wrong.", "advises, clears, reasons", -10),  # 3 unwelcome acts, at most 2 cost
])
def test_unwelcome_acts_cost_five_each_up_to_two(make_profile, reply, unwelcome, change):
    """A venting user's first reply: each sentence plainly one act venting cannot stand (its main act, p >= 0.5),
    and nothing it welcomes."""
    [turn] = play_rule_dialogue(make_profile("venting"), [reply])
    assert f"unwelcome {unwelcome};" in turn.reasoning and turn.raw_change == change


def test_the_vanilla_user_reacts_to_the_worst_reason_not_the_first(make_profile):
    # The second reply is grounded but flat (0, listed first) right after the user showed its need (-10).
    _, second = play_rule_dialogue(make_profile("venting", "passive"), [
        ON_TOPIC_FLAT, "Her concert photos and that cancelled flight make a strange pair of stories, honestly."])
    assert second.reasoning.startswith("for 'venting'") and second.change == -10
    assert any(second.message.startswith(r) for r in rule_user.REACTIONS["ignored"])


# --------------------------------------------------------------------------------------------
# Simulator.respond with LLM backends: the clamped change reaches the reply prompt; bounded retries
# --------------------------------------------------------------------------------------------

class RecordingChat:
    """A chat transport that answers from a script and keeps every list of messages it was sent."""

    def __init__(self, answers):
        self.answers, self.sent = list(answers), []

    async def complete(self, messages, stats=None):
        self.sent.append(messages)
        if not self.answers:
            raise AssertionError("the simulator asked once more than scripted")
        return self.answers.pop(0)


async def llm_turns(profile, answers, replies, **options):
    chat = RecordingChat(answers)
    user = LLMSimulator(profile, chat, **llm_user_options(**options))
    await user.open()
    turns = []
    for reply in replies:
        turns.append(await user.respond(reply))
    return user, chat, turns


def test_the_reply_prompt_shows_the_clamped_emotion_not_the_judged_one(make_profile):
    # From 32, a judged +40 under bound 7 is +7: emotion 39 (C). Unclamped 72 (A); under the default bound 42 (B).
    answers = ["Warm.\nCHANGE: +40", "Okay.", "Cold.\nCHANGE: -30", "Hm."]
    _, chat, turns = run(llm_turns(make_profile(first_talk="Hi."), answers, ["a", "b"], start_emotion=32,
                                   change_bound=7))
    reply_prompt, next_analysis, second_reply_prompt = (chat.sent[i][-1]["content"] for i in (1, 2, 3))
    assert "Your emotion moved by 7 and is now 39 out of 100, state C" in reply_prompt
    assert "Your emotion right now is 39 out of 100 (state C" in next_analysis
    assert "Your emotion moved by -7 and is now 32 out of 100, state C" in second_reply_prompt
    assert "between -7 and +7" in chat.sent[0][-1]["content"]  # the analysis asks within the configured bound
    assert [(t.raw_change, t.change, t.emotion, t.clamped) for t in turns] == [(40, 7, 39, True), (-30, -7, 32, True)]


def test_the_reply_prompt_carries_the_analysis_reasoning_and_the_reply_reaches_the_history(make_profile):
    answers = ["She named Dana and the empty seat.\nIt felt heard.\nCHANGE: +4", "Yes, exactly."]
    user, chat, _ = run(llm_turns(make_profile(first_talk="Hi."), answers, ["Dana's empty seat hurt you."]))
    reply_prompt = chat.sent[1][-1]["content"]
    assert "She named Dana and the empty seat.\nIt felt heard." in reply_prompt
    assert reply_prompt.count("Dana's empty seat hurt you.") == chat.sent[0][-1]["content"].count(
        "Dana's empty seat hurt you.")  # the reply appears where the analysis showed it, not as the reasoning
    assert [m["content"] for m in user.history if m["role"] == "assistant"] == ["Dana's empty seat hurt you."]


def test_the_reply_prompt_shows_the_emotion_capped_at_one_hundred(make_profile):
    _, chat, turns = run(llm_turns(make_profile(first_talk="Hi."), ["Yes.\nCHANGE: +9", "Thanks, bye."], ["a"],
                                   start_emotion=96))
    assert "moved by 9 and is now 100 out of 100, state S" in chat.sent[1][-1]["content"]
    assert (turns[0].change, turns[0].emotion, turns[0].end_reason) == (9, 100, "farewell")


@pytest.mark.parametrize("start, change, message, end_reason", [
    (95, +10, "Thanks. Goodbye.", "farewell"),  # emotion first, though the user also said goodbye on the last turn
    (12, -5, "Forget it. Goodbye.", "gave_up"),
    (50, 0, "I should go. Goodbye.", "goodbye"),  # a goodbye on the last turn is a goodbye, not the turn limit
    (50, 0, "Hm, go on.", "turn_limit"),
])
def test_on_the_last_turn_the_first_rule_that_holds_names_the_end(make_profile, start, change, message, end_reason):
    _, _, [turn] = run(llm_turns(make_profile(first_talk="Hi."), [f"Why.\nCHANGE: {change:+d}", message], ["a"],
                                 start_emotion=start, max_turns=1))
    assert (turn.end_reason, turn.done) == (end_reason, True)


def test_a_malformed_analysis_is_asked_again_up_to_parse_attempts(make_profile):
    # parse_attempts 4, not the default 3: three bad analyses and a good one, then the reply call.
    answers = ["No change line.", "Bad.\nCHANGE: lots", "x\nCHANGE: +5\nmore", "Fine.\nCHANGE: +5", "Okay."]
    user, chat, [turn] = run(llm_turns(make_profile(first_talk="Hi."), answers, ["a"], parse_attempts=4))
    assert (turn.change, user.format_retries, len(chat.sent)) == (5, 3, 5)


def test_an_analysis_that_never_parses_fails_after_exactly_parse_attempts(make_profile):
    chat = RecordingChat(["no score"] * 2)

    async def go():
        user = LLMSimulator(make_profile(first_talk="Hi."), chat, parse_attempts=2, **user_options())
        await user.open()
        return await user.respond("a")

    with pytest.raises(SimulatorError, match="after 2 attempts"):
        run(go())
    assert len(chat.sent) == 2


def test_an_empty_message_is_asked_again_up_to_parse_attempts(make_profile):
    answers = ["Fine.\nCHANGE: +5", "", " ", '""', "Okay."]
    user, chat, [turn] = run(llm_turns(make_profile(first_talk="Hi."), answers, ["a"], parse_attempts=4))
    assert (turn.message, user.format_retries, len(chat.sent)) == ("Okay.", 0, 5)  # empty replies are no format retries
    with pytest.raises(SimulatorError, match="empty message 2 times"):
        run(llm_turns(make_profile(first_talk="Hi."), ["Fine.\nCHANGE: +5", "", " "], ["a"], parse_attempts=2))


def zh_profile():
    return simulator.parse_profile({
        "id": "zh-1", "player": "* 姓名：李雷\n* 年龄：29", "scene": "## 背景\n李雷的项目被同事抢了功劳。",
        "main_cha": "负面型", "cha_group": ["急躁", "敏感", "要强"], "task": ZH_TASK,
        "first_talk": "唉，今天开会又被张浩抢了功劳。"})


def official_analysis(change):
    return f"Content:\n[内容]\nTargetCompletion:\n[贴合]\nReason:\n[理由]\nActivity:\n[活动]\nAnalyse:\n[感受]\nChange:\n{change}"


async def official_turns(source, answers, replies, **options):
    chat = RecordingChat(answers)
    user = llm_user.OfficialSimulator(zh_profile(), chat, official.load(source, str(REPO)), **official_user_options(**options))
    await user.open()
    turns = [await user.respond(reply) for reply in replies]
    return user, chat, turns


@needs_repo
@pytest.mark.parametrize("source, judged", [("sage", "[+10]"), ("rlver", "+40")])
def test_the_official_reply_prompt_shows_the_state_of_the_clamped_emotion(source, judged):
    # From 32 under bound 7: 39 (C), then 46 (B). Under the default bound 42 (B); RLVER's unclamped +40, 72 (A);
    # the second turn's state before its change, C.
    user, chat, turns = run(official_turns(source, [official_analysis(judged), "Response:\n嗯", official_analysis(judged),
                                                    "Response:\n好"], ["我在听。", "慢慢说。"],
                                           start_emotion=32, change_bound=7))
    reply_prompt, next_analysis, second_reply_prompt = (chat.sent[i][0]["content"] for i in (1, 2, 3))
    assert "**这是你当前的Emotion\nEmotion-C\n" in reply_prompt  # the official template's {{emotion}}
    assert "当前的情绪是39\n" in next_analysis
    assert "**这是你当前的Emotion\nEmotion-B\n" in second_reply_prompt
    assert [(t.change, t.emotion, t.clamped) for t in turns] == [(7, 39, True), (7, 46, True)] and user.emotion == 46


@needs_repo
@pytest.mark.parametrize("source", official.SOURCES)
def test_an_official_analysis_is_asked_again_up_to_parse_attempts(source):
    bad = official_analysis("不变")  # no integer: both official parsers would ask again
    user, chat, [turn] = run(official_turns(source, [bad, bad, bad, official_analysis("+4"), "Response:\n嗯"], ["好"],
                                            parse_attempts=4))
    assert (turn.change, user.format_retries, len(chat.sent)) == (4, 3, 5)
    with pytest.raises(SimulatorError, match=f"{source} analysis could not be parsed after 2 attempts"):
        run(official_turns(source, [bad, bad], ["好"], parse_attempts=2))
    with pytest.raises(SimulatorError, match="empty message 2 times"):  # ours, asked for (--empty_user_message)
        run(official_turns(source, [official_analysis("+4"), "Response:\n", "Response:\n[]"], ["好"], parse_attempts=2,
                           empty_user_message="ask_again"))
    user, chat, [turn] = run(official_turns(source, [official_analysis("+4"), "Response:\n"], ["好"]))
    assert (turn.message, len(chat.sent)) == ("", 2)  # the released loops' way, the default: kept, not asked again


# --------------------------------------------------------------------------------------------
# Options, result rows and profiles
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(start_emotion=-1), dict(start_emotion=101), dict(change_bound=0),
                                     dict(max_turns=0), dict(variant="strict"), dict(language="fr")])
def test_options_out_of_range_are_refused(make_profile, options):
    with pytest.raises(ValueError):
        LLMSimulator(make_profile(), RecordingChat([]), **llm_user_options(**options))


def test_the_extreme_valid_options_are_accepted(make_profile):
    for options in (dict(start_emotion=0), dict(start_emotion=100), dict(change_bound=1, max_turns=1)):
        user = LLMSimulator(make_profile(), RecordingChat([]), **llm_user_options(**options))
        assert (user.emotion, user.change_bound, user.max_turns) == (
            options.get("start_emotion", 30), options.get("change_bound", 10), options.get("max_turns", 8))


@pytest.mark.parametrize("opening, first_talk, expected", [
    ("A group's shared opening.", "The profile's own.", "A group's shared opening."),
    (None, "The profile's own.", "The profile's own."),
    (None, None, "Written by the model."),
])
def test_the_opening_is_the_shared_one_then_first_talk_then_the_models(make_profile, opening, first_talk, expected):
    chat = RecordingChat(["Written by the model."])
    user = LLMSimulator(make_profile(first_talk=first_talk), chat, **llm_user_options(start_emotion=44))
    assert run(user.open(opening)) == expected
    assert user.history == [{"role": "user", "content": expected, "emotion-point": 44}]
    assert len(chat.sent) == (expected == "Written by the model.")


def test_a_result_row_puts_each_thought_beside_its_own_reply(make_profile):
    answers = ["a\nCHANGE: +5", "One.", "b\nCHANGE: -5", "Two.", "c\nCHANGE: +5", "Three."]
    user, _, _ = run(llm_turns(make_profile(first_talk="Hi."), answers, ["r1", "r2", "r3"], start_emotion=50))
    row = user.result_row(["", "second thought", "third thought"])
    replies = [m for m in row["history"] if m["role"] == "assistant"]
    assert [m.get("think") for m in replies] == [None, "second thought", "third thought"]
    assert (row["emo_point"], row["emo_state"]) == (55, "Emotion-B")
    assert all("think" not in m for m in user.history)  # the row is a copy


def test_a_bad_row_after_blank_lines_names_its_line_in_the_file(tmp_path):
    # Blank lines count as lines: the bad row is row 2 of the file's rows but line 4 of the file.
    path = tmp_path / "p.jsonl"
    write_jsonl(path, [profile_row(id="a"), "", "  ", profile_row(id="b", main_cha="cheerful")])
    with pytest.raises(ProfileError, match=rf"^{re.escape(str(path))}:4: field 'main_cha'"):
        simulator.load_profiles(path)


def test_a_repeated_id_names_the_line_of_its_first_use_after_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="b"), "", profile_row(id="a"), profile_row(id="a")])
    with pytest.raises(ProfileError, match=r"p.jsonl:4: field 'id' 'a' repeats line 3$"):
        simulator.load_profiles(path)


def test_a_missing_first_talk_in_benchmark_mode_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="a", first_talk="Hi."), profile_row(id="b")])
    with pytest.raises(ProfileError, match=r"p.jsonl:2: field 'first_talk' is required"):
        simulator.load_profiles(path, require_first_talk=True)


@pytest.mark.parametrize("traits", [["a", "b", "c", "d"], ["a", "b"], ["a", " ", "c"], ["a", "b", 3]])
def test_cha_group_must_be_exactly_three_non_empty_strings(traits):
    with pytest.raises(ProfileError, match=r"^here:7: field 'cha_group'"):
        simulator.parse_profile(profile_row(cha_group=traits), "here:7")


@pytest.mark.parametrize("task_language, personality_language, language", [(1, 0, "zh"), (0, 1, "en")])
def test_the_language_follows_the_hidden_intention_not_the_personality(task_language, personality_language,
                                                                        language):
    profile = simulator.parse_profile(profile_row(task=simulator.INTENTIONS["sincere_praise"][task_language],
                                                  main_cha=simulator.PERSONALITIES["avoidant"][personality_language]))
    assert (profile.language, profile.intention, profile.personality) == (language, "sincere_praise", "avoidant")


@given(field=st.sampled_from(["id", "player", "scene", "main_cha", "task", "cha_group"]),
       value=st.one_of(st.none(), st.just(""), st.just("   "), st.integers(), st.just(["x"])),
       line=st.integers(1, 10_000))
def test_any_bad_required_field_is_named_with_where_it_is(field, value, line):
    with pytest.raises(ProfileError, match=rf"^f.jsonl:{line}: field '{field}'"):
        simulator.parse_profile(profile_row(**{field: value}), f"f.jsonl:{line}")


@pytest.mark.parametrize("text, read", [
    ("I can\u2019t imagine", "I can't imagine"), ("\u2018never\u2019", "'never'"),
    ("\uff24\uff41\uff4e\uff41", "Dana"),  # full-width letters
    ("so\u00adunds\u200b", "sounds"),  # a soft hyphen and a zero-width space
    ("\u0441\u043ere", "core"),  # Cyrillic letters that look Latin
])
def test_the_rule_user_reads_typographic_and_disguised_text_as_plain_text(text, read):
    assert rule_user.normalise(text) == read


def test_the_rule_users_reasoning_names_the_need_the_acts_and_the_first_words_taken_up(make_profile):
    """Measured rules' wording: the need with spaces, what the reply gave of what it asks, the listening heard beside
    it and the acts it cannot stand ("gave ..., heard ...; unwelcome ..."); then the story's details taken up
    (seven: the first five, sorted; keys are cut to five letters) and how specific it is (the first four of five
    words of its own). A reply about nothing I told says so, with its closeness."""
    [turn] = play_rule_dialogue(make_profile("balanced_analysis", "passive"), [
        "You must feel so hurt that your sister chose a concert over your wedding and the seat beside your mother. "
        "Maybe Dana was afraid of facing the whole family in Lisbon. None of this is on you."])
    assert turn.reasoning == (
        "for 'balanced analysis': gave reasons, heard feeling, reflects; unwelcome clears; took up 7 details of my "
        "story (conce, dana, lisbo, mothe, seat); 5 details tied in one sentence, 5 words of its own (besid, chose, "
        "facin, famil) (+10)")
    [generic] = play_rule_dialogue(make_profile("balanced_analysis", "passive"), [
        "Dana has always been a hard person to read, from what I can tell."])
    found = re.fullmatch(r"nothing about what I told you: took up 1 details of my story \(dana\), "
                         r"closeness (0\.\d+) \(-5\)", generic.reasoning)
    assert found and float(found.group(1)) < rule_user.THRESHOLDS["about"], generic.reasoning  # one detail, not close


@pytest.mark.parametrize("patterns, text, cues", [
    (("ab", "cd"), "ab cd", 2), (("ab", "cd"), "abcd", 2),  # apart, and touching: two cues
    (("ab", "bc"), "abc", 1), (("ab", "bc"), "abcbc", 2),  # "ab" and "bc" overlap: one cue; then "bc" once more
    (("ab", "cd"), "xx", 0),
])
def test_cues_are_counted_once_where_they_overlap_and_twice_where_they_only_touch(monkeypatch, patterns, text, cues):
    monkeypatch.setattr(rule_user, "ACTS", {f"act{index}": re.compile(pattern) for index, pattern in enumerate(patterns)})
    assert rule_user.cue_count(text) == cues


def test_the_simulators_base_url_flag_beats_the_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/from-env")
    given = rollout.make_chat(simulator.SimulatorArguments(backend="llm", simulator_model="m",
                                                             base_url="http://127.0.0.1:9/from-flag"))
    assert given.base_url == "http://127.0.0.1:9/from-flag"
    assert rollout.make_chat(simulator.SimulatorArguments(backend="llm", simulator_model="m")).base_url == \
        "http://127.0.0.1:9/from-env"


@pytest.mark.parametrize("need, reply, lectured", [
    ("practical_advice", "You need to call Dana tonight.", False),  # one is advice to this need
    ("practical_advice", "You need to call Dana tonight. You ought to write down what you want to say.", True),
    ("venting", "You need to call Dana tonight.", True),  # to a need that wants no lecture, one is a lecture
])
def test_two_lectures_are_a_lecture_to_any_need_one_only_to_those_that_want_none(make_profile, need, reply, lectured):
    frictions = simulator.RuleSimulator(make_profile(need), **user_options())._frictions(rule_user.normalise(reply))
    assert any(key == "lecture" for key, _, _ in frictions) == lectured


def read_as(monkeypatch, acts):
    """The read-out made to see one sentence per act in any reply, each plainly that act (p 0.9), as `_worth` reads
    them: `sentence_acts` for what the reply does, `act_sentences` and the reader's probabilities for its main acts."""
    probabilities = {act: {a: 0.9 if a == act else 0.01 for a in rule_user.ACTS} for act in acts}
    monkeypatch.setattr(rule_user, "sentence_acts", lambda text: [probabilities[act] for act in acts])
    monkeypatch.setattr(rule_user, "act_sentences", lambda text: list(acts))
    monkeypatch.setattr(rule_user, "reader", lambda: types.SimpleNamespace(act_probabilities=probabilities.__getitem__))


@pytest.mark.parametrize("acts, specific, worth", [
    (("advises", "feeling"), True, "gain_big"),  # asked for, and heard beside it: 3 points
    (("advises",), True, "gain"),  # asked for, not heard: 2
    (("feeling",), True, "against"),  # only a listening act this need cannot stand: it costs (-1)
    (("advises", "feeling"), False, "hollow"),  # what it asks, in words that could be about anyone
])
def test_later_listening_beside_what_the_need_asks_counts_as_heard_and_costs_nothing(make_profile, monkeypatch,
                                                                                      acts, specific, worth):
    """Changed by design (measured rules): after the first reply, a listening act beside what the need asks counts
    as heard even where the need cannot stand it alone ("heard, then answered"); without what it asks, it costs.
    A challenging practical_advice user (naming a feeling is unwelcome; gain at 1 point, gain_big at 3)."""
    async def go():
        user = simulator.RuleSimulator(make_profile("practical_advice", "passive"),
                                       **user_options(variant="challenging"))
        await user.open()
        await user.respond(WARM)  # the first reply, listening only
        read_as(monkeypatch, acts)
        return user._worth("a reply", "took up", specific)
    key, why, _ = asyncio.run(go())
    assert key == worth, why


@pytest.mark.parametrize("reply, only_questions", [
    ("What was it like when Dana skipped your wedding in Lisbon?", False),  # one question is a question
    ("What was it like when Dana skipped your wedding in Lisbon? Why do you think your sister did it?", True),
])
def test_only_questions_takes_two_of_them(make_profile, reply, only_questions):
    async def go():
        user = simulator.RuleSimulator(make_profile("venting", "passive"), **user_options())
        await user.open()
        return user.score(reply)[1]
    assert any(key == "questions" for key, _, _ in asyncio.run(go())) == only_questions


@pytest.mark.parametrize("bound, accepted", [(0, False), (1, True), (100, True), (101, False)])
def test_the_simulator_options_take_a_change_bound_from_1_to_100(bound, accepted):
    if accepted:
        assert simulator.SimulatorArguments(change_bound=bound).change_bound == bound
    else:
        with pytest.raises(common.ArgumentError, match="change_bound"):
            simulator.SimulatorArguments(change_bound=bound)


def test_the_dialogue_quoted_to_the_simulator_keeps_every_script_as_written():
    """The simulator reads the text a user wrote, not JSON escapes of it (a Chinese dialogue stays Chinese)."""
    quoted = llm_user.quoted_dialogue([{"role": "user", "content": "我妹妹没来我的婚礼。"},
                                        {"role": "assistant", "content": "That \"hurt\", café."}])
    assert quoted.splitlines() == ['{"speaker": "me", "text": "我妹妹没来我的婚礼。"}',
                                   '{"speaker": "them", "text": "That \\"hurt\\", café."}']


def defect_keys(make_profile, reply: str) -> set[str]:
    user = simulator.RuleSimulator(make_profile("venting"), **user_options())
    return {key for key, _, _ in user._defects(rule_user.normalise(reply), [], set())}


@pytest.mark.parametrize("reply, fillers", [
    ("Um, I am sorry about what happened with your sister.", False),  # one filler is how people talk
    ("Um, I am sorry about what happened, you know, with your sister.", True),  # two: THRESHOLDS["fillers"]
])
def test_fillers_cost_from_the_thresholds_count_on(make_profile, reply, fillers):
    assert ("fillers" in defect_keys(make_profile, reply)) == fillers


def test_a_reply_repeats_itself_from_12_trigrams_on_when_fewer_than_the_thresholds_share_are_distinct(
        make_profile, monkeypatch):
    """One sentence going round "Dana left the room": 13 words (11 trigrams) are too few to judge; 14 words
    make 12 trigrams, 4 of them distinct (a share of 1/3): a repeat below a threshold above 1/3, not at it."""
    cycle = ("Dana left the room " * 4).split()
    assert "self_repeat" not in defect_keys(make_profile, " ".join(cycle[:13]))
    assert "self_repeat" in defect_keys(make_profile, " ".join(cycle[:14]))
    monkeypatch.setitem(rule_user.THRESHOLDS, "distinct_trigrams", 1 / 3)
    assert "self_repeat" not in defect_keys(make_profile, " ".join(cycle[:14]))
