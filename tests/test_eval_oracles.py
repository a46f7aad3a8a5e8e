"""The evaluation and reporting tools against independent oracles: numpy, lm-eval's own IFEval functions,
LiveCodeBench's code extraction rule, and plain loops written from each figure's definition.

Inputs are chosen so that plausible wrong versions give different numbers: thresholds with different counts
on each side, groups and prompts of different sizes (the denominator shows), strict and loose verdicts that
differ, several boxed answers, runs whose length is not a multiple of five.
"""
import asyncio
import json
import math
import re
import types
from html.parser import HTMLParser

import numpy as np
import pytest
from conftest import profile_row, write_jsonl
from test_rollout_properties import IM_END, byte_tokenizer  # noqa: F401 (a fixture)
from hypothesis import given
from hypothesis import strategies as st

import common
import guards
import eval_general
import eval_sentient
import plot_training
import report
import simulator
import talk

# --------------------------------------------------------------------------------------------
# eval_sentient.py: the bootstrap interval, the summary and the leaderboard
# --------------------------------------------------------------------------------------------


def oracle_bootstrap(values, samples, seed):
    """Percentile bootstrap written as a loop: each resample draws len(values) indices one at a time from a
    generator seeded like the product's, its mean is taken, and numpy's percentile reads the 2.5th and 97.5th."""
    rng = np.random.default_rng(seed)
    means = []
    for _ in range(samples):
        picked = [values[int(rng.integers(0, len(values)))] for _ in range(len(values))]
        means.append(sum(picked) / len(picked))
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def test_the_bootstrap_interval_is_the_percentiles_of_resampled_means():
    values = [0, 9, 35, 35, 60, 72, 100]  # whole numbers: every mean is exact, so the percentiles match exactly
    assert eval_sentient.bootstrap_interval(values, 500, seed=3) == oracle_bootstrap(values, 500, 3)


def test_the_bootstrap_interval_depends_on_its_seed_and_sample_count():
    values = [0, 9, 35, 35, 60, 72, 100]
    assert eval_sentient.bootstrap_interval(values, 500, seed=4) == oracle_bootstrap(values, 500, 4)
    assert eval_sentient.bootstrap_interval(values, 40, seed=3) == oracle_bootstrap(values, 40, 3)
    assert oracle_bootstrap(values, 500, 4) != oracle_bootstrap(values, 500, 3)  # the seeds do give other intervals


def sage_row(scenario_id, finals, task, unjudged_reply=False, **personality):
    """A result row in SAGE's layout: the opening at 40, then one judged reply per value of `finals` (the
    emotion after it); `personality` is main_cha= (ours) or character= (SAGE's), or nothing."""
    history = [{"role": "user", "content": "Opening.", "emotion-point": 40}]
    for point in finals:
        history += [{"role": "assistant", "content": "I hear you."},
                    {"role": "user", "content": "Hm.", "emotion-point": point}]
    if unjudged_reply:
        history.append({"role": "assistant", "content": "Anything else?"})
    return {"id": scenario_id, "emo_point": finals[-1], "history": history, "task": task, **personality}


MOTIVES_ZH = simulator.INTENTIONS["others_motives"][1]
PRAISE_ZH = simulator.INTENTIONS["sincere_praise"][1]
VENTING_EN = simulator.INTENTIONS["venting"][0]

# Seven scenarios: three end at 100, two below 10, and 10 and 99 sit one step inside each threshold. Judged
# replies 2, 6, 9 (+ SAGE's unjudged 10th reply), 3, 4, 1, 5. Hidden intentions in groups of 4, 2 and 1.
SCENARIOS = [
    sage_row("s1", [60, 100], MOTIVES_ZH, character="负面型"),
    sage_row("s2", [50, 60, 70, 80, 90, 100], MOTIVES_ZH, character="负面型"),
    sage_row("s3", [45, 50, 55, 60, 70, 80, 90, 95, 100], MOTIVES_ZH, unjudged_reply=True, main_cha="passive"),
    sage_row("s4", [30, 20, 9], MOTIVES_ZH, main_cha="avoidant"),
    sage_row("s5", [30, 20, 10, 0], PRAISE_ZH, character="回避型"),
    sage_row("s6", [10], PRAISE_ZH),
    sage_row("s7", [50, 60, 70, 80, 99], VENTING_EN, main_cha="stubborn"),
]


def oracle_figures(rows):
    """n, mean final emotion, successes (final >= 100) and failures (final < 10), counted in a loop."""
    finals = [row["emo_point"] for row in rows]
    return {"n": len(rows), "score": sum(finals) / len(finals), "success": len([f for f in finals if f >= 100]),
            "failure": len([f for f in finals if f < 10])}


def test_summary_score_success_and_failure_use_their_own_thresholds_and_all_scenarios():
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=50)
    assert (summary["n"], summary["success"], summary["failure"]) == (7, 3, 2)
    assert summary["score"] == pytest.approx(418 / 7)
    assert summary["success_rate"] == pytest.approx(300 / 7) and summary["failure_rate"] == pytest.approx(200 / 7)


def test_summary_mean_turns_counts_judged_replies_only():
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=50)
    assert [eval_sentient.judged_replies(row) for row in SCENARIOS] == [2, 6, 9, 3, 4, 1, 5]
    assert summary["mean_turns"] == pytest.approx(30 / 7)


def test_judged_replies_are_user_messages_after_the_opening_not_assistant_messages():
    # The unjudged 10th reply makes the assistant count (10) differ from the judged one (9).
    row = sage_row("x", [41] * 9, MOTIVES_ZH, unjudged_reply=True)
    assert sum(m["role"] == "assistant" for m in row["history"]) == 10
    assert eval_sentient.judged_replies(row) == 9
    assert eval_sentient.judged_replies(sage_row("y", [41], MOTIVES_ZH)) == 1


def test_summary_final_states_are_counted_by_their_lower_thresholds():
    # S >= 100, A >= 70, B >= 40, C >= 10, F below: 100, 100, 100, 9, 0, 10, 99.
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=50)
    assert summary["states"] == {"S": 3, "A": 1, "B": 0, "C": 1, "F": 2}


def test_summary_interval_uses_the_requested_number_of_resamples_and_seed_zero():
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=120)
    assert summary["score_ci95"] == list(oracle_bootstrap([row["emo_point"] for row in SCENARIOS], 120, 0))


def test_summary_groups_by_intention_with_their_own_sizes():
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=50)
    assert summary["by_intention"] == {"others_motives": oracle_figures(SCENARIOS[:4]),
                                       "sincere_praise": oracle_figures(SCENARIOS[4:6]),
                                       "venting": oracle_figures(SCENARIOS[6:])}
    assert summary["by_intention"]["others_motives"] == {"n": 4, "score": pytest.approx(309 / 4), "success": 3,
                                                         "failure": 1}


def test_summary_groups_by_personality_from_main_cha_or_sages_character():
    summary = eval_sentient.summarize(SCENARIOS, bootstrap_samples=50)
    assert summary["by_personality"] == {"avoidant": oracle_figures([SCENARIOS[3], SCENARIOS[4]]),
                                         "negative": oracle_figures(SCENARIOS[:2]),
                                         "passive": oracle_figures([SCENARIOS[2]]),
                                         "stubborn": oracle_figures([SCENARIOS[6]]),  # not a known type: its text
                                         "unknown": oracle_figures([SCENARIOS[5]])}


