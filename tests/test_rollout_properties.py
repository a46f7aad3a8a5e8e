"""Properties of the token-level rollout, checked against oracles written apart from the code: the dialogue's
ids against the tokenizer's own chat template of the same messages, its env mask and logprobs against where
the policy's sampled tokens sit, the per-turn budgets against their definition, and split_think against a
str.partition reading of its documented rule.

No model is loaded: the policy is a script at the generation interface, the tokenizer a byte-level one (one
token per byte, so a position in the text is a position in the ids) with ChatML's special tokens at SmolLM2's
ids, and the simulated user is the rule user. One slow test repeats the template check on SmolLM2's own
tokenizer."""
import re
from types import SimpleNamespace

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import common
import generation
import guards
import vllm_backends
import rollout
import simulator
from generation import THINK_CLOSE, THINK_OPEN, split_think
from rollout import DialogueArguments, DialogueRunner

# SmolLM2-Instruct's chat template (ChatML): what the packaged model's tokenizer carries.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
OTHER_END, IM_START, IM_END = 0, 1, 2  # <|endoftext|>, <|im_start|>, <|im_end|>, as in SmolLM2's vocabulary
END, SECOND_END = "\x00", "\x01"  # in a script: the policy samples <|im_end|>, or the config's other end token


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """One token per byte plus ChatML's special tokens; its generation config lists two end-of-turn ids, as
    Qwen2.5-Instruct's does (<|im_end|> and <|endoftext|>)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: index for index, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, OTHER_END]}))
    return AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------------------------
# split_think against its documented rule
# --------------------------------------------------------------------------------------------

def split_think_oracle(text: str, think: bool) -> tuple[str, str, bool]:
    """The documented rule, read with str.partition: only the text after the last </think> is the reply; an
    unclosed <think> makes the whole turn thought. Well formed: optional whitespace, one <think>, a thought,
    one </think>, and a non-empty reply holding no think tag."""
    if not think:
        return "", text.strip(), True
    before, closed, after = text.rpartition(THINK_CLOSE)
    if not closed:
        _, opened, thought = text.partition(THINK_OPEN)
        return (thought.strip(), "", False) if opened else ("", text.strip(), False)
    head, _, tail = before.partition(THINK_OPEN)
    reply = after.strip()
    match = re.fullmatch(r"\s*<think>(.*)</think>(.*)", text, re.DOTALL)
    well_formed = (match is not None and reply != ""
                   and not any(tag in part for tag in (THINK_OPEN, THINK_CLOSE) for part in match.groups()))
    return (head + tail).strip(), reply, well_formed


TURN_PIECES = st.lists(st.sampled_from([THINK_OPEN, THINK_CLOSE, " ", "\n", "a", "b c"]), max_size=7).map("".join)
NEAR_TAGS = st.lists(st.sampled_from([THINK_OPEN, THINK_CLOSE, "<think", "think>", "</", "\t", "  ", "ok.",
                                      "she is hurt"]), max_size=6).map("".join)


@given(text=st.one_of(TURN_PIECES, NEAR_TAGS, st.text(max_size=20)), think=st.booleans())
@example("<think>never closed", True)  # all thought, no reply: a violation
@example("</think> reply", True)  # a close at the very start
@example("<think>a<think>b</think> c", True)  # two opens
@example("<think>a</think> b</think> c", True)  # two closes
@example("<think>a</think> b <think> c", True)  # a tag in the reply
@example(" <think>a</think>\n", True)  # an empty reply
def test_split_think_follows_its_documented_rule_on_any_text(text, think):
    assert split_think(text, think) == split_think_oracle(text, think)


@given(lead=st.sampled_from(["", " ", "\n", "x"]), thought=TURN_PIECES, reply=TURN_PIECES,
       closed=st.booleans())
def test_split_think_follows_its_documented_rule_on_turns_shaped_like_the_format(lead, thought, reply, closed):
    """<think> thought [</think>] reply, with tags and whitespace anywhere inside the parts."""
    text = f"{lead}<think>{thought}{THINK_CLOSE if closed else ''}{reply}"
    assert split_think(text, think=True) == split_think_oracle(text, think=True)


@given(thought=st.text(alphabet="ab \n", max_size=6), reply=st.text(alphabet="cd \n", max_size=6),
       lead=st.sampled_from(["", " ", "\n "]))
def test_one_closed_thought_and_a_non_empty_reply_is_well_formed_and_splits_stripped(thought, reply, lead):
    result = split_think(f"{lead}<think>{thought}</think>{reply}", think=True)
    assert result == (thought.strip(), reply.strip(), reply.strip() != "")


@pytest.mark.parametrize("text, expected", [
    ("<think>a</think> b <think> c", ("a", "b <think> c", False)),  # a tag in the reply: a violation
    ("<think>a</think> b <think>", ("a", "b <think>", False)),
    ("x <think>a</think> b", ("x a", "b", False)),  # text before the <think>
    ("<think>a</think>\n\t b \n", ("a", "b", True)),  # any whitespace around the reply is stripped
])
def test_split_think_boundaries_of_well_formed(text, expected):
    assert split_think(text, think=True) == expected


def test_without_think_mode_tags_are_reply_text_and_never_a_violation():
    assert split_think("\n<think>a</think> b ", think=False) == ("", "<think>a</think> b", True)
    assert split_think("", think=False) == ("", "", True)


# --------------------------------------------------------------------------------------------
# A scripted policy and the oracle of the dialogue it plays
# --------------------------------------------------------------------------------------------

def script_ids(tokenizer, text: str) -> list[int]:
    """A script's ids: its text byte by byte, END and SECOND_END as the two end-of-turn ids."""
    ids = []
    for part in re.split(f"([{END}{SECOND_END}])", text):
        if part in (END, SECOND_END):
            ids.append(IM_END if part == END else OTHER_END)
        elif part:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids


def logprob(call: int, position: int) -> float:
    """The logprob the scripted policy reports for the token at `position` of its `call`-th call: unique."""
    return -(call + 1 + position / 1000)


def served(ids: list[int], budget: int, ends) -> list[int]:
    """What a generator returns: at most `budget` ids, up to and including the first end-of-turn id."""
    ids = ids[:budget]
    end = next((index for index, token in enumerate(ids) if token in ends), None)
    return ids if end is None else ids[:end + 1]


