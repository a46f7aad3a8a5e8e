"""eval_general.py: graders on known right and wrong answers, the sandbox, data loading, resuming,
think stripping, and the paired comparison. Fixtures are in each benchmark's real format, written here."""
import base64
import functools
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
from conftest import write_jsonl
from fake_openai import FakeOpenAIServer

import eval_general

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# MATH-500
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, response, correct", [
    ("\\frac{1}{2}", "So the probability is $\\boxed{0.5}$.", True),
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "Hence $\\boxed{(3, \\pi/2)}$", True),
    ("[-2,7]", "x lies in \\boxed{[-2, 7]}", True),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", False),
    ("10", "First 10 apples, then 12: \\boxed{12}", False),  # the boxed answer wins over earlier numbers
    ("[-2,7]", "\\boxed{(-2, 7)}", False),  # open and closed intervals differ
    ("3", "I cannot solve this.", False),
])
def test_math_answers_are_graded_by_equivalence_not_string_match(answer, response, correct):
    assert eval_general.grade_math500({"answer": answer}, response)["correct"] is correct


def test_math500_rows_load_from_a_local_file_with_subject_and_level(tmp_path):
    rows = [{"problem": "What is $1+1$?", "solution": "$1+1=\\boxed{2}$", "answer": "2", "subject": "Prealgebra",
             "level": 1, "unique_id": "test/prealgebra/1.json"}]
    args = eval_general.GeneralEvalArguments(math500_path=str(write_jsonl(tmp_path / "math.jsonl", rows)))
    (item,) = eval_general.load_math500(args)
    assert item["id"] == "test/prealgebra/1.json" and item["subject"] == "Prealgebra" and item["level"] == 1
    assert item["messages"][-1]["content"].endswith("\\boxed{}.") and "1+1" in item["messages"][-1]["content"]


def test_a_malformed_data_line_names_its_file_and_line(tmp_path):
    good = {"problem": "p", "solution": "s", "answer": "1", "subject": "Algebra", "level": 2, "unique_id": "a"}
    path = write_jsonl(tmp_path / "math.jsonl", [good, {k: v for k, v in good.items() if k != "answer"}])
    with pytest.raises(eval_general.DataError, match=r"math.jsonl:2: missing field 'answer'"):
        eval_general.load_math500(eval_general.GeneralEvalArguments(math500_path=str(path)))
    write_jsonl(path, [good, "{not json"])
    with pytest.raises(eval_general.DataError, match=r"math.jsonl:2: not valid JSON"):
        eval_general.load_math500(eval_general.GeneralEvalArguments(math500_path=str(path)))