def test_group_figures_counts_successes_at_100_and_failures_below_10():
    rows = [sage_row(str(i), [final], VENTING_EN) for i, final in enumerate([100, 99.5, 10, 9.5, 0])]
    assert eval_sentient.group_figures(rows) == {"n": 5, "score": pytest.approx(219 / 5), "success": 1, "failure": 2}


def leaderboard_rows(board: str) -> list[list[str]]:
    return [line.split() for line in board.splitlines()[1:-1]]


def test_the_leaderboard_ranks_files_by_score_best_first_with_their_own_columns():
    summaries = {"runs/mid/mid.jsonl": {"n": 3, "score": 55.0, "score_ci95": [40.25, 70.5], "success": 1,
                                        "failure": 0, "mean_turns": 4.5},
                 "/abs/path/best_model.jsonl": {"n": 100, "score": 81.44, "score_ci95": [75.0, 86.0], "success": 37,
                                                "failure": 4, "mean_turns": 7.125},
                 "worst.jsonl": {"n": 2, "score": 12.5, "score_ci95": [5.0, 20.0], "success": 0, "failure": 2,
                                 "mean_turns": 2.0}}
    assert leaderboard_rows(eval_sentient.leaderboard(summaries)) == [
        ["1", "best_model.jsonl", "100", "81.4", "75.0-86.0", "37", "4", "7.12"],
        ["2", "mid.jsonl", "3", "55.0", "40.2-70.5", "1", "0", "4.50"],
        ["3", "worst.jsonl", "2", "12.5", "5.0-20.0", "0", "2", "2.00"]]


def test_the_leaderboard_of_real_summaries_follows_their_scores():
    weak = [sage_row("a", [5], VENTING_EN), sage_row("b", [30], VENTING_EN)]
    board = eval_sentient.leaderboard({"weak.jsonl": eval_sentient.summarize(weak, 50),
                                       "strong.jsonl": eval_sentient.summarize(SCENARIOS, 50)})
    assert [row[:4] for row in leaderboard_rows(board)] == [["1", "strong.jsonl", "7", "59.7"],
                                                            ["2", "weak.jsonl", "2", "17.5"]]


# --------------------------------------------------------------------------------------------
# eval_general.py: IFEval against lm-eval's own functions
# --------------------------------------------------------------------------------------------

END_PHRASE = "Is there anything else I can help with?"
# Four prompts holding 3, 1, 2 and 3 instructions; strict and loose verdicts differ in three of them.
IFEVAL_CASES = [
    ("p1", ["punctuation:no_comma", "change_case:english_lowercase", "startend:end_checker"],
     [{}, {}, {"end_phrase": END_PHRASE}],
     "Sure, here you go!\nthe weather is mild today.\nis there anything else i can help with?",
     [False, False, True], [True, True, True]),  # loose drops the first line, with its comma and capital
    ("p2", ["keywords:existence"], [{"keywords": ["mild"]}], "The weather is mild.", [True], [True]),
    ("p3", ["length_constraints:number_words", "detectable_format:number_highlighted_sections"],
     [{"num_words": 5, "relation": "less than"}, {"num_highlights": 2}],
     "Here is my short answer for you:\n*one* and *two*", [False, True], [True, True]),
    ("p4", ["detectable_format:title", "punctuation:no_comma", "change_case:english_lowercase"], [{}, {}, {}],
     "Sure, fine.\nno title here", [False, False, False], [False, True, True]),
]


def ifeval_doc(key, instructions, kwargs):
    return {"key": key, "prompt": "Answer the question.", "instruction_id_list": instructions, "kwargs": kwargs}


@pytest.fixture(scope="module")
def lm_eval_ifeval():
    """lm-eval's IFEval utils module, imported once the offline punkt data is in place (eval_general writes it)."""
    eval_general.ifeval_checkers()
    from lm_eval.tasks.ifeval import utils

    return utils


def lm_eval_verdicts(utils, doc, response):
    example = utils.InputExample(key=doc["key"], instruction_id_list=doc["instruction_id_list"], prompt=doc["prompt"],
                                 kwargs=doc["kwargs"])
    return (utils.test_instruction_following_strict(example, response),
            utils.test_instruction_following_loose(example, response))


@pytest.mark.parametrize("key, instructions, kwargs, response, strict, loose", IFEVAL_CASES,
                         ids=[case[0] for case in IFEVAL_CASES])
def test_ifeval_verdicts_are_lm_evals_strict_and_loose_ones(lm_eval_ifeval, key, instructions, kwargs, response,
                                                           strict, loose):
    doc = ifeval_doc(key, instructions, kwargs)
    verdict = eval_general.grade_ifeval({"doc": doc}, response)
    official_strict, official_loose = lm_eval_verdicts(lm_eval_ifeval, doc, response)
    assert verdict == {"prompt_level_strict_acc": official_strict.follow_all_instructions,
                       "inst_level_strict_acc": official_strict.follow_instruction_list,
                       "prompt_level_loose_acc": official_loose.follow_all_instructions,
                       "inst_level_loose_acc": official_loose.follow_instruction_list}
    assert (verdict["inst_level_strict_acc"], verdict["inst_level_loose_acc"]) == (strict, loose)


def ifeval_rows():
    return [{"id": key, "verdict": eval_general.grade_ifeval({"doc": ifeval_doc(key, instructions, kwargs)}, response)}
            for key, instructions, kwargs, response, _, _ in IFEVAL_CASES]


def test_ifeval_scores_are_lm_evals_prompt_level_means_and_instruction_level_pooled_ratios(lm_eval_ifeval):
    strict, loose = zip(*(lm_eval_verdicts(lm_eval_ifeval, ifeval_doc(key, instructions, kwargs), response)
                          for key, instructions, kwargs, response, _, _ in IFEVAL_CASES))
    summary = eval_general.summarize("ifeval", ifeval_rows())
    assert summary == {
        "items": 4,
        "prompt_strict": pytest.approx(100 * np.mean([out.follow_all_instructions for out in strict])),
        "instruction_strict": pytest.approx(100 * lm_eval_ifeval.agg_inst_level_acc(
            [out.follow_instruction_list for out in strict])),
        "prompt_loose": pytest.approx(100 * np.mean([out.follow_all_instructions for out in loose])),
        "instruction_loose": pytest.approx(100 * lm_eval_ifeval.agg_inst_level_acc(
            [out.follow_instruction_list for out in loose]))}
    # 1 of 4 and 3 of 4 prompts; 3 of 9 and 8 of 9 instructions (the mean of per-prompt rates would be 45.8 and 91.7).
    assert [round(summary[name], 1) for name in ("prompt_strict", "instruction_strict", "prompt_loose",
                                                 "instruction_loose")] == [25.0, 33.3, 75.0, 88.9]


def test_an_ifeval_response_is_graded_whole_not_by_its_first_character():
    # "S" alone has no comma: a grader handed the string where lm-eval expects a list of responses reads "S".
    verdict = eval_general.grade_ifeval({"doc": ifeval_doc(1, ["punctuation:no_comma"], [{}])}, "Sure, a comma.")
    assert verdict["inst_level_strict_acc"] == [False] and verdict["inst_level_loose_acc"] == [False]


