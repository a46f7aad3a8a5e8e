"""The one place that reads input files and checks options (common.py, and the profile reader of simulator.py):
every script's errors for bad files, lines and values come from here."""
import argparse
import json
import sys
from pathlib import Path
from dataclasses import dataclass

import pytest

import common
import guards
import simulator
import talk


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"name": "Jos\xe9"}\n')
    with pytest.raises(common.InputError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9\); is it the profile"):
        list(common.json_lines(path, "profile file"))
    with pytest.raises(common.InputError, match=r"latin1.jsonl:2: not UTF-8 text"):
        common.read_text(path, "replies file")


def test_a_folder_or_a_missing_file_is_said_to_be_one(tmp_path):
    with pytest.raises(common.InputError, match="a folder; give the profile file itself"):
        common.read_text(tmp_path, "profile file")
    with pytest.raises(simulator.ProfileError, match="nope.jsonl: profile file not found"):
        list(common.json_lines(tmp_path / "nope.jsonl", "profile file", simulator.ProfileError))


def test_a_bad_line_in_the_middle_is_an_error_even_where_a_cut_last_line_is_skipped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(common.InputError, match=r"rows.jsonl:2: not valid JSON") as error:
        list(common.json_lines(path, "transcript", skip_cut_last_line=True))
    assert "cut short" not in str(error.value)


def test_a_last_line_cut_short_is_named_or_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3, "b"')
    with pytest.raises(common.InputError, match=r"rows.jsonl:3: .*the last line, cut short"):
        list(common.json_lines(path, "transcript"))
    assert [row for _, _, row in common.json_lines(path, "transcript", skip_cut_last_line=True)] == [{"a": 1}, {"a": 2}]
    assert "rows.jsonl:3: the last line is cut short" in capsys.readouterr().err


def test_a_whole_last_row_without_its_newline_is_read(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}')
    assert [row for _, _, row in common.json_lines(path, "transcript")] == [{"a": 1}, {"a": 2}]


def test_appending_completes_a_whole_last_row_and_drops_a_cut_one(tmp_path, capsys):
    whole, cut = tmp_path / "whole.jsonl", tmp_path / "cut.jsonl"
    whole.write_text('{"a": 1}\n{"a": 2}')
    cut.write_text('{"a": 1}\n{"a": 2, "b')
    for path in (whole, cut):
        common.append_json_lines(path, [{"a": 9}])
    assert [json.loads(line) for line in whole.read_text().splitlines()] == [{"a": 1}, {"a": 2}, {"a": 9}]
    assert [json.loads(line) for line in cut.read_text().splitlines()] == [{"a": 1}, {"a": 9}]
    err = capsys.readouterr().err
    assert "cut.jsonl:2: the last line was cut short" in err and "whole.jsonl" not in err


@dataclass
class Options:
    rate: float = 1.0
    count: int = 1
    limit: int | None = None


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_float_option_must_be_finite_even_without_a_rule(value):
    with pytest.raises(common.ArgumentError, match=r"--rate .*: must be a finite number"):
        guards.check_options(Options(rate=value))


def test_a_non_finite_value_is_named_once_not_also_by_its_rule():
    with pytest.raises(common.ArgumentError) as error:
        guards.check_options(Options(rate=float("nan")), rate=guards.POSITIVE)
    assert str(error.value) == "--rate nan: must be a finite number"


def test_rules_name_every_broken_option_and_leave_unset_ones_alone():
    guards.check_options(Options(), limit=guards.AT_LEAST_ONE)
    with pytest.raises(common.ArgumentError) as error:
        guards.check_options(Options(rate=0.0, count=0, limit=0), rate=guards.POSITIVE,
                             count=guards.AT_LEAST_ONE, limit=guards.AT_LEAST_ONE)
    assert str(error.value) == ("--rate 0.0: must be above 0; --count 0: must be at least 1; "
                                "--limit 0: must be at least 1")


@pytest.fixture
def parser():
    parser = argparse.ArgumentParser()
    for name in ("config", "learning_rate", "max_steps"):
        parser.add_argument(f"--{name}")
    return parser


