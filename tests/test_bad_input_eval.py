"""Bad input to eval_sentient.py and eval_general.py: one line saying what is wrong and how to fix it, a
non-zero exit, no traceback, no data lost, and where it can be checked before a model loads, a refusal
before it does. The scripts' main() runs in-process; a test that must not reach a model replaces the
loading functions with ones that fail the test."""
import json
import subprocess
import sys

import pytest
from conftest import REPO, profile_row, write_jsonl
from fake_openai import FakeOpenAIServer

import chat_client
import common
import guards
import eval_general
import eval_sentient
import generation
import llm_user
import rollout
import simulator


def outcome(main, argv, capsys) -> tuple[int, str]:
    """(exit status, what the user reads) of a run that exits: sys.exit("error: ...") exits 1 with its
    message, parser.error exits 2 with usage and the message on stderr."""
    with pytest.raises(SystemExit) as exit:
        main([str(arg) for arg in argv])
    code = exit.value.code
    return (1, code) if isinstance(code, str) else (code, capsys.readouterr().err)


def fail_if_called(what):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} was called: the bad input should have been refused before")
    return called


@pytest.fixture
def no_sentient_model(monkeypatch):
    """eval_sentient must not load the tested model (tokenizer or weights) nor the simulator's."""
    monkeypatch.setattr(generation, "load_tokenizer", fail_if_called("load_tokenizer"))
    monkeypatch.setattr(generation, "load_generator", fail_if_called("load_generator"))
    monkeypatch.setattr(llm_user, "LocalChat", fail_if_called("LocalChat"))


@pytest.fixture
def no_general_model(monkeypatch):
    monkeypatch.setattr(eval_general, "make_backend", fail_if_called("make_backend"))


@pytest.fixture
def offline_hub(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)


def benchmark_profiles(path, count=2, language="en"):
    intentions = list(simulator.INTENTIONS)
    rows = [profile_row(intentions[i], id=f"bench-{i}", first_talk=f"Something happened with my sister, part {i}.",
                        task=simulator.INTENTIONS[intentions[i]][language == "zh"]) for i in range(count)]
    return write_jsonl(path, rows)


def result_row(scenario_id, point=50):
    return {"id": scenario_id, "emo_point": point, "emo_state": "Emotion-B",
            "history": [{"role": "user", "content": "Hi.", "emotion-point": point}]}


# --------------------------------------------------------------------------------------------
# Help and numbers out of range: refused while parsing, usage and exit 2
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("main", [eval_sentient.main, eval_general.main], ids=["sentient", "general"])
def test_help_prints_and_exits_0(main, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0 and "--bootstrap_samples" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--limit", 0], "--limit 0: must be at least 1 (leave it out for every scenario)"),
    (["--limit", -15], "--limit -15: must be at least 1"),
    (["--batch_size", 0], "--batch_size 0: must be at least 1"),
    (["--max_reply_tokens", 0], "--max_reply_tokens 0: must be at least 1"),
    (["--max_dialogue_tokens", 0], "--max_dialogue_tokens 0: must be at least 1"),
    (["--bootstrap_samples", 0], "--bootstrap_samples 0: must be from 1 to 100000"),
    (["--bootstrap_samples", -5], "--bootstrap_samples -5: must be from 1 to 100000"),
    (["--bootstrap_samples", 10**9], "--bootstrap_samples 1000000000: must be from 1 to 100000"),  # 119 GiB
    (["--temperature", -1], "--temperature -1.0: must be 0 or more"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number"),
    (["--top_p", 0], "--top_p 0.0: must be above 0 and at most 1"),
    (["--top_p", "nan"], "--top_p nan: must be a finite number"),
    (["--seed", -1], "--seed -1: must be from 0 to 2147483647"),
    (["--seed", 2**31], "--seed 2147483648: must be from 0 to 2147483647"),  # numpy and torch would overflow
    (["--model_base_url", "localhost:8000/v1"], "--model_base_url 'localhost:8000/v1': must be an http(s) URL"),
])
def test_sentient_numbers_out_of_range_are_refused_while_parsing(argv, message, capsys):
    status, error = outcome(eval_sentient.main, argv, capsys)
    assert status == 2 and message in error