def oracle_paired_difference(base_lists, trained_lists, samples, seed):
    """Instruction-level (pooled) trained - base in points, and its 95% percentile interval, resampling the
    paired items one index at a time."""
    def pooled(lists):
        return 100 * sum(sum(flags) for flags in lists) / sum(len(flags) for flags in lists)

    rng = np.random.default_rng(seed)
    differences = []
    for _ in range(samples):
        picks = [int(rng.integers(0, len(base_lists))) for _ in range(len(base_lists))]
        differences.append(pooled([trained_lists[i] for i in picks]) - pooled([base_lists[i] for i in picks]))
    return pooled(trained_lists) - pooled(base_lists), np.percentile(differences, [2.5, 97.5])


def test_the_paired_bootstrap_resamples_items_and_pools_their_instructions():
    base = ifeval_rows()  # ids p1..p4, instructions 3, 1, 2, 3
    trained_flags = {"p1": [True, True, False], "p2": [False], "p3": [True, True], "p4": [True, False, False]}
    trained = [{"id": key, "verdict": {"prompt_level_strict_acc": all(flags), "inst_level_strict_acc": flags,
                                       "prompt_level_loose_acc": all(flags), "inst_level_loose_acc": flags}}
               for key, flags in reversed(trained_flags.items())]  # another order: paired by id
    table = eval_general.paired_bootstrap("ifeval", base, trained, samples=300, seed=2)
    base_flags = [row["verdict"]["inst_level_strict_acc"] for row in base]
    difference, interval = oracle_paired_difference(base_flags, list(trained_flags.values()), 300, 2)
    row = table["instruction_strict"]
    assert (row["items"], row["base"], row["trained"]) == (4, pytest.approx(300 / 9), pytest.approx(500 / 9))
    assert row["difference"] == pytest.approx(difference) and difference == pytest.approx(200 / 9)
    assert row["interval"] == pytest.approx(tuple(interval), abs=1e-9)
    assert row["significant_drop"] is False


def test_the_paired_bootstrap_flags_a_drop_only_when_its_whole_interval_is_below_zero():
    base = [{"id": f"q{i:02d}", "verdict": {"correct": True}} for i in range(12)]
    dropped = [{"id": f"q{i:02d}", "verdict": {"correct": i >= 6}} for i in range(12)]
    down = eval_general.paired_bootstrap("math500", base, dropped, samples=200)["accuracy"]
    up = eval_general.paired_bootstrap("math500", dropped, base, samples=200)["accuracy"]
    assert (down["base"], down["trained"], down["difference"]) == (100.0, 50.0, -50.0)
    assert down["significant_drop"] is True and up["significant_drop"] is False
    assert up["interval"] == pytest.approx((-down["interval"][1], -down["interval"][0]))  # the same draws, mirrored


def test_livecodebench_scores_break_down_by_difficulty_over_groups_of_different_sizes():
    rows = [{"id": str(i), "difficulty": difficulty, "verdict": {"passed": passed}}
            for i, (difficulty, passed) in enumerate([("easy", True), ("easy", True), ("easy", False),
                                                      ("hard", False), ("medium", True)])]
    assert eval_general.summarize("livecodebench", rows) == {
        "items": 5, "pass@1": 60.0,
        "by_difficulty": {"easy": {"items": 3, "pass@1": pytest.approx(200 / 3)}, "hard": {"items": 1, "pass@1": 0.0},
                          "medium": {"items": 1, "pass@1": 100.0}}}


# --------------------------------------------------------------------------------------------
# eval_general.py: MATH-500 answers
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, response, correct, extracted", [
    ("5", "I guessed \\boxed{3}. Checking again gives \\boxed{5}.", True, "5"),  # a revised answer: the last counts
    ("3", "I guessed \\boxed{3}. Checking again gives \\boxed{5}.", False, "5"),
    ("3,5", "The roots are \\boxed{3} and \\boxed{5}", True, "3,5"),  # answers listed together are one answer
    ("5", "The roots are \\boxed{3} and \\boxed{5}", False, "3,5"),
    ("5", "\\boxed{5}. The final answer is $7$", True, "5"),  # a boxed answer before any other final-answer form
    ("12", "Adding them gives 12", True, "12"),  # no LaTeX at all: a plain expression is read
    ("\\frac{1}{2}", "So $p = \\boxed{\\frac{1}{2}}$.", True, "\\frac{1}{2}"),  # the answer as written, not 1/2
    ("x<2", "\\boxed{(-\\infty,2)}", True, "(-\\infty,2)"),
    ("(-\\infty,2)", "\\boxed{x<2}", False, "x<2"),  # verify(gold, predicted) is not symmetric: gold first
])
def test_math_grading_reads_the_final_boxed_answer_and_compares_it_with_the_reference(answer, response, correct,
                                                                                     extracted):
    assert eval_general.grade_math500({"answer": answer}, response) == {"correct": correct, "extracted": extracted}


def test_a_math_response_without_an_answer_is_wrong_and_extracts_nothing():
    assert eval_general.grade_math500({"answer": "3"}, "I am not sure.") == {"correct": False, "extracted": None}


# --------------------------------------------------------------------------------------------
# eval_general.py: code extraction, HumanEval, LiveCodeBench and the sandbox
# --------------------------------------------------------------------------------------------

def test_code_is_the_last_fenced_block():
    response = "Try:\n```python\nprint(1)\n```\nBetter:\n```python\nx = 2\nprint(x)\n```\nDone."
    assert eval_general.extract_code(response) == "x = 2\nprint(x)"


def test_an_unclosed_fence_yields_no_code_as_in_livecodebench():
    assert eval_general.extract_code("```python\nprint(1)\n") == ""


@given(st.text(alphabet=st.characters(blacklist_characters="`", blacklist_categories=("Cs",))))
def test_a_response_without_fences_is_taken_whole(text):
    assert eval_general.extract_code(text) == text


@given(st.lists(st.text(alphabet="abc xyz=+()1\n").filter(lambda code: "\n\n" not in code), min_size=1, max_size=4),
       st.text(alphabet="abc .\n", max_size=20))
def test_among_several_fenced_blocks_the_last_one_is_the_code(blocks, prose):
    response = "".join(f"{prose}\n```python\n{code}\n```\n" for code in blocks) + prose
    assert eval_general.extract_code(response) == blocks[-1]


def humaneval_item():
    return eval_general.load_humaneval(None)[0]  # has_close_elements; its prompt imports List


def test_a_humaneval_reply_with_its_own_def_keeps_the_prompts_imports():
    reply = ("```python\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
             "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n```")
    assert eval_general.grade_humaneval(humaneval_item(), reply) == {"passed": True, "result": "passed"}


def test_a_humaneval_program_that_exits_silently_reports_its_exit_code():
    body = "    import os\n    os._exit(4)\n"  # continues the prompt's signature; no traceback to report
    assert eval_general.grade_humaneval(humaneval_item(), body) == {"passed": False, "result": "exit code 4"}


def test_a_humaneval_failure_reports_the_last_line_of_the_traceback():
    body = "    raise ValueError('numbers ' + str(len(numbers)))\n"
    assert eval_general.grade_humaneval(humaneval_item(), body) == {"passed": False, "result": "ValueError: numbers 6"}


def stdin_item(inputs, outputs):
    return {"sample": {"input_output": json.dumps({"inputs": inputs, "outputs": outputs, "fn_name": None})}}


def test_livecodebench_counts_the_tests_passed_before_the_first_failure():
    item = stdin_item(["2 3\n", "10 -4\n", "7 7\n"], ["5\n", "6\n", "14\n"])
    code = "a, b = map(int, input().split())\nprint(a + b if a < 7 or b < 0 else 0)"  # right on the first two only
    verdict = eval_general.grade_livecodebench(item, f"```python\n{code}\n```")
    assert (verdict["passed"], verdict["tests_passed"], verdict["tests"]) == (False, 2, 3)
    assert verdict["result"] == "Wrong answer at output_line_idx=0: 0 != 14"