def test_a_config_with_a_misspelt_key_names_it_and_the_likely_one(tmp_path, parser):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-6\nmax_step: 10\n")
    with pytest.raises(common.InputError, match=r"run.yaml: unknown option\(s\): max_step \(did you mean max_steps\?\)"):
        guards.read_config(path, parser)
    path.write_text("learning_rate: 1.0e-6\nmax_steps: 10\n")
    assert guards.read_config(path, parser) == {"learning_rate": 1e-6, "max_steps": 10}


def test_a_config_may_hold_the_extra_keys_its_parser_reads_itself(tmp_path, parser):
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  WANDB_PROJECT: rlver\nmax_steps: 10\n")
    with pytest.raises(common.InputError, match=r"unknown option\(s\): env"):
        guards.read_config(path, parser)
    assert guards.read_config(path, parser, extra_keys=("env",))["env"] == {"WANDB_PROJECT": "rlver"}


def test_a_config_that_is_not_yaml_or_not_a_mapping_is_named_with_its_line(tmp_path, parser):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 1.0e-6\nmax_steps: [10\n")
    with pytest.raises(common.InputError, match=r"run.yaml:3: not valid YAML"):
        guards.read_config(path, parser)
    path.write_text("- learning_rate\n")
    with pytest.raises(common.InputError, match="a config is a mapping of option: value, got list"):
        guards.read_config(path, parser)
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(common.InputError, match="not UTF-8 text"):
        guards.read_config(path, parser)


def test_an_output_folder_under_a_file_is_refused_and_nothing_is_created(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(common.InputError, match=r"--output_dir .*/file/run: .*/file is a file, not a folder"):
        guards.check_output_folder(tmp_path / "file" / "run", "output_dir")
    guards.check_output_folder(tmp_path / "new" / "run", "output_dir")
    assert not (tmp_path / "new").exists()


def test_a_model_that_is_no_folder_and_no_reachable_hub_id_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(common.InputError, match=r"^--model \./nope: no such folder \(and not a hub id"):
        guards.checked_model("./nope", "model")
    with pytest.raises(common.InputError, match=r"runs/nope: no such folder, and not in the hub cache .*"
                       r"HF_HUB_OFFLINE is set"):
        guards.checked_model("runs/nope")
    with pytest.raises(common.InputError, match="a folder without a model"):
        guards.checked_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert guards.checked_model(str(tmp_path)) == str(tmp_path)


def test_a_hub_id_the_hub_cannot_be_asked_for_says_so(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens on port 9
    with pytest.raises(common.InputError, match=r"org/model: .*the hub \(127.0.0.1\) cannot be reached"):
        guards.checked_model("org/model")


def test_the_rule_backend_refuses_chinese_dialogues_naming_why(make_profile):
    english = make_profile()
    rule = simulator.SimulatorArguments()
    simulator.check_backend([english], rule)
    with pytest.raises(simulator.SimulatorError, match="--language zh: the rule backend has English cues only"):
        simulator.check_backend([english], simulator.SimulatorArguments(language="zh"))
    chinese = simulator.parse_profile({**english.to_row(), "task": simulator.INTENTIONS["venting"][1]})
    with pytest.raises(simulator.SimulatorError, match=f"profile {chinese.id} is Chinese"):
        simulator.check_backend([english, chinese], rule)
    simulator.check_backend([chinese], simulator.SimulatorArguments(backend="llm", simulator_model="m"))


# --------------------------------------------------------------------------------------------
# Every numeric option has a rule, and the rule does what its message says
# --------------------------------------------------------------------------------------------

def option_classes():
    import eval_general
    import eval_sentient
    import rollout
    import train_grpo
    import train_ppo

    return [(rollout.DialogueArguments, {}), (simulator.SimulatorArguments, {}), (eval_sentient.EvalArguments, {}),
            (eval_general.GeneralEvalArguments, {}), (train_ppo.PPOArguments, {}),
            (train_grpo.TurnCreditArguments, {}), (talk.PlayArguments, {"profile": "en-train-01"})]


def rules_of(options_class, required, monkeypatch) -> dict:
    """The rules the class's __post_init__ hands to check_options, caught on their way."""
    rules, check = {}, guards.check_options
    monkeypatch.setattr(guards, "check_options", lambda options, **given: rules.update(given) or check(options, **given))
    options_class(**required)
    return rules


def bounds_said(what: str):
    """(lowest accepted or None, whether it is accepted, highest accepted or None) read from the message alone."""
    import re

    if match := re.fullmatch(r"above (\d+)( and at most (\d+))?", what):
        return float(match[1]), False, float(match[3]) if match[3] else None
    if match := re.fullmatch(r"at least (\d+)( \(.*\))?", what):
        return float(match[1]), True, None
    if what == "0 or more":
        return 0.0, True, None
    if match := re.fullmatch(r"within (\d+)-(\d+)", what):
        return float(match[1]), True, float(match[2])
    if match := re.fullmatch(r"from (\d+) to (\d+)( \(.*\))?", what):
        return float(match[1]), True, float(match[2])
    return None


# Rules whose message is not a plain range (lists, dates, paths, a divisor), each tested where it is defined.
NOT_A_RANGE = {"tasks", "livecodebench_release", "livecodebench_start_date", "livecodebench_end_date", "compare",
               "micro_batch_size", "base_url", "model_base_url"}


@pytest.mark.parametrize("index", range(7))
def test_every_numeric_option_has_a_rule_that_accepts_and_refuses_exactly_what_its_message_says(index, monkeypatch):
    """A rule's message (what a user reads) against its test (what the code does), at each bound and just past
    it: an integer option a step of 1 away, a float one a step of 1e-9."""
    import dataclasses

    options_class, required = option_classes()[index]
    rules = rules_of(options_class, required, monkeypatch)
    numeric = {item.name: item.type for item in dataclasses.fields(options_class)
               if item.type in (int, float, int | None, float | None)}
    assert numeric and set(numeric) <= set(rules), f"{options_class.__name__}: no rule for {set(numeric) - set(rules)}"
    for name, (test, what) in rules.items():
        if name in NOT_A_RANGE:
            continue
        said = bounds_said(what)
        assert said is not None, f"{name}: a message no test reads: {what!r}"
        low, low_accepted, high = said
        step = 1 if numeric[name] in (int, int | None) else 1e-9
        assert test(low) is low_accepted and not test(low - step), (name, what)
        assert test(low + step), (name, what)
        if high is None:
            assert test(10 ** 6), (name, what)
        else:
            assert test(high) and not test(high + step), (name, what)


def test_a_model_cache_that_is_a_file_is_refused_before_the_packaged_model_converts(tmp_path, monkeypatch):
    (tmp_path / "r.txt").write_text("")
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "r.txt"))
    with pytest.raises(common.InputError, match=r"^\$RLVER_CACHE .*r\.txt: .*r\.txt is a file, not a folder$"):
        guards.checked_model(common.PACKAGED_MODEL)


def test_a_device_given_as_an_input_file_is_named_as_such_not_as_missing():
    with pytest.raises(common.InputError, match="^/dev/null: not a regular file; give the profile file as a file$"):
        common.read_text("/dev/null", "profile file")


def test_an_input_path_with_a_leading_tilde_is_read_from_the_home_folder(tmp_path, monkeypatch):
    """A config file's paths reach the scripts unexpanded: `profiles: ~/mine.jsonl` must still be found."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.jsonl").write_text("{}\n")
    assert common.read_text("~/mine.jsonl", "profile file") == "{}\n"


def test_model_folders_written_at_once_by_two_processes_leave_one_whole_folder_and_no_partial(tmp_path):
    """The ranks of a launch on a fresh clone (or parallel test workers) convert the packaged model at once."""
    import threading

    target, both_written = tmp_path / "cache" / "model", threading.Barrier(2)
    errors = []

    def writer(name):
        def write(folder):
            (folder / "config.json").write_text(name)
            both_written.wait(timeout=10)  # neither renames before both have written
        try:
            common.write_folder_once(target, write)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert (target / "config.json").read_text() in {"a", "b"}
    assert [f.name for f in target.parent.iterdir()] == ["model"]


def test_a_model_folder_write_that_fails_leaves_nothing_and_says_why(tmp_path):
    def write(folder):
        (folder / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        common.write_folder_once(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("launcher_env, launcher", [
    ({}, "python "),
    ({"TORCHELASTIC_RUN_ID": "none"}, "torchrun [its options, as before] "),
    ({"TORCHELASTIC_RUN_ID": "none", "ACCELERATE_MIXED_PRECISION": "no"}, "accelerate launch [its options, as before] "),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "accelerate launch [its options, as before] "),  # one process
])
def test_the_resume_command_names_the_launcher_and_replaces_the_option_it_continues_with(launcher_env, launcher,
                                                                                          monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["/repo/train_grpo.py", "--output_dir", "my runs/a", "--resume_from_checkpoint",
                                      "old", "--max_steps", "9"])
    assert guards.resume_command("--resume_from_checkpoint", "runs/a/checkpoint-3") == (
        launcher + "train_grpo.py --output_dir 'my runs/a' --max_steps 9 --resume_from_checkpoint runs/a/checkpoint-3")
    monkeypatch.setattr(sys, "argv", ["train_ppo.py", "--resume", "--think"])
    assert guards.resume_command("--resume") == launcher + "train_ppo.py --think --resume"


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_an_output_held_by_another_run_is_refused_until_that_run_ends(kind, tmp_path):
    from conftest import held_by_another_process

    path = tmp_path / "out"
    path.mkdir() if kind == "folder" else path.write_text('{"id": "a"}\n')
    with held_by_another_process(path):
        with pytest.raises(common.InputError, match=rf"^--output {path}: another run is writing there now; let it "
                                                    "finish, or give another path$"):
            guards.hold(path, "--output")
    guards.hold(path, "--output")  # that run has ended
    guards.hold(path, "--output", create=kind)  # held once per process: this run's first rows go on
    assert path.is_dir() if kind == "folder" else path.read_text() == '{"id": "a"}\n'


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_an_output_that_appeared_after_the_run_started_is_refused_at_its_first_rows(kind, tmp_path):
    """This run found none, so it counted no finished rows: writing among another run's would play them twice."""
    path = tmp_path / "out"
    path.mkdir() if kind == "folder" else path.write_text('{"id": "a"}\n')  # made by another run since
    with pytest.raises(common.InputError, match=rf"^--output {path}: another run began writing there after this "
                                                "one started; run the same command again to go on from its rows$"):
        guards.hold(path, "--output", create=kind)
    assert path.is_dir() if kind == "folder" else path.read_text() == '{"id": "a"}\n'


def test_an_empty_model_cache_variable_means_the_default_not_the_current_folder(tmp_path):
    """RLVER_CACHE= would convert the 500 MB model into whatever folder the command was run from."""
    import os
    import subprocess

    shown = subprocess.run([sys.executable, "-c", "import common; print(common.model_cache())"], cwd=tmp_path,
                           env={**os.environ, "RLVER_CACHE": "", "PYTHONPATH": str(common.REPO_DIR)},
                           capture_output=True, text=True, check=True).stdout.strip()
    assert shown == str(common.REPO_DIR / "cache")


def test_an_output_naming_an_input_through_a_missing_folder_is_refused_as_the_input(tmp_path):
    """x/../in.jsonl with x missing: the kernel cannot follow it yet, but the folder made for it would make it so."""
    given = tmp_path / "in.jsonl"
    given.write_text("{}\n")
    with pytest.raises(common.InputError, match="that is an input of this run"):
        guards.check_output_file(tmp_path / "x" / ".." / "in.jsonl", "output", None, [given])


def test_an_output_that_is_a_link_loop_is_named_as_one(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(common.InputError, match="a symbolic link that leads back to itself"):
        guards.check_output_file(tmp_path / "a", "output")
    with pytest.raises(common.InputError, match=rf"^--output_dir {tmp_path / 'a'}: a symbolic link that leads back"):
        guards.check_output_folder(tmp_path / "a", "output_dir")


def test_a_config_given_twice_is_refused_naming_it(tmp_path):
    with pytest.raises(common.ArgumentError, match="--config is given twice; give one YAML file"):
        guards.config_file(["--config", "a.yaml", "--config=b.yaml"])


def test_a_printed_command_names_the_script_as_it_runs_from_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(common.REPO_DIR)
    assert common.script_command("report.py") == "python report.py"
    monkeypatch.chdir(tmp_path)  # a run started elsewhere: `python report.py` would not be found there
    shown = common.script_command("report.py").removeprefix("python ")
    assert (tmp_path / shown).resolve() == common.REPO_DIR / "report.py"


def test_only_a_failed_collective_of_several_processes_counts_as_a_lost_process(monkeypatch):
    """Any other RuntimeError keeps its traceback: the trainers catch only what a dead peer causes."""
    def failing():
        raise RuntimeError("shape mismatch")

    for world_size in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", world_size)
        with pytest.raises(RuntimeError) as raised:
            failing()
        assert guards.lost_process(raised.value) is False


@pytest.mark.parametrize("world, local, refused", [(16, 8, True), (8, 8, False), (None, None, False)])
def test_on_several_nodes_addresses_that_name_each_node_itself_are_refused(monkeypatch, world, local, refused):
    import preflight

    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    llm_user = lambda url: simulator.SimulatorArguments(backend="llm", base_url=url)  # noqa: E731
    for local_address in ("http://localhost:8001/v1", "http://127.0.0.2:8001/v1", "http://0.0.0.0:8001",
                          "http://[::1]:8001/v1"):
        checks = [lambda: preflight.check_addresses_on_several_nodes(llm_user(local_address)),
                  lambda: preflight.check_addresses_on_several_nodes(simulator.SimulatorArguments(), local_address)]
        for check in checks:
            if refused:
                with pytest.raises(common.InputError, match="names each node itself|named as each node itself"):
                    check()
            else:
                check()
    preflight.check_addresses_on_several_nodes(llm_user("http://sim-host:8001/v1"), "http://vllm-host:8000")
    preflight.check_addresses_on_several_nodes(simulator.SimulatorArguments(base_url="http://localhost:1/v1"))  # rule
    monkeypatch.setenv("OPENAI_BASE_URL", "http://localhost:8001/v1")  # --base_url's fallback
    if refused:
        with pytest.raises(common.InputError):
            preflight.check_addresses_on_several_nodes(llm_user(None))


def test_grpos_vllm_server_address_is_the_one_every_rank_calls_only_in_async_server_mode():
    import preflight
    import train_grpo

    def address(*flags):
        dialogue_args, _, _, training_args, _ = train_grpo.parse_arguments(["--use_cpu", "true", *flags])
        return preflight.vllm_server_address(training_args, dialogue_args)

    assert address("--use_vllm", "--vllm_mode", "server", "--vllm_server_host", "h", "--vllm_server_port", "9") \
        == "http://h:9"
    assert address("--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://b:7") == "http://b:7"
    assert address("--use_vllm", "--vllm_mode", "server", "--rollout", "lockstep") is None
    assert address("--use_vllm", "--vllm_mode", "colocate") is None
    assert address("--vllm_mode", "server") is None


def test_the_model_cache_expands_a_tilde_and_is_read_after_a_configs_env(tmp_path, monkeypatch):
    """RLVER_CACHE='~/rlver-cache' made a folder named ~ in the current folder; a --config file's `env:` is set
    while parsing, after common was imported, and was ignored."""
    import os

    import train_grpo

    monkeypatch.setenv("RLVER_CACHE", "~/rlver-cache")
    assert common.model_cache() == Path(os.path.expanduser("~")) / "rlver-cache"
    config = tmp_path / "run.yaml"
    config.write_text(f"env:\n  RLVER_CACHE: {tmp_path / 'from-config'}\n")
    train_grpo.parse_arguments(["--config", str(config), "--output_dir", str(tmp_path / "run")])
    assert common.model_cache() == tmp_path / "from-config"