def test_without_the_hub_and_without_a_local_file_loading_says_what_to_pass_at_once(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", False)  # the loader turns it on: restored afterwards
    started = time.perf_counter()
    with pytest.raises(eval_general.DataError, match=r"cannot load HuggingFaceH4/MATH-500 .*pass --math500_path"):
        eval_general.load_math500(eval_general.GeneralEvalArguments())
    with pytest.raises(eval_general.DataError, match=r"code_generation_lite .*pass --livecodebench_path"):
        eval_general.load_livecodebench(eval_general.GeneralEvalArguments())
    assert time.perf_counter() - started < 10  # the hub clients' own retries took 46 s


# --------------------------------------------------------------------------------------------
# The sandbox and HumanEval
# --------------------------------------------------------------------------------------------

def humaneval_item(task_id="HumanEval/0"):
    return next(item for item in eval_general.load_humaneval(None) if item["id"] == task_id)


def test_all_164_humaneval_problems_ship_with_the_package():
    items = eval_general.load_humaneval(None)
    assert len(items) == 164 and items[0]["problem"]["entry_point"] == "has_close_elements"


def test_a_correct_humaneval_solution_passes_whole_or_as_a_body():
    item = humaneval_item()
    problem = item["problem"]
    whole = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    assert eval_general.grade_humaneval(item, whole) == {"passed": True, "result": "passed"}
    body = f"```python\n{problem['canonical_solution']}```"
    assert eval_general.grade_humaneval(item, body)["passed"]


def test_a_wrong_humaneval_solution_fails():
    item = humaneval_item()
    verdict = eval_general.grade_humaneval(item, "```python\ndef has_close_elements(numbers, threshold):\n"
                                                 "    return False\n```")
    assert verdict == {"passed": False, "result": "AssertionError"}


@pytest.mark.slow
def test_a_solution_that_loops_forever_is_stopped_at_the_timeout():
    item = humaneval_item()
    started = time.monotonic()
    verdict = eval_general.grade_humaneval(item, "```python\ndef has_close_elements(numbers, threshold):\n"
                                                 "    while True:\n        pass\n```")
    assert verdict == {"passed": False, "result": "timed out"}
    assert time.monotonic() - started < eval_general.HUMANEVAL_TIMEOUT + 3


@pytest.mark.slow
def test_a_looping_program_s_children_are_killed_too(tmp_path):
    marker = tmp_path / "child-alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    source = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True:\n    pass\n"
    assert eval_general.run_sandboxed(source, timeout=1).timed_out
    time.sleep(3.5)
    assert not marker.exists()


@pytest.fixture
def listening_server():
    """A TCP server on 127.0.0.1 that records every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
                accepted.append(connection)
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@functools.cache
def kernel_allows_network_namespaces() -> bool:
    """Asked of the kernel here, not of eval_general.network_namespace: where namespaces work, a sandbox that
    stopped using them must fail the tests below, not skip them."""
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("connect", [
    "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "import _socket\ns = _socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))",  # under the guard
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
])
@pytest.mark.slow
@pytest.mark.parametrize("namespace", [True, False], ids=["namespace", "guard-only"])
def test_a_solution_that_tries_the_network_fails_and_reaches_nothing(listening_server, connect, namespace,
                                                                     monkeypatch):
    if namespace and not kernel_allows_network_namespaces():
        pytest.skip("unprivileged network namespaces are not available on this machine")
    if not namespace:
        if "_socket" in connect:
            pytest.skip("the in-process guard does not cover the raw _socket module (documented limit)")
        monkeypatch.setattr(eval_general, "network_namespace", lambda: [])  # as where unshare is refused
    port, accepted = listening_server
    item = humaneval_item()
    problem = item["problem"]
    response = f"```python\n{connect.format(port=port)}\n{problem['prompt']}{problem['canonical_solution']}```"
    verdict = eval_general.grade_humaneval(item, response)
    time.sleep(0.5)
    assert not verdict["passed"] and not accepted


def test_where_the_kernel_allows_it_the_program_runs_in_its_own_network_namespace_with_only_loopback():
    if not kernel_allows_network_namespaces():
        pytest.skip("unprivileged network namespaces are not available on this machine")
    run = eval_general.run_sandboxed("import os, socket\nprint(os.readlink('/proc/self/ns/net'))\n"
                                     "print(sorted(name for _, name in socket.if_nameindex()))")
    namespace, interfaces = run.stdout.splitlines()
    assert namespace != os.readlink("/proc/self/ns/net") and interfaces == "['lo']"


@pytest.fixture
def no_unshare_command(tmp_path, monkeypatch):
    """A PATH without `unshare`, as on a machine without util-linux; the namespace decision is made afresh."""
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))
        eval_general.network_namespace.cache_clear()
        yield
    eval_general.network_namespace.cache_clear()  # the next caller asks again, with the real PATH


def test_without_unshare_programs_still_run_with_sockets_refused_in_the_process(no_unshare_command):
    run = eval_general.run_sandboxed("import socket\nprint('running')\nsocket.socket()")
    assert run.stdout == "running\n" and "network access is disabled in the sandbox" in run.stderr


def test_the_program_runs_under_the_cpu_memory_and_file_size_limits_asked_for():
    source = ("import resource\nfor name in ('CPU', 'AS', 'FSIZE'):\n"
              "    print(*resource.getrlimit(getattr(resource, 'RLIMIT_' + name)))")
    run = eval_general.run_sandboxed(source, timeout=2.5, memory_mb=700)
    cpu, memory, file_size = (tuple(map(int, line.split())) for line in run.stdout.splitlines())
    assert cpu == (3, 3)  # CPU seconds just past the wall-clock timeout, which stops a single-threaded program first
    assert memory == (700 << 20,) * 2 and file_size == (64 << 20,) * 2


def test_a_file_can_grow_to_64_mb_and_no_further():
    source = ("import os\nfd = os.open('big', os.O_WRONLY | os.O_CREAT)\nos.pwrite(fd, b'x', (64 << 20) - 1)\n"
              "print(os.fstat(fd).st_size)\nos.pwrite(fd, b'x', 64 << 20)")
    run = eval_general.run_sandboxed(source)
    assert run.stdout == f"{64 << 20}\n" and run.stderr.strip().endswith("OSError: [Errno 27] File too large")


def test_output_comes_back_cut_at_1_mb():
    run = eval_general.run_sandboxed("import sys\nsys.stdout.write('y' * (3 << 20))\nsys.stderr.write('z' * (3 << 20))")
    assert run.returncode == 0 and run.stdout == "y" * (1 << 20) and run.stderr == "z" * (1 << 20)


def test_a_memory_blow_up_fails_within_the_limit():
    run = eval_general.run_sandboxed("x = bytearray(8 << 30)\nprint('allocated')", memory_mb=512)
    assert run.returncode != 0 and "MemoryError" in run.stderr and "allocated" not in run.stdout


def test_the_sandbox_runs_in_an_empty_temporary_folder_with_its_own_stdin():
    run = eval_general.run_sandboxed("import os\nprint(sorted(os.listdir('.')))\nprint(input())", stdin="hello\n")
    assert run.returncode == 0
    assert run.stdout.splitlines() == ["['main.py', 'stderr.txt', 'stdin.txt', 'stdout.txt']", "hello"]


# --------------------------------------------------------------------------------------------
# LiveCodeBench
# --------------------------------------------------------------------------------------------

def encode_private(tests):
    """The hub's encoding of private tests: JSON, pickled, zlib-compressed, base64."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def livecodebench_rows():
    stdin_tests = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    stdin_private = [{"input": "40 2\n", "output": "42\n", "testtype": "stdin"},
                     {"input": "-5 5\n", "output": "0\n", "testtype": "stdin"}]
    call_tests = [{"input": "[2, 7, 11]\n9", "output": "[0, 1]", "testtype": "functional"}]
    call_private = [{"input": "[3, 3]\n6", "output": "[0, 1]", "testtype": "functional"}]
    common = {"contest_id": "c1", "platform": "atcoder", "difficulty": "easy"}
    return [
        {**common, "question_title": "Sum", "question_id": "abc001_a", "contest_date": "2024-09-01T00:00:00",
         "question_content": "Read two integers A and B and print A+B.", "starter_code": "",
         "public_test_cases": json.dumps(stdin_tests), "private_test_cases": encode_private(stdin_private),
         "metadata": "{}"},
        {**common, "platform": "leetcode", "difficulty": "medium", "question_title": "Two sum",
         "question_id": "1", "contest_date": "2024-07-01T00:00:00",
         "question_content": "Return indices of the two numbers that add up to target.",
         "starter_code": "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
         "public_test_cases": json.dumps(call_tests), "private_test_cases": json.dumps(call_private),
         "metadata": json.dumps({"func_name": "twoSum"})},
    ]


@pytest.fixture
def livecodebench_items(tmp_path, monkeypatch):
    monkeypatch.setattr(eval_general, "LIVECODEBENCH_TIMEOUT", 1)  # keeps the looping case short
    path = write_jsonl(tmp_path / "test.jsonl", livecodebench_rows())
    items = eval_general.load_livecodebench(eval_general.GeneralEvalArguments(livecodebench_path=str(path)))
    return {item["id"]: item for item in items}


def fenced(code):
    return f"### Answer\n```python\n{code}\n```\n"


def test_livecodebench_problems_decode_private_tests_and_use_the_official_prompt(livecodebench_items):
    item = livecodebench_items["abc001_a"]
    assert len(json.loads(item["sample"]["input_output"])["inputs"]) == 3  # 1 public + 2 private
    assert item["messages"][0]["content"].startswith("You are an expert Python programmer")
    assert "### Question:\nRead two integers" in item["messages"][1]["content"]
    assert "```python\nclass Solution" in livecodebench_items["1"]["messages"][1]["content"]


@pytest.mark.parametrize("starter_code", ["", "class Solution:\n    def f(self) -> int:\n        "])
def test_the_livecodebench_prompt_is_the_official_generic_one(monkeypatch, starter_code):
    """Restated because the official prompts module imports the anthropic SDK; compared with it here,
    with that SDK's two constants stubbed so the module imports."""
    import types

    monkeypatch.setitem(sys.modules, "anthropic", types.SimpleNamespace(HUMAN_PROMPT=None, AI_PROMPT=None))
    from livecodebench.prompts.code_generation import PromptConstants, get_generic_question_template_answer

    question = types.SimpleNamespace(question_content="Print 42.", starter_code=starter_code)
    assert eval_general.livecodebench_prompt("Print 42.", starter_code) == get_generic_question_template_answer(question)
    assert eval_general.LIVECODEBENCH_SYSTEM == PromptConstants.SYSTEM_MESSAGE_GENERIC


@pytest.mark.slow
def test_livecodebench_grades_stdin_programs_on_public_and_private_tests(livecodebench_items):
    item = livecodebench_items["abc001_a"]
    right = eval_general.grade_livecodebench(item, fenced("a, b = map(int, input().split())\nprint(a + b)"))
    assert right["passed"] and right["tests_passed"] == 3
    public_only = eval_general.grade_livecodebench(item, fenced("input()\nprint(3)"))  # passes the public test only
    assert not public_only["passed"] and public_only["tests_passed"] < 3
    loops = eval_general.grade_livecodebench(item, fenced("while True:\n    pass"))
    assert not loops["passed"] and loops["tests_passed"] == 0


def test_livecodebench_grades_call_based_solutions(livecodebench_items):
    item = livecodebench_items["1"]
    solution = ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
                "                return [seen[target - n], i]\n            seen[n] = i\n")
    assert eval_general.grade_livecodebench(item, fenced(solution))["passed"]
    wrong = "class Solution:\n    def twoSum(self, nums, target):\n        return [0, 1] if nums[0] == 2 else [1, 0]\n"
    assert not eval_general.grade_livecodebench(item, fenced(wrong))["passed"]


