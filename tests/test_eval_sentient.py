"""eval_sentient.py: protocol, metrics on official-format result files, resume, hidden thinking, bad files."""
import asyncio
import json
import subprocess
import sys

import pytest
from conftest import REPO, profile_row, write_jsonl
from fake_openai import FakeOpenAIServer

import guards
import eval_sentient
import rollout
import simulator
from eval_sentient import EvalArguments, ResultFileError, read_results, summarize


def official_row(scenario_id, points, task="你想分析事件中其他人物这么做的原因", character="负面型", unjudged_reply=False):
    """A result row as SAGE's release writes it (our own text, their field names and layout): the opening at
    40, then assistant/user pairs whose user side carries emotion-point and planning; a dialogue that ran
    all 10 turns ends with the 10th reply, never judged."""
    history = [{"role": "user", "content": "最近烦死了。", "emotion-point": 40}]
    for point in points:
        history += [{"role": "assistant", "content": "我在听。"},
                    {"role": "user", "content": "嗯。", "thinking": "……", "emotion-point": point,
                     "planning": {"activity": "……", "TargetCompletion": "……", "content": "……", "analyse": "……",
                                  "change": 5}}]
    if unjudged_reply:
        history.append({"role": "assistant", "content": "还有什么想说的吗？"})
    final = points[-1]
    return {"id": scenario_id, "emo_point": final, "emo_state": f"Emotion-{simulator.emotion_state(final)}",
            "target": "eq", "player": "* 姓名：测试", "scene": "……", "character": character, "topic": "测试",
            "task": task, "history": history}


def official_file(path):
    rows = [official_row("a", [45, 55, 65, 75, 85, 95, 100]),  # success
            official_row("b", [35, 25, 15, 5]),  # failure
            official_row("c", [45, 50, 55, 60, 60, 60, 60, 60, 60], unjudged_reply=True),  # ran all 10 turns
            official_row("d", [45, 40], task="你希望对方真诚地夸奖你在事件中的具体行为", character="回避型")]  # goodbye
    return write_jsonl(path, rows)


def test_metrics_on_an_official_format_file(tmp_path):
    summary = summarize(read_results(official_file(tmp_path / "model_result.jsonl")), bootstrap_samples=2000)
    assert summary["n"] == 4
    assert summary["score"] == pytest.approx((100 + 5 + 60 + 40) / 4)
    assert (summary["success"], summary["failure"]) == (1, 1)
    assert (summary["success_rate"], summary["failure_rate"]) == (25.0, 25.0)
    assert summary["mean_turns"] == pytest.approx((7 + 4 + 9 + 2) / 4)  # the unjudged 10th reply is not a turn
    assert summary["states"] == {"S": 1, "A": 0, "B": 2, "C": 0, "F": 1}
    assert summary["by_intention"]["others_motives"] == {"n": 3, "score": pytest.approx(55.0), "success": 1, "failure": 1}
    assert summary["by_intention"]["sincere_praise"]["score"] == 40
    assert set(summary["by_personality"]) == {"negative", "avoidant"}
    low, high = summary["score_ci95"]
    assert 5 <= low < summary["score"] < high <= 100


def test_success_needs_100_and_failure_below_10(tmp_path):
    rows = [official_row("a", [99]), official_row("b", [10]), official_row("c", [9]), official_row("d", [100])]
    summary = summarize(read_results(write_jsonl(tmp_path / "r.jsonl", rows)), bootstrap_samples=100)
    assert (summary["success"], summary["failure"]) == (1, 1)
    assert (summary["success_rate"], summary["failure_rate"]) == (25.0, 25.0)


def test_success_and_failure_rates_are_per_cent_of_all_scenarios(tmp_path):
    rows = [official_row(name, [final]) for name, final in zip("abcde", [100, 100, 50, 9, 5])]
    summary = summarize(read_results(write_jsonl(tmp_path / "r.jsonl", rows)), bootstrap_samples=100)
    assert (summary["success_rate"], summary["failure_rate"], summary["score"]) == (40.0, 40.0, 52.8)
    assert summary["mean_turns"] == 1.0  # one judged reply in each


