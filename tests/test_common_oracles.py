"""guards.py's option checks, --config files and argument parsing, and common.py's JSON Lines files, at their boundaries and
against oracles written apart from the code (a file cut at every byte of its last line, rules at the values
where they turn)."""
import json
import os
import re
import warnings
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

import chat_client
import common
import guards
import rollout

# --------------------------------------------------------------------------------------------
# check_options: each rule at the value where it turns
# --------------------------------------------------------------------------------------------


@dataclass
class Knobs:
    low: float = 0.5
    high: float = 0.5
    count: int = 1
    share: float = 0.5
    weight: float = 0.0


RULES = {"low": guards.POSITIVE, "count": guards.AT_LEAST_ONE, "share": guards.FRACTION, "weight": guards.NOT_NEGATIVE}


@pytest.mark.parametrize("option, passes, fails", [
    ("low", [5e-324, 1e-9, 3.0], [0.0, -0.0, -1e-9]),  # above 0
    ("count", [1, 2, 10**9], [0, -1]),  # at least 1
    ("share", [0.0, 1.0, 0.5], [-1e-12, 1.0000001, 2.0]),  # within 0-1, both ends in
    ("weight", [0.0, 7.5], [-1e-12, -3.0]),  # 0 or more
])
def test_each_rule_turns_exactly_at_its_bound(option, passes, fails):
    for value in passes:
        guards.check_options(Knobs(**{option: value}), **RULES)
    for value in fails:
        with pytest.raises(common.ArgumentError) as error:
            guards.check_options(Knobs(**{option: value}), **RULES)
        assert str(error.value) == f"--{option} {value!r}: must be {RULES[option][1]}"


def test_an_option_without_a_rule_is_not_checked_by_another_options_rule():
    """high shares low's value by default; only low has a rule, so only low's value is read by it."""
    guards.check_options(Knobs(low=0.1, high=-5.0), **RULES)
    with pytest.raises(common.ArgumentError, match=r"^--low -5.0: must be above 0$"):
        guards.check_options(Knobs(low=-5.0, high=0.1), **RULES)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_float_is_refused_in_any_field_with_or_without_a_rule(value):
    for option in ("low", "high"):
        with pytest.raises(common.ArgumentError, match=rf"^--{option} {value!r}: must be a finite number$"):
            guards.check_options(Knobs(**{option: value}), **RULES)


def test_every_broken_option_is_named_the_non_finite_first_then_in_the_order_of_the_rules():
    with pytest.raises(common.ArgumentError) as error:
        guards.check_options(Knobs(low=0.0, count=0, share=1.5, weight=-1.0, high=float("inf")), **RULES)
    assert str(error.value) == ("--high inf: must be a finite number; --low 0.0: must be above 0; --count 0: must be "
                                "at least 1; --share 1.5: must be within 0-1; --weight -1.0: must be 0 or more")


@pytest.mark.parametrize("option, good, bad", [
    ("start_emotion", [0, 100], [-1, 101]),
    ("max_turns", [1], [0]), ("max_think_tokens", [1], [0]), ("max_reply_tokens", [1], [0]),
    ("max_dialogue_tokens", [1], [0]), ("simulator_concurrency", [1], [0]),
    ("format_penalty", [0.0, 3.0], [-0.01]), ("max_failed_share", [0.0, 1.0], [-0.01, 1.01]),
])
def test_dialogue_options_turn_at_their_documented_bounds(option, good, bad):
    for value in good:
        assert getattr(rollout.DialogueArguments(**{option: value}), option) == value
    for value in bad:
        with pytest.raises(common.ArgumentError, match=rf"^--{option} {value!r}: must be "):
            rollout.DialogueArguments(**{option: value})