def test_livecodebench_date_window_and_release_files(tmp_path):
    folder = tmp_path / "lcb"
    folder.mkdir()
    rows = livecodebench_rows()
    write_jsonl(folder / "test.jsonl", rows[:1])
    write_jsonl(folder / "test2.jsonl", rows[1:])
    args = eval_general.GeneralEvalArguments(livecodebench_path=str(folder), livecodebench_release="release_v2")
    assert {item["id"] for item in eval_general.load_livecodebench(args)} == {"abc001_a", "1"}
    args.livecodebench_start_date = "2024-08-01"
    assert [item["id"] for item in eval_general.load_livecodebench(args)] == ["abc001_a"]
    args.livecodebench_release = "release_v3"
    with pytest.raises(eval_general.DataError, match="test3.jsonl"):
        eval_general.load_livecodebench(args)


# --------------------------------------------------------------------------------------------
# IFEval
# --------------------------------------------------------------------------------------------

def ifeval_item(instruction, kwargs, prompt="Write something."):
    return {"doc": {"key": 1, "prompt": prompt, "instruction_id_list": [instruction], "kwargs": [kwargs]}}


@pytest.mark.parametrize("instruction, kwargs, response, strict, loose", [
    ("punctuation:no_comma", {}, "No commas in here at all.", True, True),
    ("punctuation:no_comma", {}, "Sure, here it is:\nNo commas in here at all.", False, True),  # loose drops line 1
    ("change_case:english_lowercase", {}, "all lower case here.", True, True),
    ("change_case:english_lowercase", {}, "Not All Lower.", False, False),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "less than"},
     "Dr. Smith went home. He was tired.", True, True),  # two sentences: "Dr." does not end one
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"},
     "One. Two. Three. Four.", True, True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": "at least"}, "Just one.", False, False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two", True, True),
])
def test_ifeval_checkers_on_known_outputs(instruction, kwargs, response, strict, loose):
    verdict = eval_general.grade_ifeval(ifeval_item(instruction, kwargs), response)
    assert verdict["prompt_level_strict_acc"] is strict and verdict["inst_level_strict_acc"] == [strict]
    assert verdict["prompt_level_loose_acc"] is loose