def test_the_bootstrap_interval_is_seeded_and_narrows_with_more_scenarios():
    few, many = [0, 100] * 5, [0, 100] * 500
    assert eval_sentient.bootstrap_interval(few, 1000) == eval_sentient.bootstrap_interval(few, 1000)
    (low_few, high_few), (low_many, high_many) = (eval_sentient.bootstrap_interval(v, 1000) for v in (few, many))
    assert low_few < low_many < 50 < high_many < high_few


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('{"id": "x", "history": []}', "'emo_point'"),
    ('{"id": "x", "emo_point": 140, "history": []}', "'emo_point'"),
    ('{"id": "x", "emo_point": "40", "history": []}', "'emo_point'"),
    ('{"emo_point": 40, "history": []}', "'id'"),
    ('[1, 2]', "JSON object"),
])
def test_a_malformed_result_row_names_its_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "results.jsonl", [official_row("a", [45]), line])
    with pytest.raises(ResultFileError, match=rf"results\.jsonl:2: .*{message}"):
        read_results(path)


@pytest.mark.slow
def test_rescore_prints_a_leaderboard_best_first(tmp_path):
    weak = write_jsonl(tmp_path / "weak_result.jsonl", [official_row("a", [5]), official_row("b", [30])])
    strong = official_file(tmp_path / "strong_result.jsonl")
    finished = subprocess.run([sys.executable, str(REPO / "eval_sentient.py"), "--rescore", str(weak), str(strong),
                               "--bootstrap_samples", "200"], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    board = [line.split() for line in finished.stdout.split("\n\n")[0].splitlines()[1:3]]
    # rank, file, n, score, 95% CI, success, failure, mean judged replies
    assert board[0][:4] == ["1", "strong_result.jsonl", "4", "51.2"] and board[0][5:7] == ["1", "1"]
    assert board[1][:4] == ["2", "weak_result.jsonl", "2", "17.5"] and board[1][5:7] == ["0", "1"]


@pytest.mark.slow
def test_rescore_of_a_broken_file_exits_with_its_location(tmp_path):
    broken = write_jsonl(tmp_path / "broken.jsonl", [official_row("a", [45]), "{oops"])
    finished = subprocess.run([sys.executable, str(REPO / "eval_sentient.py"), "--rescore", str(broken)],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0 and "broken.jsonl:2: not valid JSON" in finished.stderr


# --------------------------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------------------------

class ScriptedUser(simulator.Simulator):
    """A simulated user whose judgements are given: the protocol's bookkeeping is what is tested."""

    def __init__(self, profile, changes, messages=None, **options):
        super().__init__(profile, **options)
        self.changes, self.messages = list(changes), list(messages or [])

    async def _judge(self, reply_text):
        return self.changes.pop(0), "scripted"

    async def _write_message(self, reply_text, reasoning, change):
        return self.messages.pop(0) if self.messages else "Go on."


def benchmark_user(profile, changes, messages=None):
    settings = rollout.new_simulator(profile, None, eval_sentient.benchmark_dialogues(eval_sentient.EvalArguments()),
                                     simulator.SimulatorArguments())
    return ScriptedUser(profile, changes, messages, start_emotion=settings.emotion, max_turns=settings.max_turns,
                        change_bound=settings.change_bound, variant=settings.variant, language=None)


def play(user, replies=20):
    asyncio.run(user.open())
    turns = []
    while not user.done and len(turns) < replies:
        turns.append(asyncio.run(user.respond("I hear you.")))
    return turns


def test_benchmark_dialogues_start_at_40_with_the_first_talk(make_profile):
    profile = make_profile(first_talk="My sister skipped my wedding.")
    user = benchmark_user(profile, [])
    assert asyncio.run(user.open()) == "My sister skipped my wedding."
    assert user.history[0] == {"role": "user", "content": "My sister skipped my wedding.", "emotion-point": 40}


def test_changes_are_bounded_to_ten_either_way(make_profile):
    turns = play(benchmark_user(make_profile(first_talk="Hi."), [+25, -40, +7]), replies=3)
    assert [t.change for t in turns] == [10, -10, 7] and [t.emotion for t in turns] == [50, 40, 47]


def test_nine_judged_replies_then_the_dialogue_ends(make_profile):
    turns = play(benchmark_user(make_profile(first_talk="Hi."), [+1] * 20))
    assert len(turns) == 9 and turns[-1].end_reason == "turn_limit" and turns[-1].emotion == 49


@pytest.mark.parametrize("changes, messages, reason, final", [
    ([+10] * 6, None, "farewell", 100),
    ([-10] * 4, None, "gave_up", 0),
    ([-10, -10, -10, -5], None, "gave_up", 5),
    ([+5, +5], ["Fine.", "Thanks anyway. Goodbye."], "goodbye", 50),
])
def test_the_dialogue_ends_at_100_below_10_or_on_a_goodbye(make_profile, changes, messages, reason, final):
    turns = play(benchmark_user(make_profile(first_talk="Hi."), changes, messages))
    assert turns[-1].end_reason == reason and turns[-1].emotion == final
    if reason == "gave_up":
        assert [t.emotion for t in turns][-2] >= 10  # it ends on the first turn below 10, not before


# --------------------------------------------------------------------------------------------
# Whole runs
# --------------------------------------------------------------------------------------------

def benchmark_profiles(path, count=4):
    intentions = list(simulator.INTENTIONS)
    rows = [profile_row(intentions[i], ("negative", "passive", "avoidant")[i % 3], id=f"bench-{i}",
                        first_talk=f"Something happened with my sister, part {i}.") for i in range(count)]
    return write_jsonl(path, rows)


def test_an_interrupted_local_run_resumes_and_plays_what_the_whole_run_would(tiny_model_dir, tmp_path):
    profiles = benchmark_profiles(tmp_path / "bench.jsonl")
    options = dict(model=str(tiny_model_dir), profiles=str(profiles), batch_size=2, max_reply_tokens=6,
                   bootstrap_samples=100)
    whole = tmp_path / "whole.jsonl"
    eval_sentient.evaluate(EvalArguments(output=str(whole), **options), simulator.SimulatorArguments())
    rows = whole.read_text(encoding="utf-8").splitlines()
    assert [json.loads(r)["id"] for r in rows] == ["bench-0", "bench-1", "bench-2", "bench-3"]

    interrupted = write_jsonl(tmp_path / "interrupted.jsonl", rows[:2])  # killed after its first batch
    summary = eval_sentient.evaluate(EvalArguments(output=str(interrupted), **options), simulator.SimulatorArguments())
    assert interrupted.read_text(encoding="utf-8").splitlines() == rows  # nothing replayed, nothing lost
    assert summary["n"] == 4 and (tmp_path / "interrupted.summary.json").is_file()
    first = json.loads(rows[0])
    assert first["history"][0]["emotion-point"] == 40 and first["emo_state"].startswith("Emotion-")
    assert all(1 <= eval_sentient.judged_replies(json.loads(r)) <= 9 for r in rows)


def test_a_result_file_from_other_scenarios_is_refused(tiny_model_dir, tmp_path):
    output = write_jsonl(tmp_path / "other.jsonl", [{**official_row("not-ours", [45]), "made_by": {}}])
    with pytest.raises(ResultFileError, match="not in"):
        eval_sentient.evaluate(EvalArguments(model=str(tiny_model_dir), profiles=str(benchmark_profiles(
            tmp_path / "bench.jsonl")), output=str(output)), simulator.SimulatorArguments())


@pytest.mark.slow
def test_an_endpoint_models_thinking_never_reaches_the_simulator_or_itself(tmp_path):
    thought = "SECRET-THOUGHT she wants to be heard"
    reply = f"<think>{thought}</think>It sounds like Dana's absence really hurt you, and that makes sense."
    analysis = "They noticed what I felt.\nCHANGE: +5"
    with FakeOpenAIServer(models=["tested"], default=reply) as model, \
            FakeOpenAIServer(models=["sim-model"], default=analysis) as user:
        args = EvalArguments(model="tested", model_base_url=model.base_url, think=True, output=str(tmp_path / "r.jsonl"),
                             profiles=str(benchmark_profiles(tmp_path / "bench.jsonl", count=2)), bootstrap_samples=100)
        summary = eval_sentient.evaluate(args, simulator.SimulatorArguments(backend="llm", base_url=user.base_url,
                                                                            simulator_model="sim-model"))
    assert summary["n"] == 2
    assert all(thought not in json.dumps(body) for body in user.requests)  # the simulated user never saw it
    assert all(thought not in json.dumps(body) for body in model.requests)  # nor did the model's own context
    assert model.requests[0]["messages"][0]["content"].startswith("You are an intelligent chat companion")
    rows = read_results(tmp_path / "r.jsonl")
    replies = [m for m in rows[0]["history"] if m["role"] == "assistant"]
    assert replies[0]["think"] == thought and thought not in replies[0]["content"]
    assert [m["emotion-point"] for m in rows[0]["history"] if m["role"] == "user"][:3] == [40, 45, 50]


def test_a_scenario_whose_simulated_user_fails_is_not_scored_and_a_rerun_plays_it(tiny_model_dir, tmp_path):
    """The first scenario is answered; then the endpoint answers 500 past the client's retries."""
    answer = "Fine.\nCHANGE: +5"  # an analysis, and a user message
    args = EvalArguments(model=str(tiny_model_dir), profiles=str(benchmark_profiles(tmp_path / "bench.jsonl", count=2)),
                         output=str(tmp_path / "r.jsonl"), batch_size=1, max_reply_tokens=4, bootstrap_samples=100)
    with FakeOpenAIServer([answer] * 18, default=None) as user:  # 9 judged replies x 2 calls, then 500s
        with pytest.raises(simulator.SimulatorError, match=r"1 scenario\(s\) whose simulated user failed.*rerun"):
            eval_sentient.evaluate(args, simulator.SimulatorArguments(backend="llm", base_url=user.base_url,
                                                                      simulator_model="sim-model"))
    assert len(read_results(tmp_path / "r.jsonl")) == 1  # the failed one is not scored as 0 or anything else
    with FakeOpenAIServer(default=answer) as user:
        summary = eval_sentient.evaluate(args, simulator.SimulatorArguments(backend="llm", base_url=user.base_url,
                                                                            simulator_model="sim-model"))
    assert summary["n"] == 2


def test_a_lora_folder_from_training_is_tested_on_its_base_model(tiny_model_dir, tmp_path, monkeypatch):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))  # the merge's cache
    torch.manual_seed(0)
    trained = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "run")
    merged = guards.loadable_model(str(tmp_path / "run"))
    model, tokenizer = AutoModelForCausalLM.from_pretrained(merged), AutoTokenizer.from_pretrained(merged)
    ids = torch.tensor([tokenizer("I hear you.")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, trained(ids).logits, atol=1e-5)
        assert not torch.allclose(model(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits)


def test_the_leaderboard_tells_result_files_of_one_name_apart_by_their_paths():
    summary = {"score": 50.0, "score_ci95": [40.0, 60.0], "n": 2, "success": 0, "failure": 0, "mean_turns": 3.0}
    board = eval_sentient.leaderboard({"a/results.jsonl": summary, "b/results.jsonl": {**summary, "score": 60.0}})
    assert [line.split()[1] for line in board.splitlines()[1:3]] == ["b/results.jsonl", "a/results.jsonl"]
    assert eval_sentient.leaderboard({"a/x.jsonl": summary}).splitlines()[1].split()[1] == "x.jsonl"


def test_a_first_batch_whose_every_user_fails_says_so_and_leaves_no_file(tiny_model_dir, tmp_path):
    """Before: a ZeroDivisionError in the progress line and a 0-byte result file."""
    args = EvalArguments(model=str(tiny_model_dir), profiles=str(benchmark_profiles(tmp_path / "bench.jsonl", count=2)),
                         output=str(tmp_path / "r.jsonl"), batch_size=2, max_reply_tokens=4, bootstrap_samples=100)
    with FakeOpenAIServer(default={"status": 500}) as user:
        with pytest.raises(simulator.SimulatorError, match=r"2 scenario\(s\) whose simulated user failed.*rerun"):
            eval_sentient.evaluate(args, simulator.SimulatorArguments(backend="llm", base_url=user.base_url,
                                                                      simulator_model="sim-model",
                                                                      simulator_max_retries=0))
    assert not (tmp_path / "r.jsonl").exists()
