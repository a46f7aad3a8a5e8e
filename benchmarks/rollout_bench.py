"""Rollout throughput: does a step cost what its slowest simulator calls cost, or its longest dialogue?

    python benchmarks/rollout_bench.py                      # 32 dialogues x 4 turns, median 0.3 s a call
    python benchmarks/rollout_bench.py --dialogues 64 --turns 8 --median 1 --sigma 1.0 --no_sequential  # paper's
    python benchmarks/rollout_bench.py --batch_waits 0,0.05,0.2    # async once per --batch_wait

Plays the same dialogues through `rollout.DialogueRunner` against a fake OpenAI-compatible simulator on
127.0.0.1 (tests/fake_openai.py) whose every call waits a log-normal latency and reports token usage:
  (a) lockstep (`--rollout lockstep`), simulator calls of all dialogues concurrent (`--simulator_concurrency`);
  (b) async (`--rollout async`, the default): each dialogue asks for its next policy turn as soon as its own
      user answered, the waiting ones sharing a generate call (`--batch_wait`);
  (c) lockstep, one simulator call at a time (concurrency 1: the original design);
  (d) the lockstep ideal: policy generation time of (a) plus, for each turn, the slowest dialogue's
      simulator turn (its analysis and reply latencies together);
  (e) the async ideal of each async run: the longest single dialogue's own chain (its simulator turns, and
      for each of its turns the run's shortest policy call), or all of the run's policy time (its calls run
      one at a time), whichever is larger.
A call's latency is a function of its messages, so every run waits exactly the same latencies; the
policy decodes greedily, each reply its full token budget, so every run plays exactly the same
dialogues (checked). The policy is a tiny random Llama on the real SmolLM2 tokenizer unless
`--policy` names a model: a small one leaves the simulator's share in view.
"""
import argparse
import hashlib
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import chat_client  # noqa: E402
import common  # noqa: E402
import guards  # noqa: E402  (before the libraries below: quick, and it quiets a Ctrl-C while they load)

if __name__ == "__main__":
    guards.start_script("nothing measured")

import torch  # noqa: E402
from fake_openai import FakeOpenAIServer  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

import generation  # noqa: E402
import rollout  # noqa: E402
import simulator  # noqa: E402