@pytest.mark.parametrize("argv, message", [
    (["--limit", -2], "--limit -2: must be at least 1 (leave it out for every item)"),
    (["--limit", 0], "--limit 0: must be at least 1"),
    (["--max_new_tokens", 0], "--max_new_tokens 0: must be at least 1 (leave it out for each task's own budget)"),
    (["--code_memory_mb", 0], "--code_memory_mb 0: must be from 256 to 1048576 (MB: 1 TB)"),
    (["--code_memory_mb", 10**20], "must be from 256 to 1048576 (MB: 1 TB)"),  # setrlimit would overflow
    (["--compare", "A", "B", "--bootstrap_samples", 0], "--bootstrap_samples 0: must be from 1 to 100000"),
    (["--batch_size", 0], "--batch_size 0: must be at least 1"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number"),
    (["--top_p", 1.5], "--top_p 1.5: must be above 0 and at most 1"),
    (["--seed", 10**20], "--seed 100000000000000000000: must be from 0 to 2147483647"),
    (["--model_base_url", "http://[::1"], "--model_base_url 'http://[::1': must be an http(s) URL"),
])
def test_general_numbers_out_of_range_are_refused_while_parsing(argv, message, capsys):
    status, error = outcome(eval_general.main, argv, capsys)
    assert status == 2 and message in error


@pytest.mark.slow
def test_a_refusal_while_parsing_is_usage_and_one_line_not_a_traceback():
    finished = subprocess.run([sys.executable, "eval_general.py", "--compare", "A", "B", "--bootstrap_samples", "0"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.splitlines()[-1] == "eval_general.py: error: --bootstrap_samples 0: must be from 1 to 100000"


# --------------------------------------------------------------------------------------------
# Impossible combinations
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--tasks", ""], "--tasks '': must be one or more of math500, livecodebench, humaneval, ifeval"),
    (["--tasks", ","], "--tasks ',': must be one or more of"),
    (["--tasks", "humaneval,math"], "--tasks 'humaneval,math': must be one or more of"),
    (["--compare", "A"], "--compare ['A']: must be two paths: BASE TRAINED"),
    (["--livecodebench_release", "release_v9"], "--livecodebench_release 'release_v9': must be one of release_v1"),
    (["--livecodebench_start_date", "2024-1-5"], "--livecodebench_start_date '2024-1-5': must be a date, YYYY-MM-DD"),
    (["--livecodebench_start_date", "2024-02-01", "--livecodebench_end_date", "2024-01-01"],
     "--livecodebench_start_date 2024-02-01 is after --livecodebench_end_date 2024-01-01"),
])
def test_general_options_that_select_nothing_or_cannot_hold_are_refused_while_parsing(argv, message, capsys):
    status, error = outcome(eval_general.main, argv, capsys)
    assert status == 2 and message in error


@pytest.mark.parametrize("language_flag", [[], ["--language", "zh"]], ids=["chinese-profiles", "language-zh"])
def test_chinese_dialogues_with_the_rule_backend_are_refused_before_any_model_loads(language_flag, no_sentient_model,
                                                                                    tmp_path, capsys):
    language = "en" if language_flag else "zh"
    profiles = benchmark_profiles(tmp_path / "bench.jsonl", language=language)
    status, error = outcome(eval_sentient.main, ["--profiles", profiles, "--output", tmp_path / "new" / "r.jsonl",
                                                 *language_flag], capsys)
    why = "--language zh" if language_flag else "profile bench-0 is Chinese"
    assert status == 1 and error.startswith(f"error: {why}: the rule backend has English cues only")
    assert not (tmp_path / "new").exists()


def test_a_dialogue_budget_too_small_for_the_prompt_is_refused_before_the_weights_load(packaged_model, monkeypatch,
                                                                                       tmp_path, capsys):
    monkeypatch.setattr(generation, "load_generator", fail_if_called("load_generator"))
    profiles = benchmark_profiles(tmp_path / "bench.jsonl")
    status, error = outcome(eval_sentient.main, ["--profiles", profiles, "--output", tmp_path / "r.jsonl",
                                                 "--max_dialogue_tokens", 20], capsys)
    assert status == 1 and error.startswith("error: --max_dialogue_tokens 20: profile bench-0 needs ")
    assert error.endswith("raise it to at least " + error.split(" needs ")[1].split()[0])


def test_sandbox_limits_a_reference_solution_cannot_run_under_are_refused_before_the_model_loads(
        no_general_model, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(eval_general, "MIN_CODE_MEMORY_MB", 1)  # past the parse-time floor: the probe must catch it
    status, error = outcome(eval_general.main, ["--tasks", "humaneval", "--limit", 1, "--code_memory_mb", 1,
                                                "--output_dir", tmp_path / "out"], capsys)
    assert status == 1 and error == ("error: --code_memory_mb 1: a known-good humaneval program fails in the sandbox "
                                     "(MemoryError); raise --code_memory_mb (default 4096)")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# Unreadable and empty files: named with their line, before any model loads
# --------------------------------------------------------------------------------------------

LATIN1 = '{"id": "Jos\xe9"}\n'.encode("latin-1")
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"


def test_a_latin1_result_file_to_rescore_is_named_with_its_line(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_bytes(json.dumps(result_row("a")).encode() + b"\n" + LATIN1)
    status, error = outcome(eval_sentient.main, ["--rescore", path], capsys)
    assert status == 1 and error == (f"error: {path}:2: not UTF-8 text (byte 0xe9); is it the result file? "
                                     "Save it as UTF-8")


def test_a_binary_profile_file_is_named_before_any_model_loads(no_sentient_model, tmp_path, capsys):
    path = tmp_path / "profiles.png"
    path.write_bytes(BINARY)
    status, error = outcome(eval_sentient.main, ["--profiles", path, "--output", tmp_path / "r.jsonl"], capsys)
    assert status == 1 and error.startswith(f"error: {path}:1: not UTF-8 text (byte 0x89); is it the profile file?")


def test_a_binary_result_file_to_compare_is_named_with_its_line(tmp_path, capsys):
    base, trained = tmp_path / "base" / "math500.jsonl", tmp_path / "trained" / "math500.jsonl"
    base.parent.mkdir(), trained.parent.mkdir()
    write_jsonl(base, [{"id": "q0", "verdict": {"correct": True}}])
    trained.write_bytes(BINARY)
    status, error = outcome(eval_general.main, ["--compare", base, trained], capsys)
    assert status == 1 and error.startswith(f"error: {trained}:1: not UTF-8 text (byte 0x89); is it the result file?")


@pytest.mark.parametrize("content, message", [(LATIN1, ":1: not UTF-8 text (byte 0xe9); is it the data file?"),
                                              (b"", ": no items in file"), (b"\n\n", ": no items in file")],
                         ids=["latin1", "empty", "blank-lines"])
def test_a_data_file_that_is_unreadable_or_empty_is_refused_before_the_model_loads_leaving_no_folder(
        content, message, no_general_model, tmp_path, capsys):
    data = tmp_path / "math500.jsonl"
    data.write_bytes(content)
    out = tmp_path / "runs" / "out"
    status, error = outcome(eval_general.main, ["--tasks", "math500", "--math500_path", data, "--output_dir", out],
                            capsys)
    assert status == 1 and error.startswith(f"error: {data}{message}")
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------
# Paths: models and output folders
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model, message", [
    ("./nope", "--model ./nope: no such folder (and not a hub id, which reads owner/name)"),
    ("runs/nope", "--model runs/nope: no such folder, and not in the hub cache"),
])
def test_a_missing_sentient_model_is_refused_before_the_simulator_s_model_loads(model, message, offline_hub,
                                                                                no_sentient_model, tmp_path, capsys):
    status, error = outcome(eval_sentient.main, [
        "--model", model, "--profiles", benchmark_profiles(tmp_path / "bench.jsonl"), "--output",
        tmp_path / "new" / "r.jsonl", "--backend", "local", "--simulator_model", common.PACKAGED_MODEL], capsys)
    assert status == 1 and error.startswith(f"error: {message}")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("model, message", [
    ("./nope", "--model ./nope: no such folder (and not a hub id, which reads owner/name)"),
    ("runs/nope", "--model runs/nope: no such folder, and not in the hub cache"),
])
def test_a_missing_general_model_is_refused_before_the_data_loads(model, message, offline_hub, no_general_model,
                                                                  monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(eval_general.LOADERS, "humaneval", fail_if_called("the data loader"))
    status, error = outcome(eval_general.main, ["--model", model, "--tasks", "humaneval", "--output_dir",
                                                tmp_path / "out"], capsys)
    assert status == 1 and error.startswith(f"error: {message}")
    assert not (tmp_path / "out").exists()


def test_output_paths_under_a_file_or_naming_a_folder_are_refused_creating_nothing(no_sentient_model,
                                                                                   no_general_model, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    profiles = benchmark_profiles(tmp_path / "bench.jsonl")
    status, error = outcome(eval_sentient.main, ["--profiles", profiles, "--output", blocker / "r.jsonl"], capsys)
    assert status == 1 and error.startswith("error: --output ") and f"{blocker} is a file, not a folder" in error
    status, error = outcome(eval_sentient.main, ["--profiles", profiles, "--output", tmp_path], capsys)
    assert status == 1 and error.startswith(f"error: --output {tmp_path}: a folder")
    status, error = outcome(eval_general.main, ["--tasks", "humaneval", "--output_dir", blocker / "out"], capsys)
    assert status == 1 and error == f"error: --output_dir {blocker / 'out'}: {blocker} is a file, not a folder"


# --------------------------------------------------------------------------------------------
# Resuming onto a result file whose last line has no newline (a run killed while writing it)
# --------------------------------------------------------------------------------------------

CUT = '{"id": "bench-1", "emo_po'


@pytest.mark.slow
@pytest.mark.parametrize("last_line", ["whole", "cut"])
def test_a_sentient_run_resumes_onto_a_last_line_without_newline_and_keeps_every_row(last_line, tmp_path, capsys):
    profiles = benchmark_profiles(tmp_path / "bench.jsonl", count=3)
    output = tmp_path / "r.jsonl"
    made_by = eval_sentient.run_record(eval_sentient.EvalArguments(model="tested", model_base_url="http://elsewhere"),
                                       simulator.SimulatorArguments())  # an earlier run's, at another address
    first = json.dumps({**result_row("bench-0"), "made_by": made_by})
    output.write_text(first if last_line == "whole" else f"{first}\n{CUT}", encoding="utf-8")
    with FakeOpenAIServer(models=["tested"], default="That sounds hard. Tell me more about Dana.") as model:
        eval_sentient.main(["--model", "tested", "--model_base_url", model.base_url, "--profiles", str(profiles),
                            "--output", str(output), "--bootstrap_samples", "10"])
    lines = output.read_text(encoding="utf-8").splitlines()
    assert lines[0] == first and sorted(json.loads(line)["id"] for line in lines) == ["bench-0", "bench-1", "bench-2"]
    if last_line == "cut":
        assert "r.jsonl:2: the last line is cut short" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("last_line", ["whole", "cut"])
def test_a_general_run_resumes_onto_a_last_line_without_newline_and_keeps_every_row(last_line, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    made_by = eval_general.run_record("humaneval", eval_general.GeneralEvalArguments(
        model="tested", model_base_url="http://elsewhere", tasks="humaneval", limit=2))
    first = json.dumps({"id": "HumanEval/0", "prompt": "p", "output": "o", "verdict": {"passed": False, "result": "x"},
                        "made_by": made_by})
    (out / "humaneval.jsonl").write_text(first if last_line == "whole" else f'{first}\n{{"id": "HumanEval/1", "ver')
    with FakeOpenAIServer(models=["tested"], default="```python\ndef f():\n    pass\n```") as model:
        eval_general.main(["--model", "tested", "--model_base_url", model.base_url, "--tasks", "humaneval",
                           "--limit", "2", "--output_dir", str(out)])
    assert len(model.requests) == 1  # only the unfinished item
    lines = (out / "humaneval.jsonl").read_text().splitlines()
    assert lines[0] == first and [json.loads(line)["id"] for line in lines] == ["HumanEval/0", "HumanEval/1"]


@pytest.mark.parametrize("name, content, message", [
    ("humaneval.jsonl", '{"id": "HumanEval/0", "verdict": {}}\n{oops\n{"id": "HumanEval/1", "verdict": {}}\n',
     "humaneval.jsonl:2: not valid JSON"),
    ("summary.json", '{"humaneval": {"items": 1,', "summary.json:1: not valid JSON"),
], ids=["result-file", "summary"])
def test_a_broken_file_in_the_output_folder_is_refused_before_the_model_loads(name, content, message, no_general_model,
                                                                              tmp_path, capsys):
    (tmp_path / name).write_text(content)
    status, error = outcome(eval_general.main, ["--tasks", "humaneval", "--output_dir", tmp_path], capsys)
    assert status == 1 and error.startswith(f"error: {tmp_path / name}") and message in error


@pytest.mark.parametrize("summary, message", [
    ({"humaneval": {"pass@1": 87.5}, "model": "gpt-4"}, "summary.json: not a summary this script wrote"),
    ({"humaneval": {"pass@1": 87.5}, "model": "gpt-4", "think": False, "made_by": {"model": "gpt-4", "served": True}},
     "summary.json: the figures of gpt-4 (think=False), not of tested (think=True); give another --output_dir"),
], ids=["foreign", "another-model"])
def test_a_general_summary_of_someone_else_or_another_model_is_refused_and_kept(summary, message, no_general_model,
                                                                                tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    status, error = outcome(eval_general.main, ["--model", "tested", "--model_base_url", "http://127.0.0.1:9/v1",
                                                "--think", "--tasks", "humaneval", "--output_dir", tmp_path], capsys)
    assert status == 1 and message in error
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_an_output_name_the_filesystem_refuses_is_one_line(no_sentient_model, no_general_model, tmp_path, capsys):
    """An OSError (a name too long here; a full disk or a removed folder mid-run) is said in one line."""
    long_name = tmp_path / ("a" * 300 + ".jsonl")
    status, error = outcome(eval_sentient.main, ["--limit", "1", "--output", long_name], capsys)
    assert status == 1 and error.startswith("error: [Errno 36] File name too long")
    status, error = outcome(eval_general.main, ["--tasks", "humaneval", "--output_dir", tmp_path / ("b" * 300)], capsys)
    assert status == 1 and error.startswith("error: [Errno 36] File name too long")


def test_a_training_runs_folder_is_refused_as_the_general_evaluations_output(no_general_model, tmp_path, capsys):
    guards.mark_run_folder(tmp_path / "run", "train_ppo.py", "m")
    status, error = outcome(eval_general.main, ["--tasks", "humaneval", "--output_dir", tmp_path / "run"], capsys)
    assert status == 1 and error == (f"error: --output_dir {tmp_path / 'run'}: a training run's folder; give a folder "
                                     "of its own")
    assert [path.name for path in (tmp_path / "run").iterdir()] == [guards.RUN_MARKER]


def test_a_sentient_summary_file_this_script_did_not_write_is_refused_before_any_dialogue(no_sentient_model,
                                                                                          tmp_path, capsys):
    profiles = benchmark_profiles(tmp_path / "bench.jsonl")
    (tmp_path / "r.summary.json").write_text('{"score": 61.7}')
    status, error = outcome(eval_sentient.main, ["--profiles", profiles, "--output", tmp_path / "r.jsonl"], capsys)
    assert status == 1 and error == (f"error: --output {tmp_path / 'r.summary.json'}: a file this script did not "
                                     "write; give another path, or delete it")
    assert (tmp_path / "r.summary.json").read_text() == '{"score": 61.7}' and not (tmp_path / "r.jsonl").exists()


# --------------------------------------------------------------------------------------------
# Endpoints: the simulator's is checked before the tested model's weights load
# --------------------------------------------------------------------------------------------

def test_an_unreachable_simulator_endpoint_is_refused_before_the_tested_model_loads(packaged_model, monkeypatch,
                                                                                    tmp_path, capsys):
    monkeypatch.setattr(generation, "load_generator", fail_if_called("load_generator"))
    status, error = outcome(eval_sentient.main, [
        "--profiles", benchmark_profiles(tmp_path / "bench.jsonl"), "--output", tmp_path / "new" / "r.jsonl",
        "--backend", "llm", "--base_url", "http://127.0.0.1:9/v1", "--simulator_model", "x",
        "--simulator_max_retries", 0], capsys)
    assert status == 1 and error.startswith("error: cannot reach the simulator endpoint http://127.0.0.1:9/v1")
    assert not (tmp_path / "new").exists()


def test_a_sentient_output_another_run_is_writing_is_refused_before_any_model_loads(no_sentient_model, tmp_path,
                                                                                  capsys):
    """Two runs at once on one --output would each play the scenarios missing from it: every one twice."""
    from conftest import held_by_another_process

    output = tmp_path / "r.jsonl"
    output.write_text("")  # the other run has not finished a scenario yet
    with held_by_another_process(output):
        status, error = outcome(eval_sentient.main, ["--profiles", benchmark_profiles(tmp_path / "p.jsonl"),
                                                     "--output", output], capsys)
    assert (status, error) == (1, f"error: --output {output}: another run is writing there now; let it finish, or "
                                  "give another path")
    assert output.read_text() == ""


def test_a_general_output_folder_another_run_is_writing_is_refused_before_any_model_loads(no_general_model, tmp_path,
                                                                                        capsys):
    from conftest import held_by_another_process

    row = {"problem": "p", "solution": "s", "answer": "1", "subject": "Algebra", "level": 2, "unique_id": "a"}
    data, out = write_jsonl(tmp_path / "math500.jsonl", [row]), tmp_path / "out"
    out.mkdir()
    with held_by_another_process(out):
        status, error = outcome(eval_general.main, ["--tasks", "math500", "--math500_path", data, "--output_dir",
                                                    out], capsys)
    assert (status, error) == (1, f"error: --output_dir {out}: another run is writing there now; let it finish, or "
                                  "give another path")
    assert list(out.iterdir()) == []


def test_a_tested_model_folder_transformers_cannot_load_is_refused_in_one_line(no_sentient_model, tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text("{}")
    status, error = outcome(eval_sentient.main, ["--model", folder, "--profiles",
                                                 benchmark_profiles(tmp_path / "p.jsonl"), "--output",
                                                 tmp_path / "r.jsonl"], capsys)
    assert (status, error) == (1, f"error: --model {folder}: its config.json names no model_type, so transformers "
                                  "cannot tell which model it is; give a folder saved by save_pretrained")
    assert not (tmp_path / "r.jsonl").exists()


def test_two_outputs_sharing_one_summary_file_are_refused_keeping_the_first_summary(no_sentient_model, tmp_path,
                                                                                  capsys):
    """results.jsonl and results both have results.summary.json: the second run would replace the first's."""
    summary = tmp_path / "col.summary.json"
    summary.write_text(json.dumps({"results": str(tmp_path / "col.jsonl"), "made_by": {"model": "m"}, "n": 1}))
    before = summary.read_text()
    status, error = outcome(eval_sentient.main, ["--profiles", benchmark_profiles(tmp_path / "p.jsonl"),
                                                 "--output", tmp_path / "col"], capsys)
    assert (status, error) == (1, f"error: --output {tmp_path / 'col'}: its summary file, {summary}, is the summary "
                                  f"of {tmp_path / 'col.jsonl'}; give an --output of another name")
    assert summary.read_text() == before


def test_keeping_an_empty_user_message_is_for_the_released_prompts_only(capsys):
    status, error = outcome(eval_sentient.main, ["--empty_user_message", "keep"], capsys)
    assert status == 2 and "--empty_user_message keep: our prompts ask again for an empty message" in error


# --------------------------------------------------------------------------------------------
# Waits: bounded by the user's settings, and said within seconds
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--model_timeout", "1e300"), ("--model_timeout", "0"),
                                         ("--model_max_retries", "1000000"), ("--simulator_timeout", "1e300"),
                                         ("--simulator_parse_attempts", "1000000"), ("--simulator_max_retries", "50")])
def test_waits_past_any_use_are_refused_at_start_up(flag, value, tmp_path, capsys, no_sentient_model):
    code, said = outcome(eval_sentient.main, [flag, value, "--output", tmp_path / "r.jsonl"], capsys)
    assert code == 2 and f"error: {flag} " in said and ("at most 3600" in said or "to 20" in said), said


def test_a_tested_model_endpoint_that_never_answers_fails_within_its_bound_and_says_it_waits(tmp_path, capsys,
                                                                                            monkeypatch):
    """--model_timeout and --model_max_retries bound the wait (before: 120 s of silence a try, up to 8 minutes);
    a call unanswered for a few seconds is said while it waits."""
    import time

    monkeypatch.setattr(chat_client, "WAIT_NOTICE_AFTER", 0.3)
    profiles = benchmark_profiles(tmp_path / "bench.jsonl", count=1)
    with FakeOpenAIServer(models=["tested"], default={"hang": 30}) as model:
        started = time.monotonic()
        code, said = outcome(eval_sentient.main, ["--model", "tested", "--model_base_url", model.base_url,
                                                  "--profiles", profiles, "--output", tmp_path / "r.jsonl",
                                                  "--model_timeout", "1", "--model_max_retries", "1"], capsys)
        took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 1 and "tested-model endpoint" in said and took < 10, (said, took)
    assert "waiting for the tested-model endpoint" in err and "given up after 1 s, and retried 1 times" in err


@pytest.mark.parametrize("main, flag, said", [
    (eval_sentient.main, "--modle", "did you mean --model for --modle?"),
    (eval_general.main, "--limt", "did you mean --limit for --limt?"),
    (eval_sentient.main, "--no_such_flag", "not used by the HfArgumentParser: ['--no_such_flag', '1']"),
])
def test_an_evaluations_unknown_flag_is_usage_and_one_line_not_a_traceback(main, flag, said, capsys):
    code, err = outcome(main, [flag, "1"], capsys)
    assert code == 2 and said in err and "Traceback" not in err


@pytest.mark.parametrize("rows, said", [
    ([{"problem": "1+1", "answer": "2", "subject": "a", "level": 1, "unique_id": "x"}] * 2,
     "math500: two items share the id 'x'"),
])
def test_math500_items_sharing_an_id_are_refused_when_read(rows, said, tmp_path, capsys):
    """The resumed run took the second of two rows sharing an id as done once the first was."""
    data = write_jsonl(tmp_path / "math.jsonl", rows)
    code, err = outcome(eval_general.main, ["--tasks", "math500", "--math500_path", data, "--output_dir",
                                            tmp_path / "out"], capsys)
    assert code == 1 and said in err


@pytest.mark.parametrize("change, said", [
    ({"kwargs": [{}]}, "'kwargs' must be a list of objects, one for each of 'instruction_id_list'"),
    ({"instruction_id_list": "punctuation:no_comma"}, "'instruction_id_list' must be a list of instruction names"),
    ({"kwargs": ["x", "y"]}, "'kwargs' must be a list of objects"),
    ({"prompt": 3}, "'prompt' must be text"),
])
def test_ifeval_rows_of_the_wrong_shape_are_refused_with_their_line_before_any_generation(change, said, tmp_path,
                                                                                          capsys, monkeypatch):
    monkeypatch.setattr(eval_general, "make_backend", fail_if_called("make_backend"))
    row = {"key": 1, "prompt": "Write a poem.", "instruction_id_list": ["punctuation:no_comma", "length:x"],
           "kwargs": [{}, {}]}
    data = write_jsonl(tmp_path / "ifeval.jsonl", [{**row, "key": 0}, {**row, **change}])
    code, err = outcome(eval_general.main, ["--tasks", "ifeval", "--ifeval_path", data, "--output_dir",
                                            tmp_path / "out"], capsys)
    assert code == 1 and f"ifeval.jsonl:2: {said}" in err


def test_a_task_result_file_with_two_rows_of_one_item_is_refused_when_resumed(tmp_path):
    row = {"id": "HumanEval/0", "verdict": {"passed": True}, "made_by": {}}
    path = write_jsonl(tmp_path / "humaneval.jsonl", [row, row])
    with pytest.raises(eval_general.DataError, match="holds two rows of one item"):
        eval_general.finished_items(path, [{"id": "HumanEval/0"}], {})


def test_a_resume_onto_rows_of_a_scenario_or_item_that_changed_since_is_refused(tmp_path):
    """A profile's first_talk, or a MATH-500 problem, edited between two runs: the old row was kept and scored
    as the new input's."""
    profiles = simulator.load_profiles(benchmark_profiles(tmp_path / "bench.jsonl", count=2))
    made_by = {"model": "m"}
    row = {**result_row(profiles[0].id), "made_by": made_by, "input_digest": guards.digest(profiles[0].to_row())}
    path = write_jsonl(tmp_path / "r.jsonl", [row])
    assert eval_sentient.finished_ids(path, made_by, profiles, "bench.jsonl", None) == {profiles[0].id}
    changed = benchmark_profiles(tmp_path / "bench2.jsonl", count=2)
    text = changed.read_text().replace("part 0", "part zero")
    changed.write_text(text)
    with pytest.raises(common.InputError, match="answered another version of it"):
        eval_sentient.finished_ids(path, made_by, simulator.load_profiles(changed), "bench2.jsonl", None)
    item = {"id": "test/a/1.json", "messages": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}
    general = write_jsonl(tmp_path / "math500.jsonl", [{"id": item["id"], "verdict": {}, "made_by": made_by,
                                                        "input_digest": guards.digest(item)}])
    eval_general.finished_items(general, [item], made_by)
    with pytest.raises(common.InputError, match="answered another version of it"):
        eval_general.finished_items(general, [{**item, "answer": "42"}], made_by)


def test_a_chat_completion_without_content_is_a_failed_call_not_an_empty_answer():
    import asyncio

    body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "tested", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None}}]})
    with FakeOpenAIServer(models=["tested"], default={"raw": body}) as server:
        client = chat_client.ChatClient(server.base_url, "tested", max_retries=0, role="tested-model")
        with pytest.raises(common.EndpointError, match="without content"):
            asyncio.run(client.complete([{"role": "user", "content": "hi"}]))


