"""How far the packaged policy's own samples can get against the rule user: a best-of-n oracle.

At every turn of every dialogue the policy samples n replies to the same context; the rule user scores
each (`RuleUser.score`, without answering), the best is sent (the first among equals) and the dialogue
goes on from it. n = 1 is the policy as it is; a larger n shows what RL could reach by preferring the
policy's better samples, the ceiling a CPU demo is judged against (docs/results.md).

    python benchmarks/best_of_n.py --n 1 4 16                   # benchmark protocol: 16 scenarios, start 40
    python benchmarks/best_of_n.py --protocol train --n 16 --turns 2 --temperature 1.0 --max_reply_tokens 48
    python benchmarks/best_of_n.py --protocol held_out --n 1 --copies 8 --model runs/grpo-demo \
        --temperature 1.0 --max_reply_tokens 48      # a trained adapter on profiles it never trained on

Prints, for each n, the mean final emotion with its 95% bootstrap interval, and per turn the share of all
candidates the rule user scored +5 or more, 0, and -5 or less, and its most frequent reasons (rule_user.py's
keys: generic = could be said to anyone, ignored / stalling = heard but not what the need asks, ...);
`--output` keeps one JSON line per n.
"""
import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project's modules, run from anywhere

import common  # noqa: E402
import guards  # noqa: E402  (before the libraries below: quick, and it quiets a Ctrl-C while they load)

if __name__ == "__main__":
    guards.start_script("each finished n's row is in --output (where given)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import eval_sentient  # noqa: E402
import generation  # noqa: E402
import simulator  # noqa: E402


def sample_replies(generate, tokenizer, policy_messages: list[dict], simulators: list, n: int,
                   budget: int) -> list[list[str]]:
    """n sampled reply texts for each simulator's dialogue so far, in one batched call."""
    contexts = []
    for user in simulators:
        messages = policy_messages + [
            {"role": m["role"], "content": m["content"]} for m in user.history]
        context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        contexts += [context] * n
    sampled, _ = generate(contexts, [budget] * len(contexts))
    texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in sampled]
    return [texts[index * n:(index + 1) * n] for index in range(len(simulators))]


