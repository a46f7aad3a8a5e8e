"""Token-level multi-turn rollouts: masks, think handling, budgets, ordering, isolation."""
import json
from pathlib import Path

import pytest
from fake_openai import FakeOpenAIServer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import chat_client
import common
import generation
import rollout
import simulator
from generation import TransformersGenerator, split_think
from rollout import DialogueArguments, DialogueRunner


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    return model, tokenizer


def sampling_generator(model, tokenizer, seed_sampling=True):
    config = GenerationConfig(do_sample=seed_sampling, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return TransformersGenerator(model, tokenizer, config)


class Recording:
    """Wraps a real generator and keeps what it returned, per call, to check the rollout against."""

    def __init__(self, generate):
        self.generate, self.calls = generate, []

    def __call__(self, contexts, max_new_tokens, stop=None):
        sampled, logprobs = self.generate(contexts, max_new_tokens, stop=stop)
        self.calls.append({"contexts": contexts, "budgets": max_new_tokens, "sampled": sampled, "stop": stop})
        return sampled, logprobs


class Scripted:
    """Stands in for the model at the generation interface: returns given texts, as token ids, per
    dialogue (keyed by the opening line, so order changes cannot hide a mix-up)."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]], openings: dict[str, str]):
        self.tokenizer, self.scripts, self.openings = tokenizer, scripts, openings
        self.turn = {}

    def __call__(self, contexts, max_new_tokens, stop=None):
        sampled = []
        for context, limit in zip(contexts, max_new_tokens):
            text = self.tokenizer.decode(context)
            key = next(k for k, opening in self.openings.items() if opening in text)
            index = self.turn.get(key, 0)
            self.turn[key] = index + 1
            ids = self.tokenizer(self.scripts[key][index], add_special_tokens=False)["input_ids"]
            sampled.append((ids + [self.tokenizer.eos_token_id])[:limit])
        return sampled, None


def profiles(count=2):
    return simulator.load_profiles(simulator.DEFAULT_PROFILES)[:count]


def roomy_args(**config) -> DialogueArguments:
    """Dialogue options with room to spare (8 turns, long budgets), overridden by `config`."""
    return DialogueArguments(**{"max_turns": 8, "max_think_tokens": 1024, "max_reply_tokens": 512,
                                "max_dialogue_tokens": 8192, **config})


def run(tokenizer, generate, starts, chat=None, **config):
    """The dialogues of `starts`, with the rule user, or an LLM user talking through `chat` if given."""
    llm = simulator.SimulatorArguments(backend="llm", base_url="http://127.0.0.1:9/v1", simulator_model="sim-model")
    runner = DialogueRunner(tokenizer, roomy_args(**config), None if chat is None else llm, chat=chat)
    try:
        return runner.run(starts, generate)
    finally:
        runner.close()


def starts_for(tokenizer, chosen, copies=1, **config):
    runner = DialogueRunner(tokenizer, roomy_args(**config))
    openings = runner.openings(chosen)
    runner.close()
    return [(p, openings[p.id]) for p in chosen for _ in range(copies)], openings


@pytest.mark.parametrize("think", [False, True])
def test_env_mask_is_one_exactly_on_the_sampled_tokens(tiny, think):
    model, tokenizer = tiny
    segments = rollout.ChatSegments(tokenizer)
    starts, _ = starts_for(tokenizer, profiles(2), copies=2)
    dialogues = run(tokenizer, sampling_generator(model, tokenizer), starts, think=think, max_turns=3,
                    max_think_tokens=6, max_reply_tokens=10)
    for dialogue in dialogues:
        assert len(dialogue.env_mask) == len(dialogue.completion_ids) == len(dialogue.logprobs)
        # Rebuild the completion from its parts: what the policy sampled (1), what was inserted (0).
        expected, mask = [], []

        def add(ids, sampled):
            expected.extend(ids)
            mask.extend([int(sampled)] * len(ids))

        user_messages = [m["content"] for m in dialogue.simulator.history if m["role"] == "user"][1:]
        for turn, (turn_ids, thought) in enumerate(zip(dialogue.turn_ids, dialogue.thought_ids)):
            if think:
                add(segments.think_open, False)
                add(thought, True)
                if not tokenizer.decode(thought).endswith("</think>"):
                    add(segments.think_close, False)
            add(turn_ids[len(thought):], True)
            if turn < len(dialogue.turn_ids) - 1:  # nothing is appended after the last turn
                add(segments.closing_ids(turn_ids) + segments.user_turn_ids(user_messages[turn]), False)
        assert expected == dialogue.completion_ids
        assert mask == dialogue.env_mask


def test_masked_in_tokens_are_what_the_model_returned_turn_by_turn(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(2), copies=2)
    recorder = Recording(sampling_generator(model, tokenizer))
    dialogues = run(tokenizer, recorder, starts, max_turns=3, max_reply_tokens=10)
    for turn, call in enumerate(recorder.calls):
        active = [d for d in dialogues if len(d.turn_ids) > turn]
        assert [d.turn_ids[turn] for d in active] == call["sampled"]
    for dialogue in dialogues:
        runs, current = [], []
        for token, keep in zip(dialogue.completion_ids, dialogue.env_mask):
            if keep:
                current.append(token)
            elif current:
                runs, current = runs + [current], []
        runs += [current] if current else []
        assert [tokenizer.decode(r) for r in runs] == [tokenizer.decode(t) for t in dialogue.turn_ids]


def test_inserted_tokens_are_the_user_messages_in_the_chat_template(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(1))
    [dialogue] = run(tokenizer, sampling_generator(model, tokenizer), starts, max_turns=2, max_reply_tokens=8)
    inserted = tokenizer.decode([t for t, keep in zip(dialogue.completion_ids, dialogue.env_mask) if not keep])
    second_user_message = dialogue.simulator.history[2]["content"]
    assert second_user_message in inserted and "<|im_start|>user" in inserted
    assert inserted.endswith("<|im_start|>assistant\n")


def test_the_simulator_never_receives_the_thought(tiny):
    _, tokenizer = tiny
    chosen = profiles(1)
    starts, openings = starts_for(tokenizer, chosen)
    script = Scripted(tokenizer, {chosen[0].id: ["SECRETPLAN she wants an ear</think>", "I am so sorry about the sofas."]},
                      openings)
    with FakeOpenAIServer(["Fine.\nCHANGE: +5", "Okay."]) as server:
        chat = chat_client.ChatClient(server.base_url, "sim-model", max_retries=0)
        [dialogue] = run(tokenizer, script, starts, chat=chat, think=True, max_turns=1,
                         max_think_tokens=40, max_reply_tokens=20)
        sent = json.dumps(server.requests)
    assert "SECRETPLAN" not in sent
    assert "I am so sorry about the sofas." in sent
    assert dialogue.think_texts == ["SECRETPLAN she wants an ear"]
    assert dialogue.format_violations == 0


def test_thinking_past_its_budget_is_closed_for_the_policy_and_counted(tiny):
    _, tokenizer = tiny
    chosen = profiles(1)
    starts, openings = starts_for(tokenizer, chosen)
    long_thought = "hmm " * 50
    script = Scripted(tokenizer, {chosen[0].id: [long_thought, "That sounds heavy."]}, openings)
    [dialogue] = run(tokenizer, script, starts, think=True, max_turns=1, max_think_tokens=5, max_reply_tokens=20)
    segments = rollout.ChatSegments(tokenizer)
    close_at = len(segments.think_open) + 5
    assert dialogue.completion_ids[close_at:close_at + len(segments.think_close)] == segments.think_close
    assert dialogue.env_mask[close_at:close_at + len(segments.think_close)] == [0] * len(segments.think_close)
    assert dialogue.reply_texts == ["That sounds heavy."]
    assert dialogue.format_violations == 1


@pytest.mark.parametrize("text, think, expected", [
    ("<think>she is hurt</think> That sounds painful.", True, ("she is hurt", "That sounds painful.", True)),
    ("<think>a</think> b </think> c", True, ("a</think> b", "c", False)),
    ("<think>never closed, all thought", True, ("never closed, all thought", "", False)),
    ("No thinking at all.", True, ("", "No thinking at all.", False)),
    ("<think>only thought</think>", True, ("only thought", "", False)),
    ("<think>x</think> y", False, ("", "<think>x</think> y", True)),
    (" plain reply \n", False, ("", "plain reply", True)),
    (" plain reply \n", True, ("", "plain reply", False)),
    ("</think> reply", True, ("", "reply", False)),  # closed at position 0: a close, not a missing one
    (" <think> musing \n", True, ("musing", "", False)),
    ("<think>a <think> b", True, ("a <think> b", "", False)),
    ("<think>a <think> b</think> c", True, ("a <think> b", "c", False)),
])
def test_split_think_passes_on_only_the_text_after_the_last_close(text, think, expected):
    assert split_think(text, think) == expected


@pytest.mark.parametrize("name", ["policy", "sentient"])
def test_the_think_prompts_show_their_format_in_worked_exchanges_that_split_well_formed(name):
    messages = generation.policy_messages("en", True, name)
    assert messages[0] == {"role": "system", "content": generation.policy_system_prompt("en", True, name)}
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * 3
    for answer in messages[2::2]:
        thought, reply, well_formed = split_think(answer["content"], think=True)
        assert well_formed and thought and reply
    assert generation.policy_messages("en", False, name) == [  # the reply-only prompts have none
        {"role": "system", "content": generation.policy_system_prompt("en", False, name)}]


def test_policy_examples_are_read_in_order_and_a_bad_line_is_named(tmp_path, monkeypatch):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "mine_think.txt").write_text("  Think first.\n")
    examples = tmp_path / "en" / "mine_think.examples.jsonl"
    examples.write_text('{"user": "u1", "assistant": "a1"}\n\n{"user": "u2", "assistant": "a2"}\n')
    monkeypatch.setattr(common, "PROMPTS_DIR", tmp_path)
    assert generation.policy_messages("en", True, "mine") == [
        {"role": "system", "content": "Think first."}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]
    examples.write_text('{"user": "u1", "assistant": "a1"}\n{"user": "u2"}\n')
    with pytest.raises(common.InputError, match=rf"{examples}:2: an example is an object"):
        generation.policy_messages("en", True, "mine")


def test_the_released_prompts_come_without_our_examples():
    class Released:
        def policy_prompt(self, think):
            return f"released think={think}"
    assert generation.policy_messages("en", True, "policy", Released()) == [
        {"role": "system", "content": "released think=True"}]


def test_the_examples_sit_between_the_system_prompt_and_the_opening_in_the_policy_prompt(tiny):
    _, tokenizer = tiny
    runner = DialogueRunner(tokenizer, DialogueArguments(think=True))
    text = tokenizer.decode(runner.prompt_ids(profiles(1)[0], "OPENING LINE"))
    system, first_example = generation.policy_system_prompt("en", True), generation.policy_messages("en", True)[1]
    assert text.index(system) < text.index(first_example["content"]) < text.index("OPENING LINE")
    runner.close()


def test_a_dialogue_ended_early_leaves_the_others_matched(tiny):
    _, tokenizer = tiny
    chosen = profiles(3)
    starts, openings = starts_for(tokenizer, chosen)
    scripts = {
        chosen[0].id: ["Just calm down, it's not a big deal."] * 3,  # gives up after two turns from 20 (-10 each)
        # generic, -5 each, three turns (distinct sentences: a sentence said again is a repeat, -10)
        chosen[1].id: ["Tell me more about that.", "I am listening, go on whenever you are ready.",
                       "Okay, and what came after it all?"],
        chosen[2].id: ["What happened next?", "How did everyone around you react?",
                       "Where do things stand at the moment?"],
    }
    dialogues = run(tokenizer, Scripted(tokenizer, scripts, openings), starts, max_turns=3, start_emotion=20)
    assert dialogues[0].end_reason == "gave_up" and len(dialogues[0].reply_texts) == 2
    for dialogue in dialogues:
        assert dialogue.reply_texts == scripts[dialogue.profile.id][:len(dialogue.reply_texts)]
        replies = [m["content"] for m in dialogue.simulator.history if m["role"] == "assistant"]
        assert replies == dialogue.reply_texts
    assert [len(d.reply_texts) for d in dialogues[1:]] == [3, 3]


def test_thinking_near_the_dialogue_budget_leaves_room_for_the_close_and_a_minimal_reply(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(1))
    segments = rollout.ChatSegments(tokenizer)
    prompt = segments.prompt_ids(generation.policy_messages("en", True), starts[0][1])
    budget = len(prompt) + len(segments.think_open) + 40  # 40 tokens left once <think> is inserted
    recording = Recording(sampling_generator(model, tokenizer))
    run(tokenizer, recording, starts, think=True, max_turns=1, max_think_tokens=1000, max_reply_tokens=1000,
        max_dialogue_tokens=budget)
    think_call, reply_call = recording.calls
    assert think_call["budgets"] == [40 - len(segments.think_close) - rollout.MIN_REPLY_TOKENS]
    assert (think_call["stop"], reply_call["stop"]) == ("</think>", None)


def test_token_budget_is_never_exceeded(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(2), copies=2)
    budget = max(len(rollout.ChatSegments(tokenizer).prompt_ids(generation.policy_messages("en", False), o))
                 for _, o in starts) + 90
    dialogues = run(tokenizer, sampling_generator(model, tokenizer), starts, max_turns=8, max_reply_tokens=30,
                    max_dialogue_tokens=budget)
    assert all(len(d.prompt_ids) + len(d.completion_ids) <= budget for d in dialogues)
    assert {d.end_reason for d in dialogues} == {"token_budget"}


def test_a_prompt_longer_than_the_budget_is_a_clear_error(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(1))
    with pytest.raises(ValueError, match="needs .* tokens for its prompt and a short reply"):
        run(tokenizer, sampling_generator(model, tokenizer), starts, max_dialogue_tokens=20)


def test_one_dialogue_per_start_in_order_and_groups_share_profile_and_opening(tiny):
    model, tokenizer = tiny
    starts, openings = starts_for(tokenizer, profiles(2), copies=3)
    dialogues = run(tokenizer, sampling_generator(model, tokenizer), starts, max_turns=1, max_reply_tokens=6)
    assert [d.profile.id for d in dialogues] == [p.id for p, _ in starts]
    for dialogue in dialogues:
        assert dialogue.simulator.history[0]["content"] == openings[dialogue.profile.id]
    output = rollout.rollout_output(dialogues, with_logprobs=False)
    assert len(output["prompt_ids"]) == len(starts) and output["logprobs"] is None
    assert output["prompt_ids"][0] == output["prompt_ids"][2]  # same profile, same opening, same prompt


def test_transcripts_are_benchmark_rows_with_step_and_thoughts(tiny, tmp_path):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(1))
    dialogues = run(tokenizer, sampling_generator(model, tokenizer), starts, think=True, max_turns=2,
                    max_think_tokens=4, max_reply_tokens=6)
    rollout.write_transcripts(tmp_path / "t.jsonl", dialogues, step=7)
    [row] = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {"id", "player", "scene", "main_cha", "cha_group", "task", "emo_point", "emo_state", "history"} <= set(row)
    assert row["step"] == 7 and len(row["think_texts"]) == 2
    assert row["emo_point"] == dialogues[0].final_emotion
    user_turns = [m for m in row["history"] if m["role"] == "user"][1:]
    assert all("emotion-point" in m and "reasoning" in m for m in user_turns)


def test_reward_is_final_emotion_over_one_hundred_minus_the_penalty_times_the_share_of_violating_turns():
    assert rollout.reward(85, 0, 2) == 0.85
    assert rollout.reward(85, 2, 2, format_penalty=0.1) == pytest.approx(0.75)  # every turn violated: all of it
    assert rollout.reward(85, 1, 4, format_penalty=0.2) == pytest.approx(0.80)  # one turn of four: a quarter
    assert rollout.reward(85, 0, 2, format_penalty=0.1) == 0.85
    assert rollout.reward(85, 2, 2) == 0.85  # no penalty unless one is configured
    assert rollout.reward(85, 0, 0, format_penalty=0.1) == 0.85  # no turn played (the user left at once)


def metrics_of(final_emotion, emotions=None, turns=None, max_turns=2, **fields):
    """dialogue_metrics for scored dialogues, the fields a test does not name left neutral."""
    count = len(final_emotion)
    values = {"final_emotion": final_emotion, "turns": turns or [1] * count, "end_reason": ["turn_limit"] * count, "format_violations": [0] * count,
              "think_tokens": [0] * count, "reply_tokens": [0] * count, "simulator_seconds": [0.0] * count,
              "emotions": emotions or [[e] for e in final_emotion], "failed": [False] * count,
              "simulator_calls": [{}] * count, **fields}
    return rollout.dialogue_metrics(values, max_turns=max_turns)


def test_metrics_count_success_only_at_100_and_failure_only_below_10():
    metrics = metrics_of([100, 99, 10, 9])
    assert metrics["emotion/success_rate"] == 0.25
    assert metrics["emotion/failure_rate"] == 0.25
    assert metrics["emotion/final_mean"] == 54.5


def test_metrics_after_turn_k_carry_an_ended_dialogues_final_emotion_forward():
    metrics = metrics_of([60, 20], emotions=[[40, 50, 60], [20]], turns=[3, 1], max_turns=3)
    assert metrics["emotion/after_turn_1"] == 30  # (40 + 20) / 2
    assert metrics["emotion/after_turn_2"] == 35  # (50 + 20) / 2: the second ended at 20
    assert metrics["emotion/after_turn_3"] == 40  # (60 + 20) / 2


def test_metrics_turns_mean_is_policy_turns_per_dialogue():
    assert metrics_of([60, 20, 30], turns=[3, 1, 2], max_turns=3)["dialogue/turns_mean"] == 2


def test_metrics_per_turn_are_over_all_policy_turns_not_per_dialogue():
    metrics = metrics_of([50, 50], turns=[3, 1], format_violations=[1, 1], think_tokens=[30, 10],
                         reply_tokens=[60, 20], simulator_seconds=[0.3, 0.1])
    assert metrics["format/violation_rate"] == 0.5  # 2 violations in 4 turns
    assert metrics["length/think_tokens_per_turn"] == 10
    assert metrics["length/reply_tokens_per_turn"] == 20
    assert metrics["simulator/seconds_per_turn"] == pytest.approx(0.1)


def test_a_dialogue_whose_simulator_fails_ends_unscored_and_the_others_go_on(tiny):
    _, tokenizer = tiny
    chosen = profiles(2)
    starts, openings = starts_for(tokenizer, chosen)
    script = Scripted(tokenizer, {p.id: ["I hear you.", "Tell me more."] for p in chosen}, openings)
    # One call at a time, so the script's order is the dialogues' order: d0 then d1, each analysis then reply.
    answers = ["Fine.\nCHANGE: +5", "Okay.", {"status": 500},  # turn 1: d1's analysis fails (no retries here)
               "Good.\nCHANGE: +5", "Thanks."]  # turn 2: only d0 is left
    with FakeOpenAIServer(answers) as server:
        chat = chat_client.ChatClient(server.base_url, "sim-model", max_retries=0)
        d0, d1 = run(tokenizer, script, starts, chat=chat, max_turns=2, simulator_concurrency=1)
        assert not server.script  # every scripted answer was asked for, no more
    assert d1.end_reason == "simulator_failed" and "500" in d1.failure and len(d1.reply_texts) == 1
    assert d0.failure is None and d0.end_reason == "turn_limit" and d0.emotions == [35, 40]
    assert rollout.rollout_output([d0, d1], with_logprobs=False)["failed"] == [False, True]
    metrics = rollout.dialogue_metrics(rollout.dialogue_columns([d0, d1]), max_turns=2)
    assert metrics["dialogue/ended_simulator_failed"] == 0.5
    assert metrics["emotion/final_mean"] == 40  # the failed dialogue's partial score is not averaged in
    rollout.check_failures([d0, d1], max_failed_share=0.5)  # 1 of 2 is allowed
    with pytest.raises(rollout.TooManySimulatorFailures, match=r"the simulators of 1 of 2 dialogues failed.*500"):
        rollout.check_failures([d0, d1], max_failed_share=0.4)
    with pytest.raises(rollout.TooManySimulatorFailures):
        rollout.check_failures([d1], max_failed_share=1.0)  # nothing left to learn from


def greedy_generator(model, tokenizer, prefix_cache: bool = True):
    config = GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return TransformersGenerator(model, tokenizer, config, prefix_cache)


def count_prefilled_tokens(model, counts: list):
    """Records how many tokens each generate call feeds in its first forward pass (its prefill)."""
    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            counts.append(ids.shape[1])
    return model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module")
def smollm(packaged_model):
    """The real SmolLM2: its greedy output depends on the context, which the tiny random model's barely does."""
    return AutoModelForCausalLM.from_pretrained(packaged_model), AutoTokenizer.from_pretrained(packaged_model)


def test_the_generator_reuses_its_cached_prefix_and_samples_as_a_fresh_prefill(smollm):
    model, tokenizer = smollm
    reusing = greedy_generator(model, tokenizer)

    def fresh(contexts, budgets, stop=None):
        return greedy_generator(model, tokenizer)(contexts, budgets, stop=stop)

    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    contexts = [encode("Count with me: one, two, three,"), encode("I lost my job"), encode("The capital of France is")]
    budgets = [8, 4, 6]
    prefills = []
    handle = count_prefilled_tokens(model, prefills)
    try:
        first, _ = reusing(contexts, budgets)
        assert first == fresh(contexts, budgets)[0]
        # Next call: rows reordered, one dropped, one's sampled tokens cut short (the rest of them
        # stays cached but must be masked out), inserted tokens after each.
        second_contexts = [contexts[2] + first[2] + encode(" The capital of Italy is"),
                           contexts[0] + first[0][:2] + encode(" ten, eleven,")]
        prefills.clear()
        second, _ = reusing(second_contexts, [6, 6])
        reused_prefill = prefills[0]
        assert second == fresh(second_contexts, [6, 6])[0]
        assert tokenizer.decode(second[0]).startswith(" Rome")  # the context mattered, and was seen
        # Only the uncached tokens were fed: the inserted text (plus the last sampled token), not the contexts.
        assert reused_prefill <= len(encode(" The capital of Italy is")) + 1
        third_contexts = [second_contexts[1] + second[1] + encode(" Really?")]
        third, _ = reusing(third_contexts, [5])
        assert third == fresh(third_contexts, [5])[0]
        # Unrelated contexts: nothing worth reusing, a fresh prefill of the whole width.
        prefills.clear()
        other = [encode("A completely different prompt about rivers")]
        assert reusing(other, [4])[0] == fresh(other, [4])[0]
        assert prefills[0] == len(other[0])
    finally:
        handle.remove()


def test_think_dialogues_with_the_prefix_cache_match_fresh_prefills_token_for_token(smollm):
    model, tokenizer = smollm
    starts, _ = starts_for(tokenizer, profiles(2))
    settings = dict(think=True, max_turns=2, max_think_tokens=6, max_reply_tokens=10)  # turn 2 drops turn 1's thought
    reused = run(tokenizer, greedy_generator(model, tokenizer), starts, **settings)
    prefills = []
    handle = count_prefilled_tokens(model, prefills)
    try:  # the off switch (--prefix_cache false): every call prefills its whole contexts
        fresh = run(tokenizer, greedy_generator(model, tokenizer, prefix_cache=False), starts, **settings)
    finally:
        handle.remove()
    assert [d.completion_ids for d in reused] == [d.completion_ids for d in fresh]
    assert [d.env_mask for d in reused] == [d.env_mask for d in fresh]
    assert len(prefills) == 4 and all(width >= len(fresh[0].prompt_ids) for width in prefills)  # 2 turns x 2 phases


@pytest.mark.slow
def test_the_throughput_benchmark_runs_and_reports_its_ratios():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "rollout_bench.py"
    finished = subprocess.run([sys.executable, str(script), "--dialogues", "3", "--turns", "2", "--median", "0.02",
                               "--reply_tokens", "4", "--batch_waits", "0,0.01"], capture_output=True, text=True,
                              timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "lockstep efficiency (d)/(a):" in finished.stdout and "(c)/(a):" in finished.stdout
    assert "| (b) async, batch_wait 0 s |" in finished.stdout and "| (b) async, batch_wait 0.01 s |" in finished.stdout
    assert "(e) async ideal: " in finished.stdout and "of its async ideal (e)/(b)" in finished.stdout
    assert "3 dialogues x 2 turns" in finished.stdout and "12 calls a run" in finished.stdout  # 3 x 2 x (analysis + reply)


def test_the_async_ideal_is_the_longest_dialogue_s_own_chain_or_all_policy_time(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import rollout_bench

    # Policy calls of 0.5 s at shortest: dialogue 0 waits 1 + 2 + 2 x 0.5 = 4 s, dialogue 1 waits 3 + 0.5 = 3.5 s.
    assert rollout_bench.async_ideal([[1.0, 2.0], [3.0]], [0.5, 0.75, 0.5, 0.5]) == 4.0
    assert rollout_bench.async_ideal([[1.0, 2.0], [3.0]], [0.5, 2.5, 3.5, 3.5]) == 10.0  # the policy's compute is longer


def test_every_end_token_of_the_models_generation_config_ends_a_turn(tiny_model_dir, tmp_path):
    """Qwen2.5 ends turns with <|im_end|> (its tokenizer's end token) or <|endoftext|> (only in its generation
    config), and vLLM stops at either: both must close the turn."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    other_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_end != tokenizer.eos_token_id
    assert other_end not in rollout.ChatSegments(tokenizer).eos_ids
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, other_end]).save_pretrained(folder)
    segments = rollout.ChatSegments(AutoTokenizer.from_pretrained(folder))
    assert segments.eos_ids == {tokenizer.eos_token_id, other_end}


RANKS_AGREE_SCRIPT = '''
import json, sys
from types import SimpleNamespace
from accelerate import Accelerator
sys.path.insert(0, sys.argv[1])
import rollout
accelerator = Accelerator(cpu=True)
lost = SimpleNamespace(failure="HTTP 500 from the simulator")
kept = SimpleNamespace(failure=None)
mine = [lost, lost, lost] if accelerator.process_index == 0 else [kept, kept, kept]  # 3 of 6 lost, all on rank 0
outcome = {}
for share in (0.5, 0.4):
    try:
        rollout.check_failures(mine, share, accelerator)
        outcome[share] = "went on"
    except rollout.TooManySimulatorFailures as error:
        outcome[share] = str(error)
with open(f"{sys.argv[2]}/rank{accelerator.process_index}.json", "w") as out:  # a file each: printed lines interleave
    json.dump(outcome, out)
'''


@pytest.mark.slow
def test_all_ranks_agree_on_stopping_for_simulator_failures(tmp_path):
    """A rank that stopped alone would start saving a checkpoint the others never join: a hang."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port

    script = tmp_path / "agree.py"
    script.write_text(RANKS_AGREE_SCRIPT)
    repo = Path(__file__).resolve().parent.parent
    finished = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(script), str(repo), str(tmp_path)],
                              capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    outcomes = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for outcome in outcomes:  # both ranks decide on all 6 dialogues: 3 lost is allowed at 0.5, not at 0.4
        assert outcome["0.5"] == "went on"
        assert outcome["0.4"].startswith("the simulators of 3 of 6 dialogues failed") and "HTTP 500" in outcome["0.4"]


def test_metrics_of_a_single_one_turn_dialogue_are_per_that_turn():
    metrics = metrics_of([40], format_violations=[1], reply_tokens=[12])
    assert (metrics["format/violation_rate"], metrics["length/reply_tokens_per_turn"]) == (1.0, 12.0)


@pytest.mark.parametrize("sampled, kept, closed", [
    ("weighing her words</think> more", "weighing her words</think>", True),  # cut right after the close
    ("</think> more", "</think>", True),  # a close as the very first tokens
    ("</think> and the reply goes on for many more words", "</think>", True),  # ... of a long sample
    ("one two three four five six seven eight nine ten</think>", None, True),  # a close after a long thought
    ("weighing<EOS></think>", "weighing", False),  # an end of turn before the close: dropped, not closed
    ("<EOS>weighing", "", False),
    ("weighing on and on", None, False),  # never closed: all of it kept
])
def test_thinking_is_cut_after_the_first_close_or_before_an_end_of_turn(tiny, sampled, kept, closed):
    _, tokenizer = tiny
    runner = DialogueRunner(tokenizer, roomy_args(think=True))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = [tokenizer.eos_token_id if part == "<EOS>" else token
           for part in sampled.replace("<EOS>", "\0<EOS>\0").split("\0") if part
           for token in ([part] if part == "<EOS>" else encode(part))]
    runner.close()
    assert runner._cut_thought(ids) == ((ids if kept is None else encode(kept)), closed)


def test_simulator_time_is_the_seconds_its_turns_took(tiny):
    model, tokenizer = tiny
    starts, _ = starts_for(tokenizer, profiles(2))
    dialogues = run(tokenizer, sampling_generator(model, tokenizer), starts, max_turns=2, max_reply_tokens=6)
    assert all(0 < d.simulator_seconds < 5 for d in dialogues)  # the rule user answers in milliseconds


def test_a_dialogue_goes_on_exactly_while_the_next_user_message_and_a_minimal_turn_fit(tiny):
    _, tokenizer = tiny
    chosen = profiles(1)
    starts, openings = starts_for(tokenizer, chosen)

    def play(budget):
        script = Scripted(tokenizer, {chosen[0].id: ["I hear how much that hurt.", "Tell me more."]}, openings)
        [dialogue] = run(tokenizer, script, starts, max_turns=2, max_reply_tokens=40, max_dialogue_tokens=budget)
        return dialogue

    roomy = play(4096)
    second_turn = roomy.turn_starts[1]  # where the policy's second turn began: after the user's next message
    runner = DialogueRunner(tokenizer, roomy_args())
    needed = len(roomy.prompt_ids) + second_turn + runner.min_turn_tokens
    runner.close()
    assert len(play(needed).reply_texts) == 2
    assert play(needed - 1).end_reason == "token_budget" and len(play(needed - 1).reply_texts) == 1


@pytest.mark.parametrize("argv, message", [
    (["--dialogues", "0"], "--dialogues must be at least 1"),
    (["--median", "nan", "--sigma", "-1"], "--median must be a finite number above 0; --sigma must be a finite"),
    (["--policy", "/no/such/model"], "error: --policy /no/such/model"),
    (["--dialogues", "100000", "--turns", "100000"], "--dialogues must be at most 1024; --turns must be at most 32"),
    (["--median", "1e9"], "--median must be at most 6.0"),  # every call would time out, after minutes of silence
    (["--batch_waits", "0,x"], "--batch_waits must be comma-separated seconds"),
    (["--batch_waits", "-1"], "--batch_waits must be comma-separated seconds"),
])
def test_the_rollout_benchmark_checks_its_options_before_it_loads_anything(argv, message, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import rollout_bench

    with pytest.raises(SystemExit) as stopped:
        rollout_bench.main(argv)
    assert stopped.value.code in (1, 2) and message in capsys.readouterr().err


def check_turn_group(tokenizer, generate, think):
    """Two groups of 3 dialogues, parting at their third and second turns, played by `generate`."""
    starts, _ = starts_for(tokenizer, profiles(2), copies=3)
    recording = Recording(generate)
    shared = [(0, 2)] * 3 + [(3, 1)] * 3  # the first group parts at its third turn, the second at its second
    runner = DialogueRunner(tokenizer, roomy_args(think=think, max_turns=3, max_think_tokens=6, max_reply_tokens=10))
    try:
        dialogues = runner.run(starts, recording, shared)
    finally:
        runner.close()
    calls_per_turn = 2 if think else 1
    # Turn 1 samples the two leaders only, turn 2 the first group's leader and all of the second group, turn 3 all.
    assert [len(call["contexts"]) for call in recording.calls[::calls_per_turn]] == [2, 4, 6]
    for group, parted in ((dialogues[:3], 2), (dialogues[3:], 1)):
        assert all(d.reply_texts[:parted] == group[0].reply_texts[:parted] for d in group)
        assert all(d.emotions[:parted] == group[0].emotions[:parted] for d in group)
        for dialogue in group:
            turns = dialogue.token_turns()
            assert not any(turn in range(parted) for turn in turns)  # shared turns: no token trained
            trained = [turn for turn in turns if turn >= 0]
            assert set(trained) == set(range(parted, len(dialogue.turn_ids)))
            assert sum(dialogue.env_mask) == sum(len(ids) for ids in dialogue.turn_ids[parted:])
    assert len({d.reply_texts[2] for d in dialogues[:3]}) > 1  # parted: its own samples from there


@pytest.mark.parametrize("think", [False, True])
def test_a_turn_group_plays_its_first_dialogues_replies_once_untrained_and_parts_at_its_turn(tiny, think):
    model, tokenizer = tiny
    check_turn_group(tokenizer, sampling_generator(model, tokenizer), think)


def numbered_turns(tokenizer):
    """A stand-in policy whose every sampled row is new ("Reply number N.", N counting rows; a thought that
    closes), for the fast subset."""
    import itertools

    count = itertools.count()

    def generate(contexts, budgets, stop=None):
        rows = []
        for budget in budgets:
            text = f"Thought {next(count)}</think>" if stop else f"Reply number {next(count)}."
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if stop else [tokenizer.eos_token_id])
            rows.append(ids[:budget])
        return rows, None
    return generate


@pytest.mark.parametrize("think", [False, True])
def test_a_turn_group_shares_and_parts_with_a_stand_in_policy(tokenizer, think):
    check_turn_group(tokenizer, numbered_turns(tokenizer), think)