def test_the_reply_budget_defaults_to_48_or_32_with_think_and_a_given_one_is_kept():
    assert rollout.DialogueArguments().max_reply_tokens == 48
    assert rollout.DialogueArguments(think=True).max_reply_tokens == 32
    assert rollout.DialogueArguments(think=True, max_reply_tokens=7).max_reply_tokens == 7
    assert rollout.DialogueArguments(max_reply_tokens=7, max_think_tokens=3).max_think_tokens == 3


# --------------------------------------------------------------------------------------------
# read_config and parse_arguments: defaults, then the YAML file, then the flags
# --------------------------------------------------------------------------------------------


@dataclass
class ClipArguments:
    clip_low: float = field(default=0.2, metadata={"help": "lower clip range"})
    clip_high: float = field(default=0.28, metadata={"help": "upper clip range"})
    epochs: int = field(default=1, metadata={"help": "passes over a batch"})

    def __post_init__(self):
        guards.check_options(self, clip_low=guards.FRACTION, clip_high=guards.FRACTION, epochs=guards.AT_LEAST_ONE)


@pytest.fixture
def parser():
    from trl import TrlParser
    return TrlParser((ClipArguments,))


def parse(parser, argv):
    [args] = guards.parse_arguments(parser, argv, hint=lambda message: " (HINT)")
    return args


