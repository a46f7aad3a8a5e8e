"""What PPO's reuse of its first forward pass saves (train_ppo.old_logprobs_and_values, `untrained_forward`): the
demo's steps, timing at each step the scoring pass as made (with graphs, then reused by the update) and the
no-grad pass a version without the reuse would make in addition.

    python benchmarks/ppo_first_pass.py OUTPUT_DIR [--max_steps 2]

Run on an idle machine: the demo's own step times are printed beside."""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_ppo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--max_steps", type=int, default=2)
    args = parser.parse_args()
    timings = {"scoring pass, reused": [], "a no-grad pass more": []}
    scored = train_ppo.old_logprobs_and_values

    def timed(model, batch, order, temperature, micro_batch_size):
        started = time.perf_counter()
        made = scored(model, batch, order, temperature, micro_batch_size)
        timings["scoring pass, reused"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with torch.no_grad():
            train_ppo.forward(model, train_ppo.select_rows(batch, order), temperature, with_entropy=False)
        timings["a no-grad pass more"].append(time.perf_counter() - started)
        return made

    train_ppo.old_logprobs_and_values = timed
    train_ppo.main(["--max_steps", str(args.max_steps), "--output_dir", args.output_dir])
    for name, seconds in timings.items():
        print(f"{name}: {', '.join(f'{s:.1f} s' for s in seconds)}")


if __name__ == "__main__":
    main()