def test_the_punkt_data_written_offline_loads_in_nltk_as_the_same_model():
    import nltk
    import punkt
    from nltk.tokenize import PunktTokenizer

    eval_general.ifeval_checkers()
    text = "Mr. Brown arrived at 5 p.m. on Jan. 3. It rained. The U.S. team won, e.g. in Rome. Why? Nobody knows."
    assert PunktTokenizer("english").tokenize(text) == punkt.sent_tokenize(text)
    assert str(eval_general.common.model_cache() / "nltk_data") in nltk.data.path


def test_ifeval_rows_load_from_the_real_file_when_present():
    path = REPO.parent / "shared" / "data" / "ifeval" / "input_data.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    items = eval_general.load_ifeval(eval_general.GeneralEvalArguments(ifeval_path=str(path)))
    assert len(items) == 541 and sum(len(item["doc"]["instruction_id_list"]) for item in items) == 834


# --------------------------------------------------------------------------------------------
# Metrics and the comparison
# --------------------------------------------------------------------------------------------

def test_instruction_level_accuracy_is_over_instructions_not_prompts():
    rows = [{"id": "1", "verdict": {"prompt_level_strict_acc": False, "inst_level_strict_acc": [True, True, False],
                                    "prompt_level_loose_acc": False, "inst_level_loose_acc": [True, True, False]}},
            {"id": "2", "verdict": {"prompt_level_strict_acc": True, "inst_level_strict_acc": [True],
                                    "prompt_level_loose_acc": True, "inst_level_loose_acc": [True]}}]
    summary = eval_general.summarize("ifeval", rows)
    assert summary["prompt_strict"] == pytest.approx(50.0)
    assert summary["instruction_strict"] == pytest.approx(75.0)  # 3 of 4 instructions; the mean of per-prompt rates is 83.3


