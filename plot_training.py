"""Mean final emotion per training step, from runs' transcripts, and whether it went up.

    python plot_training.py runs/grpo-demo runs/grpo-demo-think --out docs/grpo_demo.png

For each run it prints the mean final emotion over the first and the last 20% of steps, each with
its standard error over those steps' means (a step's dialogues share profiles, so steps, not
dialogues, are the independent units), and the difference with its standard error.
"""
import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

EDGE_SHARE = 0.2  # compare the first and the last 20% of steps
SMOOTHING = 5  # steps in the moving average drawn over the per-step means


def step_means(run_dir: Path) -> dict[int, float]:
    """Mean final emotion of each step's dialogues, from <run>/transcripts[.rankN].jsonl (all ranks)."""
    finals = defaultdict(list)
    files = sorted(run_dir.glob("transcripts.jsonl")) + sorted(run_dir.glob("transcripts.rank*.jsonl"))
    if not files:
        raise SystemExit(f"{run_dir}: no transcripts.jsonl (is this a train_grpo.py/train_ppo.py output_dir?)")
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            finals[row["step"]].append(row["emo_point"])
    return {step: statistics.mean(values) for step, values in sorted(finals.items())}


def mean_and_error(values: list[float]) -> tuple[float, float]:
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.mean(values), error


def compare_edges(means: dict[int, float]) -> dict:
    values = list(means.values())
    edge = max(2, math.ceil(len(values) * EDGE_SHARE))
    (first, first_error), (last, last_error) = mean_and_error(values[:edge]), mean_and_error(values[-edge:])
    difference_error = math.hypot(first_error, last_error)
    return {"steps": len(values), "edge_steps": edge, "first": first, "first_se": first_error, "last": last,
            "last_se": last_error, "difference": last - first, "difference_se": difference_error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="output_dir of each run")
    parser.add_argument("--out", type=Path, default=Path("learning_curve.png"))
    parser.add_argument("--title", default="Mean final emotion per step")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    print("| run | steps | first 20% | last 20% | difference |")
    print("|---|---|---|---|---|")
    for run_dir in args.runs:
        means = step_means(run_dir)
        edges = compare_edges(means)
        print(f"| {run_dir.name} | {edges['steps']} | {edges['first']:.1f} +- {edges['first_se']:.1f} | "
              f"{edges['last']:.1f} +- {edges['last_se']:.1f} | {edges['difference']:+.1f} +- {edges['difference_se']:.1f} |")
        steps, values = list(means), list(means.values())
        line, = axes.plot(steps, values, alpha=0.35, linewidth=1)
        smoothed = [statistics.mean(values[max(0, i - SMOOTHING + 1):i + 1]) for i in range(len(values))]
        axes.plot(steps, smoothed, color=line.get_color(), linewidth=2,
                  label=f"{run_dir.name} ({edges['first']:.1f} -> {edges['last']:.1f})")
    axes.set_xlabel("training step")
    axes.set_ylabel("mean final emotion (0-100)")
    axes.set_title(args.title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
