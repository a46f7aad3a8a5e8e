"""Five scripted policies for the rule simulator, and the table of where each one leaves the user.

    python tests/reply_styles.py [--variant challenging] [--profiles profiles/train.jsonl]

warm: specific to what the user said and to what they need (`warm_reply`; `reading_reply` reads the need
from the dialogue instead of the profile); stock: stock comfort phrases
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
import guards  # noqa: E402
import rule_user  # noqa: E402
import simulator  # noqa: E402
from conftest import user_options  # noqa: E402

# One sentence per act, ten of each, so no sentence comes back within a dialogue (the rule user counts a
# sentence said again, also with other words slotted in, as a repeat). {a} and {b}: the user's words.
SENTENCES = {
    "clears": ["From what you say about {a}, this was not your fault.", "You did nothing wrong with {a}, and I mean it.",
               "Honestly, {a} is on them, not on you.", "With {a}, you did exactly what a careful person does.",
               "You had every right to expect {a} to go as agreed.",
               "Whatever they say, the blame lies with whoever changed {a}.",
               "You followed the process on {a}, step by step.", "What happened with {a} has nothing to do with you.",
               "You were right about {a}, whatever they claim now.",
               "You did your part with {a}; the mistake was someone else's."],
    "validates": ["No wonder {a} is still on your mind.", "It makes sense that {a} keeps coming back to you.",
                  "Your reaction to {a} is completely understandable.", "Of course you keep thinking about {a}.",
                  "Most people would be shaken by {a}.", "Taking {a} this seriously, that's a reasonable response.",
                  "Anyone in your place would care about {a}.", "It's natural that {a} weighs on you.",
                  "Your frustration about {a} is fair enough.",
                  "Given {a}, it makes complete sense to be this bothered."],
    "feeling": ["You must feel so alone with {a}.", "You sound exhausted by {a}.",
                "You seem hurt by {a}, more than you let on.", "You were humiliated by {a}, in front of everyone.",
                "That must have been painful, {a} of all things.", "You feel invisible when it comes to {a}.",
                "You must have felt betrayed by {a}.", "You are carrying so much hurt around {a}.",
                "You're worn down and lonely with {a}.", "You were heartbroken over {a}."],
    "reflects": ["It sounds like {a} is where it all started.", "So you have been dealing with {a} on your own.",
                 "What I'm hearing is that {a} changed things for you.", "You're saying {a} was the moment it turned.",
                 "If I understand right, {a} came out of nowhere.", "In other words, {a} keeps coming up.",
                 "It seems like {a} is the part nobody talks about.", "The hardest part seems to be {a}.",
                 "What bothers you most is {a}, if I follow.", "Sounds like you kept {a} going for a long while."],
    "invites": ["Tell me more about {a}.", "What happened after {a}?", "How did {a} go for you?",
                "Take your time, I'd like to hear about {a}.", "What was {a} like for you?",
                "Go on, what else happened with {a}?", "I'm listening, so say whatever comes up about {a}.",
                "Where were you when {a} happened?", "Who else knows about {a}?", "When did {a} start for you?"],
    "guides": ["Looking back, what do you notice about {a}?", "What would you do differently about {a}?",
               "What matters most to you about {a}?", "Do you see a pattern in {a}?",
               "If you could go back to {a}, what would change?", "How do you see your own part in {a}?",
               "What did you learn about yourself from {a}?", "What do you make of {a} now?",
               "What part of {a} would you want to handle better?",
               "What might you tell a friend in your place about {a}?"],
    "reasons": ["Maybe they felt cornered by {a}.", "Perhaps they were scared of what {a} meant for them.",
                "It could be that {a} hit their pride.", "They might have seen {a} as a threat.",
                "Possibly they never knew how much {a} mattered.", "Their worry about {a} may have come first.",
                "Probably they acted fast because {a} put them under strain.",
                "They may not have thought {a} through at all.", "Their reasons around {a} might be their own.",
                "Maybe their pressure at work spilled over into {a}."],
    "two_sides": ["On one hand {a} hurt; on the other hand the pressure was real for everyone.",
                  "At the same time, {a} looks different from where they stood.", "Both sides of {a} matter here.",
                  "That doesn't excuse {a}, and it still helps to see the whole picture.",
                  "From your side {a} was a clear wrong, and for them it may have looked different.",
                  "It seems fair to them and to you to look at {a} twice.",
                  "Both of you probably had reasons around {a}.",
                  "There are two ways to read {a}, and both things can be true at once.",
                  "Being reasonable to them about {a} does not mean agreeing with them.",
                  "On the one hand {a} was careless; on the other, it was not meant to wound."],
    "advises": ["One option is to raise {a} directly with the person in charge.",
                "You could try putting {a} to them plainly.",
                "A first step might be to check what {a} actually requires.",
                "It might help to ask someone neutral about {a}.", "Another idea is to split {a} into smaller pieces.",
                "You could ask for a second opinion on {a}.", "It's worth checking whether {a} can be changed.",
                "Start by looking at what {a} costs you each week.", "Consider asking for {a} to be reviewed.",
                "You can look for someone who has handled {a} before."],
    "concrete": ["Write down the key facts about {a} tonight.", "Send an email about {a} this week.",
                 "Book a call about {a} tomorrow.", "Make a list of what {a} involves.",
                 "Set yourself a deadline for {a}.", "Put the agreement about {a} in writing.",
                 "Draw up a plan for {a}, one line per step.", "Text them about {a} today.",
                 "Call about {a} by Friday.", "Keep a schedule for {a} so nothing slips."],
    "praises": ["The way you handled {a} was brave.", "I'm impressed by what you did with {a}.",
                "Handling {a} like that took real courage.", "What you built with {a} is remarkable.",
                "Not everyone would have stuck with {a} the way you did.",
                "You managed {a} almost on your own, and it shows.", "That's no small thing, pulling off {a}.",
                "You did a great job with {a}.", "I admire how carefully you approached {a}.",
                "Good for you for seeing {a} through."],
}
# What a skilled listener says to each need: two acts it welcomes, then one listening act it neither
# welcomes nor minds ("heard, then answered"). Before the need is known: listening only.
PLAYS = {
    "not_at_fault": ("clears", "validates", "invites"), "self_reflection": ("reflects", "guides", "feeling"),
    "balanced_analysis": ("two_sides", "reasons", "reflects"), "deep_empathy": ("feeling", "validates", "reflects"),
    "venting": ("reflects", "validates", "invites"), "others_motives": ("reasons", "two_sides", "invites"),
    "practical_advice": ("advises", "concrete", "validates"), "sincere_praise": ("praises", "feeling", "reflects"),
}
LISTENING_PLAY = ("reflects", "validates", "invites")
# Signs of each need in what a person says, for a policy that reads the need from the dialogue.
NEED_SIGNS = {
    "not_at_fault": r"\b(blam\w*|my fault|on me|where i went wrong|in the wrong|supposed to do|followed|rules|by the book|"
                    r"guilty|accus\w*|half responsible)\b",
    "self_reflection": r"\b(learn\w*|my (?:own )?part|says about me|handle it better|work out what i did|differently|my side of it)\b",
    "balanced_analysis": r"\b(whole picture|both sides|to be fair|be fair|where they stand|take my side|agree with me)\b",
    "deep_empathy": r"\b(from the inside|understood|cheering up|heavy|what (?:this|it) (?:actually )?feels like|"
                    r"it'?ll be fine)\b",
    "venting": r"\b(get (?:this|it|all of this) out|say it|holding it in|hear it|vent\w*|off my chest|out loud)\b",
    "others_motives": r"\b(why (?:would|did|do|does)|in their head|a reason they|acted like that|"
                      r"what was going on)\b",
    "practical_advice": r"\b(what do i (?:actually )?do|my options|decide|a way out|run out of ideas|"
                        r"something i can (?:actually )?do)\b",
    "sincere_praise": r"\b(put so much|worked (?:really )?hard|nobody (?:said|noticed)|not that anyone noticed|"
                      r"counted for|on my own)\b",
}


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


def compose(acts: tuple, user_messages: list[str], turn: int) -> str:
    """One sentence per act, the turn's own from each bank, about the user's latest words."""
    a, b = salient_words(user_messages)[:2]
    return " ".join(SENTENCES[act][turn % len(SENTENCES[act])].format(a=word)
                    for act, word in zip(acts, (a, b, a)))


def warm_reply(profile, user_messages: list[str], turn: int) -> str:
    """Knows the need from the profile: what a good policy could reach."""
    return compose(PLAYS[profile.intention], user_messages, turn)


def read_need(user_messages: list[str]) -> str | None:
    """The need the user's words show most (later messages weigh more), or None while nothing shows it."""
    weights = {need: sum((i + 1) * len(re.findall(signs, message, re.IGNORECASE))
                         for i, message in enumerate(user_messages)) for need, signs in NEED_SIGNS.items()}
    best = max(weights, key=weights.get)
    return best if weights[best] > 0 else None


def reading_reply(profile, user_messages: list[str], turn: int) -> str:
    """Reads the need from the dialogue alone (the profile is not looked at): listens until the need shows."""
    need = read_need(user_messages)
    return compose(PLAYS[need] if need else LISTENING_PLAY, user_messages, turn)


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
    sim = simulator.RuleSimulator(profile, **user_options(variant=variant))
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
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("what was measured is printed above; nothing written")
