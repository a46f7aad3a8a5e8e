"""The first step of each CPU demo (GRPO, GRPO --think, PPO), kept to compare two versions of the code: a
reshape that should change nothing must give the same metrics (every key but times) and transcripts.

    python benchmarks/first_steps.py run OUT [--repo PATH]     # PATH: a checkout of the version to run
    python benchmarks/first_steps.py compare OUT_A OUT_B

Each demo runs as the README starts it (`accelerate launch`, the demo's defaults) with --max_steps 1."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMOS = {"grpo": ["train_grpo.py"], "grpo-think": ["train_grpo.py", "--think"], "ppo": ["train_ppo.py"]}


def timeless(value):
    """`value` without the keys that hold times (seconds, runtimes), which differ from run to run."""
    if isinstance(value, dict):
        return {key: timeless(item) for key, item in value.items() if "time" not in key and "seconds" not in key}
    if isinstance(value, list):
        return [timeless(item) for item in value]
    return value


def first_step(folder: Path) -> dict:
    """{"metrics": the first step's metrics, "transcripts": its dialogues}, timeless."""
    if (folder / "metrics.jsonl").is_file():  # PPO
        metrics = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    else:  # GRPO: the Trainer's log of the step
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        metrics = next(entry for entry in history if "emotion/final_mean" in entry)
    transcripts = [json.loads(line) for line in (folder / "transcripts.jsonl").read_text().splitlines()]
    return timeless({"metrics": metrics, "transcripts": [row for row in transcripts if row["step"] == 0]})


def run(out: Path, repo: Path) -> None:
    out.mkdir(parents=True, exist_ok=False)
    for name, script in DEMOS.items():
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", *script,
                   "--max_steps", "1", "--output_dir", str(out / name)]
        subprocess.run(command, cwd=repo, check=True, env={**os.environ, "PYTHONPATH": str(repo)})
        (out / f"{name}.json").write_text(json.dumps(first_step(out / name), indent=1, sort_keys=True) + "\n")


def compare(a: Path, b: Path) -> bool:
    same = True
    for name in DEMOS:
        first, second = (json.loads((folder / f"{name}.json").read_text()) for folder in (a, b))
        for part in ("metrics", "transcripts"):
            verdict = "identical" if first[part] == second[part] else "DIFFERENT"
            same &= first[part] == second[part]
            print(f"{name}: {part} {verdict}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    running = commands.add_parser("run")
    running.add_argument("out", type=Path)
    running.add_argument("--repo", type=Path, default=REPO)
    comparing = commands.add_parser("compare")
    comparing.add_argument("a", type=Path)
    comparing.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.repo.resolve())
    else:
        sys.exit(0 if compare(args.a, args.b) else 1)


if __name__ == "__main__":
    main()