@pytest.mark.parametrize("code, result", [
    ("import os\nos._exit(0)", "no result"),  # nothing on stderr either
    ("import os, sys\nsys.stderr.write('first\\nruntime died here\\n')\nsys.stderr.flush()\nos._exit(1)",
     "runtime died here"),  # the last line the runner's process wrote to stderr
])
def test_a_program_that_kills_the_livecodebench_runner_passes_no_test_and_says_why(code, result):
    item = stdin_item(["1\n", "2\n"], ["1\n", "2\n"])
    verdict = eval_general.grade_livecodebench(item, f"```python\n{code}\n```")
    assert verdict == {"passed": False, "tests_passed": 0, "tests": 2, "result": result}


def test_the_sandbox_passes_the_exit_code_and_only_its_own_environment(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-must-not-leak")
    run = eval_general.run_sandboxed("import os, sys\nprint(sorted(os.environ))\nprint(sys.argv, __name__)\nsys.exit(3)")
    assert (run.returncode, run.timed_out, run.stderr) == (3, False, "")
    assert run.stdout.splitlines() == ["['LANG', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'PYTHONIOENCODING']",
                                       "['main.py'] __main__"]


def test_a_program_past_its_wall_clock_timeout_is_stopped_without_an_exit_code():
    run = eval_general.run_sandboxed("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout=0.5)
    assert (run.returncode, run.timed_out, run.stdout) == (None, True, "started\n")


def test_check_sandbox_accepts_working_limits_and_refuses_a_known_good_program_that_fails():
    good = humaneval_item()
    eval_general.check_sandbox({"humaneval": [good], "math500": []}, memory_mb=4096)  # no error
    broken = {**good, "problem": {**good["problem"], "canonical_solution": "    return None\n"}}
    with pytest.raises(eval_general.DataError, match=r"--code_memory_mb 4096: a known-good humaneval program fails"):
        eval_general.check_sandbox({"humaneval": [broken]}, memory_mb=4096)


# --------------------------------------------------------------------------------------------
# report.py: escaping, the summary figures, where two trajectories diverge
# --------------------------------------------------------------------------------------------

class TextAndTags(HTMLParser):
    def __init__(self, markup):
        super().__init__()
        self.text, self.tags = [], []
        self.feed(markup)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


# Model text made of markup pieces (tags, entities, quotes, a closing div) and any other characters.
MARKUP_TEXT = st.lists(st.sampled_from(["<script>", "<b>", "</div>", "<img src=x>", "&amp;", "&lt;", '"', "'", "<", ">",
                                        "&", "a"]) | st.characters(blacklist_categories=("Cs", "Cc")),
                       min_size=1, max_size=6).map("".join).filter(str.strip)


@given(MARKUP_TEXT, MARKUP_TEXT, MARKUP_TEXT, MARKUP_TEXT)
def test_conversation_text_is_shown_verbatim_and_adds_no_markup(user_text, reply, thought, reason):
    view = {"history": [{"role": "user", "content": user_text, "emotion-point": 40},
                        {"role": "assistant", "content": reply, "think": thought},
                        {"role": "user", "content": "ok", "emotion-point": 45, "change": 5, "reasoning": reason}]}
    parsed = TextAndTags(report.conversation(view))
    shown = "".join(parsed.text)
    assert all(text in shown for text in (user_text, reply, thought, reason))
    assert set(parsed.tags) <= {"div", "details", "summary"}


def test_changes_are_shown_signed_beside_the_emotion():
    view = {"history": [{"role": "user", "content": "a", "emotion-point": 40},
                        {"role": "user", "content": "b", "emotion-point": 30, "change": -10},
                        {"role": "user", "content": "c", "emotion-point": 35, "change": 5}]}
    shown = "".join(TextAndTags(report.conversation(view)).text)
    assert "emotion 40a" in shown and "emotion 30 (-10)b" in shown and "emotion 35 (+5)c" in shown


def report_row(index, trajectory, failed=False, with_final=True):
    history = [{"role": "user", "content": "Hi.", "emotion-point": trajectory[0]}]
    for emotion in trajectory[1:]:
        history += [{"role": "assistant", "content": "I hear you."},
                    {"role": "user", "content": "Hm.", "emotion-point": emotion}]
    row = {"id": f"d{index}", "history": history}
    if with_final:
        row["emo_point"] = trajectory[-1]
    if failed:
        row["end_reason"] = "simulator_failed"
    return row


def oracle_report_figures(rows):
    """The page's summary from its definition: over dialogues whose simulator did not fail; zeros if none."""
    scored = [row for row in rows if row.get("end_reason") != "simulator_failed"]
    finals = [[m["emotion-point"] for m in row["history"] if m["role"] == "user"][-1] for row in scored]
    turns = [sum(m["role"] == "assistant" for m in row["history"]) for row in scored]
    count = len(scored) or 1
    return {"dialogues": len(rows), "mean final emotion": sum(finals) / count,
            "success %": 100 * len([f for f in finals if f >= 100]) / count,
            "failure %": 100 * len([f for f in finals if f < 10]) / count, "mean turns": sum(turns) / count}


@given(st.lists(st.tuples(st.lists(st.integers(0, 100), min_size=1, max_size=6), st.booleans(), st.booleans()),
                min_size=1, max_size=8))
def test_summary_figures_match_their_definition(dialogues):
    rows = [report_row(i, trajectory, failed, with_final) for i, (trajectory, failed, with_final) in enumerate(dialogues)]
    figures = report.summary_figures([report.dialogue_view(row) for row in rows])
    assert figures == pytest.approx(oracle_report_figures(rows))


def test_a_row_without_emo_point_ends_at_its_last_emotion():
    view = report.dialogue_view(report_row(0, [40, 8, 100], with_final=False))
    assert (view["final"], view["outcome"], view["trajectory"]) == (100, "success", [40, 8, 100])


def oracle_divergence(a, b):
    """The first turn at which one trajectory differs from, or has no counterpart in, the other."""
    for turn in range(max(len(a), len(b))):
        if turn >= len(a) or turn >= len(b) or a[turn] != b[turn]:
            return turn
    return None


@given(st.lists(st.integers(0, 3), max_size=6), st.lists(st.integers(0, 3), max_size=6))
def test_first_divergence_matches_a_turn_by_turn_comparison(a, b):
    assert report.first_divergence(a, b) == oracle_divergence(a, b) == report.first_divergence(b, a)


@pytest.mark.parametrize("a, b, turn", [
    ([40, 45, 50, 55], [40, 46], 1),  # different lengths, differing before the shorter one ends
    ([40], [40, 45, 50, 55], 1),
    ([], [40], 0),
])
def test_trajectories_of_different_lengths_diverge_at_their_first_difference(a, b, turn):
    assert report.first_divergence(a, b) == turn and report.first_divergence(b, a) == turn


def test_the_per_step_chart_plots_each_steps_figures_over_its_scored_dialogues():
    rows = [report_row(0, [40, 100]), report_row(1, [40, 5]), report_row(2, [40, 50]),  # step 3: 3 scored
            report_row(3, [40, 9]), report_row(4, [40, 60], failed=True)]  # step 7: 1 scored
    views = [{**report.dialogue_view(row), "step": step} for row, step in zip(rows, [3, 3, 3, 7, 7])]
    series = {attrs["data-series"]: attrs["data-values"] for tag, attrs in ChartTags(report.step_chart(views)).tags
              if "data-series" in attrs}
    assert series == {"mean final emotion": "51.67,9.00", "success %": "33.33,0.00", "failure %": "33.33,100.00"}


class ChartTags(HTMLParser):
    def __init__(self, markup):
        super().__init__()
        self.tags = []
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


# --------------------------------------------------------------------------------------------
# plot_training.py: per-step values from the transcripts, first and last 20%
# --------------------------------------------------------------------------------------------

def transcript(step, final, turns=1, violations=0):
    return {"step": step, "id": "p", "emo_point": final, "turns": turns, "format_violations": violations,
            "history": []}


def test_step_values_pool_every_rank_file_and_come_in_step_order(tmp_path):
    # Rank 0 lost its dialogues at step 0: that step is read last, from rank 1's file.
    rank0 = [transcript(1, 50, 2, 1), transcript(1, 70, 4, 0), transcript(2, 20, 3, 3)]
    rank1 = [transcript(0, 30, 1, 1), transcript(0, 61, 2, 0), transcript(1, 90, 1, 1), transcript(2, 40, 5, 0)]
    write_jsonl(tmp_path / "transcripts.rank0.jsonl", rank0)
    write_jsonl(tmp_path / "transcripts.rank1.jsonl", rank1)
    with (tmp_path / "transcripts.rank1.jsonl").open("a") as cut:
        cut.write('{"step": 2, "emo_po')  # a last line cut short (a killed run): left out
    emotion, violations = {}, {}
    for row in rank0 + rank1:
        emotion.setdefault(row["step"], []).append(row["emo_point"])
        violations.setdefault(row["step"], []).append((row["format_violations"], row["turns"]))
    assert list(plot_training.step_means(tmp_path)) == [0, 1, 2]
    assert plot_training.step_means(tmp_path) == pytest.approx({step: np.mean(emotion[step]) for step in (0, 1, 2)})
    assert plot_training.step_means(tmp_path, "format") == pytest.approx(
        {step: sum(v for v, _ in pairs) / sum(t for _, t in pairs) for step, pairs in violations.items()})


def numpy_edge(values):
    return float(np.mean(values)), float(np.std(values, ddof=1) / np.sqrt(len(values)))


@pytest.mark.parametrize("steps, edge", [(7, 2), (11, 3), (13, 3)])  # 20% rounded up, at least 2
def test_first_and_last_edges_are_twenty_percent_of_steps_rounded_up(steps, edge):
    values = [float((7 * step * step) % 23) for step in range(steps)]  # uneven, so other cuts give other means
    edges = plot_training.compare_edges(dict(enumerate(values)))
    (first, first_se), (last, last_se) = numpy_edge(values[:edge]), numpy_edge(values[-edge:])
    assert edges == pytest.approx({"steps": steps, "edge_steps": edge, "first": first, "first_se": first_se,
                                   "last": last, "last_se": last_se, "difference": last - first,
                                   "difference_se": math.sqrt(first_se ** 2 + last_se ** 2)})


def test_the_printed_row_of_an_eleven_step_run_is_its_first_and_last_three_steps(tmp_path, capsys):
    finals = [30, 34, 41, 38, 45, 50, 48, 52, 61, 58, 66]
    write_jsonl(tmp_path / "transcripts.jsonl", [transcript(step, final) for step, final in enumerate(finals)])
    plot_training.main([str(tmp_path), "--out", str(tmp_path / "curve.png")])
    (first, first_se), (last, last_se) = numpy_edge(finals[:3]), numpy_edge(finals[-3:])
    expected = (f"| {tmp_path.name} | 11 | {first:.1f} +- {first_se:.1f} | {last:.1f} +- {last_se:.1f} | "
                f"{last - first:+.1f} +- {math.hypot(first_se, last_se):.1f} |")
    assert expected in capsys.readouterr().out.splitlines()
    assert expected == f"| {tmp_path.name} | 11 | 35.0 +- 3.2 | 61.7 +- 2.3 | +26.7 +- 4.0 |"


def test_an_arm_summary_is_the_mean_and_standard_error_over_its_seeds():
    seeds = [{"first": 30.0, "last": 45.0, "difference": 15.0}, {"first": 34.0, "last": 41.0, "difference": 7.0},
             {"first": 29.0, "last": 50.0, "difference": 21.0}]
    summary = plot_training.arm_summary(seeds)
    expected = {"runs": 3}
    for key in ("first", "last", "difference"):
        expected[key], expected[f"{key}_se"] = numpy_edge([seed[key] for seed in seeds])
    assert summary == pytest.approx(expected)


def test_the_drawn_curve_is_a_trailing_five_step_mean():
    values = [float(v) for v in (3, 9, 1, 7, 12, 4, 8, 20)]
    expected = [np.mean(values[max(0, i - 4):i + 1]) for i in range(len(values))]
    assert plot_training.smooth(values) == pytest.approx(expected)


# --------------------------------------------------------------------------------------------
# Settings reach their place; every item is generated once
# --------------------------------------------------------------------------------------------

def test_the_benchmark_plays_with_its_own_budgets_each_in_its_place():
    args = eval_sentient.EvalArguments(think=True, max_think_tokens=24, max_reply_tokens=80, max_dialogue_tokens=3000,
                                       batch_size=3)
    dialogue_args = eval_sentient.benchmark_dialogues(args)
    assert (dialogue_args.think, dialogue_args.max_think_tokens, dialogue_args.max_reply_tokens,
            dialogue_args.max_dialogue_tokens, dialogue_args.simulator_concurrency) == (True, 24, 80, 3000, 3)
    assert (dialogue_args.start_emotion, dialogue_args.max_turns) == (40, 9)  # the benchmark's, not training's


@pytest.mark.parametrize("spacing", [" ", "\n", "  \t"])
def test_an_intention_text_with_spaces_around_it_is_still_its_intention(spacing):
    for key, texts in simulator.INTENTIONS.items():
        for text in texts:
            assert eval_sentient.intention_of({"task": f"{spacing}{text}{spacing}"}) == key


def test_run_task_generates_each_item_once_in_batches_seeded_by_their_position(tmp_path):
    """5 items in batches of 2: 3 calls of 2, 2 and 1 prompts seeded 7, 9 and 11; resumed with items 0, 1 and 3
    done, the rest in their own batches, seeded as an uninterrupted run seeds them."""
    items = [{"id": f"m{index}", "messages": [{"role": "system", "content": "Solve it."},
                                               {"role": "user", "content": f"What is {index} + 1?"}],
              "answer": str(index + 1), "subject": "Algebra", "level": 1} for index in range(5)]
    args = eval_general.GeneralEvalArguments(batch_size=2, seed=7, max_new_tokens=16)
    calls = []

    def backend(conversations, max_new_tokens, seed):
        calls.append(([conversation[-1]["content"] for conversation in conversations], max_new_tokens, seed))
        return [f"\\boxed{{{int(conversation[-1]['content'].split()[2]) + 1}}}" for conversation in conversations]

    class Bar:
        def __init__(self, **kwargs):
            self.updates = []

        def update(self, count):
            self.updates.append(count)

        def close(self):
            pass

    rows = eval_general.run_task("math500", items, set(), args, backend, tmp_path / "a", Bar)
    assert [(len(prompts), seed) for prompts, _, seed in calls] == [(2, 7), (2, 9), (1, 11)]
    assert [row["id"] for row in rows] == [item["id"] for item in items]
    assert [row["prompt"] for row in rows] == [f"What is {index} + 1?" for index in range(5)]  # the user's, not the system's
    assert all(row["verdict"]["correct"] for row in rows) and {tokens for _, tokens, _ in calls} == {16}
    calls.clear()
    rows = eval_general.run_task("math500", items, {"m0", "m1", "m3"}, args, backend, tmp_path / "b", Bar)
    assert [(prompts, seed) for prompts, _, seed in calls] == [(["What is 2 + 1?"], 9), (["What is 4 + 1?"], 11)]
    assert [row["id"] for row in rows] == ["m2", "m4"]


def test_general_comparisons_take_only_the_tasks_both_folders_hold(tmp_path):
    base, trained = tmp_path / "base", tmp_path / "trained"
    base.mkdir(), trained.mkdir()
    for folder, tasks in ((base, ("math500", "ifeval", "humaneval")), (trained, ("ifeval", "humaneval", "livecodebench"))):
        for task in tasks:
            (folder / f"{task}.jsonl").write_text("")
    assert eval_general.result_files(str(base), str(trained)) == {
        task: (base / f"{task}.jsonl", trained / f"{task}.jsonl") for task in ("humaneval", "ifeval")}


def test_an_endpoints_requests_are_seeded_one_apart_within_a_batch_and_unseeded_when_greedy():
    from fake_openai import FakeOpenAIServer

    conversations = [[{"role": "user", "content": f"Question {index}"}] for index in range(3)]
    for temperature, seeds in ((0.7, {"Question 0": 5, "Question 1": 6, "Question 2": 7}),
                               (0.0, dict.fromkeys(["Question 0", "Question 1", "Question 2"]))):
        with FakeOpenAIServer(models=["tested"], default="42") as server:
            backend = eval_general.EndpointBackend(eval_general.GeneralEvalArguments(
                model="tested", model_base_url=server.base_url, temperature=temperature))
            assert backend(conversations, 16, seed=5) == ["42"] * 3
        assert {body["messages"][-1]["content"]: body.get("seed") for body in server.requests} == seeds
        assert {body["max_tokens"] for body in server.requests} == {16}


def test_the_benchmark_against_an_endpoint_seeds_each_scenario_by_its_position(tmp_path):
    """Three scenarios, the second already done: the others' every request carries seed 11 + their index."""
    from fake_openai import FakeOpenAIServer

    profiles = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES, require_first_talk=True)[:3]
    reply = "It sounds like that really hurt, and I am listening."
    with FakeOpenAIServer(models=["tested"], default=reply) as server:
        args = eval_sentient.EvalArguments(model="tested", model_base_url=server.base_url, seed=11)
        rows = []
        asyncio.run(eval_sentient.play_endpoint(args, simulator.SimulatorArguments(), None, profiles,
                                                {profiles[1].id}, tmp_path / "r.jsonl", rows.extend))
    assert sorted(row["id"] for row in rows) == sorted([profiles[0].id, profiles[2].id])
    made_by = {"model": "tested", "served": True, "seed": 11, "simulator": "rule"}
    assert all(row["made_by"].items() >= made_by.items() for row in rows)
    opening_seed = {body["messages"][1]["content"]: body["seed"] for body in server.requests}
    assert opening_seed == {profiles[0].first_talk: 11, profiles[2].first_talk: 13}


def test_a_resumed_local_benchmark_plays_every_unfinished_batch_seeded_by_its_position(monkeypatch, tmp_path,
                                                                                      byte_tokenizer):
    """Five scenarios in batches of 2, scenarios 0, 1 and 3 done: the first batch is skipped whole, then scenario
    2 is played seeded 3 + 2 and scenario 4 seeded 3 + 4, as the uninterrupted run seeded their batches."""
    import torch

    import generation

    profiles = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES, require_first_talk=True)[:5]
    reply = byte_tokenizer("I hear how much that hurt.", add_special_tokens=False)["input_ids"] + [IM_END]
    openings, seeds = [], []

    def generate(contexts, budgets, stop=None):
        openings.append([byte_tokenizer.decode(context) for context in contexts])
        return [reply[:budget] for budget in budgets], None

    monkeypatch.setattr(generation, "load_tokenizer", lambda args: ("the/folder", byte_tokenizer))
    monkeypatch.setattr(generation, "load_generator", lambda args, folder, tokenizer: generate)
    monkeypatch.setattr(eval_sentient.common, "use_all_cpu_cores", lambda: None)
    monkeypatch.setattr(torch, "manual_seed", seeds.append)
    args = eval_sentient.EvalArguments(seed=3, batch_size=2, max_reply_tokens=40)
    rows = []
    eval_sentient.play_local(args, simulator.SimulatorArguments(), None, profiles,
                             {profiles[0].id, profiles[1].id, profiles[3].id}, tmp_path / "r.jsonl", rows.extend)
    assert seeds == [5, 7]
    assert [row["id"] for row in rows] == [profiles[2].id, profiles[4].id]
    assert [row["id"] for row in eval_sentient.read_results(tmp_path / "r.jsonl")] == [profiles[2].id, profiles[4].id]
    assert all(row["made_by"] == eval_sentient.run_record(args, simulator.SimulatorArguments()) for row in rows)
    played = {index for index, profile in enumerate(profiles) for call in openings for context in call
              if profile.first_talk in context}
    assert played == {2, 4}  # the finished scenarios are not played again


