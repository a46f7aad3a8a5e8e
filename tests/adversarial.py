"""Degenerate reply strategies an RL optimiser could discover, played over whole dialogues against the
rule user, next to the warm style and a neutral reply: the floor a trained model must beat.

    python tests/adversarial.py            # both variants, training and benchmark protocols
    python tests/adversarial.py --held_out # the 16 benchmark profiles played as the demo trains (start 30, 2 replies)

Every strategy sees what a policy sees (the user's messages so far) plus, for the ones that
address the user by name, the profile's persona; none reads the hidden intention. Words are drawn
from what the user said with a seeded RNG, so a run is reproducible.
"""
import asyncio
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reply_styles import LISTENING_PLAY, PLAYS, SENTENCES, read_need, reading_reply, salient_words, warm_reply  # noqa: E402

import guards  # noqa: E402
import rule_user  # noqa: E402
import simulator  # noqa: E402
from conftest import user_options  # noqa: E402

NEUTRAL = "I see. Can you tell me more about that?"
FILLERS = ("um", "like", "uh", "you know")
STOPWORDS = rule_user.STOPWORDS | rule_user.GENERIC_WORDS


def user_words(messages: list[str], rng: random.Random, count: int) -> list[str]:
    """`count` distinct content words the user said, newest message first."""
    words = []
    for message in reversed(messages):
        for word in re.findall(r"[A-Za-z']+", message):
            if len(word) > 3 and word.lower() not in STOPWORDS and word.lower() not in map(str.lower, words):
                words.append(word)
    rng.shuffle(words)
    return (words + ["that"] * count)[:count]


CUE_TEMPLATES = [
    "It sounds like {0}, {1}, no wonder, not your fault, however what {2} today? Respect.",
    "So you feel {0} and {1}, makes sense, one option is {2} tomorrow, how did that feel?",
    "No wonder {0}, {1}, you did the right thing, on the other hand what about {2}?",
    "It seems like {0}, I'm impressed, maybe they felt {1}, what do you think about {2}?",
    "You must feel {0}, anyone would, {1}, first step {2} this week, tell me more.",
    "What I'm hearing is {0}, {1}, that took courage, at the same time what if {2}?",
    "Of course you feel {0}, it wasn't your fault, perhaps they {1}, go on about {2}.",
    "In other words {0}, {1}, understandable, from their side {2}, what matters to you?",
]
EVERY_NEED = ("No wonder you feel hurt and it's not your fault, you did the right thing. One option is to call "
              "tomorrow. Maybe they felt pressure, and on the other hand it makes sense. What do you think? "
              "I'm proud of you, that took courage.")
# One cue phrase of every act, for the strategies that do not know whom they are talking to.
CUE_PHRASES = ["It sounds like", "No wonder", "That makes sense", "You must feel so hurt", "It was not your fault",
               "Tell me more", "One option is", "Maybe they felt pressure", "On the other hand", "Looking back",
               "I'm proud of you", "What was that like"]
SUPPORTIVE = ["It sounds like {0} has been really hard on you.", "No wonder {1} is weighing on you so much.",
              "You are handling {0} with real strength.", "What was {1} like for you?",
              "I'm glad you told me about {0}, it matters."]
NOT_YOUR_FAULT = "It was not your fault that {0} happened."
WARMER = re.compile(r"\b(yes|helps?|exactly|means a lot|heard|fair|okay)\b", re.IGNORECASE)


def cue_stubs(m, t, r) -> str:
    """One cue phrase a line, two of the user's words slotted into each, ten rotations."""
    w = user_words(m, r, 2)
    return "\n".join(f"{CUE_PHRASES[(t + i) % 10]} {w[0]} {w[1]}." for i in range(4))


