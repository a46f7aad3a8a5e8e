"""The Sentient benchmark (SAGE): a model talks with simulated users; the score is their mean final emotion.

    python eval_sentient.py                                     # offline: packaged SmolLM2 vs the rule user
    python eval_sentient.py --model runs/grpo-demo --think      # a trained checkpoint (LoRA folder or full)
    python eval_sentient.py --model gpt-4.1 --model_base_url https://api.openai.com/v1 \\
        --profiles path/to/rlver/test_profile.jsonl --backend llm --base_url http://localhost:8001/v1 \\
        --simulator_model deepseek-v3
    python eval_sentient.py --rescore results/*.jsonl           # leaderboard from result files, no model

Protocol (SAGE, `test_npc.py` of the benchmark's release): each scenario starts from the profile's
`first_talk` at emotion 40; the simulated user judges each reply (change bounded to [-10, +10],
score capped at 100) and answers; the dialogue ends on a goodbye, at emotion >= 100 or < 10, or
after 9 judged replies (SAGE's loop runs 10 turns, the opening being the first, and never judges
the 10th reply it asks for). The tested model answers under a short fixed system prompt
(`prompts/<lang>/sentient[_think].txt`, SAGE's own prompt in Chinese) and, in think mode, only the
text after `</think>` reaches the simulated user.

Output: one result row per scenario in SAGE's format (profile fields, `emo_point`, `emo_state`,
`history` whose user messages carry `emotion-point` and the simulator's reasoning), appended as
scenarios finish, so our files and the official published ones are read the same way; a rerun of
the same command skips finished scenarios. The summary (also written as `<output>.summary.json`):
score = mean final emotion with a bootstrap 95% interval, success = share ending at 100, failure =
share ending below 10, mean judged replies, and the same by hidden intention and personality type.

Models: a local folder or hub id through transformers (batched), `--use_vllm` for an in-process vLLM
engine (rehearsed on CPU with a fake vLLM, not run on a GPU), or any OpenAI-compatible endpoint with
`--model_base_url`. A PEFT adapter folder, as training writes it, is merged onto its base model once,
into `cache/merged/` (`$RLVER_CACHE/merged/` when set), with its own tokenizer or else its base
model's: vLLM serves only full model folders, and both local backends then test the same weights.

Differences from SAGE: a local model keeps its own earlier thoughts in its context (as in training;
SAGE shows an API model only the replies), and a goodbye must be in the user's last sentence, where
SAGE matches 再见/拜拜 anywhere in the message. More: docs/evaluation.md.
"""
import asyncio
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import common
import guards  # before the libraries below: quick, and it quiets a Ctrl-C while they load

if __name__ == "__main__":
    guards.start_script("the finished scenarios' rows are in --output (run the same command again to play the rest)")

import numpy as np
from trl import TrlParser

import chat_client
import generation
import rollout
import simulator

STATES = ("S", "A", "B", "C", "F")