@pytest.mark.parametrize("tasks, names", [("math500,ifeval", ["math500", "ifeval"]),
                                          (" math500 , ifeval ,", ["math500", "ifeval"]), ("humaneval", ["humaneval"])])
def test_task_names_are_read_without_the_spaces_around_them(tasks, names):
    assert eval_general.task_list(tasks) == names


def test_result_rows_refuse_a_repeated_scenario_and_take_an_emotion_of_zero(tmp_path):
    rows = [{"id": "a", "emo_point": 0, "history": []}, {"id": "b", "emo_point": 100, "history": []}]
    assert [row["emo_point"] for row in eval_sentient.read_results(write_jsonl(tmp_path / "ok.jsonl", rows))] == [0, 100]
    with pytest.raises(eval_sentient.ResultFileError, match=r"twice.jsonl:3: scenario 'a' appears twice"):
        eval_sentient.read_results(write_jsonl(tmp_path / "twice.jsonl", rows + rows[:1]))


def test_a_livecodebench_window_of_one_day_is_accepted_and_a_reversed_one_refused():
    eval_general.GeneralEvalArguments(livecodebench_start_date="2024-05-01", livecodebench_end_date="2024-05-01")
    with pytest.raises(ValueError, match="livecodebench"):
        eval_general.GeneralEvalArguments(livecodebench_start_date="2024-05-02", livecodebench_end_date="2024-05-01")