def best_of_n(generate, tokenizer, profiles, n: int, args) -> dict:
    """Every profile's dialogue played with the best of n samples at each turn; the final emotions and,
    per turn, the candidates' scores."""
    policy_messages = generation.policy_messages("en", think=False, name=args.policy_prompt)
    users = [simulator.RuleSimulator(profile, variant=args.variant, start_emotion=args.start_emotion,
                                     max_turns=args.turns, change_bound=simulator.CHANGE_BOUND, language=None)
             for profile in profiles]
    for user, profile in zip(users, profiles):
        asyncio.run(user.open(profile.first_talk))  # training profiles: the rule user's own first line
    scores_by_turn = []
    for _ in range(args.turns):
        active = [user for user in users if not user.done]
        if not active:
            break
        candidates = sample_replies(generate, tokenizer, policy_messages, active, n, args.max_reply_tokens)
        turn_scores, turn_reasons = [], collections.Counter()
        for user, replies in zip(active, candidates):
            judged = [user.score(reply) for reply in replies]
            scores = [change for change, _ in judged]
            turn_scores += scores
            turn_reasons.update(" + ".join(key for key, _, _ in reasons) for _, reasons in judged)
            asyncio.run(user.respond(replies[scores.index(max(scores))]))
        scores_by_turn.append((turn_scores, turn_reasons))
    finals = [user.emotion for user in users]
    low, high = eval_sentient.bootstrap_interval(finals, 2000)
    return {"n": n, "score": sum(finals) / len(finals), "interval": [low, high],
            "failures": sum(final < simulator.GIVE_UP_BELOW for final in finals),
            "reached_100": sum(final >= simulator.FAREWELL_AT for final in finals),
            "per_turn": [{"candidates": len(scores), "share_plus5": sum(s >= 5 for s in scores) / len(scores),
                          "share_zero": sum(s == 0 for s in scores) / len(scores),
                          "share_minus5": sum(s <= -5 for s in scores) / len(scores),
                          "reasons": dict(reasons.most_common(6))} for scores, reasons in scores_by_turn]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 16], help="candidates per turn")
    parser.add_argument("--protocol", choices=["benchmark", "train", "held_out"], default="benchmark",
                        help="benchmark: our 16 scenarios from 40, 9 turns; train: the training profiles from 30; "
                             "held_out: the 16 scenarios played as training is (from 30, 2 turns, the training prompt)")
    parser.add_argument("--copies", type=int, default=1, help="dialogues per profile")
    parser.add_argument("--turns", type=int, help="judged replies (default: the protocol's, 9 or 2)")
    parser.add_argument("--model", default=common.PACKAGED_MODEL)
    parser.add_argument("--temperature", type=float, default=0.7, help="the benchmark's default")
    parser.add_argument("--max_reply_tokens", type=int, default=64, help="the benchmark's default")
    parser.add_argument("--variant", default="vanilla", choices=simulator.VARIANTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON Lines file to append one row per n to (a new file)")
    args = parser.parse_args()
    benchmark = args.protocol == "benchmark"
    args.turns = (simulator.BENCHMARK_MAX_TURNS if benchmark else 2) if args.turns is None else args.turns
    args.start_emotion = simulator.BENCHMARK_START_EMOTION if benchmark else simulator.TRAIN_START_EMOTION
    args.policy_prompt = "sentient" if benchmark else "policy"
    if min(args.n + [args.copies, args.turns, args.max_reply_tokens]) < 1:
        raise SystemExit("--n, --copies, --turns and --max_reply_tokens take whole numbers of at least 1")
    if not 0 < args.temperature < float("inf"):  # it samples: 0 would be greedy, the same reply n times
        raise SystemExit(f"--temperature {args.temperature}: must be above 0 (best of n compares samples)")
    if args.output and Path(args.output).exists():
        raise SystemExit(f"--output {args.output} exists: choose a new file (results are never overwritten)")
    if args.output:
        guards.note_output(args.output)  # absent: a file another run makes meanwhile is not written into
    train = args.protocol == "train"
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES if train else simulator.DEFAULT_BENCHMARK_PROFILES)
    profiles = [profile for profile in profiles for _ in range(args.copies)]

    common.use_all_cpu_cores()
    folder = guards.loadable_model(args.model)  # a trained adapter merged onto its base once
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    generate = generation.TransformersGenerator(model, tokenizer, generation.sampling_config(tokenizer, args.temperature),
                                                prefix_cache=False)
    for n in args.n:
        torch.manual_seed(args.seed)
        started = time.perf_counter()
        result = {**best_of_n(generate, tokenizer, profiles, n, args), "protocol": args.protocol,
                  "model": args.model, "temperature": args.temperature, "max_reply_tokens": args.max_reply_tokens,
                  "turns": args.turns, "variant": args.variant, "seed": args.seed, "copies": args.copies,
                  "seconds": round(time.perf_counter() - started, 1)}
        print(f"n={n}: {result['score']:.1f} ({result['interval'][0]:.1f}-{result['interval'][1]:.1f}), "
              f"{result['failures']} below 10, {result['reached_100']} at 100, {result['seconds']} s")
        for turn, shares in enumerate(result["per_turn"], 1):
            print(f"  turn {turn}: {shares['candidates']} candidates, +5 or more {shares['share_plus5']:.0%}, "
                  f"0 {shares['share_zero']:.0%}, -5 or less {shares['share_minus5']:.0%}; the rule user's reasons: "
                  + ", ".join(f"{reason} {count}" for reason, count in shares["reasons"].items()))
        if args.output:
            guards.append_rows_kept(args.output, [result])


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("each finished n's row is in --output (where given)")