class ScriptedPolicy:
    """The policy at the generation interface: for each dialogue (found by its opening line in the context),
    the ids it samples at each call in turn, served as generators serve them."""

    def __init__(self, tokenizer, scripts: dict[str, list[list[int]]], ends=(IM_END, OTHER_END)):
        self.tokenizer, self.scripts, self.ends = tokenizer, scripts, set(ends)
        self.next_phase = dict.fromkeys(scripts, 0)
        self.calls = []

    def __call__(self, contexts, max_new_tokens, stop=None):
        call = len(self.calls)
        self.calls.append({"contexts": contexts, "budgets": list(max_new_tokens), "stop": stop})
        sampled = []
        for context, budget in zip(contexts, max_new_tokens):
            text = self.tokenizer.decode(context)
            opening = next(opening for opening in self.scripts if opening in text)
            script = self.scripts[opening][self.next_phase[opening]]
            self.next_phase[opening] += 1
            sampled.append(served(script, budget, self.ends))
        return sampled, [[logprob(call, position) for position in range(len(ids))] for ids in sampled]


def oracle_cut_thought(tokenizer, ids: list[int], ends) -> tuple[list[int], bool]:
    """The sampled thought up to and including its first </think> (closed), or up to its first end-of-turn id
    (dropped; not closed), whichever comes first."""
    for end in range(1, len(ids) + 1):
        if ids[end - 1] in ends:
            return ids[:end - 1], False
        if THINK_CLOSE in tokenizer.decode(ids[:end]):
            return ids[:end], True
    return ids, False


def oracle_dialogue(tokenizer, args: DialogueArguments, opening: str, scripts: list[list[int]], history: list[dict],
                    ends=(IM_END, OTHER_END)) -> dict:
    """What the dialogue must be, from the chat template of its messages (the user's come from the simulator's
    history): every id, the env mask and logprobs over the whole context, the budget of every call, the texts,
    the violations and the end reason. The policy's sampled tokens are placed by rendering the messages before
    its turn with the generation prompt."""
    def render(messages, **options):
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **options)

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(ids, skip=False):
        return tokenizer.decode(ids, skip_special_tokens=skip)

    messages = generation.policy_messages("en", args.think) + [{"role": "user", "content": opening}]
    ids = render(messages, add_generation_prompt=True)
    prompt_length = len(ids)
    mask, logprobs = [0] * len(ids), [None] * len(ids)
    open_ids, close_ids = encode(THINK_OPEN), encode(THINK_CLOSE)
    least_turn = rollout.MIN_REPLY_TOKENS + (len(open_ids) + len(close_ids) + 1 if args.think else 0)
    phases = iter(scripts)
    result = {"budgets": [], "think_texts": [], "reply_texts": [], "violations": 0, "end_reason": None,
              "think_tokens": 0, "reply_tokens": 0, "turn_starts": []}

    def add(piece, sampled, call=None):
        ids.extend(piece)
        mask.extend([int(sampled)] * len(piece))
        logprobs.extend([logprob(call, position) for position in range(len(piece))] if sampled else
                        [None] * len(piece))

    phases_per_turn = 2 if args.think else 1
    for turn in range(args.max_turns):
        turn_start = len(ids)
        result["turn_starts"].append(turn_start - prompt_length)
        thought, closed = [], True
        if args.think:
            add(open_ids, sampled=False)
            budget = min(args.max_think_tokens,
                         args.max_dialogue_tokens - len(ids) - len(close_ids) - rollout.MIN_REPLY_TOKENS)
            result["budgets"].append(budget)
            thought, closed = oracle_cut_thought(tokenizer, served(next(phases), budget, ends), ends)
            add(thought, sampled=True, call=turn * phases_per_turn)
            if not closed:
                add(close_ids, sampled=False)
        budget = min(args.max_reply_tokens, args.max_dialogue_tokens - len(ids))
        result["budgets"].append(budget)
        reply = served(next(phases), budget, ends)
        add(reply, sampled=True, call=turn * phases_per_turn + phases_per_turn - 1)
        raw = decode(reply, skip=True)
        if args.think:
            raw = THINK_OPEN + decode(thought, skip=True) + ("" if closed else THINK_CLOSE) + raw
        think_text, reply_text, well_formed = split_think_oracle(raw, args.think)
        result["think_texts"].append(think_text)
        result["reply_texts"].append(reply_text)
        result["violations"] += not (well_formed and closed)
        result["think_tokens"] += len(encode(think_text))
        result["reply_tokens"] += len(encode(reply_text))
        # The assistant message as the template sees it: the turn's text, its sampled <|im_end|> the template's own.
        content_ids = ids[turn_start:]
        content_ids = content_ids[:-1] if content_ids[-1:] == [IM_END] else content_ids
        messages.append({"role": "assistant", "content": decode(content_ids)})
        assert render(messages)[:len(ids)] == ids  # the oracle's pieces are the template's
        answer = history[2 * turn + 2]  # the user's message after this turn
        if answer["emotion-point"] >= simulator.FAREWELL_AT:
            result["end_reason"] = "farewell"
        elif answer["emotion-point"] < simulator.GIVE_UP_BELOW:
            result["end_reason"] = "gave_up"
        elif simulator.says_goodbye(answer["content"], "en"):
            result["end_reason"] = "goodbye"
        elif turn + 1 == args.max_turns:
            result["end_reason"] = "turn_limit"
        else:
            messages.append({"role": "user", "content": answer["content"]})
            context = render(messages, add_generation_prompt=True)
            if len(context) + least_turn > args.max_dialogue_tokens:
                result["end_reason"] = "token_budget"
            else:
                add(context[len(ids):], sampled=False)
        if result["end_reason"]:
            break
    result.update(prompt_ids=ids[:prompt_length], completion_ids=ids[prompt_length:],
                  env_mask=mask[prompt_length:], logprobs=logprobs[prompt_length:])
    return result


PROFILE = simulator.load_profiles(simulator.DEFAULT_PROFILES)[0]


def play(tokenizer, args: DialogueArguments, scripts: dict[str, list[str]]):
    """(dialogues, scripted policy): one dialogue per opening line (the keys of `scripts`), in order."""
    policy = ScriptedPolicy(tokenizer, {opening: [script_ids(tokenizer, text) for text in texts]
                                        for opening, texts in scripts.items()})
    runner = DialogueRunner(tokenizer, args)
    try:
        return runner.run([(PROFILE, opening) for opening in scripts], policy), policy
    finally:
        runner.close()


