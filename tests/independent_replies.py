"""First replies written without the rule user's rules, scored by it: the mean emotion change of each set.

    python tests/independent_replies.py        # the table of docs/rule_user.md ("Independent first replies")

Three sets of 64 first replies (48 training, 16 benchmark profiles), each by a separate writer who read only
the users' opening messages, never the rule user's code or cue lists: replies the rules did not shape.
The second and third sets were written after the rule user's needs were redesigned, without the code at hand;
the third arrived after the design was settled and was first scored as it came (see docs/rule_user.md).
"""
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import simulator  # noqa: E402
from adversarial import NEUTRAL  # noqa: E402
from conftest import user_options  # noqa: E402

INDEPENDENT_REPLIES = [Path(__file__).resolve().parent / "data" / name for name in
                       ("independent_replies.jsonl", "independent_replies_2.jsonl", "independent_replies_3.jsonl")]


def every_profile() -> list:
    """The 48 training and 16 benchmark profiles, the ones each set answers."""
    return [p for path in (simulator.DEFAULT_PROFILES, simulator.DEFAULT_BENCHMARK_PROFILES)
            for p in simulator.load_profiles(path)]


def read_replies(path: Path) -> dict[str, str]:
    """The set's reply to each profile, by profile id."""
    return {row["id"]: row["reply"] for row in map(json.loads, path.read_text().splitlines())}


def first_change(profile, reply: str, variant: str) -> int:
    """The rule user's emotion change after `reply`, its first reply, from the training start."""
    user = simulator.RuleSimulator(profile, **user_options(variant=variant))
    asyncio.run(user.open(profile.first_talk))
    return asyncio.run(user.respond(reply)).change


def main() -> None:
    profiles = every_profile()
    print("| set | vanilla | challenging | below a neutral reply |\n| --- | --- | --- | --- |")
    for path in INDEPENDENT_REPLIES:
        replies = read_replies(path)
        means, below = [], 0
        for variant in simulator.VARIANTS:
            changes = [first_change(p, replies[p.id], variant) for p in profiles]
            means.append(f"{statistics.mean(changes):+.2f}")
            below += sum(change < first_change(p, NEUTRAL, variant) for p, change in zip(profiles, changes))
        print(f"| {path.stem} | {' | '.join(means)} | {below} |")


if __name__ == "__main__":
    main()
