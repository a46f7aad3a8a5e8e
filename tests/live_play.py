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
    python tests/live_play.py serve                          # optional: keeps the user loaded, a turn a second

A dialogue file is JSON Lines: a header (profile, variant, style, player, round, brief), then one line per
reply with the reply and the user's message the player saw. `table --write` keeps each measured dialogue's emotions
in tests/data/live_play/trajectories.json; tests/test_live_play.py replays every file and checks both.
"""
import argparse
import asyncio
import contextlib
import io
import json
import socket
import statistics
import sys
from pathlib import Path

# `python tests/live_play.py serve` keeps the rule user's encoder loaded and answers the other commands over this
# socket, a second a turn instead of the imports and the load each time (the commands use it when it is up).
SERVER = Path(__file__).resolve().parent / ".live_play.sock"


def _ask_server(argv: list[str]) -> None:
    """Run a command in the server if one is up (and exit with its status); return if none is."""
    try:
        with socket.socket(socket.AF_UNIX) as connection:
            connection.connect(str(SERVER))
            connection.sendall(json.dumps(argv).encode() + b"\n")
            answer = json.loads(connection.makefile().readline())
    except OSError:
        return
    print(answer["out"], end="")
    if answer["error"]:
        print(answer["error"], file=sys.stderr)
    sys.exit(1 if answer["error"] else 0)


if __name__ == "__main__" and sys.argv[1:2] != ["serve"]:
    _ask_server(sys.argv[1:])

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import simulator  # noqa: E402
import talk  # noqa: E402

SETS = Path(__file__).resolve().parent / "data" / "live_play"
TRAJECTORIES = SETS / "trajectories.json"
# The round played blind after the last change to the rules: the one that measures them. Earlier rounds tuned them.
MEASURED_ROUND = "measure-3"
STYLES = ("skilled", "friend", "cold")
# Reactions that tell the listener they were not heard or could have said it to anyone.
NOT_HEARD = ("generic", "ignored", "stalling")


def read_dialogue(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines or "profile" not in lines[0]:
        raise SystemExit(f"{path}: not a dialogue file (its first line must be the header `new` writes)")
    return lines[0], lines[1:]


def make_user(header: dict):
    profile = talk.find_profile(simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES),
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
    played = asyncio.run(replay(header, [t["reply"] for t in turns] + [args.reply]))
    if played["unplayed"]:  # the dialogue was over before this reply
        raise SystemExit("the user has left this conversation; it is over")
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


def set_table(replayed: dict) -> dict[str, dict]:
    """{set name: its row} from {path: (header, replayed dialogue)}."""
    rows = {}
    for header, played in replayed.values():
        rows.setdefault(set_name(header), []).append(played)
    table = {}
    for name, dialogues in sorted(rows.items()):
        finals = [p["emotions"][-1] if p["emotions"] else simulator.BENCHMARK_START_EMOTION for p in dialogues]
        later = [(after - before, reaction) for p in dialogues  # each reply after the first: change, reaction
                 for before, after, reaction in zip(p["emotions"], p["emotions"][1:], p["reactions"][1:])]
        table[name] = {"dialogues": len(dialogues), "mean": statistics.mean(finals), "median": statistics.median(finals),
                       "at_90": sum(f >= 90 for f in finals), "gave_up": sum(f < 10 for f in finals),
                       "unheard": sum(1 for change, reaction in later if change < 0 and reaction in NOT_HEARD),
                       "later_replies": len(later)}
    return table


def table(args) -> None:
    replayed = {path: (header, asyncio.run(replay(header, [t["reply"] for t in turns])))
                for path, (header, turns) in recorded().items()}
    print("| set | dialogues | mean final | median | reached >= 90 | gave up (< 10) | replies after the first: "
          "lost with 'not heard' |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, row in set_table(replayed).items():
        print(f"| {name} | {row['dialogues']} | {row['mean']:.1f} | {row['median']:g} | {row['at_90']} | "
              f"{row['gave_up']} | {row['unheard']} of {row['later_replies']} "
              f"({100 * row['unheard'] / max(1, row['later_replies']):.0f}%) |")
    if args.write:
        trajectories = {f"{path.parent.name}/{path.name}": played["emotions"]
                        for path, (header, played) in replayed.items() if header["round"] == MEASURED_ROUND}
        TRAJECTORIES.write_text(json.dumps(trajectories, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {TRAJECTORIES}")


def serve(args) -> None:
    """Answer the other commands, one at a time, until interrupted."""
    import rule_user
    rule_user.reader()  # loaded once, here
    SERVER.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(SERVER))
        listener.listen()
        print(f"serving on {SERVER}")
        try:
            while True:
                connection, _ = listener.accept()
                with connection:
                    argv = json.loads(connection.makefile().readline())
                    out, error = io.StringIO(), ""
                    try:
                        with contextlib.redirect_stdout(out):
                            run(argv)
                    except SystemExit as exit:
                        error = str(exit.code) if exit.code not in (None, 0) else ""
                    except Exception as failure:  # a bad command must not stop the others' games
                        error = f"error: {failure}"
                    connection.sendall(json.dumps({"out": out.getvalue(), "error": error}).encode() + b"\n")
        finally:
            SERVER.unlink(missing_ok=True)


def main() -> None:
    run(sys.argv[1:])


def run(argv: list[str]) -> None:
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
    commands.add_parser("serve", help="keep the rule user loaded and answer the other commands")
    args = parser.parse_args(argv)
    {"new": new, "say": say, "show": show, "table": table, "serve": serve}[args.command](args)


if __name__ == "__main__":
    main()
