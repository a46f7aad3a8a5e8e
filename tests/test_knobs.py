"""Every dialogue, simulator and reward knob is one flag of both trainers (or one edit of rule_user.py's table),
and the value set on the command line reaches what it controls. A knob added to DialogueArguments or
SimulatorArguments without a case here fails test_every_knob_has_a_case."""
import asyncio
from dataclasses import fields

import pytest
from conftest import user_options
from test_official_prompts import REPO as OFFICIAL_REPO

import chat_client
import common
import llm_user
import rollout
import rule_user
import simulator
import train_grpo
import train_ppo

TRAINERS = {"grpo": lambda argv: train_grpo.parse_arguments(argv)[:2],
            "ppo": lambda argv: train_ppo.parse_arguments(argv)[1:3]}


@pytest.fixture(params=sorted(TRAINERS))
def parse(request):
    """(dialogue arguments, simulator arguments) from a command line, as the trainer parses it."""
    return TRAINERS[request.param]


def first_user(tokenizer, dialogue_args, simulator_args=None, profile=None):
    """The simulated user a runner on these options makes for a dialogue, opened."""
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args)
    user = runner.new_simulator(profile or simulator.load_profiles(dialogue_args.profiles)[0])
    asyncio.run(user.open())
    runner.close()
    return user


def budgets_asked(tokenizer, dialogue_args, simulator_args=None) -> list[list[int]]:
    """The token budgets the runner asks the policy for, call by call, in a dialogue of 3-token replies."""
    asked = []

    def generate(contexts, max_new_tokens, stop=None):
        asked.append(list(max_new_tokens))
        reply = tokenizer("I hear you.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [reply[:limit] for limit in max_new_tokens], None

    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args)
    profile = simulator.load_profiles(dialogue_args.profiles)[0]
    runner.run([(profile, runner.openings([profile])[profile.id])], generate)
    runner.close()
    return asked


def system_prompt(tokenizer, dialogue_args) -> str:
    runner = rollout.DialogueRunner(tokenizer, dialogue_args)
    profile = simulator.load_profiles(dialogue_args.profiles)[0]
    text = tokenizer.decode(runner.prompt_ids(profile, "Hello."))
    runner.close()
    return text


def prompt_file(name: str) -> str:
    return (common.PROMPTS_DIR / "en" / name).read_text(encoding="utf-8").strip()


# --------------------------------------------------------------------------------------------
# Dialogue knobs (rollout.DialogueArguments)
# --------------------------------------------------------------------------------------------