def test_an_openai_base_url_variable_that_is_no_url_is_named_as_the_variable(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "localhost:18103/v1")
    with pytest.raises(simulator.SimulatorError, match=r"\$OPENAI_BASE_URL 'localhost:18103/v1' .*pass --base_url"):
        rollout.make_chat(simulator.SimulatorArguments(backend="llm", simulator_model="m"))


def test_a_profiles_file_saved_with_a_byte_order_mark_reads(tmp_path):
    path = benchmark_profiles(tmp_path / "bench.jsonl", count=2)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert len(simulator.load_profiles(path)) == 2


def test_rescoring_a_training_transcript_says_what_it_is_and_which_tool_reads_it(tmp_path, capsys):
    path = write_jsonl(tmp_path / "transcripts.jsonl", [{**result_row("a"), "step": 0}])
    code, said = outcome(eval_sentient.main, ["--rescore", path], capsys)
    assert code == 1 and "a training run's transcript row" in said and "report.py" in said


def test_an_adapter_folder_without_its_weights_is_one_line_not_a_hub_traceback(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "adapter_config.json").write_text('{"base_model_name_or_path": "x"}')
    with pytest.raises(common.InputError, match="holds an adapter's config .* but not its weights"):
        guards.loadable_model(str(tmp_path / "run"))


def test_a_tilde_in_an_evaluations_output_is_the_home_folder_not_a_folder_named_tilde(tmp_path, monkeypatch, capsys,
                                                                                      no_sentient_model):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "r.jsonl").mkdir()  # refused as a folder: the message shows which path was meant
    code, said = outcome(eval_sentient.main, ["--output", "~/r.jsonl"], capsys)
    assert code == 1 and f"--output {tmp_path / 'r.jsonl'}: a folder" in said


def test_closing_a_runner_ends_the_dialogues_a_ctrl_c_left_on_its_loop(tmp_path):
    """Else each is torn down later against the closed loop: "Event loop is closed" and "Task was destroyed"."""
    import asyncio

    import rollout

    runner = rollout.DialogueRunner.__new__(rollout.DialogueRunner)  # its loop alone
    runner.loop = asyncio.new_event_loop()
    left = runner.loop.create_task(asyncio.sleep(100))
    runner.loop.run_until_complete(asyncio.sleep(0))
    runner.close()
    assert left.cancelled() and runner.loop.is_closed()
