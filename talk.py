"""Talk to a simulated user in the terminal, turn by turn: you write the policy's replies (an empty line ends),
and see each turn's emotion, change and reason. The user is the one training and the benchmark use
(simulator.py, rollout.make_simulator).

    python talk.py --profile en-train-01 --backend rule
    python talk.py --profile en-train-01 --backend rule --replies my_replies.txt
    python talk.py --profile en-bench-01 --profiles profiles/benchmark.jsonl --benchmark \\
        --backend llm --base_url http://localhost:8000/v1 --simulator_model Qwen/Qwen2.5-32B-Instruct
"""
import asyncio
import sys
from dataclasses import dataclass, field

import common
import guards

if __name__ == "__main__":
    guards.start_script("the dialogue was left")

import rollout
import simulator


def find_profile(profiles, profile_id: str, path) -> simulator.Profile:
    for profile in profiles:
        if profile.id == profile_id:
            return profile
    raise simulator.SimulatorError(f"no profile with id {profile_id!r} in {path} (--profiles); its ids look like "
                         f"{', '.join(p.id for p in profiles[:3])}")


async def play(user: simulator.Simulator, replies, out=None) -> None:
    """Run one dialogue, taking the policy's replies from an iterator of strings; print it to `out` (stdout)."""
    out = out or sys.stdout  # looked up now, not at import: a redirected stdout is honoured
    print(f"[user, emotion {user.emotion}] {await user.open()}", file=out)
    for reply in replies:
        turn = await user.respond(reply)
        clamped = ", clamped" if turn.clamped else ""
        print(f"[turn {user.turns}] emotion {turn.emotion} ({turn.change:+d}{clamped}) "
              f"state {simulator.emotion_state(turn.emotion)}\n  why: {turn.reasoning}\n[user] {turn.message}",
              file=out)
        if turn.done:
            print(f"[end: {turn.end_reason}, final emotion {turn.emotion}]", file=out)
            return
    print(f"[stopped after {user.turns} turns, emotion {user.emotion}]", file=out)


def _typed_replies():
    while True:
        try:
            reply = input("[you] ")
        except (EOFError, RuntimeError):  # the end of the input; RuntimeError: no stdin at all (closed)
            return
        if not reply.strip():
            return
        yield reply


@dataclass
class PlayArguments:
    profile: str = field(metadata={"help": "profile id, e.g. en-train-01"})
    profiles: str = field(default=str(simulator.DEFAULT_PROFILES), metadata={"help": "profile file (JSON Lines)"})
    replies: str | None = field(default=None, metadata={"help": "file with one policy reply per line (else type them)"})
    max_turns: int = field(default=simulator.PAPER_MAX_TURNS, metadata={"help": "policy turns before the user leaves"})
    benchmark: bool = field(default=False, metadata={
        "help": f"benchmark settings: start at {simulator.BENCHMARK_START_EMOTION}, "
                f"{simulator.BENCHMARK_MAX_TURNS} turns"})

    def __post_init__(self):
        guards.check_options(self, max_turns=guards.TURNS)


def main(argv=None) -> None:
    try:
        from transformers import HfArgumentParser  # a second or two: inside the try, where Ctrl-C is one line

        parser = HfArgumentParser((PlayArguments, simulator.SimulatorArguments),
                                  description="Talk to a simulated user, turn by turn.")
        try:
            play_args, simulator_args = parser.parse_args_into_dataclasses(argv)
        except common.ArgumentError as error:
            parser.error(str(error))
        # Not asyncio.run: its Ctrl-C handling waits for a pending input() to return, then raises on a second.
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_talk(play_args, simulator_args))
        finally:
            loop.close()
    except (common.InputError, common.EndpointError) as error:
        sys.exit(f"error: {error}")
    except KeyboardInterrupt:
        guards.exit_interrupted("the dialogue was left")


async def _talk(play_args: PlayArguments, simulator_args: simulator.SimulatorArguments) -> None:
    # Everything that can be checked offline is, before the endpoint is asked or a model loads.
    profile = find_profile(simulator.load_profiles(play_args.profiles), play_args.profile, play_args.profiles)
    simulator.check_backend([profile], simulator_args)
    if play_args.replies:
        replies = [line for line in common.read_text(play_args.replies, "replies file").splitlines() if line.strip()]
    else:
        replies = _typed_replies()
    chat = rollout.make_chat(simulator_args)
    if chat is not None:
        await chat.check()
    user = rollout.make_simulator(
        profile, chat, simulator_args,
        start_emotion=simulator.BENCHMARK_START_EMOTION if play_args.benchmark else simulator.TRAIN_START_EMOTION,
        max_turns=simulator.BENCHMARK_MAX_TURNS if play_args.benchmark else play_args.max_turns)
    await play(user, replies)


if __name__ == "__main__":
    main()