def test_math_summary_breaks_down_by_subject_and_level():
    rows = [{"id": str(i), "subject": subject, "level": level, "verdict": {"correct": correct}}
            for i, (subject, level, correct) in enumerate([("Algebra", 1, True), ("Algebra", 5, False),
                                                           ("Geometry", 5, False), ("Geometry", 5, True)])]
    summary = eval_general.summarize("math500", rows)
    assert summary["accuracy"] == 50.0
    assert summary["by_subject"]["Algebra"] == {"items": 2, "accuracy": 50.0}
    assert summary["by_level"]["5"] == {"items": 3, "accuracy": pytest.approx(100 / 3)}


def math_rows(correct):
    return [{"id": f"q{i}", "verdict": {"correct": c}} for i, c in enumerate(correct)]


def test_the_comparison_flags_a_real_drop_and_not_noise(tmp_path):
    base = math_rows([True] * 80 + [False] * 20)
    dropped = math_rows([True] * 60 + [False] * 40)  # 20 items flipped from right to wrong
    table = eval_general.paired_bootstrap("math500", base, dropped, samples=2000)["accuracy"]
    assert table["base"] == 80.0 and table["trained"] == 60.0 and table["difference"] == pytest.approx(-20.0)
    assert table["interval"][1] < 0 and table["significant_drop"]
    # Two flips each way: same score, and the interval straddles zero.
    noisy = math_rows([False] * 2 + [True] * 78 + [True] * 2 + [False] * 18)
    table = eval_general.paired_bootstrap("math500", base, noisy, samples=2000)["accuracy"]
    assert table["difference"] == 0 and table["interval"][0] < 0 < table["interval"][1]
    assert not table["significant_drop"]