def test_the_think_instruction_joins_an_existing_system_message_once():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"}]
    joined = eval_general.with_think_prompt(messages, think=True)
    assert [m["role"] for m in joined] == ["system", "user"] and joined[0]["content"].startswith("Be terse.\n\n")
    assert eval_general.with_think_prompt(messages, think=False) == messages
    alone = eval_general.with_think_prompt(messages[1:], think=True)
    assert [m["role"] for m in alone] == ["system", "user"] and alone[1] == messages[1]


def test_a_humaneval_reply_with_only_a_body_continues_the_prompts_signature():
    problem = {"prompt": "import math\n\ndef f(x):\n    \"\"\"Double.\"\"\"\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate(2) == 4\n"}
    body = eval_general.humaneval_program(problem, "```python\n    return 2 * x\n```")
    assert body.startswith(problem["prompt"] + "    return 2 * x")
    whole = eval_general.humaneval_program(problem, "```python\ndef f(x):\n    return x + x\n```")
    assert whole.startswith(problem["prompt"] + "\n    pass\n\ndef f(x):\n    return x + x")
    for program in (body, whole):
        assert program.rstrip().endswith("check(f)")


def test_a_limited_run_returns_only_the_items_within_its_limit(tmp_path):
    items = [{"id": f"m{index}", "messages": [{"role": "user", "content": f"What is {index} + 1?"}],
              "answer": str(index + 1), "subject": "Algebra", "level": 1} for index in range(4)]
    backend = lambda conversations, max_new_tokens, seed: ["\\boxed{0}"] * len(conversations)  # noqa: E731

    class Bar:
        def __init__(self, **kwargs):
            pass

        update = close = lambda self, *args: None

    out = tmp_path / "out"
    eval_general.run_task("math500", items, set(), eval_general.GeneralEvalArguments(batch_size=4), backend, out, Bar)
    rows = eval_general.run_task("math500", items, {"m0", "m1", "m2", "m3"},
                                 eval_general.GeneralEvalArguments(batch_size=4, limit=2), backend, out, Bar)
    assert [row["id"] for row in rows] == ["m0", "m1"]


