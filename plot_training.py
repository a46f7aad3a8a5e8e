"""Mean final emotion per training step, from runs' transcripts, and whether it went up.

    python plot_training.py runs/grpo-demo runs/grpo-demo-think --out docs/grpo_demo.png

For each run it prints the mean final emotion over the first and the last 20% of steps, each with
its standard error over those steps' means (a step's dialogues share profiles, so steps, not
dialogues, are the independent units), and the difference with its standard error. Without
`--out` the plot is `learning_curve.png` in the first run's folder.

A transcript whose last line was cut short (a run killed while writing it) is plotted without that
line, with a warning; any other line that is not a transcript row is an error naming file and line.
"""
import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import simulator

EDGE_SHARE = 0.2  # compare the first and the last 20% of steps
SMOOTHING = 5  # steps in the moving average drawn over the per-step means
DEFAULT_PLOT_NAME = "learning_curve.png"  # written in the first run's folder when --out is not given


def transcript_files(run_dir: Path) -> list[Path]:
    """<run>/transcripts.jsonl and transcripts.rankN.jsonl (one per rank)."""
    if not run_dir.is_dir():
        state = "a file" if run_dir.exists() else "not found"
        raise simulator.InputError(f"{run_dir}: {state}; give the output_dir of a train_grpo.py/train_ppo.py run")
    files = sorted(run_dir.glob("transcripts.jsonl")) + sorted(run_dir.glob("transcripts.rank*.jsonl"))
    if not files:
        raise simulator.InputError(f"{run_dir}: no transcripts.jsonl (is this a train_grpo.py/train_ppo.py output_dir?)")
    return files


def step_means(run_dir: Path) -> dict[int, float]:
    """Mean final emotion of each step's dialogues, from all of the run's transcript files."""
    finals = defaultdict(list)
    files = transcript_files(run_dir)
    for path in files:
        for _, where, row in simulator.json_lines(path, "transcript", skip_cut_last_line=True):
            if not (isinstance(row, dict) and _is_number(row.get("step")) and _is_number(row.get("emo_point"))):
                raise simulator.InputError(f"{where}: a transcript row needs numbers 'step' and 'emo_point'; "
                                           "is it a train_grpo.py/train_ppo.py transcript?")
            finals[row["step"]].append(row["emo_point"])
    if not finals:
        raise simulator.InputError(f"{', '.join(map(str, files))}: no transcript rows (empty?); nothing to plot")
    return {step: statistics.mean(values) for step, values in sorted(finals.items())}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


def plot(all_means: dict[Path, dict[int, float]], all_edges: dict[Path, dict], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for run_dir, means in all_means.items():
        edges = all_edges[run_dir]
        steps, values = list(means), list(means.values())
        line, = axes.plot(steps, values, alpha=0.35, linewidth=1)
        smoothed = [statistics.mean(values[max(0, i - SMOOTHING + 1):i + 1]) for i in range(len(values))]
        axes.plot(steps, smoothed, color=line.get_color(), linewidth=2,
                  label=f"{run_dir.name} ({edges['first']:.1f} -> {edges['last']:.1f})")
    axes.set_xlabel("training step")
    axes.set_ylabel("mean final emotion (0-100)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="output_dir of each run")
    parser.add_argument("--out", type=Path, help=f"the PNG file (default: {DEFAULT_PLOT_NAME} in the first run's folder)")
    parser.add_argument("--title", default="Mean final emotion per step")
    args = parser.parse_args(argv)
    out = args.out or args.runs[0] / DEFAULT_PLOT_NAME
    try:
        # Every run is read, and the plot path checked, before the table is printed or matplotlib loads.
        all_means = {run_dir: step_means(run_dir) for run_dir in args.runs}
        simulator.check_output_file(out, "out")
    except simulator.InputError as error:
        sys.exit(f"error: {error}")
    all_edges = {run_dir: compare_edges(means) for run_dir, means in all_means.items()}
    print("| run | steps | first 20% | last 20% | difference |")
    print("|---|---|---|---|---|")
    for run_dir, edges in all_edges.items():
        print(f"| {run_dir.name} | {edges['steps']} | {edges['first']:.1f} +- {edges['first_se']:.1f} | "
              f"{edges['last']:.1f} +- {edges['last_se']:.1f} | {edges['difference']:+.1f} +- {edges['difference_se']:.1f} |")
    plot(all_means, all_edges, args.title, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
