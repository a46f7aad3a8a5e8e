"""Blind live play: people who never read the rule user's rules play the benchmark protocol turn by turn, and
the recorded dialogues measure the rule user from the listener's side.

A player sees what a policy sees, the user's messages, and never the emotion or the user's stated reasons.
The rule user is deterministic, so a dialogue is its replies: each command replays them through the project's
own simulator (rule backend, benchmark protocol: start 40, up to 9 judged replies, change bound 10).

    python tests/live_play.py new FILE --profile en-bench-03 --variant vanilla --style skilled \\
        --player p1 --round measure-1 --brief brief.txt     # starts a dialogue, prints the opening message
    python tests/live_play.py say FILE "your reply"          # one reply: prints the user's next message
    python tests/live_play.py show FILE                      # the dialogue so far, as the player sees it
    python tests/live_play.py table                          # every recorded set: the table of docs/rule_user.md
    python tests/live_play.py table --write                  # ... and records each dialogue's emotions

A dialogue file is JSON Lines: a header (profile, variant, style, player, round, brief), then one line per
reply with the reply and the user's message the player saw. `table --write` keeps each dialogue's emotions in
tests/data/live_play/trajectories.json; tests/test_live_play.py replays every file and checks both.
"""
import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import simulator  # noqa: E402

SETS = Path(__file__).resolve().parent / "data" / "live_play"
TRAJECTORIES = SETS / "trajectories.json"
STYLES = ("skilled", "friend", "cold")
# Reactions that tell the listener they were not heard or could have said it to anyone.
NOT_HEARD = ("generic", "ignored", "stalling")


def read_dialogue(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines or "profile" not in lines[0]:
        raise SystemExit(f"{path}: not a dialogue file (its first line must be the header `new` writes)")
    return lines[0], lines[1:]


def make_user(header: dict):
    profile = simulator.find_profile(simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES),
                                     header["profile"], simulator.DEFAULT_BENCHMARK_PROFILES)
    return profile, simulator.RuleSimulator(profile, variant=header["variant"],
                                            start_emotion=simulator.BENCHMARK_START_EMOTION,
                                            max_turns=simulator.BENCHMARK_MAX_TURNS,
                                            change_bound=simulator.CHANGE_BOUND, language=None)


async def replay(header: dict, replies: list[str]) -> dict:
    """The dialogue the replies give now: the user's messages, emotions and the key of each turn's reaction."""
    profile, user = make_user(header)
    played = {"opening": await user.open(profile.first_talk), "messages": [], "emotions": [], "reactions": [],
              "done": False, "left": False, "unplayed": 0}
    for reply in replies:
        if user.done:  # the rules changed since it was played: the user leaves earlier now
            played["unplayed"] += 1
            continue
        turn = await user.respond(reply)
        played["messages"].append(turn.message)
        played["emotions"].append(turn.emotion)
        played["reactions"].append(user._reaction)
        played["done"] = turn.done
        played["left"] = turn.end_reason in ("farewell", "gave_up")
    return played


def new(args) -> None:
    path = Path(args.file)
    if path.exists():
        raise SystemExit(f"{path} exists: a dialogue is never started over another (pick a new file name)")
    header = {"profile": args.profile, "variant": args.variant, "style": args.style, "player": args.player,
              "round": args.round, "brief": Path(args.brief).read_text(encoding="utf-8"),
              "rules": (Path(args.brief).parent / "rules.txt").read_text(encoding="utf-8")}  # told to every player
    played = asyncio.run(replay(header, []))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(header, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[user] {played['opening']}")


def say(args) -> None:
    path = Path(args.file)
    header, turns = read_dialogue(path)
    before = asyncio.run(replay(header, [t["reply"] for t in turns]))
    if before["done"] or before["unplayed"]:
        raise SystemExit("the user has left this conversation; it is over")
    played = asyncio.run(replay(header, [t["reply"] for t in turns] + [args.reply]))
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps({"reply": args.reply, "message": played["messages"][-1]}, ensure_ascii=False) + "\n")
    print(f"[user] {played['messages'][-1]}")
    if played["left"]:
        print("[the user has left the conversation]")
    elif played["done"]:
        print("[that was the last reply: the conversation is over]")


def show(args) -> None:
    header, turns = read_dialogue(Path(args.file))
    played = asyncio.run(replay(header, [t["reply"] for t in turns]))
    print(f"[user] {played['opening']}")
    for turn, message in zip(turns, played["messages"]):
        print(f"[you] {turn['reply']}\n[user] {message}")


def recorded() -> dict[Path, tuple[dict, list[dict]]]:
    return {path: read_dialogue(path) for path in sorted(SETS.glob("*/*.jsonl"))}


def set_name(header: dict) -> str:
    return f"{header['round']}: {header['style']}, {header['variant']}"


def table(args) -> None:
    rows, trajectories = {}, {}
    for path, (header, turns) in recorded().items():
        played = asyncio.run(replay(header, [t["reply"] for t in turns]))
        trajectories[str(path.relative_to(SETS))] = played["emotions"]
        rows.setdefault(set_name(header), []).append((header, played))
    print("| set | dialogues | mean final | median | reached >= 90 | gave up (< 10) | replies after the first: "
          "lost with 'not heard' |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, dialogues in sorted(rows.items()):
        finals = [p["emotions"][-1] if p["emotions"] else simulator.BENCHMARK_START_EMOTION for _, p in dialogues]
        later = [(after - before, reaction) for _, p in dialogues  # each reply after the first: change, reaction
                 for before, after, reaction in zip(p["emotions"], p["emotions"][1:], p["reactions"][1:])]
        unheard = sum(1 for change, reaction in later if change < 0 and reaction in NOT_HEARD)
        print(f"| {name} | {len(dialogues)} | {statistics.mean(finals):.1f} | {statistics.median(finals):g} | "
              f"{sum(f >= 90 for f in finals)} | {sum(f < 10 for f in finals)} | "
              f"{unheard} of {len(later)} ({100 * unheard / max(1, len(later)):.0f}%) |")
    if args.write:
        TRAJECTORIES.write_text(json.dumps(trajectories, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {TRAJECTORIES}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("new", help="start a dialogue")
    start.add_argument("file")
    start.add_argument("--profile", required=True, help="a benchmark profile id, e.g. en-bench-03")
    start.add_argument("--variant", choices=simulator.VARIANTS, default="vanilla")
    start.add_argument("--style", choices=STYLES, required=True)
    start.add_argument("--player", required=True, help="who plays (one name per player, never reused)")
    start.add_argument("--round", required=True, help="tuning-N (used to tune the rules) or measure-N")
    start.add_argument("--brief", required=True, help="the text file of the player's brief")
    reply = commands.add_parser("say", help="add one reply and print the user's next message")
    reply.add_argument("file")
    reply.add_argument("reply")
    commands.add_parser("show", help="the dialogue so far").add_argument("file")
    commands.add_parser("table", help="the table of every recorded set").add_argument("--write", action="store_true")
    args = parser.parse_args()
    {"new": new, "say": say, "show": show, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