@dataclass
class EvalArguments:
    """What to test and how; defaults are the offline run (packaged SmolLM2, our English scenarios)."""

    model: str = field(default=common.PACKAGED_MODEL, metadata={
        "help": "local folder, hub id, or the model name served at --model_base_url"})
    model_base_url: str | None = field(default=None, metadata={
        "help": "OpenAI-compatible endpoint of the tested model"})
    model_api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "variable holding its API key"})
    model_timeout: float = field(default=120.0, metadata={
        "help": "seconds one call to --model_base_url may take before it is retried"})
    model_max_retries: int = field(default=3, metadata={
        "help": "retries of a failed call to --model_base_url: connection errors, timeouts, 429, 5xx"})
    use_vllm: bool = field(default=False, metadata={"help": "generate with an in-process vLLM engine (GPU)"})
    think: bool = field(default=False, metadata={"help": "think-then-say: <think>...</think>, hidden from the user"})
    profiles: str = field(default=str(simulator.DEFAULT_BENCHMARK_PROFILES), metadata={
        "help": "benchmark scenarios with first_talk (the official 100: RLVER's test_profile.jsonl)"})
    output: str | None = field(default=None, metadata={
        "help": "result rows (JSON Lines); default runs/sentient/<model>.jsonl"})
    limit: int | None = field(default=None, metadata={"help": "only the first N scenarios"})
    max_reply_tokens: int = field(default=64, metadata={"help": "reply tokens per turn (offline default; GPU: 1024)"})
    max_think_tokens: int = field(default=64, metadata={"help": "thinking tokens per turn, think mode (GPU: 2048)"})
    max_dialogue_tokens: int = field(default=4096, metadata={
        "help": "prompt + completion tokens per dialogue (local models)"})
    temperature: float = field(default=0.7, metadata={"help": "sampling temperature of the tested model"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (temperature > 0), also sent to an endpoint"})
    seed: int = field(default=0, metadata={
        "help": "sampling seed: the same seed and simulator outputs give the same rows"})
    batch_size: int = field(default=16, metadata={
        "help": "scenarios played at once (local models; endpoints: at once in flight)"})
    rollout: Literal["async", "lockstep"] = field(default="async", metadata={
        "help": "local models: async, each scenario asks for its next reply as soon as its user answered; "
                "lockstep, each turn waits for the batch's slowest user (rollout.py)"})
    rescore: list[str] = field(default_factory=list, metadata={
        "help": "result files to summarise (ours or official), printed as a leaderboard; no model is loaded"})
    bootstrap_samples: int = field(default=10000, metadata={"help": "resamples for the score's 95%% interval"})

    def __post_init__(self):
        guards.check_options(
            self, limit=(lambda value: value >= 1, "at least 1 (leave it out for every scenario)"),
            max_reply_tokens=guards.AT_LEAST_ONE, max_think_tokens=guards.AT_LEAST_ONE,
            max_dialogue_tokens=guards.AT_LEAST_ONE, temperature=guards.NOT_NEGATIVE,
            top_p=(lambda value: 0 < value <= 1, "above 0 and at most 1"), seed=guards.SEED,
            batch_size=guards.AT_LEAST_ONE, bootstrap_samples=guards.BOOTSTRAP_SAMPLES, model_base_url=guards.URL,
            model_timeout=guards.CALL_TIMEOUT, model_max_retries=guards.RETRIES)


# --------------------------------------------------------------------------------------------
# Result files and metrics
# --------------------------------------------------------------------------------------------

class ResultFileError(common.InputError):
    """A result row that does not follow SAGE's format."""


def read_results(path, skip_cut_last_line: bool = False) -> list[dict]:
    """The rows of a result file (result_rows); a file without any is an error."""
    rows = list(result_rows(path, skip_cut_last_line))
    if not rows:
        raise ResultFileError(f"{path}: no result rows")
    return rows


def result_rows(path, skip_cut_last_line: bool = False):
    """Each row, checked: it needs an `id`, an `emo_point` within 0-100 (the last user message's `emotion-point`,
    where it has one) and a `history` list. Our own output, read to resume or summarise it, may end in a line
    cut short by a killed run: `skip_cut_last_line` leaves that line out (with a warning), and its scenario is
    played again."""
    seen = set()
    for _, where, row in common.json_lines(path, "result file", ResultFileError, skip_cut_last_line):
        if not isinstance(row, dict):
            raise ResultFileError(f"{where}: a result row must be a JSON object")
        if "step" in row:  # a training run's transcript: each profile played at every step
            raise ResultFileError(f"{where}: a training run's transcript row (it has a 'step'), not a benchmark "
                                  "result; read a run's dialogues with report.py, its curve with plot_training.py")
        point = row.get("emo_point")
        if isinstance(point, bool) or not isinstance(point, (int, float)) or not 0 <= point <= simulator.MAX_EMOTION:
            raise ResultFileError(f"{where}: field 'emo_point' must be a number within 0-100, got {point!r}")
        if not isinstance(row.get("id"), str) or not isinstance(row.get("history"), list):
            raise ResultFileError(f"{where}: a result row needs a string 'id' and a 'history' list")
        last = next((message.get("emotion-point") for message in reversed(row["history"])
                     if isinstance(message, dict) and message.get("role") == "user"), None)
        if last is not None and last != point:  # the simulated user's last emotion is the score (as in SAGE)
            raise ResultFileError(f"{where}: 'emo_point' {point!r} is not the last user message's 'emotion-point' "
                                  f"{last!r}; was the row edited? play the scenario again")
        if row["id"] in seen:
            raise ResultFileError(f"{where}: scenario {row['id']!r} appears twice")
        seen.add(row["id"])
        yield row


def judged_replies(row: dict) -> int:
    """Replies the simulated user judged: its messages after the opening (SAGE's unjudged 10th reply is not one)."""
    return sum(message.get("role") == "user" for message in row["history"]) - 1


def bootstrap_interval(values, samples: int, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean."""
    values = np.asarray(values, dtype=float)
    means = np.random.default_rng(seed).choice(values, size=(samples, len(values))).mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def group_figures(rows: list[dict]) -> dict:
    points = [row["emo_point"] for row in rows]
    return {"n": len(rows), "score": sum(points) / len(points),
            "success": sum(p >= simulator.FAREWELL_AT for p in points),
            "failure": sum(p < simulator.GIVE_UP_BELOW for p in points)}


def summarize(rows: list[dict], bootstrap_samples: int = 10000) -> dict:
    """Score (mean final emotion), success and failure (counts and % of scenarios), mean judged replies,
    final states, and the same figures by hidden intention and by personality type."""
    figures = group_figures(rows)
    n = figures["n"]
    low, high = bootstrap_interval([row["emo_point"] for row in rows], bootstrap_samples)
    states = [simulator.emotion_state(row["emo_point"]) for row in rows]
    summary = {**figures, "score_ci95": [low, high], "success_rate": 100 * figures["success"] / n,
               "failure_rate": 100 * figures["failure"] / n,
               "mean_turns": sum(judged_replies(row) for row in rows) / n,
               "states": {state: states.count(state) for state in STATES}}
    for name, key in (("by_intention", intention_of), ("by_personality", personality_of)):
        groups = {}
        for row in rows:
            groups.setdefault(key(row), []).append(row)
        summary[name] = {label: group_figures(group) for label, group in sorted(groups.items())}
    return summary


def intention_of(row: dict) -> str:
    """Our key for the row's hidden intention (official Chinese or our English text), else the text itself."""
    task = str(row.get("task", "")).strip()
    return simulator.INTENTION_BY_TEXT.get(task, task or "unknown")


def personality_of(row: dict) -> str:
    kind = str(row.get("main_cha", row.get("character", ""))).strip()  # official result rows say "character"
    return simulator.PERSONALITY_BY_TEXT.get(kind, kind or "unknown")


def format_summary(summary: dict, title: str) -> str:
    low, high = summary["score_ci95"]
    lines = [title,
             f"  score {summary['score']:.1f}  (95% CI {low:.1f} to {high:.1f}; exact mean {summary['score']:.2f})",
             f"  success {summary['success_rate']:.1f}% ({summary['success']}/{summary['n']})   "
             f"failure {summary['failure_rate']:.1f}% ({summary['failure']}/{summary['n']})   "
             f"mean judged replies {summary['mean_turns']:.2f}",
             "  final states " + "  ".join(f"{state} {count}" for state, count in summary["states"].items())]
    for name, heading in (("by_intention", "hidden intention"), ("by_personality", "personality type")):
        lines.append(f"  {heading:<22} {'n':>3} {'score':>6} {'success':>8} {'failure':>8}")
        for label, group in summary[name].items():
            lines.append(f"    {label[:20]:<20} {group['n']:>3} {group['score']:>6.1f} {group['success']:>8} "
                         f"{group['failure']:>8}")
    return "\n".join(lines)


def leaderboard(summaries: dict[str, dict]) -> str:
    """One line per result file (path -> its summary), best score first: the published columns plus ours."""
    names = [Path(path).name for path in summaries]
    if len(set(names)) < len(names):  # a/results.jsonl and b/results.jsonl: their paths tell them apart
        names = [str(path) for path in summaries]
    entries = sorted(zip(names, summaries.values()), key=lambda entry: -entry[1]["score"])
    width = max(len(name) for name, _ in entries)
    lines = [f"{'rank':>4}  {'results':<{width}}  {'n':>3}  {'score':>5}  {'95% CI':>11}  {'success':>7}  "
             f"{'failure':>7}  {'turns':>5}"]
    for rank, (name, s) in enumerate(entries, start=1):
        low, high = s["score_ci95"]
        lines.append(f"{rank:>4}  {name:<{width}}  {s['n']:>3}  {s['score']:>5.1f}  {low:>5.1f}-{high:<5.1f}  "
                     f"{s['success']:>7}  {s['failure']:>7}  {s['mean_turns']:>5.2f}")
    lines.append("success / failure: scenarios ending at 100 / below 10 (counts; per cent when n = 100)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Playing the benchmark
# --------------------------------------------------------------------------------------------

def default_output(args: EvalArguments) -> Path:
    name = Path(args.model.rstrip("/")).name or "model"
    return Path("runs") / "sentient" / f"{name}{'-think' if args.think else ''}.jsonl"


def run_record(args: EvalArguments, simulator_args: simulator.SimulatorArguments) -> dict:
    """What every result row records as its "made_by": the tested model, and the settings that shape a score."""
    settings = ("think", "max_reply_tokens", "max_think_tokens", "max_dialogue_tokens", "temperature", "top_p", "seed")
    simulator_settings = {"simulator": "backend", "simulator_variant": "variant", "simulator_model": "simulator_model",
                          "change_bound": "change_bound",
                          "simulator_language": "language", "simulator_prompts": "simulator_prompts",
                          "policy_prompts": "policy_prompts"}
    if simulator_args.backend == "llm":  # what its requests send
        simulator_settings.update(simulator_temperature="simulator_temperature",
                                  simulator_max_tokens="simulator_max_tokens")
    if simulator_args.simulator_prompts != "ours":  # ours always ask again, and show the current emotion
        simulator_settings.update(empty_user_message="empty_user_message", analysis_emotion="analysis_emotion")
    return {**guards.model_record(args.model, args.model_base_url),
            **{key: getattr(args, key) for key in settings},
            **{key: getattr(simulator_args, option) for key, option in simulator_settings.items()}}


def finished_ids(path: Path, made_by: dict, profiles: list, profiles_file: str, limit: int | None) -> set[str]:
    """Scenarios already in our output (none when it does not exist yet), refused when they are not among
    `profiles` (the first `limit` of the file) or another model or other settings made them."""
    rows = list(result_rows(path, skip_cut_last_line=True)) if path.is_file() else []
    done = {row["id"] for row in rows}
    unknown = done - {p.id for p in profiles}
    if unknown:
        where = f"the first {limit} of {profiles_file} (--limit {limit})" if limit else profiles_file
        raise ResultFileError(f"{path} holds results for scenarios not in {where} (e.g. {sorted(unknown)[0]}); "
                              f"choose another --output{' or raise --limit' if limit else ''}")
    guards.check_made_by(path, rows, made_by)
    guards.check_inputs_unchanged(path, rows, {p.id: guards.digest(p.to_row()) for p in profiles}, "scenario")
    return done


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append result rows. The first make the file (and its folder), held from then on (guards.hold): a run
    that fails earlier leaves nothing behind."""
    if not rows:  # a batch whose every user failed: no file made for nothing
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    guards.hold(path, "--output", create="file")
    guards.append_rows_kept(path, rows)  # a last line cut short by a killed run is dropped first


def benchmark_dialogues(args: EvalArguments) -> rollout.DialogueArguments:
    """The benchmark's dialogues: SAGE's start and judged-reply limit, our sentient prompt, the tested
    model's budgets (the change bound is the simulator's, --change_bound)."""
    return rollout.DialogueArguments(
        think=args.think, start_emotion=simulator.BENCHMARK_START_EMOTION, max_turns=simulator.BENCHMARK_MAX_TURNS,
        max_think_tokens=args.max_think_tokens, max_reply_tokens=args.max_reply_tokens,
        max_dialogue_tokens=args.max_dialogue_tokens, policy_prompt="sentient", simulator_concurrency=args.batch_size,
        rollout=args.rollout)


def play_local(args, simulator_args, chat, profiles, done: set, output: Path, progress) -> None:
    """Batches of scenarios through rollout.py (--rollout). Batches are cut from the full scenario list and
    each is seeded by its index, so a resumed run plays what the uninterrupted run would have (with an LLM
    simulator and --rollout async, only when the model decodes greedily: its generate calls hold whichever
    scenarios wait, so the sampling order follows the simulator's latencies)."""
    import torch

    common.use_all_cpu_cores()
    made_by = run_record(args, simulator_args)
    folder, tokenizer = generation.load_tokenizer(args)
    runner = rollout.DialogueRunner(tokenizer, benchmark_dialogues(args), simulator_args, chat)
    failed = []  # scenarios whose simulated user failed past its retries: not written, so a rerun plays them
    try:
        runner.check_room([(p, p.first_talk) for p in profiles])  # before the weights load
        runner.check_chat()  # a wrong URL, key or model name fails now, before the weights load
        generate = generation.load_generator(args, folder, tokenizer)
        for index in range(0, len(profiles), args.batch_size):
            batch = [p for p in profiles[index:index + args.batch_size] if p.id not in done]
            if not batch:
                continue
            torch.manual_seed(args.seed + index)
            dialogues = runner.run([(p, p.first_talk) for p in batch], generate)
            failed += [d for d in dialogues if d.failure is not None]
            rows = [{**d.simulator.result_row(d.think_texts), "made_by": made_by,
                     "input_digest": guards.digest(d.profile.to_row())} for d in dialogues if d.failure is None]
            append_rows(output, rows)
            progress(rows)
    finally:
        runner.close()
    if failed:
        raise simulator.SimulatorError(
            f"{len(failed)} scenario(s) whose simulated user failed were not written ({failed[0].profile.id}: "
            f"{failed[0].failure}); rerun the same command to play them again")


async def play_endpoint(args, simulator_args, chat, profiles, done: set, output: Path, progress) -> None:
    """Scenarios concurrently (at most batch_size at once) against an OpenAI-compatible endpoint; the
    model sees the system prompt and the dialogue's messages, never its own earlier thinking."""
    made_by = run_record(args, simulator_args)
    client = chat_client.ChatClient(args.model_base_url, args.model, args.model_api_key_env,
                               temperature=args.temperature, top_p=args.top_p, timeout=args.model_timeout,
                               max_retries=args.model_max_retries,
                               max_tokens=args.max_reply_tokens + (args.max_think_tokens if args.think else 0),
                               role="tested-model")
    await client.check()
    if chat is not None:
        await chat.check()
    gate = asyncio.Semaphore(args.batch_size)
    dialogues = benchmark_dialogues(args)  # the same start, turn limit and prompt as the local path's

    async def play(index, profile):
        async with gate:
            user = rollout.new_simulator(profile, chat, dialogues, simulator_args)
            messages = generation.policy_messages(simulator_args.language or profile.language, args.think,
                                                  dialogues.policy_prompt, simulator_args.released_prompts("policy_prompts"))
            messages.append({"role": "user", "content": await user.open()})
            thoughts = []
            while not user.done:
                raw = await client.complete(messages, seed=args.seed + index)
                thought, reply, _ = generation.split_think(raw, args.think)
                thoughts.append(thought)
                turn = await user.respond(reply)
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn.message}]
            row = {**user.result_row(thoughts), "made_by": made_by, "input_digest": guards.digest(profile.to_row())}
        append_rows(output, [row])  # one event loop thread: appends never interleave
        progress([row])

    await asyncio.gather(*(play(i, p) for i, p in enumerate(profiles) if p.id not in done))


def evaluate(args: EvalArguments, simulator_args: simulator.SimulatorArguments) -> dict:
    """Play every unfinished scenario, then summarise the output file."""
    profiles = simulator.load_profiles(args.profiles, require_first_talk=True)[:args.limit]
    simulator.check_backend(profiles, simulator_args)
    simulator.check_policy_prompts(simulator_args, args.think)
    guards.check_vllm(args.use_vllm and not args.model_base_url)
    output = Path(args.output).expanduser() if args.output else default_output(args)  # ~ as a shell reads it
    # A file of rows, ours, is resumed (finished_ids).
    # Ours: rows that say who made them (a training run's transcripts are rows too, without it).
    guards.check_output_file(output, "output", guards.starts_with(b'"made_by": {', 1 << 22), [args.profiles])
    summary_path = output.with_suffix(".summary.json")
    guards.check_output_file(summary_path, "output", guards.json_object_with("made_by"), [args.profiles, output])
    summarised = (json.loads(summary_path.read_bytes()).get("results")
                  if summary_path.is_file() and summary_path.stat().st_size else None)
    if summarised and Path(summarised).name != output.name:  # results.jsonl and results share results.summary.json
        raise common.InputError(f"--output {output}: its summary file, {summary_path}, is the summary of "
                                f"{summarised}; give an --output of another name")
    if output.exists():  # two evaluations at once would both play the rest (a new file: append_rows)
        guards.hold(output, "--output")
    made_by = run_record(args, simulator_args)
    done = finished_ids(output, made_by, profiles, args.profiles, args.limit)
    if len(done) < len(profiles):
        guards.check_local_model(args)
        chat = rollout.make_chat(simulator_args)
        points = []
        with rollout.DialogueProgress(len(profiles), len(done), "scenarios") as bar:
            def progress(rows):
                points.extend(row["emo_point"] for row in rows)
                bar.advance(len(rows), sum(points) / len(points) if points else float("nan"))

            try:
                if args.model_base_url:
                    asyncio.run(play_endpoint(args, simulator_args, chat, profiles, done, output, progress))
                else:
                    play_local(args, simulator_args, chat, profiles, done, output, progress)
            except KeyboardInterrupt:  # every finished scenario's row is in the output already
                finished = finished_ids(output, made_by, profiles, args.profiles, args.limit)
                guards.exit_interrupted(f"{len(finished)} of {len(profiles)} scenarios are in "
                                        f"{output}; run the same command again to play the rest")
    guards.check_output_kept(output)  # the summary covers this model's rows only
    summary = summarize(read_results(output, skip_cut_last_line=True), args.bootstrap_samples)
    summary.update(results=str(output), made_by=made_by)
    summary_path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def main(argv=None) -> None:
    parser = TrlParser((EvalArguments, simulator.SimulatorArguments), description=__doc__.split("\n")[0])
    args, simulator_args = guards.parse_arguments(parser, sys.argv[1:] if argv is None else list(argv))
    try:
        if args.rescore:
            summaries = {path: summarize(read_results(path), args.bootstrap_samples) for path in args.rescore}
            print(leaderboard(summaries))
            for path, summary in summaries.items():
                print()
                print(format_summary(summary, path))
            return
        summary = evaluate(args, simulator_args)
    except (common.InputError, common.EndpointError) as error:
        sys.exit(f"error: {error}")
    except OSError as error:  # a full disk, a name too long, a folder removed while writing
        sys.exit(f"error: {error} (the finished scenarios' rows are kept: fix it, then run the same command)")
    except KeyboardInterrupt:  # while a model loads or the summary is made; the dialogues say their own
        guards.exit_interrupted("the finished scenarios' rows are in --output; run the same command again to play "
                                "the rest")
    print(format_summary(summary, f"Sentient benchmark: {summary['results']} ({args.model}"
                                  f"{', think' if args.think else ''}; {simulator_args.backend} simulator)"))
    results = shlex.quote(summary["results"])  # a command to paste: a path with spaces or quotes stays one
    report = common.script_command("report.py")
    print(f"\nread the dialogues: {report} {results}   (against another model: {report} --compare OTHER.jsonl "
          f"{results})")


if __name__ == "__main__":
    main()