def bank(m, t, r, adaptive: bool) -> str:
    """Three of five supportive sentences, two random user words; adaptive: after a reaction that shows no
    warming, "not your fault" takes the first sentence's place."""
    w = user_words(m, r, 2)
    picked = r.sample(SUPPORTIVE, 3)
    if adaptive and t > 0 and not WARMER.search(m[-1].split(".")[0]):
        picked[0] = NOT_YOUR_FAULT
    return " ".join(sentence.format(*w) for sentence in picked)


THERAPIST = ["It sounds like you're carrying a lot right now, and your feelings make sense.",
             "What comes up for you when you sit with that? I'm curious what it's like for you.",
             "It seems like this touches something deep in you. Would you like to explore that together?",
             "That makes sense. Let's stay with that feeling for a moment. What do you notice?"]


def name_of(profile) -> str:
    found = re.search(r"Name:\s*([A-Z][a-z]+)", profile.player)
    return found.group(1) if found else "friend"


def echo_with_fillers(text: str, rng: random.Random) -> str:
    words = text.split()
    return " ".join(word + (f" {rng.choice(FILLERS)}" if i % 2 else "") for i, word in enumerate(words))


def shuffled(text: str, rng: random.Random) -> str:
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def reversed_sentences(text: str) -> str:
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
    return " ".join(" ".join(reversed(s.rstrip(".!?").split())) + "." for s in sentences)


# Each strategy: (profile, the user's messages so far, turn index, rng) -> reply.
STRATEGIES = {
    "cue stubs, one a line, two user words each, 10 rotations": lambda p, m, t, r: cue_stubs(m, t, r),
    "bare cue phrases, then (w1, w2)": lambda p, m, t, r: ". ".join(CUE_PHRASES[(t + i) % 12] for i in range(3))
    + ". ({}, {})".format(*user_words(m, r, 2)),
    "need-blind bank of 5 supportive sentences, 2 random user words": lambda p, m, t, r: bank(m, t, r, False),
    "the same, 'not your fault' swapped in after a cool reaction": lambda p, m, t, r: bank(m, t, r, True),
    "cue-phrase salad, 8 rotating templates": lambda p, m, t, r: CUE_TEMPLATES[t % 8].format(*user_words(m, r, 3)),
    "cue-phrase salad, one template": lambda p, m, t, r: CUE_TEMPLATES[0].format(*user_words(m, r, 3)),
    "one short template, the user's words slotted in": lambda p, m, t, r: (
        "It sounds like {} and the {} in {} left you so hurt. What was that like?".format(*user_words(m, r, 3))),
    "cue phrases of every need": lambda p, m, t, r: EVERY_NEED,
    "echo with fillers": lambda p, m, t, r: echo_with_fillers(m[-1], r),
    "list of the user's words": lambda p, m, t, r: ", ".join(user_words(m, r, 7)) + ".",
    "So, w1 and w2?": lambda p, m, t, r: "So, {} and {}?".format(*user_words(m, r, 2)),
    "questions only": lambda p, m, t, r: "What happened with {}? How did {} make you feel? What do you think about {}?".format(
        *user_words(m, r, 3)),
    "flattery": lambda p, m, t, r: "You are wonderful and so strong. Honestly, you are one of the bravest people I know.",
    "praise only": lambda p, m, t, r: "The way you handled {} was impressive. I really admire how you dealt with {}.".format(
        *user_words(m, r, 2)),
    "therapist-speak without content": lambda p, m, t, r: THERAPIST[t % len(THERAPIST)],
    "the same sentence with the user's name": lambda p, m, t, r: f"{name_of(p)}, I really hear how much this matters to you.",
    "the user's words shuffled": lambda p, m, t, r: shuffled(m[-1], r),
    "the user's sentences reversed": lambda p, m, t, r: reversed_sentences(m[-1]),
    "the user's last sentence as a question": lambda p, m, t, r: "You said: " + re.split(r"(?<=[.!?])\s+", m[-1].strip())[-1].rstrip(".!?") + "?",
}
# Adaptive policies: they read the dialogue (the user's reactions, or the need the user's words show) and
# write templates with the user's words slotted in. They never read the profile's need. A reaction warmed when
# its first sentence is one of the vanilla user's warm reactions (a policy learns them from the dialogue).
WARM_REACTIONS = set(rule_user.REACTIONS["gain"])


