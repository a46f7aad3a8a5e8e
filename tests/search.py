"""A black-box search for what the rule user pays: an evolutionary search over need-blind reply policies.

    python tests/search.py                      # the suite's budget (tests/test_adversarial.py runs it)
    python tests/search.py --generations 50     # by hand: 10x the suite's budget

A policy is built from a generic bank of phrases (supportive lines, cue phrases of every kind of reply,
bare stubs), told nothing about the rules: which phrases, how many a turn, how it rotates through them,
whether it joins them as sentences or one a line, and where it takes the user's words from (the latest
message or anywhere). Like a real policy it sees only the user's messages. The search maximises the mean
final emotion of the training protocol (start 30; the demo's 2 turns and the paper's 8, both variants) on
every other training profile: 8-turn dialogues of need-blind policies mostly end at the floor, where every
policy looks alike, and the 2-turn ones still tell them apart. The best policy is then scored on all
training profiles (2 and 8 turns) and on the benchmark protocol.
Seeded: the same budget gives the same result.

    python tests/search.py --adaptive           # adaptive template policies instead (see AdaptivePolicy)

With --adaptive the search is over policies that read the dialogue: which of the needs' plays they probe and
in what order, whether they stick with a play after which the user warmed, how many of the user's words each
sentence takes (one or two) and whether they switch to the play of the need the user's words show once it
shows (tests/reply_styles.py's read_need). They write the warm style's template sentences (ten an act).
"""
import argparse
import asyncio
import random
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from adversarial import play, user_words, warmed  # noqa: E402
from reply_styles import LISTENING_PLAY, PLAYS, SENTENCES, read_need, salient_words  # noqa: E402

import guards  # noqa: E402
import simulator  # noqa: E402

# Phrases anyone might try; {0} and {1} take the user's words.
PHRASES = [
    "It sounds like {0} has been really hard on you.", "No wonder {0} is weighing on you.",
    "That makes complete sense given {0}.", "You must feel so hurt about {0}.", "It was not your fault that {0} happened.",
    "Tell me more about {0}.", "One option is to talk to someone about {0} this week.",
    "Maybe they felt pressure around {0}.", "On the other hand, {0} looks different from their side.",
    "Looking back, what do you notice about {0}?", "I'm proud of how you handled {0}.",
    "What was {0} like for you?", "I'm here for you, whatever happens with {0}.", "You did nothing wrong with {0}.",
    "You could try writing down what {0} means to you.", "That took real courage, with {0}.",
    "So you have been carrying {0} and {1} on your own.", "Of course you feel that way about {0}.",
    "Both sides of {0} matter.", "What would you do differently about {0}?", "It must have been awful, {0}.",
    "Anyone in your place would care about {0}.", "Perhaps they did not see how much {0} mattered to you.",
    "Thank you for telling me about {0} and {1}.", "{0} and {1} are a lot to carry.", "No wonder.", "Not your fault.",
    "Tell me more.", "You did well.", "I see, {0}.", "That's really something, {0} and {1}.",
    "What a thing to go through with {0}.", "How are you holding up after {0}?", "You deserve better than {0}.",
    "It is okay to be upset about {0}.", "Going through {0} would shake anyone.",
]


@dataclass(frozen=True)
class Policy:
    phrases: tuple  # indices into PHRASES
    per_turn: int  # phrases a reply
    step: int  # how far the rotation moves each turn
    lines: bool  # one phrase a line, or sentences in a paragraph
    latest: bool  # the user's words from their latest message only, or from anything they said

    def reply(self, messages: list[str], turn: int, rng: random.Random) -> str:
        source = messages[-1:] if self.latest else messages
        chosen = [PHRASES[self.phrases[(turn * self.step + i) % len(self.phrases)]] for i in range(self.per_turn)]
        return ("\n" if self.lines else " ").join(p.format(*user_words(source, rng, 2)) for p in chosen)


def random_policy(rng: random.Random) -> Policy:
    return Policy(tuple(rng.sample(range(len(PHRASES)), rng.randint(2, 8))), rng.randint(1, 4), rng.randint(1, 3),
                  rng.random() < 0.3, rng.random() < 0.5)


def mutate(policy: Policy, rng: random.Random) -> Policy:
    phrases = list(policy.phrases)
    move = rng.randrange(6)
    if move == 0 and len(phrases) > 1:
        phrases.pop(rng.randrange(len(phrases)))
    elif move == 1:
        phrases.insert(rng.randrange(len(phrases) + 1), rng.randrange(len(PHRASES)))
    elif move == 2:
        phrases[rng.randrange(len(phrases))] = rng.randrange(len(PHRASES))
    elif move == 3:
        return replace(policy, per_turn=max(1, min(4, policy.per_turn + rng.choice((-1, 1)))))
    elif move == 4:
        return replace(policy, step=rng.randint(1, 3), lines=not policy.lines if rng.random() < 0.3 else policy.lines)
    else:
        return replace(policy, latest=not policy.latest)
    return replace(policy, phrases=tuple(phrases))