def test_a_run_folders_transcripts_are_every_ranks(tmp_path):
    write_jsonl(tmp_path / "transcripts.jsonl", [{"id": "a", "step": 0, "emo_point": 40, "history": []}])
    write_jsonl(tmp_path / "transcripts.rank1.jsonl", [{"id": "b", "step": 0, "emo_point": 50, "history": []}])
    assert sorted(row["id"] for row in report.read_rows(tmp_path)) == ["a", "b"]


@pytest.mark.parametrize("value, number", [(3, True), (2.5, True), (True, False), (False, False),
                                           (float("nan"), False), ("4", False), (None, False)])
def test_a_transcript_value_is_a_number_only_if_it_is_a_finite_int_or_float(value, number):
    assert plot_training._is_number(value) == number


def test_a_comparison_page_goes_beside_run_b_by_default(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_jsonl(a / "results.jsonl", SCENARIOS[:3])
    write_jsonl(b / "results.jsonl", [sage_row(row["id"], [55], row["task"]) for row in SCENARIOS[:3]])
    report.main(["--compare", str(a / "results.jsonl"), str(b / "results.jsonl")])
    assert (b / "compare.html").is_file() and not (a / "compare.html").exists()
    assert f"wrote {b / 'compare.html'}" in capsys.readouterr().out


def test_an_endpoint_models_thought_never_returns_to_its_own_context(tmp_path):
    from fake_openai import FakeOpenAIServer

    [profile] = simulator.load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES, require_first_talk=True)[:1]
    with FakeOpenAIServer(models=["tested"], default="<think>SECRET plan</think>It sounds like that hurt.") as server:
        args = eval_sentient.EvalArguments(model="tested", model_base_url=server.base_url, think=True,
                                           max_think_tokens=24, max_reply_tokens=80)
        rows = []
        asyncio.run(eval_sentient.play_endpoint(args, simulator.SimulatorArguments(), None, [profile], set(),
                                                tmp_path / "r.jsonl", rows.extend))
    assert len(server.requests) > 1 and {body["max_tokens"] for body in server.requests} == {24 + 80}
    for turn, body in enumerate(server.requests):  # the prompt's worked examples, then the dialogue so far
        assert "SECRET" not in json.dumps(body)
        assert [m["content"] for m in body["messages"]].count("It sounds like that hurt.") == turn
    assert [m.get("think") for m in rows[0]["history"] if m["role"] == "assistant"][0] == "SECRET plan"


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("top_p", 1.5), ("livecodebench_start_date", "20240105"),
                                          ("livecodebench_end_date", "2024-5-1")])
def test_general_options_out_of_range_or_not_canonical_dates_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        eval_general.GeneralEvalArguments(**{field: value})


def test_a_partial_general_result_file_resumes_and_a_foreign_one_is_refused(tmp_path):
    items, made_by = [{"id": "a"}, {"id": "b"}, {"id": "c"}], {"model": "m", "seed": 0}
    partial = write_jsonl(tmp_path / "partial.jsonl", [{"id": "a", "verdict": {}, "made_by": made_by},
                                                       {"id": "b", "verdict": {}, "made_by": made_by}])
    assert eval_general.finished_items(partial, items, made_by) == {"a", "b"}
    with pytest.raises(common.InputError, match=r"partial.jsonl: its rows were made with seed=0; this run has seed=1"):
        eval_general.finished_items(partial, items, {"model": "m", "seed": 1})
    foreign = write_jsonl(tmp_path / "foreign.jsonl", [{"id": "a", "verdict": {}}, {"id": "zz", "verdict": {}}])
    with pytest.raises(eval_general.DataError, match="holds items this data does not have"):
        eval_general.finished_items(foreign, items, made_by)
    unverdicted = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a"}])
    with pytest.raises(eval_general.DataError, match=r"bad.jsonl:1: a result row needs 'id' and 'verdict'"):
        eval_general.finished_items(unverdicted, items, made_by)


@pytest.mark.parametrize("point", [True, "50", None, -1, 101])
def test_a_result_rows_emotion_must_be_a_number_within_0_and_100(tmp_path, point):
    path = write_jsonl(tmp_path / "r.jsonl", [{"id": "a", "emo_point": point, "history": []}])
    with pytest.raises(eval_sentient.ResultFileError, match="emo_point"):
        eval_sentient.read_results(path)


def test_the_benchmark_refuses_scenarios_without_an_opening_before_anything_loads(tmp_path):
    from conftest import profile_row

    profiles = write_jsonl(tmp_path / "bench.jsonl", [profile_row()])  # no first_talk
    with pytest.raises(simulator.ProfileError, match="first_talk"):
        eval_sentient.evaluate(eval_sentient.EvalArguments(model="no/such-model", profiles=str(profiles),
                                                           output=str(tmp_path / "r.jsonl")),
                               simulator.SimulatorArguments())
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("field", ["main_cha", "character"])  # ours, the official result rows'
def test_a_result_rows_personality_and_intention_are_read_with_the_spaces_around_them_dropped(field):
    [(personality, [text, *_])] = list(simulator.PERSONALITIES.items())[:1]
    [(intention, [task, *_])] = list(simulator.INTENTIONS.items())[:1]
    assert eval_sentient.personality_of({field: f"  {text}\n"}) == personality
    assert eval_sentient.intention_of({"task": f" {task} "}) == intention
    assert eval_sentient.personality_of({}) == eval_sentient.intention_of({}) == "unknown"


@pytest.mark.parametrize("base, trained, paired", [
    ("a/humaneval.jsonl", "b/humaneval.jsonl", True),
    ("a/humaneval.jsonl", "b/math500.jsonl", False),  # two tasks
    ("a/results.jsonl", "b/results.jsonl", False),  # one name, but no task's
])
def test_two_result_files_are_compared_only_when_both_are_of_one_task(tmp_path, base, trained, paired):
    for name in (base, trained):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    if paired:
        assert eval_general.result_files(tmp_path / base, tmp_path / trained) == {
            "humaneval": (tmp_path / base, tmp_path / trained)}
    else:
        with pytest.raises(eval_general.DataError, match="compare result files of the same task"):
            eval_general.result_files(tmp_path / base, tmp_path / trained)