def warmed(message: str) -> bool:
    return any(message.startswith(reaction) for reaction in WARM_REACTIONS)


def probed_plays(plays: list[tuple], messages: list[str]) -> int:
    """Probe, then stick: the index of the play for the next turn. Each turn keeps the play after which the
    user warmed, and moves to the next untried one otherwise."""
    index = 0
    for reaction in messages[1:]:
        index = index if warmed(reaction) else (index + 1) % len(plays)
    return index


# The need reader: short act phrases, one word of the user's each.
SHORT_PHRASES = {"clears": "Not your fault about {a}.", "validates": "Fair enough about {a}.",
                 "feeling": "You seem shaken about {a}.", "reflects": "So {a} is the hard part.",
                 "invites": "Tell me more about {a}.", "guides": "What do you notice about {a}?",
                 "reasons": "Maybe they feared {a}.", "two_sides": "Both sides of {a} matter.",
                 "advises": "One option is to ask about {a}.", "concrete": "Call about {a} this week.",
                 "praises": "You should be proud of {a}."}


def two_slot_reply(acts: tuple, messages: list[str], turn: int) -> str:
    """The warm style's banks (ten sentences an act, none said twice in a dialogue), two of the user's words
    slotted into every sentence, so that each sentence ties two details of the story."""
    a, b = salient_words(messages)[:2]
    return " ".join(SENTENCES[act][turn % len(SENTENCES[act])].format(a=f"{a} and {b}") for act in acts)


def short_phrase_reply(acts: tuple, messages: list[str], turn: int) -> str:
    words = salient_words(messages)
    return " ".join(SHORT_PHRASES[act].format(a=words[i % 2]) for i, act in enumerate(acts))


THREE_PLAYS = [("clears", "validates", "invites"), ("advises", "concrete", "validates"),
               ("reflects", "feeling", "invites")]
NEED_PLAYS = list(PLAYS.values())


def reaction_tree(messages: list[str]) -> tuple:
    """An act tree solved from the tables (rule_user.NEEDS): after each reply, keep the needs under which the
    play just made would have warmed the user exactly when it did; play the first need still possible."""
    candidates = list(rule_user.NEEDS)
    for turn, reaction in enumerate(messages[1:]):
        play = set(PLAYS[candidates[0]] if turn else LISTENING_PLAY)
        kept = [need for need in candidates if (turn == 0 or bool(play & _asks(need))) == warmed(reaction)]
        candidates = kept or candidates[1:] or list(rule_user.NEEDS)
    return PLAYS[candidates[0]] if len(messages) > 1 else LISTENING_PLAY


def _asks(need: str) -> set:
    welcome = rule_user.NEEDS[need][0]
    return welcome - set(rule_user.LISTENING) or welcome


ADAPTIVE = {
    "probe and stick, three plays, one word a sentence": lambda p, m, t, r: reading_compose(
        THREE_PLAYS[probed_plays(THREE_PLAYS, m)], m, t),
    "probe and stick, three plays, two words a sentence": lambda p, m, t, r: two_slot_reply(
        THREE_PLAYS[probed_plays(THREE_PLAYS, m)], m, t),
    "probe and stick, every need's play, two words a sentence": lambda p, m, t, r: two_slot_reply(
        NEED_PLAYS[probed_plays(NEED_PLAYS, m)], m, t),
    "reaction tree solved from the tables, two words a sentence": lambda p, m, t, r: two_slot_reply(
        reaction_tree(m), m, t),
    "reads the need, short act phrases (the issue's example)": lambda p, m, t, r: short_phrase_reply(
        PLAYS[read_need(m)] if read_need(m) else LISTENING_PLAY, m, t),
    "reads the need, two words a sentence": lambda p, m, t, r: two_slot_reply(
        PLAYS[read_need(m)] if read_need(m) else LISTENING_PLAY, m, t),
}


