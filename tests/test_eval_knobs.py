"""Every flag of the two evaluations reaches what it controls, as tests/test_knobs.py holds the trainers' dialogue and
simulator settings to: each flag is set to a value other than its default in a test that sees it act, named in
SENTIENT_FLAGS or GENERAL_FLAGS. A flag added to EvalArguments or GeneralEvalArguments without an entry fails
test_every_evaluation_flag_is_seen_acting_by_a_named_test. The two whole runs below play against a recording fake
endpoint (fast: the rule user, no weights) with most flags away from their defaults at once, each with its own value."""
import asyncio
import importlib
import json
from dataclasses import fields

import pytest
from fake_openai import FakeOpenAIServer
from test_seams import eval_arguments, flags, general_arguments

import eval_general
import eval_sentient
import simulator

TESTED = "<think>Let me see.</think>That sounds heavy, and I am listening."


@pytest.fixture
def sentient_run(tmp_path, monkeypatch):
    """A benchmark run against an endpoint: 2 of 3 scenarios (--limit), each flag its own value."""
    monkeypatch.setenv("MODEL_KEY", "model-secret")
    lines = simulator.DEFAULT_BENCHMARK_PROFILES.read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "three.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    with FakeOpenAIServer(models=("served",), respond=lambda body: {"hang": 0.02, "text": TESTED}) as server:
        args, simulator_args = eval_arguments(flags(
            model="served", model_base_url=server.base_url, model_api_key_env="MODEL_KEY", model_timeout=5,
            model_max_retries=1, profiles=tmp_path / "three.jsonl", limit=2, output=tmp_path / "out.jsonl",
            max_think_tokens=7, max_reply_tokens=9, temperature=0.3, top_p=0.6, seed=4, batch_size=1,
            bootstrap_samples=50) + ["--think"])
        summary = eval_sentient.evaluate(args, simulator_args)
    rows = eval_sentient.read_results(tmp_path / "out.jsonl")
    return {"server": server, "summary": summary, "rows": rows, "ids": [json.loads(line)["id"] for line in lines]}


def test_a_benchmark_run_against_an_endpoint_takes_every_flag_it_was_given(sentient_run):
    server, rows, summary = sentient_run["server"], sentient_run["rows"], sentient_run["summary"]
    assert sorted(row["id"] for row in rows) == sentient_run["ids"][:2]  # --profiles, --limit
    assert summary["results"].endswith("out.jsonl")  # --output
    assert {(b["model"], b["temperature"], b["top_p"], b["max_tokens"]) for b in server.requests} == {
        ("served", 0.3, 0.6, 16)}  # --model, --temperature, --top_p, the think and reply budgets (--think)
    assert {b["seed"] for b in server.requests} == {4, 5}  # --seed, plus each scenario's place
    assert set(server.keys) == {"Bearer model-secret"}  # --model_api_key_env
    assert server.most_at_once == 1  # --batch_size: scenarios at once against an endpoint
    points = [row["emo_point"] for row in rows]
    assert summary["score_ci95"] == list(eval_sentient.bootstrap_interval(points, 50))  # --bootstrap_samples
    made_by = rows[0]["made_by"]
    assert (made_by["think"], made_by["max_think_tokens"], made_by["seed"]) == (True, 7, 4)


@pytest.fixture
def general_run(tmp_path, monkeypatch):
    """A MATH-500 run against an endpoint from a local file: 3 of 4 items (--limit), each flag its own value."""
    monkeypatch.setenv("MODEL_KEY", "model-secret")
    items = [{"problem": f"What is {n} + {n}?", "answer": str(2 * n), "subject": "Algebra", "level": n % 5 + 1,
              "unique_id": f"test/{n}.json"} for n in range(4)]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    with FakeOpenAIServer(models=("served",), respond=lambda body: {"hang": 0.02, "text": "\\boxed{2}"}) as server:
        args = general_arguments(flags(
            model="served", model_base_url=server.base_url, model_api_key_env="MODEL_KEY", model_timeout=5,
            model_max_retries=1, tasks="math500", math500_path=tmp_path / "math.jsonl", limit=3,
            output_dir=tmp_path / "out", temperature=0.3, top_p=0.6, seed=4, batch_size=2, max_new_tokens=21,
            bootstrap_samples=50) + ["--think"])
        summary = eval_general.evaluate(args)
    rows = eval_general.read_result_rows(tmp_path / "out" / "math500.jsonl")
    return {"server": server, "summary": summary, "rows": rows}