def latency_of(messages: list[dict], median: float, sigma: float) -> float:
    """A call's latency, drawn from a log-normal seeded by the call's messages."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).digest()
    return random.Random(digest).lognormvariate(math.log(median), sigma)


class LatencyServer:
    """The fake simulator: sleeps each call's latency, answers an analysis (a small rise) or a user
    message, and keeps (start, latency) per call to count the calls in flight."""

    def __init__(self, median: float, sigma: float):
        self.median, self.sigma, self.calls, self.lock = median, sigma, [], threading.Lock()
        self.server = FakeOpenAIServer(respond=self.respond)

    def respond(self, body: dict) -> dict:
        wait = latency_of(body["messages"], self.median, self.sigma)
        with self.lock:
            self.calls.append((time.perf_counter(), wait))
        is_analysis = "CHANGE" in body["messages"][-1]["content"]
        text = ("They took up what I said about my week.\nCHANGE: +3" if is_analysis
                else "Yeah. It has been a long week, and nobody at work noticed.")
        return {"hang": wait, "text": text}

    def in_flight(self, since: float) -> tuple[float, int]:
        """(time-weighted mean, max) of calls in flight since `since`, over the time any was in flight."""
        events = sorted([(start, 1) for start, _ in self.calls if start >= since]
                        + [(start + wait, -1) for start, wait in self.calls if start >= since])
        busy = weighted = 0.0
        level = peak = 0
        for (at, change), (following, _) in zip(events, events[1:] + [events[-1]]):
            level += change
            peak = max(peak, level)
            if level:
                busy += following - at
                weighted += level * (following - at)
        return (weighted / busy if busy else 0.0), peak


class TimedChat(chat_client.ChatClient):
    """The real client; also notes each call's latency under the dialogue it belongs to (its stats)."""

    def __init__(self, *args, median: float, sigma: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.median, self.sigma, self.latencies = median, sigma, {}

    async def complete(self, messages, seed=None, stats=None):
        self.latencies.setdefault(id(stats), []).append(latency_of(messages, self.median, self.sigma))
        return await super().complete(messages, seed=seed, stats=stats)


class TimedGenerator:
    """The policy's generator, timing and counting its calls."""

    def __init__(self, generate):
        self.generate, self.durations = generate, []

    def __call__(self, contexts, max_new_tokens, stop=None):
        started = time.perf_counter()
        try:
            return self.generate(contexts, max_new_tokens, stop=stop)
        finally:
            self.durations.append(time.perf_counter() - started)


def load_policy(name: str):
    if name != "tiny":
        path = guards.checked_model(name, "policy")
        return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(common.resolve_model(common.PACKAGED_MODEL))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def play(args, model, tokenizer, base_url: str, concurrency: int, starts, schedule: str = "lockstep",
         batch_wait: float = 0.0) -> dict:
    chat = TimedChat(base_url, "sim-model", median=args.median, sigma=args.sigma, timeout=CALL_TIMEOUT, max_retries=0)
    dialogue_args = rollout.DialogueArguments(max_turns=args.turns, max_reply_tokens=args.reply_tokens,
                                              max_dialogue_tokens=4096, start_emotion=50,
                                              simulator_concurrency=concurrency, rollout=schedule,
                                              batch_wait=batch_wait)
    simulator_args = simulator.SimulatorArguments(backend="llm", base_url=base_url, simulator_model="sim-model")
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args, chat)
    # Greedy, each reply its full budget: both runs play the same dialogues, of the length sampling
    # would give (on CPU, torch.multinomial over a 49k vocabulary would be most of a tiny model's time).
    greedy = GenerationConfig(do_sample=False, min_new_tokens=args.reply_tokens, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    generate = TimedGenerator(generation.TransformersGenerator(model, tokenizer, greedy))
    started = time.perf_counter()
    dialogues = runner.run(starts, generate)
    wall = time.perf_counter() - started
    runner.close()
    turn_latencies = [[sum(calls[i:i + 2]) for i in range(0, len(calls), 2)]  # analysis + reply, per turn
                      for calls in (chat.latencies[id(d.simulator.calls)] for d in dialogues)]
    slowest = [max(lat[t] for lat in turn_latencies if t < len(lat)) for t in range(max(map(len, turn_latencies)))]
    policy = sum(generate.durations)
    return {"wall": wall, "policy": policy, "calls": len(generate.durations), "started": started,
            "dialogues": dialogues, "turn_latencies": turn_latencies, "ideal": policy + sum(slowest),
            "totals": chat.totals, "async_ideal": async_ideal(turn_latencies, generate.durations)}


def async_ideal(turn_latencies: list[list[float]], call_seconds: list[float]) -> float:
    """The least a rollout without the per-turn barrier could take: each dialogue waits at least its own
    chain, its simulator turns and, for each of its turns, the run's shortest policy call; and the policy's
    calls, one at a time, take all their time."""
    chain = max(sum(latencies) + len(latencies) * min(call_seconds) for latencies in turn_latencies)
    return max(chain, sum(call_seconds))


MAX_DIALOGUES, MAX_TURNS = 1024, 32
CALL_TIMEOUT = 60  # seconds a simulated call may take before the client gives up


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dialogues", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--median", type=float, default=0.3, help="median seconds per simulator call")
    parser.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma of the latency")
    parser.add_argument("--reply_tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=rollout.DialogueArguments.simulator_concurrency,
                        help="our rollout's simulator concurrency (default: the scripts' default)")
    parser.add_argument("--policy", default="tiny", help="'tiny' (random, 2 layers) or a model path / packaged name")
    parser.add_argument("--no_sequential", action="store_true",
                        help="leave out (c), one call at a time (at the paper's shape it waits half an hour)")
    parser.add_argument("--batch_waits", default=str(rollout.DialogueArguments.batch_wait),
                        help="comma-separated --batch_wait values: the async run (b) once for each")
    args = parser.parse_args(argv)
    try:
        args.batch_waits = [float(value) for value in args.batch_waits.split(",")]
    except ValueError:
        args.batch_waits = [math.nan]
    bad = [f"--{name} must be {what}" for name, value, what in (
        ("dialogues", args.dialogues, "at least 1"), ("turns", args.turns, "at least 1"),
        ("reply_tokens", args.reply_tokens, "at least 1"), ("concurrency", args.concurrency, "at least 1"),
        ("median", args.median, "a finite number above 0"), ("sigma", args.sigma, "a finite number, 0 or more"))
        if not math.isfinite(value) or value < (0 if name == "sigma" else 1e-9 if name == "median" else 1)]
    if not all(0 <= wait <= 10 for wait in args.batch_waits):  # nan too
        bad.append("--batch_waits must be comma-separated seconds, each from 0 to 10")
    # Beyond these the sequential run alone (dialogues x turns x 2 calls, one at a time) takes days and the
    # dialogues' tensors outgrow memory, with nothing said while it happens.
    bad += [f"--{name} must be at most {most}" for name, value, most in (
        ("dialogues", args.dialogues, MAX_DIALOGUES), ("turns", args.turns, MAX_TURNS),
        ("median", args.median, CALL_TIMEOUT / 10)) if value > most]  # a call slower than its timeout fails
    if bad:
        parser.error("; ".join(bad))
    sequential_seconds = args.dialogues * args.turns * 2 * args.median * math.exp(args.sigma ** 2 / 2)
    if sequential_seconds > 60 and not args.no_sequential:
        print(f"the run one dialogue at a time takes about {sequential_seconds / 60:.0f} min of simulator waits "
              "alone", flush=True)
    common.use_all_cpu_cores()
    try:
        model, tokenizer = load_policy(args.policy)
    except common.InputError as error:
        parser.exit(1, f"error: {error}\n")
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)
    chosen = [profiles[i % len(profiles)] for i in range(args.dialogues)]
    openings = {p.id: f"Hi. I need to talk about something that happened to me ({p.id})." for p in chosen}
    starts = [(p, openings[p.id]) for p in chosen]

    server = LatencyServer(args.median, args.sigma)
    with server.server:
        url = server.server.base_url
        lockstep = play(args, model, tokenizer, url, args.concurrency, starts)
        mean_in_flight, max_in_flight = server.in_flight(lockstep["started"])
        asynchronous = {wait: play(args, model, tokenizer, url, args.concurrency, starts, "async", wait)
                        for wait in args.batch_waits}
        async_in_flight = server.in_flight(asynchronous[args.batch_waits[-1]]["started"])
        sequential = None if args.no_sequential else play(args, model, tokenizer, url, 1, starts)
    runs = [lockstep, *asynchronous.values(), *filter(None, [sequential])]
    for run in runs:
        if run["totals"].failed or run["totals"].retries:
            raise SystemExit(f"the fake simulator failed {run['totals'].failed} calls "
                             f"and retried {run['totals'].retries}")
        if ([d.completion_ids for d in run["dialogues"]] != [d.completion_ids for d in lockstep["dialogues"]]
                or run["turn_latencies"] != lockstep["turn_latencies"]):
            raise SystemExit("the runs did not play the same dialogues with the same latencies")
    totals, n = lockstep["totals"], args.dialogues

    print(f"{n} dialogues x {args.turns} turns; simulator latency log-normal, median {args.median} s, sigma "
          f"{args.sigma}; policy: {args.policy}; {totals.calls} calls a run")
    print("| run | wall time (s) | policy calls | policy time (s) | async ideal (e) of the run (s) |\n"
          "| --- | --- | --- | --- | --- |")
    print(f"| (a) lockstep, concurrency {args.concurrency} | {lockstep['wall']:.2f} | {lockstep['calls']} | "
          f"{lockstep['policy']:.2f} | |")
    for wait, run in asynchronous.items():
        print(f"| (b) async, batch_wait {wait:g} s | {run['wall']:.2f} | {run['calls']} | {run['policy']:.2f} | "
              f"{run['async_ideal']:.2f} |")
    if sequential is not None:
        print(f"| (c) lockstep, one simulator call at a time | {sequential['wall']:.2f} | {sequential['calls']} | "
              f"{sequential['policy']:.2f} | |")
    print(f"| (d) lockstep ideal: (a)'s policy time + slowest simulator turn per turn | {lockstep['ideal']:.2f} | | | |")
    print("(e) async ideal: the longest dialogue's own chain (its simulator turns + the run's shortest policy call "
          "a turn), or all the run's policy time")
    print(f"lockstep efficiency (d)/(a): {lockstep['ideal'] / lockstep['wall']:.3f}")
    for wait, run in asynchronous.items():
        print(f"async, batch_wait {wait:g} s: {lockstep['wall'] / run['wall']:.2f}x faster than lockstep, "
              f"{run['async_ideal'] / run['wall']:.3f} of its async ideal (e)/(b)")
    if sequential is not None:
        print(f"speed-up of lockstep over one call at a time (c)/(a): {sequential['wall'] / lockstep['wall']:.1f}x")
    print(f"simulator calls in flight while any is: lockstep mean {mean_in_flight:.1f}, max {max_in_flight}; "
          f"async mean {async_in_flight[0]:.1f}, max {async_in_flight[1]}")
    print(f"simulator tokens per dialogue: {totals.prompt_tokens / n:.0f} prompt, {totals.completion_tokens / n:.0f} "
          "completion (whitespace words, as the fake server counts them)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("nothing measured")