def check_against_oracle(tokenizer, args, dialogue, opening, texts, calls=None):
    expected = oracle_dialogue(tokenizer, args, opening, [script_ids(tokenizer, t) for t in texts],
                               dialogue.simulator.history)
    assert dialogue.prompt_ids == expected["prompt_ids"]
    assert dialogue.completion_ids == expected["completion_ids"]
    assert dialogue.env_mask == expected["env_mask"]
    assert dialogue.logprobs == expected["logprobs"]
    assert dialogue.turn_starts == expected["turn_starts"]
    assert dialogue.reply_texts == expected["reply_texts"]
    assert dialogue.think_texts == expected["think_texts"]
    assert dialogue.format_violations == expected["violations"]
    assert (dialogue.think_tokens, dialogue.reply_tokens) == (expected["think_tokens"], expected["reply_tokens"])
    assert dialogue.end_reason == expected["end_reason"]
    # The simulated user read exactly the replies.
    assert [m["content"] for m in dialogue.simulator.history if m["role"] == "assistant"] == expected["reply_texts"]
    if calls is not None:  # a dialogue alone: after it ends, the runner's calls (a fixed number) have no context
        assert [call["stop"] for call in calls] == [THINK_CLOSE if args.think and index % 2 == 0 else None
                                                    for index in range(len(calls))]
        calls = [call for call in calls if call["contexts"]]
        assert [call["budgets"] for call in calls] == [[budget] for budget in expected["budgets"]]
        for call in calls:  # each call saw the dialogue so far, as the template renders it
            [context] = call["contexts"]
            assert context == (expected["prompt_ids"] + expected["completion_ids"])[:len(context)]
    return expected


# --------------------------------------------------------------------------------------------
# Dialogues against the oracle
# --------------------------------------------------------------------------------------------

WORDS = ["I", " hear", " you", ".", " That", " sounds", " painful", " Dana", " wedding", "\n", " ", "?", "</think>",
         "<think>", " sister"]
PHASE_TEXT = st.lists(st.one_of(st.sampled_from(WORDS), st.sampled_from([END, SECOND_END])), max_size=14).map("".join)
THOUGHT_TEXT = st.tuples(  # often closed by the policy within a few words
    st.lists(st.sampled_from(WORDS + [END]), max_size=2).map("".join), st.sampled_from(["", THINK_CLOSE]),
    PHASE_TEXT).map("".join)


@st.composite
def dialogue_settings(draw):
    think = draw(st.booleans())
    think_budget, reply_budget = draw(st.lists(st.integers(1, 50), min_size=2, max_size=2, unique=True))
    max_turns = draw(st.integers(1, 4))
    scripts = []
    for _ in range(max_turns):
        scripts += [draw(THOUGHT_TEXT), draw(PHASE_TEXT)] if think else [draw(PHASE_TEXT)]
    return dict(think=think, max_think_tokens=think_budget, max_reply_tokens=reply_budget, max_turns=max_turns,
                start_emotion=draw(st.sampled_from([20, 30, 50, 95])), room=draw(st.one_of(
                    st.none(), st.integers(0, 250))), scripts=scripts)