def test_a_general_run_against_an_endpoint_takes_every_flag_it_was_given(general_run):
    server, rows, summary = general_run["server"], general_run["rows"], general_run["summary"]
    assert [row["id"] for row in rows] == ["test/0.json", "test/1.json", "test/2.json"]  # --math500_path, --limit
    assert summary["math500"]["items"] == 3 and summary["math500"]["accuracy"] == pytest.approx(100 / 3)
    assert {(b["model"], b["temperature"], b["top_p"], b["max_tokens"]) for b in server.requests} == {
        ("served", 0.3, 0.6, 21)}  # --max_new_tokens over the task's own budget
    assert sorted(b["seed"] for b in server.requests) == [4, 5, 6]  # batches of 2 (--batch_size) from --seed
    assert server.most_at_once <= 2
    assert set(server.keys) == {"Bearer model-secret"}
    assert all("think" in b["messages"][0]["content"].lower() for b in server.requests)  # --think's instruction
    assert rows[0]["made_by"]["max_new_tokens"] == 21 and "graded_response" in rows[0]


# Each flag: the tests (module::function) that set it away from its default and see it act.
# The named tests, short: module::function.
SENTIENT_RUN = "test_eval_knobs::test_a_benchmark_run_against_an_endpoint_takes_every_flag_it_was_given"
GENERAL_RUN = "test_eval_knobs::test_a_general_run_against_an_endpoint_takes_every_flag_it_was_given"
SAMPLES = "test_eval_knobs::test_rescore_and_compare_take_their_bootstrap_samples"
BACKENDS = "test_seams::test_an_evaluations_sampling_flags_reach_the_vllm_engine_and_transformers"
RETRIES = "test_seams::test_the_tested_model_is_tried_once_more_than_model_max_retries"
DIALOGUES = "test_seams::test_the_sentient_benchmarks_budgets_and_schedule_reach_its_dialogues"
GENERAL_REQUESTS = "test_seams::test_the_general_evaluations_requests_carry_its_sampling_flags"
BATCHES = "test_seams::test_the_general_evaluation_seeds_each_batch_by_its_first_items_place"
LIVECODEBENCH = "test_eval_general::test_livecodebench_date_window_and_release_files"
SENTIENT_FLAGS = {
    "model": [SENTIENT_RUN], "model_base_url": [SENTIENT_RUN], "model_api_key_env": [SENTIENT_RUN],
    "model_timeout": ["test_bad_input_eval::"
                      "test_a_tested_model_endpoint_that_never_answers_fails_within_its_bound_and_says_it_waits"],
    "model_max_retries": [RETRIES],
    "use_vllm": [BACKENDS, "test_eval_vllm::"
                           "test_the_sentient_command_line_passes_top_p_and_each_context_gets_its_own_completion"],
    "think": [SENTIENT_RUN, DIALOGUES], "profiles": [SENTIENT_RUN], "output": [SENTIENT_RUN], "limit": [SENTIENT_RUN],
    "max_reply_tokens": [SENTIENT_RUN, DIALOGUES], "max_think_tokens": [SENTIENT_RUN, DIALOGUES],
    "max_dialogue_tokens": [DIALOGUES], "temperature": [SENTIENT_RUN, BACKENDS], "top_p": [SENTIENT_RUN, BACKENDS],
    "seed": [SENTIENT_RUN, "test_eval_oracles::"
                           "test_a_resumed_local_benchmark_plays_every_unfinished_batch_seeded_by_its_position"],
    "batch_size": [SENTIENT_RUN, DIALOGUES], "rollout": [DIALOGUES],
    "rescore": ["test_eval_sentient::test_rescore_prints_a_leaderboard_best_first", SAMPLES],
    "bootstrap_samples": [SENTIENT_RUN, SAMPLES],
}
GENERAL_FLAGS = {
    "model": [GENERAL_RUN], "model_base_url": [GENERAL_RUN], "model_api_key_env": [GENERAL_RUN],
    "model_timeout": [GENERAL_REQUESTS], "model_max_retries": [RETRIES], "use_vllm": [BACKENDS],
    "think": [GENERAL_RUN], "tasks": [GENERAL_RUN], "output_dir": [GENERAL_RUN], "limit": [GENERAL_RUN],
    "math500_path": [GENERAL_RUN],
    "ifeval_path": ["test_bad_input_eval::"
                    "test_ifeval_rows_of_the_wrong_shape_are_refused_with_their_line_before_any_generation"],
    "livecodebench_path": [LIVECODEBENCH], "livecodebench_release": [LIVECODEBENCH],
    "livecodebench_start_date": [LIVECODEBENCH], "livecodebench_end_date": [LIVECODEBENCH],
    "temperature": [GENERAL_RUN, GENERAL_REQUESTS], "top_p": [GENERAL_RUN, BACKENDS],
    "max_new_tokens": [GENERAL_RUN, BATCHES], "batch_size": [GENERAL_RUN, BATCHES], "seed": [GENERAL_RUN, BATCHES],
    "code_memory_mb": ["test_eval_oracles::"
                       "test_check_sandbox_accepts_working_limits_and_refuses_a_known_good_program_that_fails"],
    "compare": ["test_eval_general::test_compare_command_prints_a_table_from_two_result_folders", SAMPLES],
    "bootstrap_samples": [SAMPLES],
}