def test_flags_override_the_config_which_overrides_the_defaults_option_by_option(parser, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("clip_low: 0.1\nepochs: 3\n")
    assert parse(parser, []) == ClipArguments(0.2, 0.28, 1)
    assert parse(parser, ["--config", str(config)]) == ClipArguments(0.1, 0.28, 3)
    assert parse(parser, [f"--config={config}", "--clip_high", "0.4", "--epochs", "2"]) == ClipArguments(0.1, 0.4, 2)


def test_a_config_may_set_environment_variables_under_env(parser, tmp_path, monkeypatch):
    monkeypatch.delenv("RLVER_TEST_VARIABLE", raising=False)
    config = tmp_path / "run.yaml"
    config.write_text("env:\n  RLVER_TEST_VARIABLE: 7\nepochs: 2\n")
    assert parse(parser, ["--config", str(config)]).epochs == 2
    import os
    assert os.environ["RLVER_TEST_VARIABLE"] == "7"
    monkeypatch.delenv("RLVER_TEST_VARIABLE")


@pytest.mark.parametrize("argv, message", [
    (["--clip_high", "1.5"], "--clip_high 1.5: must be within 0-1"),
    (["--epochs", "0"], "--epochs 0: must be at least 1"),
    (["--clip_hgh", "0.3"], "(HINT)"),  # an unknown flag: the library's message and the hint
])
def test_a_value_that_cannot_work_prints_usage_and_exits_2(parser, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(parser, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and message in err


def test_a_config_value_that_cannot_work_exits_2_like_a_flag(parser, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("clip_low: -0.1\n")
    with pytest.raises(SystemExit) as exit_:
        parse(parser, ["--config", str(config)])
    assert exit_.value.code == 2 and "--clip_low -0.1: must be within 0-1" in capsys.readouterr().err


def test_a_faulty_config_file_is_an_input_error_naming_it_not_usage(parser, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("clip_lo: 0.1\n")
    with pytest.raises(common.InputError, match=r"run.yaml: unknown option\(s\): clip_lo \(did you mean clip_low\?\)"):
        parse(parser, ["--config", str(config)])
    with pytest.raises(common.InputError, match="YAML config not found"):
        parse(parser, ["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("argv", [["--config"], ["--config", "--epochs", "2"]])
def test_config_without_its_file_is_refused(parser, argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(parser, argv)
    assert exit_.value.code == 2 and "--config needs a YAML file" in capsys.readouterr().err


def test_config_file_reads_both_spellings_and_no_flag():
    assert guards.config_file(["--epochs", "2", "--config", "a.yaml"]) == "a.yaml"
    assert guards.config_file(["--config=b.yaml", "--epochs", "2"]) == "b.yaml"
    assert guards.config_file(["--epochs", "2"]) is None
    assert common.split_config_flag(["--config=c=d.yaml", "--x=1"]) == ["--config", "c=d.yaml", "--x=1"]


def test_a_config_may_not_set_help_or_config_itself(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--epochs")
    config = tmp_path / "run.yaml"
    for key in ("config", "help"):
        config.write_text(f"{key}: x\n")
        with pytest.raises(common.InputError, match=rf"unknown option\(s\): {key}"):
            guards.read_config(config, parser)
    config.write_text("")
    assert guards.read_config(config, parser) == {}
    config.write_text("epochs: 4\n")
    assert guards.read_config(config, parser) == {"epochs": 4}


# --------------------------------------------------------------------------------------------
# JSON Lines: a writer killed at any byte of its last line
# --------------------------------------------------------------------------------------------

ROW = st.dictionaries(st.sampled_from(["step", "text", "id"]),
                      st.one_of(st.integers(-5, 10**6), st.text(alphabet=st.sampled_from(list("a \"\\\n{}") +
                                                                                          ["情", "é", "🙂"]),
                                                                max_size=6)), max_size=3)


@st.composite
def cut_files(draw):
    """(rows, a file of them whose last line was cut after any of its bytes, whether that left the row whole)."""
    rows = draw(st.lists(ROW, min_size=1, max_size=5))
    lines = [(json.dumps(row, ensure_ascii=False) + "\n").encode() for row in rows]
    written = draw(st.integers(0, len(lines[-1]) - 1))
    return rows, b"".join(lines[:-1]) + lines[-1][:written], written == len(lines[-1]) - 1


def lines_of(rows) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


@given(cut=cut_files())
def test_repair_leaves_the_whole_rows_each_on_its_line_wherever_the_last_line_was_cut(tmp_path_factory, cut):
    rows, data, last_whole = cut
    path = tmp_path_factory.mktemp("repair") / "rows.jsonl"
    path.write_bytes(data)
    common.repair_last_line(path)
    assert path.read_bytes() == lines_of(rows if last_whole else rows[:-1])


@given(cut=cut_files(), more=st.lists(ROW, max_size=3))
def test_appending_after_a_cut_gives_the_whole_rows_then_the_new_ones(tmp_path_factory, cut, more):
    rows, data, last_whole = cut
    path = tmp_path_factory.mktemp("append") / "rows.jsonl"
    path.write_bytes(data)
    common.append_json_lines(path, more)
    assert path.read_bytes() == lines_of((rows if last_whole else rows[:-1]) + more)
    assert [row for _, _, row in common.json_lines(path, "rows")] == (rows if last_whole else rows[:-1]) + more


@given(cut=cut_files())
def test_reading_a_cut_file_skips_only_its_cut_last_line_and_numbers_lines_from_one(tmp_path_factory, cut):
    rows, data, last_whole = cut
    path = tmp_path_factory.mktemp("read") / "rows.jsonl"
    path.write_bytes(data)
    read = list(common.json_lines(path, "rows", skip_cut_last_line=True))
    whole = rows if last_whole else rows[:-1]
    assert [row for _, _, row in read] == whole
    assert [(number, where) for number, where, _ in read] == [(n, f"{path}:{n}") for n in range(1, len(whole) + 1)]


def test_a_cut_last_line_without_skipping_is_an_error_naming_it(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "\xe6\x83')  # cut inside a three-byte character
    with pytest.raises(common.InputError, match=r"rows.jsonl:2: not UTF-8"):
        list(common.json_lines(path, "rows"))
    assert [row for _, _, row in common.json_lines(path, "rows", skip_cut_last_line=True)] == [{"a": 1}]


def test_blank_lines_are_skipped_but_keep_their_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"a": 1}\n  \n{"a": 2}\n')
    assert [(number, row) for number, _, row in common.json_lines(path, "rows")] == [(2, {"a": 1}), (4, {"a": 2})]


def test_repair_leaves_an_empty_file_and_a_file_ending_in_a_newline_alone(tmp_path, capsys):
    empty, whole = tmp_path / "empty.jsonl", tmp_path / "whole.jsonl"
    empty.write_bytes(b"")
    whole.write_bytes(b'{"a": 1}\n{"a": 2}\n')
    for path in (empty, whole, tmp_path / "missing.jsonl"):
        common.repair_last_line(path)
    assert (empty.read_bytes(), whole.read_bytes()) == (b"", b'{"a": 1}\n{"a": 2}\n')
    assert not (tmp_path / "missing.jsonl").exists()
    assert capsys.readouterr().err == ""  # nothing was cut, so nothing is said


def test_a_one_line_file_cut_short_is_emptied(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": ')
    common.repair_last_line(path)
    assert path.read_bytes() == b""
    assert "rows.jsonl:1: the last line was cut short" in capsys.readouterr().err


def test_a_cut_last_line_is_named_by_its_line_and_its_bytes_after_blank_and_whole_lines(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\n{"a": 1}\n{"a": 2, "b')  # a blank first line, a whole row, 11 bytes cut short
    common.repair_last_line(path)
    assert path.read_bytes() == b'\n{"a": 1}\n'
    assert "rows.jsonl:3: the last line was cut short (a run killed while writing it?); dropped (11 bytes)" in \
        capsys.readouterr().err


def test_the_api_key_comes_from_the_named_variable(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "the-default-key")
    monkeypatch.setenv("MY_SIM_KEY", "the-named-key")
    client = chat_client.ChatClient("http://127.0.0.1:9/v1", "m", api_key_env="MY_SIM_KEY")
    assert client.client.api_key == "the-named-key"
    monkeypatch.delenv("MY_SIM_KEY")
    assert chat_client.ChatClient("http://127.0.0.1:9/v1", "m", api_key_env="MY_SIM_KEY").client.api_key == "EMPTY"


def test_a_seed_of_zero_is_sent_as_zero():
    from fake_openai import FakeOpenAIServer

    import asyncio

    with FakeOpenAIServer(models=["m"], default="ok") as server:
        client = chat_client.ChatClient(server.base_url, "m")
        for seed in (0, 3, None):
            assert asyncio.run(client.complete([{"role": "user", "content": "hi"}], seed=seed)) == "ok"
    assert [body.get("seed", "absent") for body in server.requests] == [0, 3, "absent"]


@pytest.mark.parametrize("files, ok", [(["config.json"], True), (["adapter_config.json"], True), (["README.md"], False)])
def test_a_model_folder_holds_a_model_or_an_adapter(tmp_path, files, ok):
    for name in files:
        (tmp_path / name).write_text("{}")
    if ok:
        guards.check_model_source(str(tmp_path), "model")
    else:
        with pytest.raises(common.InputError, match="a folder without a model"):
            guards.check_model_source(str(tmp_path), "model")


@pytest.mark.parametrize("served, ok", [([], True), (["m"], True), (["other"], False)])
def test_an_endpoint_that_lists_no_models_is_taken_at_its_word_one_that_lists_others_is_refused(served, ok):
    import asyncio

    from fake_openai import FakeOpenAIServer

    with FakeOpenAIServer(models=served) as server:
        check = chat_client.ChatClient(server.base_url, "m").check()
        if ok:
            asyncio.run(check)
        else:
            with pytest.raises(common.EndpointError, match=r"model 'm' is not served at .*it serves \['other'\]"):
                asyncio.run(check)


def test_an_endpoint_answer_without_usage_is_taken_and_counts_no_tokens():
    import asyncio

    from fake_openai import FakeOpenAIServer

    with FakeOpenAIServer([{"text": "Fine.", "usage": False}, "Good."]) as server:
        chat = chat_client.ChatClient(server.base_url, "sim-model", max_retries=0, timeout=5)
        answers = [asyncio.run(chat.complete([{"role": "user", "content": "How are you?"}])) for _ in range(2)]
    assert answers == ["Fine.", "Good."]
    assert (chat.totals.calls, chat.totals.failed, chat.totals.completion_tokens) == (2, 0, 1)
    assert chat.totals.prompt_tokens == 3  # the second answer's: "How are you?"


@pytest.mark.parametrize("script", ["train_ppo", "train_grpo"])
@pytest.mark.parametrize("line, message", [
    ("max_steps: 1.5", "max_steps: 1.5 is not int"),
    ("learning_rate: [0.1]", "learning_rate: [0.1] is not one value"),
    ("max_turns: many", "max_turns: 'many' is not int"),
    ("backend: cloud", "backend: 'cloud' is not one of rule, llm, local"),
    ("think: maybe", "think: 'maybe' is not true or false"),
    ("max_steps: null", "max_steps: no value (null); give one, or leave the line out for the default"),
    ("max_turns:", "max_turns: no value (null)"),
])
def test_a_config_value_of_the_wrong_type_is_refused_naming_its_file_and_line(tmp_path, script, line, message):
    import importlib

    config = tmp_path / "run.yaml"
    config.write_text(f"# mine\n{line}\n")
    with pytest.raises(common.InputError, match=re.escape(f"{config}:2: {message}")):
        importlib.import_module(script).parse_arguments(["--config", str(config)])


def test_an_option_set_twice_in_a_config_is_refused_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys without a word: the first value would be silently ignored."""
    import train_ppo

    config = tmp_path / "run.yaml"
    config.write_text("max_turns: 3\nthink: true\nmax_turns: 5\n")
    with pytest.raises(common.InputError, match=re.escape(f"{config}:3: max_turns is set again (first on line 1); "
                                                          "keep one")):
        train_ppo.parse_arguments(["--config", str(config)])


def test_config_values_that_read_as_their_flags_would_are_taken(tmp_path):
    import train_ppo

    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\nlearning_rate: 1e-4\nthink: true\ngamma: 1\n")  # 1e-4: a string to YAML 1.1
    args, dialogue_args, _ = train_ppo.parse_arguments(["--config", str(config)])
    assert (args.max_steps, args.learning_rate, dialogue_args.think, args.gamma) == (3, 1e-4, True, 1.0)


@pytest.mark.parametrize("accelerator, given, expected", [(False, None, "cpu"), (True, None, None),
                                                          (False, "xpu", "xpu")])
def test_quiet_libraries_tells_deepspeed_the_cpu_only_where_torch_sees_no_accelerator(monkeypatch, accelerator, given,
                                                                                        expected):
    """On a GPU machine DeepSpeed must find the GPU itself; a DS_ACCELERATOR the user set is kept."""
    import torch
    from transformers.utils import logging as transformers_logging

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    if given:
        monkeypatch.setenv("DS_ACCELERATOR", given)
    previous = transformers_logging.set_tqdm_hook(None)
    try:
        with warnings.catch_warnings():  # its filters stay in this test
            common.quiet_libraries()
        assert os.environ.get("DS_ACCELERATOR") == expected
    finally:
        transformers_logging.set_tqdm_hook(previous)


def test_quiet_libraries_hides_the_weight_loading_bar_and_no_other(monkeypatch):
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # what it sets is undone after the test
    previous = transformers_logging.set_tqdm_hook(None)
    try:
        with warnings.catch_warnings():
            common.quiet_libraries()
        loading = transformers_logging.tqdm(range(3), desc="Loading weights")
        downloading = transformers_logging.tqdm(range(3), desc="Downloading")
        assert getattr(loading, "disable", True) and list(loading) == [0, 1, 2]
        assert not getattr(downloading, "disable", False)
        downloading.close()
    finally:
        transformers_logging.set_tqdm_hook(previous)
