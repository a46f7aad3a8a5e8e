"""What the rule user costs: milliseconds per judged reply, its message included, on one CPU thread.

    python benchmarks/rule_user_cost.py            # the blind players' dialogues (tests/data/live_play/), 3 runs

Replays every recorded dialogue (real replies of real lengths) through the rule user with torch on one thread,
after the reader is made (a one-off, timed apart: the encoder's load and trace, the kept read-out's load), and
prints the time per judged reply of each run and the cost of making the reader. Each run starts with empty
caches (sentences, words), so no reply is cheaper for having been judged before.
"""
import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's modules, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from live_play import recorded, replay  # noqa: E402

import rule_user  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    reader = rule_user.reader()
    print(f"making the reader (encoder load and trace, read-out load): {time.perf_counter() - started:.1f} s")
    dialogues = [(header, [t["reply"] for t in turns]) for header, turns in recorded().values()]
    for run in range(args.runs):
        reader._embeddings.clear()
        reader._probabilities.clear()
        rule_user.normalise.cache_clear()
        rule_user._key.cache_clear()
        started, judged = time.perf_counter(), 0
        for header, replies in dialogues:
            judged += len(asyncio.run(replay(header, replies))["emotions"])
        elapsed = time.perf_counter() - started
        print(f"run {run + 1}: {judged} judged replies of {len(dialogues)} dialogues, "
              f"{1000 * elapsed / judged:.1f} ms a reply")
    words = [len(reply.split()) for _, replies in dialogues for reply in replies]
    print(f"replies: {statistics.mean(words):.0f} words on average, at most {max(words)}")


if __name__ == "__main__":
    main()