@pytest.mark.parametrize("arguments, registry", [(eval_sentient.EvalArguments, SENTIENT_FLAGS),
                                                 (eval_general.GeneralEvalArguments, GENERAL_FLAGS)])
def test_every_evaluation_flag_is_seen_acting_by_a_named_test(arguments, registry):
    assert {f.name for f in fields(arguments)} == set(registry)
    for tests in registry.values():
        for test in tests:
            module, name = test.split("::")
            assert callable(getattr(importlib.import_module(module), name, None)), f"{test} does not exist"


def test_the_sentient_benchmark_against_an_endpoint_holds_batch_size_scenarios_at_once(tmp_path):
    """Two values, so that a fixed number does not pass: at most --batch_size requests in flight."""
    profiles = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES, require_first_talk=True)[:4]
    for batch_size in (2, 4):
        with FakeOpenAIServer(models=("served",), respond=lambda body: {"hang": 0.1, "text": TESTED}) as server:
            args, simulator_args = eval_arguments(flags(model="served", model_base_url=server.base_url,
                                                        batch_size=batch_size) + ["--think"])
            asyncio.run(eval_sentient.play_endpoint(args, simulator_args, None, profiles, set(),
                                                    tmp_path / f"{batch_size}.jsonl", lambda rows: None))
        assert server.most_at_once == batch_size


def test_rescore_and_compare_take_their_bootstrap_samples(tmp_path, monkeypatch, capsys):
    asked = []
    summarize, paired = eval_sentient.summarize, eval_general.paired_bootstrap
    monkeypatch.setattr(eval_sentient, "summarize", lambda rows, samples=10000: asked.append(samples) or summarize(
        rows, samples))
    monkeypatch.setattr(eval_general, "paired_bootstrap", lambda task, base, trained, samples, seed=0: asked.append(
        samples) or paired(task, base, trained, samples, seed))
    row = {"id": "s1", "emo_point": 60, "history": [{"role": "user", "content": "hi"}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    eval_sentient.main(["--rescore", str(tmp_path / "rows.jsonl"), "--bootstrap_samples", "77"])
    for name, correct in (("base", [True, False, True]), ("trained", [True, True, False])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "math500.jsonl").write_text("".join(json.dumps(
            {"id": f"q{n}", "verdict": {"correct": ok}}) + "\n" for n, ok in enumerate(correct)))
    eval_general.main(["--compare", str(tmp_path / "base"), str(tmp_path / "trained"), "--bootstrap_samples", "33"])
    assert asked == [77, 33] and "math500" in capsys.readouterr().out
