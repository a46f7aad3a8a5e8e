"""Train against a simulator endpoint that fails often, and count what happened.

    python tests/fault_injection.py [--steps 4] [--seed 0]

Serves the simulated user's model from the scripted server on 127.0.0.1, answering each request at
random with a fault: a 500, a 429 with Retry-After 0.2 s, a 3 s hang (the client gives up after
1 s), a truncated body, an analysis without its CHANGE line, or an empty message; otherwise a valid
answer. Then runs the PPO demo on the packaged model for a few steps and prints the server's counts
next to what training logged: the client's calls, retries and failed calls, dialogues dropped and
steps completed.
"""
import argparse
import collections
import json
import random
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_openai import FakeOpenAIServer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FAULTS = {"500": 0.10, "429": 0.08, "hang": 0.03, "truncated": 0.04, "malformed analysis": 0.08, "empty message": 0.04}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, lock, counts = random.Random(args.seed), threading.Lock(), collections.Counter()

    def respond(body):
        is_analysis = "CHANGE" in body["messages"][-1]["content"]
        with lock:
            draw, counts["requests"] = rng.random(), counts["requests"] + 1
            for kind, share in FAULTS.items():
                if draw < share:
                    if (kind == "malformed analysis") != is_analysis and kind in ("malformed analysis", "empty message"):
                        break  # that fault only fits the other kind of call
                    counts[kind] += 1
                    return {"500": {"status": 500}, "429": {"status": 429, "retry_after": 0.2},
                            "hang": {"hang": 3}, "truncated": {"text": "x", "truncated": True},
                            "malformed analysis": "I feel somewhat better.", "empty message": ""}[kind]
                draw -= share
        return "They listened to me.\nCHANGE: +4" if is_analysis else "Okay. It still hurts, though."

    with tempfile.TemporaryDirectory() as folder, FakeOpenAIServer(respond=respond) as server:
        output_dir = Path(folder) / "run"
        finished = subprocess.run(
            [sys.executable, str(REPO / "train_ppo.py"), "--output_dir", str(output_dir), "--max_steps", str(args.steps),
             "--backend", "llm", "--base_url", server.base_url, "--simulator_model", "sim-model",
             "--simulator_timeout", "1", "--simulator_max_retries", "3", "--save_steps", "2"],
            cwd=REPO, capture_output=True, text=True)
        metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()] \
            if (output_dir / "metrics.jsonl").is_file() else []
    dialogues = 8 * len(metrics)
    dropped = sum(round(m["dialogue/ended_simulator_failed"] * 8) for m in metrics)
    print(f"server: {counts['requests']} requests; faults injected: "
          + ", ".join(f"{kind} {counts[kind]}" for kind in FAULTS))
    calls = {name: sum(m[f"simulator/{name}"] for m in metrics) for name in ("calls", "retries", "failed_calls")}
    print(f"client (as training logged it): {calls['calls']} calls, {calls['retries']} retries, "
          f"{calls['failed_calls']} failed after retries")
    print(f"training: {len(metrics)} of {args.steps} steps completed, {dropped} of {dialogues} dialogues dropped, "
          f"exit status {finished.returncode}")
    if finished.returncode:
        print(finished.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the training run, in a temporary folder, got the Ctrl-C too and is gone with it
        print("\ninterrupted: nothing measured", file=sys.stderr)
        raise SystemExit(130) from None
