"""On paper: what overlapping the next step's rollout with this step's training would gain.

    python benchmarks/overlap_sim.py                                  # the paper's shape, training 0.1x..4x rollout
    python benchmarks/overlap_sim.py --train_seconds 120 --policy_seconds 2

A simulation with rollout_bench.py's latency model (each simulator call log-normal, median `--median`,
sigma `--sigma`; two calls a turn), nothing run. One step's async rollout lasts its longest dialogue's chain:
its simulator turns plus `--policy_seconds` of generation a turn. Training a step takes `--train_seconds`
(a list; by default multiples of the mean rollout, as the ratio is what matters). Without overlap a run costs
the sum of rollout and training over its steps; with one step of overlap (the rollout of step i+1 runs while
step i trains, on weights one step old, which TRL's importance-sampling correction would have to absorb) it
costs the first rollout, then the longer of each next rollout and the previous training, then the last
training. Prints the gain for each training time.
"""
import argparse
import random
import statistics


def rollout_seconds(rng: random.Random, dialogues: int, turns: int, median: float, sigma: float,
                    policy_seconds: float) -> float:
    """One async step: the longest dialogue's own chain of simulator calls and policy turns."""
    import math

    def call():
        return rng.lognormvariate(math.log(median), sigma)

    return max(sum(call() + call() + policy_seconds for _ in range(turns)) for _ in range(dialogues))


def run_seconds(rollouts: list[float], train: float, overlapped: bool) -> float:
    if not overlapped:
        return sum(rollouts) + train * len(rollouts)
    return rollouts[0] + sum(max(rollout, train) for rollout in rollouts[1:]) + train


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dialogues", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--median", type=float, default=1.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--policy_seconds", type=float, default=0.0, help="policy generation per turn")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train_seconds", type=float, nargs="*", help="default: 0.1, 0.25, 0.5, 1, 2, 4 x the mean rollout")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.dialogues, args.turns, args.steps) < 1 or args.median <= 0 or args.sigma < 0 or args.policy_seconds < 0:
        parser.error("--dialogues, --turns and --steps must be at least 1, --median above 0, the rest 0 or more")
    rng = random.Random(args.seed)
    rollouts = [rollout_seconds(rng, args.dialogues, args.turns, args.median, args.sigma, args.policy_seconds)
                for _ in range(args.steps)]
    mean = statistics.mean(rollouts)
    trains = args.train_seconds or [factor * mean for factor in (0.1, 0.25, 0.5, 1, 2, 4)]
    print(f"{args.dialogues} dialogues x {args.turns} turns, simulator calls log-normal (median {args.median} s, "
          f"sigma {args.sigma}), policy {args.policy_seconds} s a turn; {args.steps} steps; async rollout mean "
          f"{mean:.1f} s (min {min(rollouts):.1f}, max {max(rollouts):.1f})")
    print("| training a step (s) | training / rollout | without overlap (s a step) | with overlap (s a step) | gain |")
    print("| --- | --- | --- | --- | --- |")
    for train in trains:
        plain, overlapped = (run_seconds(rollouts, train, flag) / args.steps for flag in (False, True))
        print(f"| {train:.1f} | {train / mean:.2f} | {plain:.1f} | {overlapped:.1f} | {plain / overlapped:.2f}x |")


if __name__ == "__main__":
    main()