def reading_compose(acts: tuple, messages: list[str], turn: int) -> str:
    """One sentence per act from the warm style's banks (one of the user's words each)."""
    a, b = salient_words(messages)[:2]
    return " ".join(SENTENCES[act][turn % len(SENTENCES[act])].format(a=word) for act, word in zip(acts, (a, b, a)))


REFERENCES = {
    "neutral": lambda p, m, t, r: NEUTRAL,
    "warm and specific (tests/reply_styles.py)": lambda p, m, t, r: warm_reply(p, m, t),
    "reads the need from the dialogue (tests/reply_styles.py)": lambda p, m, t, r: reading_reply(p, m, t),
}
PROTOCOLS = {  # name: (profile file, start emotion, judged replies)
    "train": (simulator.DEFAULT_PROFILES, simulator.TRAIN_START_EMOTION, simulator.PAPER_MAX_TURNS),
    "train, 2 turns": (simulator.DEFAULT_PROFILES, simulator.TRAIN_START_EMOTION, 2),  # the CPU demo's length
    "benchmark": (simulator.DEFAULT_BENCHMARK_PROFILES, simulator.BENCHMARK_START_EMOTION, simulator.BENCHMARK_MAX_TURNS),
}


# What a trained adapter is compared with on profiles it never trained on (docs/results.md).
HELD_OUT = {"held-out, 2 turns": (simulator.DEFAULT_BENCHMARK_PROFILES, simulator.TRAIN_START_EMOTION, 2)}


async def play(profile, strategy, variant: str, start: int, max_turns: int, seed: int = 0) -> int:
    """The final emotion of one whole dialogue whose replies `strategy` writes."""
    user = simulator.RuleSimulator(profile, **user_options(variant=variant, start_emotion=start, max_turns=max_turns))
    messages = [await user.open(profile.first_talk)]
    rng = random.Random(f"{seed}-{profile.id}")
    turn = 0
    while not user.done:
        reply = strategy(profile, messages, turn, rng)
        messages.append((await user.respond(reply)).message)
        turn += 1
    return user.emotion


def finals(strategy, variant: str, protocol: str) -> list[int]:
    path, start, max_turns = {**PROTOCOLS, **HELD_OUT}[protocol]
    profiles = simulator.load_profiles(path)

    async def run():
        return [await play(p, strategy, variant, start, max_turns) for p in profiles]

    return asyncio.run(run())


def table(protocols=PROTOCOLS) -> dict:
    """{(strategy, variant, protocol): final emotions}, for every strategy and reference."""
    return {(name, variant, protocol): finals(strategy, variant, protocol)
            for name, strategy in {**REFERENCES, **STRATEGIES, **ADAPTIVE}.items()
            for variant in simulator.VARIANTS for protocol in protocols}


def format_table(results: dict, protocols=PROTOCOLS) -> str:
    columns = [(variant, protocol) for protocol in protocols for variant in simulator.VARIANTS]
    lines = ["| strategy | " + " | ".join(f"{p}, {v}: mean (at 100)" for v, p in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for name in {**REFERENCES, **STRATEGIES, **ADAPTIVE}:
        cells = []
        for variant, protocol in columns:
            values = results[(name, variant, protocol)]
            cells.append(f"{statistics.mean(values):.1f} ({sum(v >= simulator.MAX_EMOTION for v in values)}/{len(values)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        chosen = HELD_OUT if sys.argv[1:] == ["--held_out"] else PROTOCOLS
        if sys.argv[1:] not in ([], ["--held_out"]):
            raise SystemExit("usage: python tests/adversarial.py [--held_out]")
        print(format_table(table(chosen), chosen))
    except KeyboardInterrupt:
        guards.exit_interrupted("nothing measured (the table is printed at the end)")
