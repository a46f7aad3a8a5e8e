"""Five scripted policies for the rule simulator, and the table of where each one leaves the user.

    python tests/reply_styles.py [--variant challenging] [--profiles profiles/train.jsonl]

warm: specific to what the user said and to what they need; stock: stock comfort phrases
repeated; advice: a cold advice dump; dismissive: brushing the user off; garbled: non-language.
"""
import argparse
import asyncio
import random
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rule_user  # noqa: E402
import simulator  # noqa: E402

# Warm replies are built from three parts picked by turn from lists of coprime lengths (3, 4, 5),
# so no two replies of one dialogue share more than one part.
OPENERS = ["It sounds like {a} has been sitting heavily with you.",
           "So you've been carrying {a} and {b} on your own.",
           "What you said about {a} stays with me."]
MIDDLES = {
    "venting": ["No wonder you feel so drained by {b}.", "You must feel exhausted after {b}.",
                "It makes sense that {b} left you so angry.", "Of course you're upset about {b}."],
    "deep_empathy": ["You must feel so alone with {b}.", "No wonder {b} left you feeling invisible.",
                     "It makes sense that you feel hurt by {b}.", "You seem crushed by {b}, and that is understandable."],
    "not_at_fault": ["It wasn't your fault that {b} happened.", "You did the right thing around {b}.",
                     "Anyone would have reacted the way you did to {b}.", "Honestly, {b} is on them, not on you."],
    "sincere_praise": ["The way you handled {b} was brave.", "I'm impressed by how you dealt with {b}.",
                       "It shows real courage, what you did with {b}.", "Handling {b} like that took a lot, and I admire it."],
    "practical_advice": ["One option is to write down what {b} costs you this week.",
                         "A first step could be a short call about {b} tomorrow.",
                         "You could try to set a deadline for {b} by Friday.",
                         "Another option is to ask someone you trust about {b} this week."],
    "others_motives": ["Maybe they felt pressure around {b}.", "Perhaps they were afraid of what {b} meant for them.",
                       "It could be that {b} touched their pride.", "From their side, {b} might have felt like a threat."],
    "balanced_analysis": ["On one hand {b} hurt you; on the other hand they may have had reasons.",
                          "From their side {b} might look different, while your view is fair too.",
                          "Both sides of {b} matter, and that doesn't excuse what they did.",
                          "At the same time, {b} probably had pressures on their side too."],
    "self_reflection": ["Looking back, what do you notice about {b}?", "What would you do differently about {b}?",
                        "What matters most to you about {b}?", "Do you see a pattern in {b}?"],
}
CLOSERS = ["What was that like for you?", "How did that feel at the time?", "Tell me more about {a}, if you want.",
           "What happened after {a}?", "How do you feel about {a} now?"]

STOCK = "I understand how you feel. That must be hard. I'm here for you. Stay strong. Everything will be okay."
ADVICE = ["You should make a list and pick the best option. You need to sleep eight hours and exercise daily. "
          "Consider therapy. Drink water and think positive.",
          "You need to set goals. You must stay organized and keep a planner. Try meditation and journaling. "
          "Consider reading a self-help book.",
          "You have to be proactive. You should talk to a professional. Try a budget app and a gym routine. "
          "Consider a change of scenery."]
DISMISSIVE = ["Honestly, it's not a big deal. You'll get over it.", "Calm down, you're overreacting a bit.",
              "Whatever, other people have it worse. Just move on."]


def salient_words(user_messages: list[str]) -> list[str]:
    """The user's most specific words, newest message first: names, then long content words. The rule
    user's canned reactions ("Hm, that helps a little.") are left out: a listener answers the story."""
    picked = []
    for message in reversed(user_messages):
        for canned in rule_user.CANNED_LINES:
            message = message.replace(canned, "")
        words = re.findall(r"(?<![.!?] )(?<!^)\b[A-Z][a-z]+\b", message)  # capitalised mid-sentence: names
        words += sorted(re.findall(r"\b[a-z]{4,}\b", message), key=len, reverse=True)
        for word in words:
            lower = word.lower()
            if (lower not in rule_user.STOPWORDS and lower not in rule_user.GENERIC_WORDS and not lower.endswith("ly")
                    and rule_user._key(lower) not in {rule_user._key(p.lower()) for p in picked}):
                picked.append(word)
        if len(picked) >= 2:
            return picked
    return picked + ["this", "all of it"]


def warm_reply(profile, user_messages: list[str], turn: int) -> str:
    a, b = salient_words(user_messages)[:2]
    parts = [OPENERS[turn % 3], MIDDLES[profile.intention][turn % 4], CLOSERS[turn % 5]]
    return " ".join(part.format(a=a, b=b) for part in parts)


def garbled_reply(turn: int) -> str:
    rng = random.Random(turn)
    return " ".join("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(3, 9))) for _ in range(12))


def reply_for(style: str, profile, user_messages: list[str], turn: int) -> str:
    if style == "warm":
        return warm_reply(profile, user_messages, turn)
    if style == "stock":
        return STOCK
    if style == "advice":
        return ADVICE[turn % len(ADVICE)]
    if style == "dismissive":
        return DISMISSIVE[turn % len(DISMISSIVE)]
    return garbled_reply(turn)


STYLES = ("warm", "stock", "advice", "dismissive", "garbled")


async def final_emotion(profile, style: str, variant: str = "vanilla") -> int:
    sim = rule_user.RuleSimulator(profile, variant=variant)
    user_messages = [await sim.open()]
    for turn in range(sim.max_turns):
        result = await sim.respond(reply_for(style, profile, user_messages, turn))
        user_messages.append(result.message)
        if result.done:
            break
    return sim.emotion


def style_table(profiles, variant: str = "vanilla") -> dict:
    return {style: [asyncio.run(final_emotion(p, style, variant)) for p in profiles] for style in STYLES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=str(simulator.DEFAULT_PROFILES))
    parser.add_argument("--variant", choices=simulator.VARIANTS, default="vanilla")
    args = parser.parse_args()
    profiles = simulator.load_profiles(args.profiles)
    table = style_table(profiles, args.variant)
    print(f"{len(profiles)} profiles, {args.variant} rule simulator, start {simulator.TRAIN_START_EMOTION}, "
          f"{simulator.PAPER_MAX_TURNS} turns")
    print("| style | mean final emotion | min | max | reached 100 | fell below 10 |")
    print("|---|---|---|---|---|---|")
    for style, finals in table.items():
        print(f"| {style} | {statistics.mean(finals):.1f} | {min(finals)} | {max(finals)} | "
              f"{sum(f >= 100 for f in finals)} | {sum(f < 10 for f in finals)} |")


if __name__ == "__main__":
    main()