@dataclass(frozen=True)
class AdaptivePolicy:
    probes: tuple  # needs (keys of PLAYS) whose plays it tries, in order
    stick: bool  # keep a play after which the user warmed
    slots: int  # the user's words a sentence (1 or 2)
    read: bool  # switch to the play of the need the user's words show, once they show one

    def reply(self, messages: list[str], turn: int, rng: random.Random) -> str:
        index = 0
        for reaction in messages[1:]:
            index = index if self.stick and warmed(reaction) else index + 1
        shown = read_need(messages) if self.read else None
        acts = PLAYS[shown] if shown else PLAYS[self.probes[index % len(self.probes)]] if turn else LISTENING_PLAY
        words = salient_words(messages)
        slot = words[0] if self.slots == 1 else f"{words[0]} and {words[1]}"
        return " ".join(SENTENCES[act][turn % len(SENTENCES[act])].format(a=slot) for act in acts)


NEEDS = tuple(PLAYS)


def random_adaptive(rng: random.Random) -> AdaptivePolicy:
    return AdaptivePolicy(tuple(rng.sample(NEEDS, rng.randint(1, len(NEEDS)))), rng.random() < 0.7,
                          rng.choice((1, 2)), rng.random() < 0.5)


def mutate_adaptive(policy: AdaptivePolicy, rng: random.Random) -> AdaptivePolicy:
    move = rng.randrange(4)
    if move == 0:
        probes = list(policy.probes)
        if len(probes) > 1 and rng.random() < 0.5:
            probes.pop(rng.randrange(len(probes)))
        else:
            probes.insert(rng.randrange(len(probes) + 1), rng.choice(NEEDS))
        return replace(policy, probes=tuple(probes))
    if move == 1:
        return replace(policy, stick=not policy.stick)
    if move == 2:
        return replace(policy, slots=3 - policy.slots)
    return replace(policy, read=not policy.read)


def finals(policy: Policy | AdaptivePolicy, profiles, variant: str, start: int, max_turns: int) -> list[int]:
    def strategy(profile, messages, turn, rng):
        return policy.reply(messages, turn, rng)

    async def run():
        return [await play(p, strategy, variant, start, max_turns) for p in profiles]

    return asyncio.run(run())


def fitness(policy: Policy | AdaptivePolicy, profiles) -> float:
    return statistics.mean(v for variant in simulator.VARIANTS for max_turns in (2, simulator.PAPER_MAX_TURNS)
                           for v in finals(policy, profiles, variant, simulator.TRAIN_START_EMOTION, max_turns))


def search(generations: int = 5, population: int = 8, seed: int = 0,
           adaptive: bool = False) -> tuple[Policy | AdaptivePolicy, float, int]:
    """(best policy, its fitness, policies evaluated): keep the best half, refill with their mutants."""
    rng = random.Random(seed)
    make, change = (random_adaptive, mutate_adaptive) if adaptive else (random_policy, mutate)
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[::2]
    scored = [(fitness(p, profiles), p) for p in (make(rng) for _ in range(population))]
    evaluated = population
    for _ in range(generations):
        scored.sort(key=lambda pair: -pair[0])
        parents = scored[:population // 2]
        children = [change(rng.choice(parents)[1], rng) for _ in range(population - len(parents))]
        scored = parents + [(fitness(c, profiles), c) for c in children]
        evaluated += len(children)
    best_fitness, best = max(scored, key=lambda pair: pair[0])
    return best, best_fitness, evaluated


def protocols(policy: Policy | AdaptivePolicy) -> dict:
    """{(protocol, variant): final emotions} of a policy on every profile of each protocol."""
    train = simulator.load_profiles(simulator.DEFAULT_PROFILES)
    bench = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES)
    settings = {"train, 2 turns": (train, simulator.TRAIN_START_EMOTION, 2),
                "train, 8 turns": (train, simulator.TRAIN_START_EMOTION, simulator.PAPER_MAX_TURNS),
                "benchmark": (bench, simulator.BENCHMARK_START_EMOTION, simulator.BENCHMARK_MAX_TURNS)}
    return {(name, variant): finals(policy, profiles, variant, start, max_turns)
            for name, (profiles, start, max_turns) in settings.items() for variant in simulator.VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generations", type=int, default=5)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adaptive", action="store_true", help="search adaptive template policies")
    args = parser.parse_args()
    best, best_fitness, evaluated = search(args.generations, args.population, args.seed, args.adaptive)
    print(f"{evaluated} policies evaluated; best training fitness {best_fitness:.1f}")
    if args.adaptive:
        print(f"best policy: {best}")
    else:
        print(f"best policy: per_turn={best.per_turn} step={best.step} lines={best.lines} latest={best.latest}")
        for index in best.phrases:
            print(f"  {PHRASES[index]}")
    print("| protocol | variant | mean | max | at 100 |\n| --- | --- | --- | --- | --- |")
    for (name, variant), values in protocols(best).items():
        print(f"| {name} | {variant} | {statistics.mean(values):.1f} | {max(values)} | "
              f"{sum(v >= simulator.MAX_EMOTION for v in values)}/{len(values)} |")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("what was found is printed above; nothing written")