def test_a_benchmark_killed_mid_row_resumes_from_its_whole_rows(tmp_path, capsys):
    """The scenarios already played are those of whole rows; the one whose row was cut short is played again."""
    path = tmp_path / "results.jsonl"
    whole = {"id": "a", "emo_point": 40, "history": [], "made_by": {"model": "m"}}
    path.write_text(json.dumps(whole) + "\n" + '{"id": "b", "emo_po')
    profiles = [types.SimpleNamespace(id=id_, to_row=lambda: {}) for id_ in ("a", "b")]
    assert eval_sentient.finished_ids(path, {"model": "m"}, profiles, "bench.jsonl", None) == {"a"}
    assert eval_sentient.finished_ids(tmp_path / "none.jsonl", {"model": "m"}, profiles, "bench.jsonl", None) == set()
    with pytest.raises(eval_sentient.ResultFileError, match=r"holds results for scenarios not in the first 1 of "
                       r"bench.jsonl \(--limit 1\) \(e.g. a\); choose another --output or raise --limit"):
        eval_sentient.finished_ids(path, {"model": "m"}, profiles[1:], "bench.jsonl", 1)


def played_rows(path, args, simulator_args=None):
    """A result file of two rows that `args` made."""
    made_by = eval_sentient.run_record(args, simulator_args or simulator.SimulatorArguments())
    return write_jsonl(path, [{"id": id_, "emo_point": 50, "history": [], "made_by": made_by}
                              for id_ in ("en-bench-01", "en-bench-02")])


@pytest.mark.parametrize("change, differ", [
    (dict(temperature=0.9), "temperature=0.7; this run has temperature=0.9"),
    (dict(think=True), "think=False; this run has think=True"),
    (dict(model="other/model"), "model='no/such-model'; this run has model='other/model'"),
])
def test_a_benchmark_resumed_with_another_model_or_settings_is_refused_naming_the_difference(tmp_path, change,
                                                                                            differ):
    output = played_rows(tmp_path / "r.jsonl", eval_sentient.EvalArguments(model="no/such-model"))
    before = output.read_text()
    args = eval_sentient.EvalArguments(**{"model": "no/such-model", "output": str(output), **change})
    with pytest.raises(common.InputError, match=re.escape(differ)):
        eval_sentient.evaluate(args, simulator.SimulatorArguments())
    assert output.read_text() == before


def test_a_local_models_record_changes_with_its_weights_and_names_an_adapters_base(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    first = guards.model_record(str(folder))
    (folder / "model.safetensors").write_bytes(b"\0" * 2_999_999 + b"\1")  # the last byte retrained
    assert guards.model_record(str(folder))["model_fingerprint"] != first["model_fingerprint"]
    assert first["model"] == str(folder.resolve())
    (folder / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen2.5-7B-Instruct"}')
    assert guards.model_record(str(folder))["base_model"] == "Qwen/Qwen2.5-7B-Instruct"
    assert guards.model_record("m", "http://127.0.0.1:9/v1") == {"model": "m", "served": True}


@pytest.mark.parametrize("content, message", [
    ('{"id": "en-bench-01", "emo_point": 50, "history": [], "made_by": MADE_BY}\n'
     '{"id": "en-bench-02", "emo_point": 50, "history": []}\n', "row 2 does not say which model and settings made it"),
    ('{"id": "en-bench-01", "emo_point": 50, "history": []}\n', "a file this script did not write"),
    ('{"id": "en-train-01", "emo_point": 50, "history": [], "step": 0, "turns": 1}\n',  # a training transcript
     "a file this script did not write"),
    ("# my notes\n", "a file this script did not write"),
])
def test_a_benchmark_output_not_made_by_a_recorded_run_is_refused(tmp_path, content, message):
    output = tmp_path / "r.jsonl"
    args = eval_sentient.EvalArguments(model="no/such-model", output=str(output))
    content = content.replace("MADE_BY", json.dumps(eval_sentient.run_record(args, simulator.SimulatorArguments())))
    output.write_text(content)
    with pytest.raises(common.InputError, match=message):
        eval_sentient.evaluate(args, simulator.SimulatorArguments())
    assert output.read_text() == content


def test_the_benchmark_refuses_to_write_its_results_into_its_scenarios_file(tmp_path):
    profiles = write_jsonl(tmp_path / "bench.jsonl", [profile_row(first_talk="Hi.")])
    before = profiles.read_text()
    with pytest.raises(common.InputError, match="an input of this run"):
        eval_sentient.evaluate(eval_sentient.EvalArguments(model="no/such-model", profiles=str(profiles),
                                                           output=str(profiles)), simulator.SimulatorArguments())
    assert profiles.read_text() == before


def test_ctrl_c_in_the_benchmark_keeps_the_finished_rows_and_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    args = eval_sentient.EvalArguments(model="no/such-model", output=str(tmp_path / "r.jsonl"), limit=3)

    def one_then_ctrl_c(args, simulator_args, chat, profiles, done, output, progress):
        made_by = eval_sentient.run_record(args, simulator_args)
        common.append_json_lines(output, [{"id": profiles[0].id, "emo_point": 50, "history": [], "made_by": made_by}])
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_sentient.guards, "check_local_model", lambda args: None)
    monkeypatch.setattr(eval_sentient, "play_local", one_then_ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        eval_sentient.evaluate(args, simulator.SimulatorArguments())
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == (f"interrupted: 1 of 3 scenarios are in {tmp_path / 'r.jsonl'}; run the "
                                               "same command again to play the rest")


@pytest.mark.parametrize("graded", [0, 1])
def test_ctrl_c_in_the_general_evaluation_says_what_was_kept(graded, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"

    def grade_then_ctrl_c(task, data, done, args, backend, output_dir, tqdm):
        if graded:  # run_task makes the folder with its first rows
            output_dir.mkdir()
            eval_general.common.append_json_lines(output_dir / f"{task}.jsonl", [{"id": data[0]["id"]}])
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_general, "make_backend", lambda args: None)
    monkeypatch.setattr(eval_general, "run_task", grade_then_ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        eval_general.main(["--tasks", "humaneval", "--limit", "2", "--output_dir", str(out)])
    assert stopped.value.code == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (f"interrupted: the graded items are in {out}; run the same command again to grade the rest"
                    if graded else "interrupted: before any item was graded; nothing was written")


def test_a_closed_stdin_ends_the_typed_dialogue_like_an_empty_line(monkeypatch, capsys):
    import builtins

    def no_stdin(prompt=""):
        raise RuntimeError("input(): lost sys.stdin")

    monkeypatch.setattr(builtins, "input", no_stdin)
    talk.main(["--profile", "en-train-01"])
    assert "[stopped after 0 turns, emotion 30]" in capsys.readouterr().out


def test_ctrl_c_while_typing_a_reply_leaves_the_dialogue_in_one_line(monkeypatch, capsys):
    import builtins

    def ctrl_c(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", ctrl_c)
    with pytest.raises(SystemExit) as stopped:
        talk.main(["--profile", "en-train-01"])
    assert stopped.value.code == 130 and capsys.readouterr().err.endswith("interrupted: the dialogue was left\n")