def check_think(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--think"])
    assert dialogue_args.think and dialogue_args.max_reply_tokens == 32  # derived: 16 thinking + 32 reply
    assert prompt_file("policy_think.txt") in system_prompt(tokenizer, dialogue_args)
    assert budgets_asked(tokenizer, dialogue_args)[:2] == [[16], [32]]  # each turn: thinking, then the reply


def check_profiles(parse, tokenizer, tmp_path):
    from conftest import profile_row, write_jsonl

    path = write_jsonl(tmp_path / "mine.jsonl", [profile_row(first_talk="My own opening.")])
    dialogue_args, _ = parse(["--profiles", str(path)])
    assert first_user(tokenizer, dialogue_args).history[0]["content"] == "My own opening."


def check_start_emotion(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--start_emotion", "55"])
    assert first_user(tokenizer, dialogue_args).emotion == 55


def check_max_turns(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--max_turns", "3"])
    assert first_user(tokenizer, dialogue_args).max_turns == 3
    assert len(budgets_asked(tokenizer, dialogue_args)) == 3  # one generate call a turn


def check_max_think_tokens(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--think", "--max_think_tokens", "7"])
    assert budgets_asked(tokenizer, dialogue_args)[0] == [7]


def check_max_reply_tokens(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--max_reply_tokens", "5"])
    assert budgets_asked(tokenizer, dialogue_args)[0] == [5]
    assert parse(["--think", "--max_reply_tokens", "5"])[0].max_reply_tokens == 5  # stated beats derived


def check_max_dialogue_tokens(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--max_dialogue_tokens", "20"])
    with pytest.raises(common.InputError, match="--max_dialogue_tokens 20: profile .* needs"):
        system_prompt(tokenizer, dialogue_args)


def check_format_penalty(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--format_penalty", "0.25"])
    reward = train_grpo.make_emotion_reward(dialogue_args)
    rewards = reward(completions=["x"], final_emotion=[80], format_violations=[1], turns=[2], failed=[False])
    assert rewards == pytest.approx([0.8 - 0.25 / 2])
    assert rollout.reward(80, 1, 2, dialogue_args.format_penalty) == pytest.approx(0.675)  # what train_ppo.py pays


def check_policy_prompt(parse, tokenizer, tmp_path):
    dialogue_args, _ = parse(["--policy_prompt", "sentient"])
    assert prompt_file("sentient.txt") in system_prompt(tokenizer, dialogue_args)


def check_prefix_cache(parse, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    dialogue_args, _ = parse(["--prefix_cache", "false"])
    assert dialogue_args.prefix_cache is False
    model = AutoModelForCausalLM.from_pretrained(tokenizer.name_or_path)
    ppo_args = train_ppo.PPOArguments()
    assert train_ppo.policy_generator(None, model, tokenizer, ppo_args, dialogue_args, 0).prefix_cache is None
    assert train_ppo.policy_generator(None, model, tokenizer, ppo_args, parse([])[0], 0).prefix_cache is not None


def check_simulator_concurrency(parse, tokenizer, tmp_path):
    import rollout as module

    dialogue_args, _ = parse(["--simulator_concurrency", "3"])
    seen = []
    semaphore = module.asyncio.Semaphore

    def spy(value):
        seen.append(value)
        return semaphore(value)

    module.asyncio.Semaphore = spy
    try:
        budgets_asked(tokenizer, dialogue_args)
    finally:
        module.asyncio.Semaphore = semaphore
    assert seen == [3, 3]  # the openings' gate, then the turns' (tests/test_seams.py counts requests in flight)


def check_max_failed_share(parse, tokenizer, tmp_path):
    from types import SimpleNamespace

    dialogue_args, _ = parse(["--max_failed_share", "0.75"])
    lost, kept = SimpleNamespace(failure="500"), SimpleNamespace(failure=None)
    rollout.check_failures([lost, lost, lost, kept], dialogue_args.max_failed_share)  # 3 of 4 is allowed
    with pytest.raises(rollout.TooManySimulatorFailures):
        rollout.check_failures([lost, lost, lost, kept], parse([])[0].max_failed_share)


# --------------------------------------------------------------------------------------------
# Simulator knobs (simulator.SimulatorArguments)
# --------------------------------------------------------------------------------------------

def check_variant(parse, tokenizer, tmp_path):
    dialogue_args, simulator_args = parse(["--variant", "challenging"])
    assert first_user(tokenizer, dialogue_args, simulator_args).variant == "challenging"


def check_change_bound(parse, tokenizer, tmp_path):
    dialogue_args, simulator_args = parse(["--change_bound", "4"])
    assert first_user(tokenizer, dialogue_args, simulator_args).change_bound == 4


def check_language(parse, tokenizer, tmp_path):
    dialogue_args, simulator_args = parse(endpoint_flags(language="zh"))  # an LLM user: the rule user is English
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args, chat=object())
    user = runner.new_simulator(simulator.load_profiles(dialogue_args.profiles)[0])
    runner.close()
    assert user.language == "zh"
    zh_prompt = (common.PROMPTS_DIR / "zh" / "policy.txt").read_text(encoding="utf-8").strip()
    assert zh_prompt in system_prompt_with(tokenizer, *parse(["--language", "zh"]))  # the policy's side alone


def system_prompt_with(tokenizer, dialogue_args, simulator_args) -> str:
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args)
    text = tokenizer.decode(runner.prompt_ids(simulator.load_profiles(dialogue_args.profiles)[0], "Hello."))
    runner.close()
    return text


def endpoint_flags(**extra) -> list[str]:
    flags = {"backend": "llm", "base_url": "http://127.0.0.1:9/v1", "simulator_model": "served-name", **extra}
    return [item for key, value in flags.items() for item in (f"--{key}", str(value))]


def check_backend(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse([])[1]) is None  # rule
    assert isinstance(rollout.make_chat(parse(endpoint_flags())[1]), chat_client.ChatClient)


def check_simulator_model(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse(endpoint_flags(simulator_model="other"))[1]).model == "other"


def check_base_url(parse, tokenizer, tmp_path):
    chat = rollout.make_chat(parse(endpoint_flags(base_url="http://127.0.0.1:7/v1"))[1])
    assert chat.base_url == "http://127.0.0.1:7/v1"


def check_api_key_env(parse, tokenizer, tmp_path):
    import os

    os.environ["KNOB_TEST_KEY"] = "secret-123"
    try:
        chat = rollout.make_chat(parse(endpoint_flags(api_key_env="KNOB_TEST_KEY"))[1])
    finally:
        del os.environ["KNOB_TEST_KEY"]
    assert chat.client.api_key == "secret-123"


def check_simulator_timeout(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse(endpoint_flags(simulator_timeout=7.5))[1]).client.timeout == 7.5


def check_simulator_temperature(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse(endpoint_flags(simulator_temperature=0.3))[1]).temperature == 0.3
    assert rollout.make_chat(parse(endpoint_flags())[1]).temperature == 0.7  # ours, by default


def generate_threads(tokenizer, dialogue_args) -> set[bool]:
    """Whether each generate call of a 2-dialogue rollout ran in the main thread (lockstep calls it there; async's
    TurnBatcher calls it from a worker thread)."""
    import threading

    in_main = set()

    def generate(contexts, max_new_tokens, stop=None):
        in_main.add(threading.current_thread() is threading.main_thread())
        reply = tokenizer("I hear you.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [reply[:limit] for limit in max_new_tokens], None

    runner = rollout.DialogueRunner(tokenizer, dialogue_args)
    profile = simulator.load_profiles(dialogue_args.profiles)[0]
    runner.run([(profile, runner.openings([profile])[profile.id])] * 2, generate)
    runner.close()
    return in_main


def check_rollout(parse, tokenizer, tmp_path):
    assert parse([])[0].rollout == "async"
    assert generate_threads(tokenizer, parse([])[0]) == {False}
    assert generate_threads(tokenizer, parse(["--rollout", "lockstep"])[0]) == {True}
    with pytest.raises(SystemExit):
        parse(["--rollout", "sometimes"])


def check_batch_wait(parse, tokenizer, tmp_path):
    waits = []
    original = rollout.TurnBatcher.__init__

    def record(self, generate, dialogues, wait):
        waits.append(wait)
        original(self, generate, dialogues, wait)

    rollout.TurnBatcher.__init__ = record
    try:
        generate_threads(tokenizer, parse(["--batch_wait", "0.25"])[0])
    finally:
        rollout.TurnBatcher.__init__ = original
    assert waits == [0.25]
    with pytest.raises(SystemExit):
        parse(["--batch_wait", "-1"])


def check_simulator_max_tokens(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse(endpoint_flags(simulator_max_tokens=64))[1]).max_tokens == 64
    assert rollout.make_chat(parse(endpoint_flags())[1]).max_tokens == 512  # ours, by default


def check_simulator_max_retries(parse, tokenizer, tmp_path):
    assert rollout.make_chat(parse(endpoint_flags(simulator_max_retries=5))[1]).client.max_retries == 5


def check_simulator_parse_attempts(parse, tokenizer, tmp_path):
    """An endpoint that never answers in the analysis format is asked exactly --simulator_parse_attempts times."""
    class Unparseable:
        def __init__(self):
            self.calls = 0

        async def complete(self, messages, stats=None):
            self.calls += 1
            return "Hi." if self.calls == 1 else "no verdict here"  # the opening, then analyses

    for attempts in (2, 5):
        dialogue_args, simulator_args = parse(endpoint_flags(simulator_parse_attempts=attempts))
        chat = Unparseable()
        user = rollout.new_simulator(simulator.load_profiles(dialogue_args.profiles)[0], chat, dialogue_args,
                                     simulator_args)
        asyncio.run(user.open())
        with pytest.raises(simulator.SimulatorError, match=f"after {attempts} attempts"):
            asyncio.run(user.respond("I hear you."))
        assert chat.calls == 1 + attempts


def check_official_prompts(parse, tokenizer, tmp_path):
    """--simulator_prompts, --policy_prompts and --official_repo: refused without a checkout, at parsing
    (tests/test_official_prompts.py plays them against the released code's own functions)."""
    for option in ("simulator_prompts", "policy_prompts"):
        with pytest.raises(SystemExit):
            parse([f"--{option}", "rlver"])
        with pytest.raises(SystemExit):
            parse([f"--{option}", "rlver", "--official_repo", str(tmp_path / "nowhere")])


# --------------------------------------------------------------------------------------------
# Reward knobs beyond format_penalty: turn credit (flags), the rule user's table (one edit)
# --------------------------------------------------------------------------------------------

def check_turn_credit(parse, tokenizer, tmp_path):
    """One field, `DialogueArguments.turn_credit`, for both trainers (tests/test_turn_credit.py: what it does)."""
    assert parse(["--turn_credit"])[0].turn_credit and not parse([])[0].turn_credit


def test_grpos_turn_credit_options_are_flags():
    credit = train_grpo.parse_arguments(["--turn_credit", "--turn_credit_coef", "0.3", "--turn_credit_baseline",
                                         "group", "--turn_credit_scale", "bound"])[2]
    assert (credit.turn_credit_coef, credit.turn_credit_baseline, credit.turn_credit_scale) == (0.3, "group", "bound")


def test_the_rule_users_points_are_one_edit_of_its_table(make_profile, monkeypatch):
    async def change_of(reply):
        user = simulator.RuleSimulator(make_profile(), **user_options())
        await user.open()
        return (await user.respond(reply)).change

    brush_off = "Okay then."  # curt: fewer than min_words words
    assert asyncio.run(change_of(brush_off)) == rule_user.POINTS["curt"] == -5
    monkeypatch.setitem(rule_user.POINTS, "curt", -2)
    assert asyncio.run(change_of(brush_off)) == -2
    monkeypatch.setitem(rule_user.THRESHOLDS, "min_words", 2)
    assert asyncio.run(change_of(brush_off)) == rule_user.POINTS["generic"]  # two words are no longer curt


CASES = {name.removeprefix("check_"): check for name, check in globals().items() if name.startswith("check_")}
# The released prompts' knobs need a checkout: tests/test_official_prompts.py carries them through the trainers.
OFFICIAL = {"simulator_prompts", "policy_prompts", "official_repo", "empty_user_message", "analysis_emotion"}


def test_every_knob_has_a_case():
    knobs = {f.name for f in fields(rollout.DialogueArguments)} | {f.name for f in fields(simulator.SimulatorArguments)}
    assert knobs - OFFICIAL - set(CASES) == set()


@pytest.mark.parametrize("knob", sorted(CASES))
def test_a_knob_set_on_the_command_line_reaches_what_it_controls(knob, parse, tokenizer, tmp_path):
    CASES[knob](parse, tokenizer, tmp_path)


def test_ppos_vllm_server_defaults_are_trls_so_one_trl_vllm_serve_serves_either_trainer():
    import dataclasses

    import trl.scripts.vllm_serve
    from trl import GRPOConfig

    import train_ppo

    trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    serve = {f.name: f.default for f in dataclasses.fields(trl.scripts.vllm_serve.ScriptArguments)}
    ppo = train_ppo.PPOArguments()
    assert (ppo.vllm_server_host, ppo.vllm_server_port) == (trl_defaults["vllm_server_host"],
                                                            trl_defaults["vllm_server_port"]) == (serve["host"],
                                                                                                  serve["port"])


def test_by_default_the_reward_is_the_papers_final_emotion_over_100_with_no_format_penalty():
    options = rollout.DialogueArguments()
    assert rollout.reward(63, format_violations=2, turns=4, format_penalty=options.format_penalty) == 0.63
    assert rollout.DialogueArguments(think=True).format_penalty == 0


def test_no_simulated_user_or_transport_keeps_a_default_of_its_own():
    """A simulator setting's default lives in one dataclass field (SimulatorArguments, or DialogueArguments for the
    dialogue's start and length): the users and the local transport take every setting as a required argument, and
    the endpoint's client sends no temperature or token limit it was not given."""
    import inspect

    def defaults(function) -> dict:
        return {name: parameter.default for name, parameter in inspect.signature(function).parameters.items()
                if parameter.default is not inspect.Parameter.empty}

    for maker in (simulator.Simulator.__init__, llm_user.LLMSimulator.__init__, llm_user.OfficialSimulator.__init__,
                  rollout.make_simulator, llm_user.LocalChat.__init__):
        assert defaults(maker) == {}, maker.__qualname__
    chat = defaults(chat_client.ChatClient.__init__)
    assert chat["temperature"] is None and chat["max_tokens"] is None


@pytest.mark.parametrize("backend", ["rule", "llm", "local", "official"])
def test_the_dialogue_and_simulator_settings_reach_every_backend(backend, tiny_model_dir):
    """Each setting set to a value other than its default reaches the user (and its transport) of each backend."""
    if backend == "official" and not OFFICIAL_REPO.is_dir():
        pytest.skip(f"no checkout of the official code at {OFFICIAL_REPO} (set RLVER_OFFICIAL_REPO)")
    dialogue_args = rollout.DialogueArguments(start_emotion=44, max_turns=3)
    endpoint = ["--backend", "llm", "--simulator_model", "m", "--base_url", "http://127.0.0.1:9/v1"]
    options = {"rule": ["--variant", "challenging"], "llm": [*endpoint, "--variant", "challenging"],
               "local": ["--backend", "local", "--simulator_model", str(tiny_model_dir), "--variant", "challenging"],
               # the released prompts have one variant, vanilla
               "official": [*endpoint, "--simulator_prompts", "rlver", "--official_repo", str(OFFICIAL_REPO),
                            "--analysis_emotion", "start", "--empty_user_message", "ask_again"]}[backend]
    variant = "vanilla" if backend == "official" else "challenging"
    simulator_args = train_grpo.parse_arguments(["--change_bound", "7", "--simulator_temperature", "0.3",
                                                 "--simulator_max_tokens", "77", "--simulator_parse_attempts", "5",
                                                 *options])[1]
    chat = rollout.make_chat(simulator_args)
    user = rollout.new_simulator(simulator.load_profiles(dialogue_args.profiles)[0], chat, dialogue_args, simulator_args)
    assert (user.emotion, user.max_turns, user.variant, user.change_bound) == (44, 3, variant, 7)
    if backend != "rule":
        assert user.parse_attempts == 5
    if backend == "official":
        assert type(user) is llm_user.OfficialSimulator
        assert (user.analysis_emotion, user.keep_empty) == ("start", False)
    if backend == "llm":
        assert (chat.temperature, chat.max_tokens) == (0.3, 77)
    if backend == "local":
        assert (chat.temperature, chat.max_new_tokens) == (0.3, 77)
