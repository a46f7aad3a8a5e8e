"""Mean final emotion per training step, from runs' transcripts, and whether it went up; with
`--metric format`, the share of policy turns that broke the think format instead (think runs).

    python plot_training.py runs/grpo-demo runs/grpo-demo-think --out docs/grpo_demo.png
    python plot_training.py --arm "GRPO" runs/grpo-s1 runs/grpo-s2 runs/grpo-s3 \
        --arm "GRPO, turn credit" runs/grpo-tc-s1 runs/grpo-tc-s2 runs/grpo-tc-s3 --out docs/arms.png

For each run it prints the mean final emotion over the first and the last 20% of steps, each with
its standard error over those steps' means (a step's dialogues share profiles, so steps, not
dialogues, are the independent units), and the difference with its standard error. An `--arm` is
one setting run with several seeds: it gets a row of its own, the mean over its seeds of each run's
first, last and difference, each +- the standard error over seeds (the seeds are the independent
units there), and the plot draws the arm's mean curve over seeds with a band of +- that error.
Without `--out` the plot is `learning_curve.png` in the first run's folder.

A transcript whose last line was cut short (a run killed while writing it) is plotted without that
line, with a warning; any other line that is not a transcript row is an error naming file and line.
"""
import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import common
import guards

EDGE_SHARE = 0.2  # compare the first and the last 20% of steps
SMOOTHING = 5  # steps in the moving average drawn over the per-step means
# In every plot's PNG text: an existing --out is replaced only when this script wrote it.
SOFTWARE = "RLVER plot_training.py"
DEFAULT_PLOT_NAME = "learning_curve.png"  # written in the first run's folder when --out is not given


def transcript_files(run_dir: Path) -> list[Path]:
    """<run>/transcripts.jsonl and transcripts.rankN.jsonl (one per rank)."""
    if not run_dir.is_dir():
        state = "a file" if run_dir.exists() else "not found"
        raise common.InputError(f"{run_dir}: {state}; give the output_dir of a train_grpo.py/train_ppo.py run")
    files = sorted(run_dir.glob("transcripts.jsonl")) + sorted(run_dir.glob("transcripts.rank*.jsonl"))
    if not files:
        raise common.InputError(f"{run_dir}: no transcripts.jsonl (is this a train_grpo.py/train_ppo.py output_dir?)")
    return files


# --metric: (the transcript fields it reads, a step's value from its rows, the plot's y label, decimals printed)
METRICS = {
    "emotion": (("emo_point",), lambda rows: statistics.mean(row["emo_point"] for row in rows),
                "mean final emotion (0-100)", 1),
    # Over the step's turns, as the trainers' format/violation_rate: a long dialogue weighs more than a short one.
    "format": (("format_violations", "turns"), lambda rows: sum(row["format_violations"] for row in rows)
               / max(1, sum(row["turns"] for row in rows)), "share of turns breaking the think format", 2),
}


def step_means(run_dir: Path, metric: str = "emotion") -> dict[int, float]:
    """The metric's value at each step (by default the mean final emotion of the step's dialogues), from all of
    the run's transcript files."""
    fields, value, _, _ = METRICS[metric]
    rows_by_step = defaultdict(list)
    files = transcript_files(run_dir)
    if metric == "format" and not trained_with_think(run_dir):  # its curve would be a flat 0, meaning nothing
        raise common.InputError(f"{run_dir}: trained without --think, so it has no think format to break; "
                                "--metric format plots think runs")
    for path in files:
        last_step = {}
        for _, where, row in common.json_lines(path, "transcript", skip_cut_last_line=True):
            if not (isinstance(row, dict) and all(_is_number(row.get(key)) for key in ("step", *fields))):
                *first, last = [repr(key) for key in ("step", *fields)]
                raise common.InputError(f"{where}: a transcript row needs numbers {', '.join(first)} and {last}; "
                                        "is it a train_grpo.py/train_ppo.py transcript?")
            guards.check_steps_in_order(where, row["step"], last_step)
            rows_by_step[row["step"]].append(row)
    if not rows_by_step:
        raise common.InputError(f"{', '.join(map(str, files))}: no transcript rows (empty?); nothing to plot")
    return {step: value(rows) for step, rows in sorted(rows_by_step.items())}