@given(settings=dialogue_settings())
def test_a_dialogue_is_its_chat_template_with_exactly_the_sampled_tokens_masked_in(byte_tokenizer, settings):
    """Any turn count, budgets, scripts (end tokens, tags, nothing), start emotion and dialogue budget."""
    opening = "My sister skipped my wedding."
    room, scripts = settings.pop("room"), settings.pop("scripts")
    prompt_length = len(byte_tokenizer.apply_chat_template(
        generation.policy_messages("en", settings["think"]) + [{"role": "user", "content": opening}],
        tokenize=True, return_dict=False, add_generation_prompt=True))
    least_turn = rollout.MIN_REPLY_TOKENS + (7 + 8 + 1 if settings["think"] else 0)  # <think>, </think>: 7, 8 bytes
    args = DialogueArguments(max_dialogue_tokens=100_000 if room is None else prompt_length + least_turn + room,
                             **settings)
    [dialogue], policy = play(byte_tokenizer, args, {opening: scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, opening, scripts, policy.calls)
    assert len(dialogue.context()) <= args.max_dialogue_tokens


def test_a_reply_ending_in_its_own_end_token_keeps_it_sampled_and_the_template_adds_only_the_newline(byte_tokenizer):
    args = DialogueArguments(max_turns=2, max_reply_tokens=40, max_dialogue_tokens=100_000)
    scripts = ["I hear you, that sounds painful." + END, "Tell me about Dana and the wedding." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    first_end = dialogue.turn_starts[0] + len(scripts[0]) - 1
    assert dialogue.completion_ids[first_end:first_end + 3] == [IM_END] + byte_tokenizer("\n<|im_start|>")["input_ids"]
    assert dialogue.env_mask[first_end:first_end + 2] == [1, 0]


def test_a_reply_cut_by_its_budget_gets_the_whole_end_of_turn_inserted(byte_tokenizer):
    args = DialogueArguments(max_turns=2, max_reply_tokens=9, max_dialogue_tokens=100_000)
    scripts = ["I hear you, that sounds painful." + END, "Tell me more." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    assert dialogue.reply_texts[0] == "I hear yo"
    assert dialogue.completion_ids[9] == IM_END and dialogue.env_mask[8:10] == [1, 0]


def test_a_reply_ending_in_the_configs_other_end_token_is_closed_by_the_template(byte_tokenizer):
    """<|endoftext|> ends the turn (the generation config lists it) but is not the template's <|im_end|>."""
    args = DialogueArguments(max_turns=2, max_reply_tokens=30, max_dialogue_tokens=100_000)
    scripts = ["I hear you." + SECOND_END, "Tell me more." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    end = len("I hear you.")
    assert dialogue.completion_ids[end:end + 3] == [OTHER_END, IM_END] + byte_tokenizer("\n")["input_ids"]
    assert dialogue.env_mask[end - 1:end + 2] == [1, 1, 0]


def test_think_and_reply_budgets_are_each_their_own(byte_tokenizer):
    """A thought longer than max_think_tokens is cut there and closed for the policy; the reply gets
    max_reply_tokens, a different number."""
    args = DialogueArguments(think=True, max_turns=1, max_think_tokens=5, max_reply_tokens=11,
                             max_dialogue_tokens=100_000)
    scripts = ["weighing her words</think>", "I hear you, that is painful." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    assert [call["budgets"] for call in policy.calls] == [[5], [11]]
    assert (dialogue.think_texts, dialogue.reply_texts) == (["weigh"], ["I hear you,"])
    assert dialogue.env_mask[:7 + 5 + 8 + 11] == [0] * 7 + [1] * 5 + [0] * 8 + [1] * 11
    assert dialogue.format_violations == 1  # the policy did not close its thought itself


def test_a_think_budget_that_the_dialogue_budget_binds_leaves_room_for_the_close_and_a_reply(byte_tokenizer):
    """5 tokens of room beyond a minimal turn (<think> 7 bytes, </think> 8, a reply of MIN_REPLY_TOKENS, 1): the
    thought may take 6, not its own 40 (nor 14, forgetting the close); the reply takes what is left, MIN_REPLY_TOKENS, not 30."""
    opening = "My sister skipped my wedding."
    prompt_length = len(byte_tokenizer.apply_chat_template(
        generation.policy_messages("en", True) + [{"role": "user", "content": opening}],
        tokenize=True, return_dict=False, add_generation_prompt=True))
    args = DialogueArguments(think=True, max_turns=2, max_think_tokens=40, max_reply_tokens=30,
                             max_dialogue_tokens=prompt_length + rollout.MIN_REPLY_TOKENS + 7 + 8 + 1 + 5)
    scripts = ["weighing every word", "I hear you, that is painful." + END]
    [dialogue], policy = play(byte_tokenizer, args, {opening: scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, opening, scripts, policy.calls)
    assert [call["budgets"] for call in policy.calls if call["contexts"]] == [[6], [rollout.MIN_REPLY_TOKENS]]
    assert dialogue.end_reason == "token_budget" and len(dialogue.context()) == args.max_dialogue_tokens


def test_a_thought_closed_at_once_is_an_empty_closed_thought(byte_tokenizer):
    """The policy's first sampled tokens are </think>: found, though the close starts at the very first token."""
    args = DialogueArguments(think=True, max_turns=1, max_think_tokens=20, max_reply_tokens=30,
                             max_dialogue_tokens=100_000)
    scripts = [THINK_CLOSE + "ignored", "I hear you." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    assert dialogue.thought_ids == [byte_tokenizer(THINK_CLOSE, add_special_tokens=False)["input_ids"]]
    assert (dialogue.think_texts, dialogue.reply_texts, dialogue.format_violations) == ([""], ["I hear you."], 0)


def test_a_thought_the_policy_closes_is_kept_through_its_close_and_is_well_formed(byte_tokenizer):
    args = DialogueArguments(think=True, max_turns=1, max_think_tokens=40, max_reply_tokens=30,
                             max_dialogue_tokens=100_000)
    scripts = ["she is hurt</think> and more", " That sounds painful." + END]
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": scripts})
    check_against_oracle(byte_tokenizer, args, dialogue, "OPENING", scripts, policy.calls)
    assert dialogue.thought_ids == [byte_tokenizer("she is hurt</think>")["input_ids"]]
    assert dialogue.format_violations == 0 and dialogue.think_texts == ["she is hurt"]


def test_batched_dialogues_of_different_lengths_each_match_their_own_template(byte_tokenizer):
    """Three dialogues in lockstep; one is dismissive and gives up early, one runs out of tokens."""
    args = DialogueArguments(think=True, max_turns=3, max_think_tokens=12, max_reply_tokens=70, start_emotion=20,
                             max_dialogue_tokens=100_000)
    scripts = {
        "OPENING ONE": ["she is hurt</think>", "Just calm down, it's not a big deal." + END,
                        "calm</think>", "Just calm down, it's not a big deal." + END, "x", "y"],
        "OPENING TWO": ["what happened</think>", "That sounds painful, your sister missed your wedding." + END,
                        "ask</think>", "How did Dana explain the concert to you afterwards?" + END,
                        "ok</think>", "What would you want Dana to understand now?" + END],
        "OPENING THREE": ["listen", "I am here with you." + END, "more", "Go on, I am listening." + END,
                          "x", "y"],
    }
    dialogues, policy = play(byte_tokenizer, args, scripts)
    for dialogue, (opening, texts) in zip(dialogues, scripts.items()):
        check_against_oracle(byte_tokenizer, args, dialogue, opening, texts)
    assert len({len(d.reply_texts) for d in dialogues}) > 1  # the dialogues did end at different turns
    assert [len(call["contexts"]) for call in policy.calls] == [3, 3] + [sum(len(d.reply_texts) > t for d in dialogues)
                                                                       for t in (1, 1, 2, 2)]


def test_the_last_turn_that_fits_is_played_and_the_next_is_not(byte_tokenizer):
    """The dialogue goes on exactly while the next user message and a minimal turn fit the budget."""
    opening, scripts = "OPENING", ["I hear you, that sounds painful." + END, "Tell me more about Dana." + END]
    roomy_args = DialogueArguments(max_turns=2, max_reply_tokens=40, max_dialogue_tokens=100_000)
    [roomy], _ = play(byte_tokenizer, roomy_args, {opening: scripts})
    needed = len(roomy.prompt_ids) + roomy.turn_starts[1] + rollout.MIN_REPLY_TOKENS
    for budget, turns in ((needed, 2), (needed - 1, 1)):
        args = DialogueArguments(max_turns=2, max_reply_tokens=40, max_dialogue_tokens=budget)
        [dialogue], policy = play(byte_tokenizer, args, {opening: scripts})
        check_against_oracle(byte_tokenizer, args, dialogue, opening, scripts, policy.calls)
        assert len(dialogue.reply_texts) == turns
    assert policy.calls and dialogue.end_reason == "token_budget"


def test_the_inserted_pieces_are_found_from_the_template_not_assumed(byte_tokenizer):
    segments = rollout.ChatSegments(byte_tokenizer)
    assert (segments.close_text, segments.user_prefix, segments.user_suffix) == (
        "<|im_end|>\n", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert segments.eos_ids == {IM_END, OTHER_END}
    newline = byte_tokenizer("\n")["input_ids"]
    assert segments.closing_ids([5, IM_END]) == newline  # the policy sampled the <|im_end|>
    assert segments.closing_ids([5, OTHER_END]) == [IM_END] + newline  # another end token: the template's own
    assert segments.closing_ids([5]) == [IM_END] + newline
    assert segments.closing_ids([]) == [IM_END] + newline


@pytest.mark.slow
def test_a_dialogue_is_the_chat_template_of_its_messages_on_smollm2s_tokenizer(packaged_model):
    """The same check on a real BPE vocabulary: words whose ids are what the template's encoding gives."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(packaged_model)
    args = DialogueArguments(think=True, max_turns=3, max_think_tokens=4, max_reply_tokens=9,
                             max_dialogue_tokens=100_000)
    scripts = ["she is hurt</think>", " I hear you, that sounds painful." + END,
               " hmm hmm hmm hmm hmm hmm", " Tell me more about Dana." + END,
               " ok</think>", " What did she say afterwards about the concert and the flight?"]
    policy = ScriptedPolicy(tokenizer, {"OPENING": [script_ids(tokenizer, text) for text in scripts]}, ends=(2,))
    runner = DialogueRunner(tokenizer, args)
    [dialogue] = runner.run([(PROFILE, "OPENING")], policy)
    runner.close()
    expected = oracle_dialogue(tokenizer, args, "OPENING", [script_ids(tokenizer, t) for t in scripts],
                               dialogue.simulator.history, ends=(2,))
    assert (dialogue.prompt_ids, dialogue.completion_ids) == (expected["prompt_ids"], expected["completion_ids"])
    assert (dialogue.env_mask, dialogue.logprobs) == (expected["env_mask"], expected["logprobs"])
    assert [call["budgets"] for call in policy.calls] == [[b] for b in expected["budgets"]]


def test_simulator_messages_reach_the_context_between_turns(byte_tokenizer):
    """The user's answer to turn 1 is in the context the policy's second turn is sampled from."""
    args = DialogueArguments(max_turns=2, max_reply_tokens=40, max_dialogue_tokens=100_000)
    [dialogue], policy = play(byte_tokenizer, args, {"OPENING": ["I hear you." + END, "Go on." + END]})
    answer = dialogue.simulator.history[2]["content"]
    assert answer in byte_tokenizer.decode(policy.calls[1]["contexts"][0])
    assert answer not in byte_tokenizer.decode(policy.calls[0]["contexts"][0])



# --------------------------------------------------------------------------------------------
# Rewards, metrics, failures
# --------------------------------------------------------------------------------------------

@given(final=st.integers(0, 100), turns=st.integers(0, 8), share=st.fractions(0, 1),
       penalty=st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5]))
def test_reward_is_final_over_100_minus_the_penalty_times_the_violating_share(final, turns, share, penalty):
    from fractions import Fraction

    violations = round(share * turns)
    expected = Fraction(final, 100) - Fraction(penalty) * Fraction(violations, max(turns, 1))  # no turn: no share
    assert rollout.reward(final, violations, turns, penalty) == pytest.approx(float(expected), abs=1e-12)


def test_reward_of_one_violation_in_three_turns_under_a_penalty_of_point_six():
    assert rollout.reward(73, 1, 3, 0.6) == pytest.approx(0.53)  # 0.73 - 0.6 x 1/3
    assert rollout.reward(73, 1, 1, 0.6) == pytest.approx(0.13)  # the only turn violated: all of it


def metrics_oracle(rows: list[dict], max_turns: int) -> dict:
    """dialogue_metrics by its definitions in docs/usage.md, with numpy: shares of all dialogues per end reason, call totals
    over all, emotions per scored dialogue, lengths and violations per scored policy turn, the trajectory per
    scored dialogue with an ended dialogue's last emotion carried on."""
    import numpy as np

    expected = {f"dialogue/ended_{reason}": float(np.mean([row["end_reason"] == reason for row in rows]))
                for reason in rollout.END_REASONS}
    calls = {key: sum(row["simulator_calls"][key] for row in rows)
             for key in ("calls", "attempts", "failed", "prompt_tokens", "completion_tokens")}
    expected.update({"simulator/calls": calls["calls"], "simulator/retries": calls["attempts"] - calls["calls"],
                     "simulator/failed_calls": calls["failed"], "simulator/prompt_tokens": calls["prompt_tokens"],
                     "simulator/completion_tokens": calls["completion_tokens"]})
    scored = [row for row in rows if not row["failed"]]
    if not scored:
        return expected
    finals = np.array([row["final_emotion"] for row in scored])
    policy_turns = sum(row["turns"] for row in scored)
    expected.update({
        "emotion/final_mean": finals.mean(), "emotion/success_rate": (finals >= 100).mean(),
        "emotion/failure_rate": (finals < 10).mean(), "dialogue/turns_mean": policy_turns / len(scored),
        **{name: sum(row[key] for row in scored) / max(policy_turns, 1) for name, key in (
            ("format/violation_rate", "format_violations"), ("length/think_tokens_per_turn", "think_tokens"),
            ("length/reply_tokens_per_turn", "reply_tokens"), ("simulator/seconds_per_turn", "simulator_seconds"))},
    })
    for turn in range(max_turns):
        padded = [row["emotions"] + [row["emotions"][-1]] * max_turns for row in scored]
        expected[f"emotion/after_turn_{turn + 1}"] = float(np.mean([emotions[turn] for emotions in padded]))
    return expected


@st.composite
def metric_rows(draw, max_turns):
    turns = draw(st.integers(1, max_turns))
    emotions = draw(st.lists(st.integers(0, 100), min_size=turns, max_size=turns))
    calls = draw(st.integers(0, 6))
    return {"final_emotion": emotions[-1], "emotions": emotions, "turns": turns,
            "format_violations": draw(st.integers(0, turns)), "end_reason": draw(st.sampled_from(rollout.END_REASONS)),
            "think_tokens": draw(st.integers(0, 500)), "reply_tokens": draw(st.integers(0, 500)),
            "simulator_seconds": draw(st.floats(0, 3)), "failed": draw(st.booleans()),
            "simulator_calls": {"calls": calls, "attempts": calls + draw(st.integers(0, 3)),
                                "failed": draw(st.integers(0, calls)), "prompt_tokens": draw(st.integers(0, 900)),
                                "completion_tokens": draw(st.integers(0, 90))},
            "turn_changes": [], "token_turns": []}  # read by others, not by the metrics


@given(data=st.data(), max_turns=st.integers(1, 5))
def test_metrics_follow_their_definitions_on_any_batch(data, max_turns):
    rows = data.draw(st.lists(metric_rows(max_turns), min_size=1, max_size=6))
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    metrics = rollout.dialogue_metrics(columns, max_turns=max_turns + data.draw(st.integers(0, 2)))
    expected = metrics_oracle(rows, max_turns=len([k for k in metrics if k.startswith("emotion/after_turn_")]))
    assert metrics == pytest.approx(expected)


def test_metrics_of_dialogues_of_one_two_and_four_turns_show_each_denominator():
    rows = [  # three scored dialogues of 1, 2 and 4 turns, and one whose simulator failed
        {"final_emotion": 100, "emotions": [100], "turns": 1, "format_violations": 1, "think_tokens": 10,
         "reply_tokens": 20, "simulator_seconds": 0.5, "end_reason": "farewell", "failed": False},
        {"final_emotion": 5, "emotions": [15, 5], "turns": 2, "format_violations": 0, "think_tokens": 0,
         "reply_tokens": 40, "simulator_seconds": 1.0, "end_reason": "gave_up", "failed": False},
        {"final_emotion": 60, "emotions": [40, 50, 60, 60], "turns": 4, "format_violations": 2, "think_tokens": 60,
         "reply_tokens": 80, "simulator_seconds": 2.0, "end_reason": "turn_limit", "failed": False},
        {"final_emotion": 30, "emotions": [30], "turns": 1, "format_violations": 1, "think_tokens": 999,
         "reply_tokens": 999, "simulator_seconds": 9.0, "end_reason": "simulator_failed", "failed": True},
    ]
    for index, row in enumerate(rows):
        row["simulator_calls"] = {"calls": 2 * index, "attempts": 3 * index, "failed": index // 3,
                                  "prompt_tokens": 100 + index, "completion_tokens": 10 * index}
    metrics = rollout.dialogue_metrics({key: [row[key] for row in rows] for key in rows[0]}, max_turns=5)
    assert metrics["emotion/final_mean"] == 55  # (100 + 5 + 60) / 3 scored dialogues
    assert metrics["dialogue/turns_mean"] == pytest.approx(7 / 3)  # 7 policy turns in 3 scored dialogues
    assert metrics["format/violation_rate"] == pytest.approx(3 / 7)  # per scored policy turn
    assert metrics["length/think_tokens_per_turn"] == 10 and metrics["length/reply_tokens_per_turn"] == 20
    assert metrics["simulator/seconds_per_turn"] == pytest.approx(0.5)
    assert (metrics["emotion/success_rate"], metrics["emotion/failure_rate"]) == (pytest.approx(1 / 3),) * 2
    assert [metrics[f"emotion/after_turn_{k}"] for k in range(1, 6)] == pytest.approx(
        [155 / 3, 155 / 3, 165 / 3, 165 / 3, 165 / 3])  # each dialogue's last emotion carried on to turn 5
    assert metrics["dialogue/ended_simulator_failed"] == metrics["dialogue/ended_farewell"] == 0.25  # of all four
    assert metrics["dialogue/ended_goodbye"] == 0
    assert (metrics["simulator/calls"], metrics["simulator/retries"], metrics["simulator/failed_calls"]) == (12, 6, 1)
    assert (metrics["simulator/prompt_tokens"], metrics["simulator/completion_tokens"]) == (406, 60)


def test_metrics_of_a_batch_whose_simulators_all_failed_are_the_shares_and_calls_only():
    columns = {"end_reason": ["simulator_failed"] * 2, "failed": [True, True],
               "simulator_calls": [{"calls": 1, "attempts": 4, "failed": 1}, {"calls": 1, "attempts": 4, "failed": 1}]}
    metrics = rollout.dialogue_metrics(columns, max_turns=3)
    assert metrics["dialogue/ended_simulator_failed"] == 1 and metrics["simulator/retries"] == 6
    assert not any(key.startswith(("emotion/", "length/", "format/")) for key in metrics)


def lost(error="HTTP 500"):
    from types import SimpleNamespace
    return SimpleNamespace(failure=error)


KEPT = lost(None)


@pytest.mark.parametrize("failed, total, share, stops", [
    (0, 4, 0.0, False),  # nothing lost: never a stop
    (1, 4, 0.25, False), (1, 4, 0.24, True),  # a quarter lost: allowed at 0.25, not below
    (2, 4, 0.5, False), (3, 4, 0.5, True),
    (3, 4, 1.0, False), (4, 4, 1.0, True),  # every dialogue lost: nothing to learn from, whatever the share
    (1, 1, 1.0, True),
])
def test_too_many_simulator_failures_stop_above_the_share_or_when_all_are_lost(failed, total, share, stops):
    dialogues = [lost(f"error {index}") for index in range(failed)] + [KEPT] * (total - failed)
    if stops:
        with pytest.raises(rollout.TooManySimulatorFailures, match=rf"^the simulators of {failed} of {total} dialogues .*"
                                                                   rf"max_failed_share={share} .*error {failed - 1}$"):
            rollout.check_failures(dialogues, share)
    else:
        rollout.check_failures(dialogues, share)


@pytest.mark.parametrize("processes", [2, 3])
def test_with_several_processes_every_ranks_failures_count(monkeypatch, processes):
    """This rank lost none of its 4 dialogues; the others lost 3 of theirs: 3 of 4 + 4 x (processes - 1) is over a
    share of 0.1 on every rank, which each rank decides from the gathered counts, naming the last error."""
    import accelerate.utils

    others = [(3, 4, "error on rank 1")] + [(0, 4, None)] * (processes - 2)
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda counts: counts + others)
    total = 4 * processes
    with pytest.raises(rollout.TooManySimulatorFailures, match=rf"^the simulators of 3 of {total} dialogues .*error on rank 1$"):
        rollout.check_failures([KEPT] * 4, 0.1, SimpleNamespace(num_processes=processes))


def test_no_dialogues_is_no_failure():
    rollout.check_failures([], 0.0)


# --------------------------------------------------------------------------------------------
# Transcripts: JSON Lines that a resumed run trims to the steps before it
# --------------------------------------------------------------------------------------------

ROW_TEXT = st.text(alphabet=st.sampled_from(list("ab \"\\\n") + ["情", "é", "🙂"]), max_size=6)


@st.composite
def cut_transcripts(draw):
    """(rows, their file's bytes cut inside the last line, whether the cut left that row whole): a run killed
    while writing its last row, at any byte of it."""
    import json

    steps = sorted(draw(st.lists(st.integers(0, 4), min_size=1, max_size=6)))
    rows = [{"step": step, "dialogue_id": index, "text": draw(ROW_TEXT)} for index, step in enumerate(steps)]
    lines = [(json.dumps(row, ensure_ascii=False) + "\n").encode() for row in rows]
    cut = draw(st.integers(0, len(lines[-1]) - 1))  # bytes of the last line that were written
    return rows, b"".join(lines[:-1]) + lines[-1][:cut], cut == len(lines[-1]) - 1


@given(transcripts=cut_transcripts(), step=st.integers(0, 5))
def test_resume_keeps_the_whole_rows_of_earlier_steps_wherever_the_last_line_was_cut(tmp_path_factory, transcripts,
                                                                                     step):
    import json

    rows, data, last_whole = transcripts
    path = tmp_path_factory.mktemp("resume") / "transcripts.jsonl"
    path.write_bytes(data)
    whole = rows if last_whole else rows[:-1]
    dropped = guards.drop_rows_from(path, step)
    assert path.read_text(encoding="utf-8") == "".join(json.dumps(row, ensure_ascii=False) + "\n"
                                                       for row in whole if row["step"] < step)
    assert dropped == sum(row["step"] >= step for row in whole)


def test_resume_without_a_transcripts_file_drops_nothing(tmp_path):
    assert guards.drop_rows_from(tmp_path / "transcripts.jsonl", 3) == 0
    assert not (tmp_path / "transcripts.jsonl").exists()


@pytest.mark.parametrize("line", ['{"id": "a"}', '{"step": "2"}', '[2, "a"]', '"step"'])
def test_resume_refuses_a_row_without_its_step_naming_its_line_and_leaves_the_file(tmp_path, line):
    path = tmp_path / "transcripts.jsonl"
    path.write_text(f'{{"step": 0}}\n{line}\n{{"step": 1}}\n')
    before = path.read_bytes()
    with pytest.raises(common.InputError, match=r"transcripts.jsonl:2: a row without its step"):
        guards.drop_rows_from(path, 1)
    assert path.read_bytes() == before


def test_a_killed_step_is_trimmed_and_written_again_to_the_same_rows(byte_tokenizer, tmp_path):
    import json

    args = DialogueArguments(think=True, max_turns=2, max_think_tokens=20, max_reply_tokens=30,
                             max_dialogue_tokens=100_000)
    scripts = {"OPENING A": ["she is hurt</think>", "I hear you, Dana hurt you." + END, "more", "Go on." + END],
               "OPENING B": ["listen", "That sounds painful." + END, "ok</think>", "Tell me more." + END]}
    path = tmp_path / "run" / "transcripts.jsonl"
    for step in (0, 1):
        rollout.write_transcripts(path, play(byte_tokenizer, args, scripts)[0], step=step)
    complete = path.read_bytes()
    dialogues = play(byte_tokenizer, args, scripts)[0]
    rollout.write_transcripts(path, dialogues, step=2)
    path.write_bytes(path.read_bytes()[:-7])  # killed while writing step 2's last row
    assert guards.drop_rows_from(path, 2) == 1  # step 2's first row was whole
    assert path.read_bytes() == complete
    rollout.write_transcripts(path, dialogues, step=2)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(row["step"], row["id"]) for row in rows] == [(step, PROFILE.id) for step in (0, 0, 1, 1, 2, 2)]
    assert rows[-2:] == [json.loads(json.dumps(d.transcript(2), ensure_ascii=False)) for d in dialogues]
    assert rows[-2]["think_texts"] == ["she is hurt", "more"] and rows[-2]["format_violations"] == 1


# --------------------------------------------------------------------------------------------
# TransformersGenerator at model.generate's edge: what it asks for, what it keeps of what comes back
# --------------------------------------------------------------------------------------------

class ScriptedGenerateModel:
    """Stands in for a transformers model: `generate` takes what the real one takes here (keywords only, a
    GenerationConfig) and returns the contexts followed by scripted new tokens, every row as long as the longest
    budget and padded after its end, as the real one returns them."""

    def __init__(self, new_tokens: list[list[int]], pad_id: int):
        import torch

        self.new_tokens, self.pad_id, self.configs = new_tokens, pad_id, []
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self.weight])

    def generate(self, *, input_ids, attention_mask, generation_config, tokenizer, synced_gpus, **cache):
        import torch

        assert set(cache) == {generation.GENERATE_CACHE_NAME} and not synced_gpus
        assert input_ids.shape == attention_mask.shape
        self.configs.append(generation_config)
        width = generation_config.max_new_tokens
        rows = [(row + [self.pad_id] * width)[:width] for row in self.new_tokens]
        return SimpleNamespace(sequences=torch.cat([input_ids, torch.tensor(rows)], dim=1))


def test_the_generator_keeps_each_row_up_to_its_first_end_token_and_within_its_own_budget(byte_tokenizer):
    from transformers import GenerationConfig

    new_tokens = [[40, 41, IM_END, 42, 43], [44, 45, 46, OTHER_END, 47], [OTHER_END, 48, 49, 50, 51]]
    model = ScriptedGenerateModel(new_tokens, pad_id=IM_END)
    generate = generation.TransformersGenerator(model, byte_tokenizer, GenerationConfig(
        do_sample=True, temperature=0.7, eos_token_id=IM_END, pad_token_id=IM_END), prefix_cache=False)
    sampled, logprobs = generate([[30, 31, 32], [33], [34, 35]], [5, 3, 4], stop=THINK_CLOSE)
    assert sampled == [[40, 41, IM_END], [44, 45, 46], [OTHER_END]] and logprobs is None
    [config] = model.configs
    assert (config.max_new_tokens, config.eos_token_id, config.stop_strings) == (5, [OTHER_END, IM_END], [THINK_CLOSE])
    assert config.temperature == 0.7 and generate.generation_config.max_new_tokens != 5  # a copy was changed


@pytest.mark.parametrize("temperature, top_p, sampling", [
    (0.7, 0.9, dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)),
    (1.3, 0.5, dict(do_sample=True, temperature=1.3, top_p=0.5, top_k=0)),
    (0.0, 0.9, dict(do_sample=False, temperature=None, top_p=None, top_k=None)),
])
def test_the_evaluations_generator_samples_at_the_given_temperature_and_top_p(byte_tokenizer, monkeypatch,
                                                                              temperature, top_p, sampling):
    from transformers import AutoModelForCausalLM

    loaded = []
    model = ScriptedGenerateModel([[IM_END]], pad_id=IM_END)
    model.eval = lambda: model

    def from_pretrained(folder):
        loaded.append(folder)
        return model
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    args = SimpleNamespace(use_vllm=False, temperature=temperature, top_p=top_p, seed=0)
    generate = generation.load_generator(args, "the/folder", byte_tokenizer)
    assert loaded == ["the/folder"] and generate.model is model
    config = generate.generation_config
    assert {key: getattr(config, key) for key in sampling} == sampling
    assert set(generation._as_list(config.eos_token_id)) == {IM_END, OTHER_END}


# --------------------------------------------------------------------------------------------
# The prefix cache: a generator's next call continues its previous call's key-value cache
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharp_tiny(tiny_model_dir):
    """The tiny Llama drawn again with large weights, so that its next token hangs on every token it attends to:
    a token wrongly seen or wrongly hidden changes its logits, and mostly its greedy choice."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.initializer_range = 0.4
    torch.manual_seed(1)
    return LlamaForCausalLM(config).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy(model, tokenizer, prefix_cache: bool):
    from transformers import GenerationConfig

    return generation.TransformersGenerator(model, tokenizer, GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id), prefix_cache)


def recorded(model, generate, contexts, budgets):
    """(sampled ids, the last position's logits of every forward pass, how many tokens the first pass fed: the
    prefill)."""
    steps, widths = [], []

    def keep(_module, _args, kwargs, output):
        steps.append(output.logits[:, -1].clone())
        widths.append(kwargs["input_ids"].shape[1])
    handle = model.register_forward_hook(keep, with_kwargs=True)
    try:
        sampled, _ = generate(contexts, budgets)
    finally:
        handle.remove()
    return sampled, steps, widths[0]


def test_a_cached_prefix_samples_as_a_fresh_prefill_for_exact_longer_and_unrelated_contexts(sharp_tiny):
    """The next call's contexts: an old context plus exactly its sampled tokens, another plus its sampled tokens
    and inserted ones, and one that shares nothing; in another order than before."""
    import torch

    model, tokenizer = sharp_tiny
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    exact_old, longer_old = encode("My sister skipped my wedding last June."), encode("I lost my job")
    cached = greedy(model, tokenizer, prefix_cache=True)
    first, _ = cached([exact_old, longer_old], [6, 9])
    assert not ({tokenizer.eos_token_id} & set(first[0] + first[1]))  # so every row samples its whole budget
    assert [len(ids) for ids in first] == [6, 9]
    contexts = [longer_old + first[1] + encode(" and then what?"), encode("Rivers"), exact_old + first[0]]
    budgets = [7, 4, 5]
    sampled, steps, prefill = recorded(model, cached, contexts, budgets)
    uncached = greedy(model, tokenizer, prefix_cache=False)
    uncached([exact_old, longer_old], [6, 9])
    fresh_sampled, fresh_steps, fresh_prefill = recorded(model, uncached, contexts, budgets)
    assert sampled == fresh_sampled and [len(ids) for ids in sampled] == budgets
    for row, budget in enumerate(budgets):  # each row's logits at each of its steps, as a fresh prefill gives them
        for step in range(budget):
            torch.testing.assert_close(steps[step][row], fresh_steps[step][row], atol=2e-4, rtol=1e-4)
    # Only the uncached tokens were fed: the last sampled token of the exact row (never fed), the inserted ones
    # (with the longer row's last sampled token), the whole unrelated row; the fresh prefill fed every context.
    assert prefill == max(1, len(encode(" and then what?")) + 1, len(encode("Rivers")))
    assert fresh_prefill == max(len(context) for context in contexts)


def test_a_generator_without_the_prefix_cache_prefills_every_call_afresh(sharp_tiny):
    model, tokenizer = sharp_tiny
    context = tokenizer("I lost my job", add_special_tokens=False)["input_ids"]
    outcomes = []
    for prefix_cache in (False, True):
        generate = greedy(model, tokenizer, prefix_cache)
        assert (generate.prefix_cache is None) == (not prefix_cache)
        first, _ = generate([context], [5])
        outcomes.append(recorded(model, generate, [context + first[0]], [3]))
    (fresh, _, fresh_prefill), (cached, _, cached_prefill) = outcomes
    assert fresh == cached
    assert (fresh_prefill, cached_prefill) == (len(context) + 5, 1)  # cached: only the last sampled token


@pytest.mark.parametrize("extra_over_half, reused", [(0, True), (1, False)])
def test_the_cache_is_reused_while_at_least_half_of_the_new_context_is_cached(sharp_tiny, extra_over_half, reused):
    """c tokens cached (the old context and all but the last sampled token); a new context of exactly 2c tokens
    continues the cache (only its c uncached tokens are fed), one of 2c + 1 is prefilled afresh."""
    model, tokenizer = sharp_tiny
    old = tokenizer("My sister skipped my wedding last June.", add_special_tokens=False)["input_ids"]
    generate = greedy(model, tokenizer, prefix_cache=True)
    [first], _ = generate([old], [6])
    assert tokenizer.eos_token_id not in first
    cached = len(old) + len(first) - 1
    filler = tokenizer(" and then what?" * 40, add_special_tokens=False)["input_ids"]
    context = old + first + filler[:2 * cached + extra_over_half - len(old) - len(first)]
    _, _, prefill = recorded(model, generate, [context], [2])
    assert prefill == (len(context) - cached if reused else len(context))


def test_contexts_are_padded_on_the_left_with_a_mask_of_their_own_tokens():
    input_ids, attention_mask = generation.left_padded([[5, 6, 7], [8], [9, 10]], pad_id=2)
    assert input_ids.tolist() == [[5, 6, 7], [2, 2, 8], [2, 9, 10]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_a_dialogues_simulated_user_gets_every_setting_of_the_dialogue_and_the_simulator():
    dialogue_args = DialogueArguments(start_emotion=37, max_turns=3)
    simulator_args = simulator.SimulatorArguments(variant="challenging", change_bound=4, language="en")
    user = rollout.new_simulator(PROFILE, None, dialogue_args, simulator_args)
    assert (user.emotion, user.max_turns, user.variant, user.change_bound, user.language) == (
        37, 3, "challenging", 4, "en")


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_the_common_prefix_is_the_length_a_plain_loop_finds(a, b):
    shared = 0
    while shared < min(len(a), len(b)) and a[shared] == b[shared]:
        shared += 1
    assert generation._common_prefix(a, b) == shared


def test_the_policys_prompt_follows_the_simulators_language_flag_over_the_profiles(byte_tokenizer):
    english = DialogueRunner(byte_tokenizer, DialogueArguments(), simulator.SimulatorArguments())
    chinese = DialogueRunner(byte_tokenizer, DialogueArguments(), simulator.SimulatorArguments(language="zh"))
    try:
        assert generation.policy_system_prompt("en", False) in byte_tokenizer.decode(english.prompt_ids(PROFILE, "Hi."))
        assert generation.policy_system_prompt("zh", False) in byte_tokenizer.decode(chinese.prompt_ids(PROFILE, "Hi."))
    finally:
        english.close(), chinese.close()


def test_the_vllm_server_generator_sends_one_request_per_budget_with_that_budget():
    class Client:  # TRL's VLLMClient.generate, as the fake vLLM server answers it
        def __init__(self):
            self.calls = []

        def generate(self, prompts, n, temperature, max_tokens, logprobs, generation_kwargs):
            self.calls.append((prompts, max_tokens))
            return {"completion_ids": [[7] * 12 for _ in prompts], "logprobs": [[[-0.5]] * 12 for _ in prompts]}

    generator = vllm_backends.VLLMServerGenerator.__new__(vllm_backends.VLLMServerGenerator)
    generator.client, generator.temperature = Client(), 0.9
    sampled, logprobs = generator([[1], [2], [3]], [5, 9, 5])
    assert generator.client.calls == [([[1], [3]], 5), ([[2]], 9)]
    assert [len(ids) for ids in sampled] == [5, 9, 5] and [len(lps) for lps in logprobs] == [5, 9, 5]