def test_the_comparison_pairs_items_by_id_and_uses_only_shared_ones():
    base = math_rows([True, False, True])
    trained = list(reversed(math_rows([True, False, True, True])))  # an extra item and another order
    table = eval_general.paired_bootstrap("math500", base, trained, samples=200)["accuracy"]
    assert table["items"] == 3 and table["difference"] == 0 and table["interval"] == (0.0, 0.0)


@pytest.mark.slow
def test_compare_command_prints_a_table_from_two_result_folders(tmp_path):
    for name, correct in (("base", [True] * 30 + [False] * 10), ("trained", [True] * 10 + [False] * 30)):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "math500.jsonl", math_rows(correct))
    result = subprocess.run([sys.executable, "eval_general.py", "--compare", str(tmp_path / "base"),
                             str(tmp_path / "trained"), "--bootstrap_samples", "500"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("math500"))
    assert "75.0" in line and "25.0" in line and "-50.0" in line and line.endswith("DROP")


def test_compare_of_a_run_with_itself_and_a_task_given_twice_are_refused(tmp_path, capsys):
    (tmp_path / "base").mkdir()
    write_jsonl(tmp_path / "base" / "math500.jsonl", math_rows([True, False]))
    (tmp_path / "link").symlink_to(tmp_path / "base")
    with pytest.raises(eval_general.DataError, match="--compare: .*base and .*link are the same run; give two runs"):
        eval_general.compare(str(tmp_path / "base"), str(tmp_path / "link"))
    with pytest.raises(SystemExit) as stopped:  # each item would be graded and written twice
        eval_general.main(["--tasks", "humaneval,humaneval", "--limit", "2"])
    assert stopped.value.code == 2
    assert "--tasks 'humaneval,humaneval': must be one or more of " in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# End to end: a real tiny model, resuming, and an endpoint in think mode
# --------------------------------------------------------------------------------------------

def run_eval(*args):
    return subprocess.run([sys.executable, "eval_general.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_a_humaneval_run_writes_rows_and_a_summary_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_dir), "--tasks", "humaneval", "--limit", "2", "--max_new_tokens", "8",
            "--batch_size", "1", "--output_dir", str(out)]
    first = run_eval(*args)
    assert first.returncode == 0, first.stderr
    rows = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()]
    assert [row["id"] for row in rows] == ["HumanEval/0", "HumanEval/1"]
    assert all(set(row) >= {"prompt", "output", "verdict"} and not row["verdict"]["passed"] for row in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["humaneval"] == {"items": 2, "pass@1": 0.0}
    assert "humaneval: 2 items, pass@1 0.0%" in first.stdout
    # Drop the second row, as if the run had been killed after its first batch: the rerun plays only it, the same way.
    (out / "humaneval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    second = run_eval(*args)
    assert second.returncode == 0, second.stderr
    again = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()]
    assert again == rows
    # A smaller --limit over the same folder summarises just those items.
    smaller = run_eval(*args[:4], "--limit", "1", *args[6:])
    assert smaller.returncode == 0, smaller.stderr
    assert json.loads((out / "summary.json").read_text())["humaneval"]["items"] == 1
    # Another budget would add rows of other settings to these: refused, naming it, nothing written.
    other = run_eval("--model", str(tiny_model_dir), "--tasks", "humaneval", "--limit", "3", "--output_dir", str(out))
    assert other.returncode == 1 and "max_new_tokens=8; this run has max_new_tokens=1024" in other.stderr
    assert [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()] == rows


@pytest.mark.slow
def test_an_endpoint_in_think_mode_is_graded_on_the_text_after_the_thought(tmp_path):
    problem = humaneval_item()["problem"]
    solution = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    out = tmp_path / "out"
    with FakeOpenAIServer(models=["tested"], default=f"<think>Loop over pairs.</think>{solution}") as server:
        result = run_eval("--model", "tested", "--model_base_url", server.base_url, "--think", "--tasks",
                          "humaneval", "--limit", "1", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    (row,) = [json.loads(line) for line in (out / "humaneval.jsonl").read_text().splitlines()]
    assert row["verdict"]["passed"] and row["graded_response"] == solution
    assert server.requests[0]["messages"][0]["role"] == "system" and "<think>" in server.requests[0]["messages"][0]["content"]
    # A thought that never closes leaves nothing to grade, even if it holds a correct solution.
    with FakeOpenAIServer(models=["tested"], default=f"<think>{solution}") as server:
        result = run_eval("--model", "tested", "--model_base_url", server.base_url, "--think", "--tasks",
                          "humaneval", "--limit", "1", "--output_dir", str(tmp_path / "unclosed"))
    (row,) = [json.loads(line) for line in (tmp_path / "unclosed" / "humaneval.jsonl").read_text().splitlines()]
    assert not row["verdict"]["passed"] and row["graded_response"] == ""


@pytest.mark.slow
def test_a_bad_task_name_or_missing_local_file_fails_before_any_model_loads(tmp_path):
    result = run_eval("--tasks", "math", "--model", "no/such-model")
    assert result.returncode != 0 and "--tasks 'math': must be one or more of math500" in result.stderr
    unloadable = tmp_path / "unloadable"  # passes the model checks; loading it would fail
    unloadable.mkdir()
    (unloadable / "config.json").write_text('{"model_type": "llama"}')
    (unloadable / "model.safetensors").write_bytes(b"not weights")
    result = run_eval("--tasks", "math500", "--math500_path", str(tmp_path / "missing.jsonl"),
                      "--model", str(unloadable))
    assert result.returncode != 0 and "missing.jsonl: data file not found" in result.stderr


@pytest.mark.parametrize("start, end, kept", [("2024-07-01", "2024-09-01", {"1", "abc001_a"}),
                                              ("2024-07-02", "2024-09-01", {"abc001_a"}),
                                              ("2024-07-01", "2024-08-31", {"1"})])
def test_the_livecodebench_window_keeps_the_problems_of_its_first_and_last_days(tmp_path, start, end, kept):
    path = write_jsonl(tmp_path / "test.jsonl", livecodebench_rows())
    items = eval_general.load_livecodebench(eval_general.GeneralEvalArguments(
        livecodebench_path=str(path), livecodebench_start_date=start, livecodebench_end_date=end))
    assert {item["id"] for item in items} == kept


def test_a_think_evaluation_gets_its_own_default_folder():
    plain = eval_general.default_output_dir(eval_general.GeneralEvalArguments(model="runs/grpo-demo/"))
    think = eval_general.default_output_dir(eval_general.GeneralEvalArguments(model="runs/grpo-demo", think=True))
    assert (plain, think) == (Path("runs/general/grpo-demo"), Path("runs/general/grpo-demo-think"))