def trained_with_think(run_dir: Path) -> bool:
    """Whether the run's marker (the trainers' rlver-run.json) records --think; True where it says nothing."""
    try:
        settings = json.loads((run_dir / guards.RUN_MARKER).read_text(encoding="utf-8")).get("settings", {})
    except (OSError, ValueError, AttributeError):
        return True
    return settings.get("think", True) is not False


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


def arm_summary(runs_edges: list[dict]) -> dict:
    """One arm over its seeds: the mean of its runs' first, last and difference, each with the standard
    error over the runs."""
    summary = {"runs": len(runs_edges)}
    for key in ("first", "last", "difference"):
        summary[key], summary[f"{key}_se"] = mean_and_error([edges[key] for edges in runs_edges])
    return summary


def arm_curve(runs_means: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """(steps every run has, the mean over runs at each, its standard error over runs)."""
    steps = sorted(set.intersection(*(set(means) for means in runs_means)))
    pairs = [mean_and_error([means[step] for means in runs_means]) for step in steps]
    return steps, [mean for mean, _ in pairs], [error for _, error in pairs]


def table_cells(figures: dict, decimals: int) -> str:
    """First, last and difference, each +- its standard error ("n/a" where there is none: an arm of one seed)."""
    def cell(key: str, sign: str = "") -> str:
        error = figures[f"{key}_se"]
        return f"{figures[key]:{sign}.{decimals}f} +- " + ("n/a" if math.isnan(error) else f"{error:.{decimals}f}")
    return f"{cell('first')} | {cell('last')} | {cell('difference', '+')}"


def smooth(values: list[float]) -> list[float]:
    return [statistics.mean(values[max(0, i - SMOOTHING + 1):i + 1]) for i in range(len(values))]


def plot(curves: dict[str, tuple], title: str, out: Path, ylabel: str = METRICS["emotion"][2]) -> None:
    """`curves`: label -> (steps, per-step means, their standard errors over seeds or None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, (steps, values, errors) in curves.items():
        line, = axes.plot(steps, values, alpha=0.35, linewidth=1)
        smoothed = smooth(values)
        axes.plot(steps, smoothed, color=line.get_color(), linewidth=2, label=label)
        if errors is not None and not any(math.isnan(e) for e in errors):
            band = smooth(errors)
            axes.fill_between(steps, [m - e for m, e in zip(smoothed, band)], [m + e for m, e in zip(smoothed, band)],
                              color=line.get_color(), alpha=0.15, linewidth=0)
    axes.set_xlabel("training step")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120, metadata={"Software": SOFTWARE})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="output_dir of each run")
    parser.add_argument("--arm", nargs="+", action="append", default=[], metavar=("LABEL", "RUN"),
                        help="a label and the output_dirs of its seeds (repeat for each arm)")
    parser.add_argument("--out", type=Path,
                        help=f"the PNG file (default: {DEFAULT_PLOT_NAME} in the first run's folder)")
    parser.add_argument("--metric", choices=list(METRICS), default="emotion",
                        help="emotion: mean final emotion; format: share of turns breaking the think format")
    parser.add_argument("--title", help="default: what the metric is, per step")
    args = parser.parse_args(argv)
    title = args.title or f"{METRICS[args.metric][2][0].upper()}{METRICS[args.metric][2][1:]}, per step"
    if any(len(arm) < 2 for arm in args.arm):
        parser.error("--arm needs a label and at least one run folder")
    for label, *_ in args.arm:  # a forgotten label takes the first run folder's place, and that run is not plotted
        if (Path(label) / "transcripts.jsonl").is_file() or list(Path(label).glob("transcripts.rank*.jsonl")):
            parser.error(f"--arm {label} ...: that is a run folder where the label goes; give a label first: "
                         "--arm LABEL RUN [RUN ...]")
    labels = [arm[0] for arm in args.arm]
    if len(set(labels)) < len(labels):  # a dict by label would keep the last arm of a label, silently
        parser.error(f"--arm {next(label for label in labels if labels.count(label) > 1)!r} is given twice; give each "
                     "arm its own label")
    arms = {arm[0]: [Path(run) for run in arm[1:]] for arm in args.arm}
    runs = list(args.runs) + [run for arm_runs in arms.values() for run in arm_runs]
    if not runs:
        parser.error("give run folders, or --arm LABEL RUN [RUN ...]")
    out = args.out or runs[0] / DEFAULT_PLOT_NAME
    if out.suffix.lower() != ".png":  # the PNG's text is what marks a plot as this script's to replace
        parser.error(f"--out {out}: give a .png path")
    seen = {}
    try:
        for run_dir in runs:  # a run given twice (or by a link) would count as two seeds
            real = guards.real_path(run_dir)
            if real in seen:
                parser.error(f"{run_dir}: the same run as {seen[real]}; give each run once")
            seen[real] = run_dir
        # Every run is read, and the plot path checked, before the table is printed or matplotlib loads.
        all_means = {run_dir: step_means(run_dir, args.metric) for run_dir in runs}
        for run_dir, means in all_means.items():  # fewer: the first and last 20% would share steps (or be one)
            if len(means) < 4:
                raise common.InputError(f"{run_dir}: {len(means)} step{'s' if len(means) > 1 else ''}; comparing "
                                        "its first and last steps needs at least 4 (2 at each end)")
        inputs = [path for run_dir in runs for path in run_dir.glob("transcripts*.jsonl")]
        guards.check_output_file(out, "out", guards.starts_with(SOFTWARE.encode(), 8192), inputs)
    except common.InputError as error:
        sys.exit(f"error: {error}")
    decimals = METRICS[args.metric][3]
    all_edges = {run_dir: compare_edges(means) for run_dir, means in all_means.items()}
    names = {run_dir: run_dir.name for run_dir in runs}
    if len(set(names.values())) < len(names):  # a/run and b/run: their paths tell them apart
        names = {run_dir: str(run_dir) for run_dir in runs}
    print("| run | steps | first 20% | last 20% | difference |")
    print("|---|---|---|---|---|")
    for run_dir, edges in all_edges.items():
        print(f"| {names[run_dir]} | {edges['steps']} | {table_cells(edges, decimals)} |")
    curves = {f"{names[run_dir]} ({edges['first']:.{decimals}f} -> {edges['last']:.{decimals}f})":
              (list(all_means[run_dir]), list(all_means[run_dir].values()), None)
              for run_dir, edges in all_edges.items() if run_dir in args.runs}
    if arms:
        print("\n| arm | seeds | first 20% | last 20% | difference |  (+- standard error over seeds)")
        print("|---|---|---|---|---|")
    for label, arm_runs in arms.items():
        summary = arm_summary([all_edges[run_dir] for run_dir in arm_runs])
        print(f"| {label} | {summary['runs']} | {table_cells(summary, decimals)} |")
        seeds = f"{len(arm_runs)} seed{'s' if len(arm_runs) > 1 else ''}"
        curves[f"{label}, {seeds} ({summary['first']:.{decimals}f} -> {summary['last']:.{decimals}f})"] = arm_curve(
            [all_means[run_dir] for run_dir in arm_runs])
    plot(curves, title, out, METRICS[args.metric][2])
    print(f"wrote {out}")


if __name__ == "__main__":
    guards.start_script("run it again (a plot being written may be cut short)")
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("run it again (a plot being written may be cut short)")
