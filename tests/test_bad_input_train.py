"""Bad input to the trainers: each gets one line naming what is wrong, where and what to do, a non-zero exit
and no traceback, before any model loads; files a killed run left behind are repaired, not lost."""
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import profile_row, write_jsonl

import preflight
import common
import guards
import rollout
import simulator
import train_grpo
import train_ppo
from test_official_prompts import REPO as OFFICIAL_REPO
from test_official_prompts import needs_repo

GRPO_DEMO = (train_grpo.make_parser(), train_grpo.DEMO_DEFAULTS)  # what preflight checks --config against

REPO = Path(__file__).resolve().parent.parent
TRAINERS = {"grpo": train_grpo, "ppo": train_ppo}

PPO_CHECKPOINTS = (train_ppo.CHECKPOINT_MEMBERS, train_ppo.checkpoint_step)  # preflight.resume_point's


def profiles_digest(path) -> str:
    """The run marker's record of a profiles file, computed here with hashlib on the file's bytes."""
    import hashlib

    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


@pytest.fixture
def model_folder(tmp_path):
    """A folder that passes the model check but holds no weights: a run that got as far as loading
    anything from it fails with something other than the error a test expects."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def chinese_profiles(tmp_path):
    return write_jsonl(tmp_path / "zh.jsonl", [profile_row(task=simulator.INTENTIONS["venting"][1])])


def stopped_at_parsing(trainer: str, argv: list[str], capsys) -> str:
    """parse_arguments must exit 2 with usage; returns the last line it printed."""
    with pytest.raises(SystemExit) as stopped:
        TRAINERS[trainer].parse_arguments(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# --------------------------------------------------------------------------------------------
# Unreadable files: --config YAML
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("content, message", [
    (None, r"run.yaml: YAML config not found"),
    (b"\x00\x01\xff binary", r"run.yaml:1: not UTF-8 text \(byte 0xff\); is it the YAML config"),
    (b"learning_rate: [1,\n  max_steps: 3\n", r"run.yaml:3: not valid YAML"),
])
def test_a_config_that_is_missing_binary_or_not_yaml_is_named_before_parsing(tmp_path, trainer, content, message):
    config = tmp_path / "run.yaml"
    if content is not None:
        config.write_bytes(content)
    with pytest.raises(common.InputError, match=message):
        TRAINERS[trainer].parse_arguments(["--config", str(config)])


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("env", ["[WANDB_MODE]", "{1: offline}", "{WANDB_MODE: null}", "{WANDB_MODE: [offline]}",
                                 "{'A=B': 1}", "{'': x}"])
def test_config_environment_variables_that_trl_would_set_wrongly_or_fail_on_are_named(tmp_path, trainer, env):
    """TrlParser sets str(value) of each: None, a list or a number as a name would be set or fail with a traceback."""
    config = tmp_path / "run.yaml"
    config.write_text(f"max_steps: 3\nenv: {env}\n")
    with pytest.raises(common.InputError, match=r"run.yaml:2: env: give environment variables as NAME: value"):
        TRAINERS[trainer].parse_arguments(["--config", str(config)])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_config_environment_variables_are_set_as_given(tmp_path, trainer, monkeypatch):
    monkeypatch.setenv("RLVER_TEST_VARIABLE", "before")  # monkeypatch removes it after the test
    config = tmp_path / "run.yaml"
    config.write_text("env:\n  RLVER_TEST_VARIABLE: 1.5\n")
    TRAINERS[trainer].parse_arguments(["--config", str(config)])
    assert os.environ["RLVER_TEST_VARIABLE"] == "1.5"


@pytest.mark.parametrize("trainer, key, hint", [("grpo", "num_generation", "num_generations"),
                                                ("ppo", "learning_rat", "learning_rate")])
def test_a_misspelt_config_key_is_named_with_the_likely_one(tmp_path, trainer, key, hint):
    config = tmp_path / "run.yaml"
    config.write_text(f"{key}: 4\n")
    with pytest.raises(common.InputError, match=fr"run.yaml: unknown option\(s\): {key} \(did you mean {hint}\?\)"):
        TRAINERS[trainer].parse_arguments(["--config", str(config)])


def test_grpo_reads_the_config_for_its_demo_defaults_warning_through_the_same_reader(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_bytes(b"learning_rate: 1.0e-6\nnote: caf\xe9\n")
    with pytest.raises(common.InputError, match=r"run.yaml:2: not UTF-8 text"):
        preflight.demo_defaults_kept(["--config", str(config)], *GRPO_DEMO)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_both_trainers_read_config_equals_file_as_config_file(tmp_path, trainer):
    config = tmp_path / "run.yaml"
    config.write_text("max_turns: 5\nstart_emotion: 45\n")
    for argv in (["--config", str(config)], [f"--config={config}"]):
        dialogue_args = TRAINERS[trainer].parse_arguments(argv)[0 if trainer == "grpo" else 1]
        assert (dialogue_args.max_turns, dialogue_args.start_emotion) == (5, 45)
    assert (preflight.demo_defaults_kept([f"--config={config}"], *GRPO_DEMO)
            == preflight.demo_defaults_kept(["--config", str(config)], *GRPO_DEMO))


def test_ppo_checks_option_values_once_the_configs_are_in(tmp_path):
    """The YAML's minibatch_size makes the flag's micro_batch_size valid: no value is judged without it."""
    config = tmp_path / "run.yaml"
    config.write_text("minibatch_size: 6\n")
    args = train_ppo.parse_arguments(["--config", str(config), "--micro_batch_size", "3"])[0]
    assert (args.minibatch_size, args.micro_batch_size) == (6, 3)


# --------------------------------------------------------------------------------------------
# Numbers out of range, inf and nan
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer, argv, message", [
    ("ppo", ["--learning_rate", "inf"], "--learning_rate inf: must be a finite number"),
    ("ppo", ["--simulator_timeout", "inf"], "--simulator_timeout inf: must be a finite number"),
    ("grpo", ["--learning_rate", "inf"], "--learning_rate inf: must be a finite number"),
    ("grpo", ["--max_grad_norm", "nan"], "--max_grad_norm nan: must be a finite number"),
    ("grpo", ["--temperature", "inf"], "--temperature inf: must be a finite number"),
    ("grpo", ["--lora_dropout", "nan"], "--lora_dropout nan: must be a finite number"),  # TRL's ModelConfig
    ("grpo", ["--temperature", "-1"], "--temperature -1.0: must be above 0"),
    ("ppo", ["--seed", "-1"], "--seed -1: must be from 0 to 2147483647"),  # numpy's seeding would raise
    ("grpo", ["--seed", "4294967296"], "--seed 4294967296: must be from 0 to 2147483647"),
    ("grpo", ["--data_seed", "-3"], "--data_seed -3: must be from 0 to 2147483647"),
])
def test_an_option_out_of_range_or_not_finite_is_refused_at_parsing(trainer, argv, message, capsys):
    assert message in stopped_at_parsing(trainer, argv, capsys)


# --------------------------------------------------------------------------------------------
# Impossible combinations
# --------------------------------------------------------------------------------------------

def test_grpo_num_generations_not_dividing_the_batch_is_a_usage_error_not_a_traceback(capsys):
    last = stopped_at_parsing("grpo", ["--num_generations", "3"], capsys)
    assert last.endswith("error: generation_batch_size (8) must be divisible by num_generations (3); choose "
                         "--num_generations dividing it, or change --per_device_train_batch_size")


@pytest.mark.parametrize("trainer", TRAINERS)
def test_an_unknown_flag_is_a_usage_error_not_a_traceback(trainer, capsys):
    assert "['--bogus', '1']" in stopped_at_parsing(trainer, ["--bogus", "1"], capsys)


def test_grpo_refuses_fewer_profiles_than_a_generation_batch_needs(tmp_path, model_folder):
    profiles = write_jsonl(tmp_path / "one.jsonl", [profile_row()])
    with pytest.raises(common.InputError, match=r"one.jsonl: 1 profile\(s\), but a generation batch of 8 dialogues "
                       r".*4 per profile, needs 2 distinct profiles; add profiles"):
        train_grpo.main(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"),
                         "--profiles", str(profiles), "--per_device_train_batch_size", "8", "--num_generations", "4"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("trainer", TRAINERS)
def test_chinese_profiles_with_the_rule_backend_are_refused_before_any_model_loads(tmp_path, model_folder, trainer):
    with pytest.raises(simulator.SimulatorError, match="profile test-venting is Chinese: the rule backend"):
        TRAINERS[trainer].main(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"),
                                "--profiles", str(chinese_profiles(tmp_path))])


@pytest.mark.parametrize("config, flags, source", [
    ({}, ["--dtype", "bfloat16"], "--dtype bfloat16"),
    ({"dtype": "bfloat16"}, ["--dtype", "auto"], r"--dtype auto \(.*model is bfloat16\)"),
    ({"torch_dtype": "float16"}, ["--dtype", "auto"], r"--dtype auto \(.*model is float16\)"),
])
def test_grpo_refuses_a_full_fine_tune_of_16_bit_weights_without_deepspeed_before_they_load(tmp_path, model_folder,
                                                                                             config, flags, source):
    """AdamW's steps of ~lr are below bf16's resolution: without DeepSpeed's fp32 master weights the run would not
    learn. The folder holds no weights, so a run that got as far as loading them would fail otherwise."""
    (model_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(common.InputError, match=fr"a full fine-tune \(--use_peft false\) of {source} weights without "
                       r"DeepSpeed .* accelerate_configs/zero3.yaml \(or zero2.yaml\).* or pass --dtype float32, or "
                       r"train LoRA \(--use_peft true\)$"):
        train_grpo.main(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"),
                         "--use_peft", "false", *flags])
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("trainer", TRAINERS)
def test_an_output_dir_under_a_file_is_refused_at_start_and_nothing_is_created(tmp_path, model_folder, trainer):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(common.InputError, match=r"--output_dir .*taken/run: .*taken is a file, not a folder"):
        TRAINERS[trainer].main(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "taken" / "run")])


@pytest.mark.parametrize("trainer, option", [("grpo", "--model_name_or_path"), ("ppo", "--model_name_or_path"),
                                             ("ppo", "--critic_model_name_or_path")])
def test_a_model_that_does_not_exist_fails_before_the_tokenizer_or_the_endpoint(tmp_path, model_folder, trainer,
                                                                                option):
    """The endpoint is unreachable: had the run got as far as asking it, the error would be about it."""
    argv = ["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"), option, "./nope",
            "--backend", "llm", "--simulator_model", "m", "--base_url", "http://127.0.0.1:9/v1"]
    with pytest.raises(common.InputError, match=r"\./nope: no such folder"):
        TRAINERS[trainer].main(argv)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_the_scripts_print_an_input_error_as_one_line_without_a_traceback(tmp_path, script):
    (tmp_path / "taken").write_text("a file")
    finished = subprocess.run([sys.executable, str(REPO / script), "--output_dir", str(tmp_path / "taken" / "run")],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].startswith("error: --output_dir ")


# --------------------------------------------------------------------------------------------
# Resume states: what a killed run left behind
# --------------------------------------------------------------------------------------------

def test_resume_drops_a_last_line_cut_short_by_a_kill_and_the_steps_played_again(tmp_path, capsys):
    transcripts = tmp_path / "transcripts.jsonl"
    transcripts.write_text('{"step": 0, "id": "a"}\n{"step": 1, "id": "b"}\n{"step": 2, "id": "c"}\n{"step": 2, "i')
    assert guards.drop_rows_from(transcripts, 2) == 1
    assert [json.loads(line) for line in transcripts.read_text().splitlines()] == [{"step": 0, "id": "a"},
                                                                                   {"step": 1, "id": "b"}]
    assert "transcripts.jsonl:4: the last line is cut short" in capsys.readouterr().err


def test_resume_refuses_a_bad_line_in_the_middle_naming_it_and_leaves_the_file_as_it_was(tmp_path):
    transcripts = tmp_path / "transcripts.jsonl"
    text = '{"step": 0}\n{"step": \n{"step": 1}\n'
    transcripts.write_text(text)
    with pytest.raises(common.InputError, match=r"transcripts.jsonl:2: not valid JSON .*; mend or delete that line"):
        guards.drop_rows_from(transcripts, 1)
    assert transcripts.read_text() == text


def test_ppo_resume_over_a_bad_transcript_line_fails_before_any_model_loads(tmp_path, model_folder):
    output_dir = tmp_path / "run"
    guards.mark_run_folder(output_dir, "train_ppo.py", str(model_folder))  # an earlier run's
    (output_dir / "transcripts.jsonl").write_text('{"step": 0}\nnot json\n{"step": 0}\n')
    with pytest.raises(common.InputError, match=r"transcripts.jsonl:2: not valid JSON"):
        train_ppo.main(["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir), "--resume"])


def test_transcripts_are_appended_after_a_last_line_cut_short_is_dropped(tmp_path, capsys):
    transcripts = tmp_path / "transcripts.jsonl"
    transcripts.write_text('{"step": 0, "id": "a"}\n{"step": 1, "id')
    dialogue = types.SimpleNamespace(transcript=lambda step: {"step": step, "id": "b"})
    rollout.write_transcripts(transcripts, [dialogue], step=1)
    assert [json.loads(line) for line in transcripts.read_text().splitlines()] == [{"step": 0, "id": "a"},
                                                                                   {"step": 1, "id": "b"}]
    assert "the last line was cut short" in capsys.readouterr().err


def test_ppo_resume_of_a_finished_run_without_checkpoints_is_refused_keeping_its_policy(tmp_path, model_folder):
    output_dir = tmp_path / "run"
    guards.mark_run_folder(output_dir, "train_ppo.py", str(model_folder))
    (output_dir / "transcripts.jsonl").write_text('{"step": 0}\n')
    (output_dir / "critic.pt").write_bytes(b"weights")
    with pytest.raises(common.InputError, match="holds a finished run without checkpoints"):
        train_ppo.main(["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir), "--resume"])
    assert (output_dir / "transcripts.jsonl").read_text() == '{"step": 0}\n'


def test_ppo_resume_before_the_first_checkpoint_starts_again_at_step_0_without_the_old_rows(tiny_model_dir, tmp_path,
                                                                                            capsys):
    """Killed before its first save: the steps it played are played again, so their rows go, with a note
    (not appended to: steps 0, 1 then 0 again)."""
    output_dir = tmp_path / "run"
    guards.mark_run_folder(output_dir, "train_ppo.py", str(tiny_model_dir))
    write_jsonl(output_dir / "transcripts.jsonl", [{"step": 0}, {"step": 0}, {"step": 1}, {"step": 1}])
    write_jsonl(output_dir / "metrics.jsonl", [{"step": 0}, {"step": 1}])
    train_ppo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir), "--resume",
                    "--max_steps", "1", "--max_turns", "1", "--max_reply_tokens", "4", "--dialogues_per_profile", "2",
                    "--minibatch_size", "2", "--save_steps", "5"])
    assert [json.loads(line)["step"] for line in (output_dir / "transcripts.jsonl").read_text().splitlines()] == [0, 0]
    assert [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()] == [0]
    note = capsys.readouterr().out
    assert "--resume: no checkpoint in" in note and "dropped the 4 transcript rows and 2 metrics rows" in note


# --------------------------------------------------------------------------------------------
# Output folders: a trainer writes only into its own run's folder
# --------------------------------------------------------------------------------------------

def trainer_main(script):
    return {"train_ppo.py": train_ppo.main, "train_grpo.py": train_grpo.main}[script]


@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py"])
@pytest.mark.parametrize("theirs, message", [
    ({"README.md": "my notes"}, "holds files that no {script} run wrote (README.md)"),
    ({"checkpoint-1/state.pt": "x"}, "holds files that no {script} run wrote (checkpoint-1)"),
    ({"rlver-run.json": '{"script": "other.py", "model": "m"}'}, "holds a other.py run; choose another folder"),
    ({"rlver-run.json": "not json"}, "rlver-run.json: not a run marker"),
])
def test_a_trainer_refuses_an_output_folder_holding_what_it_did_not_write(tmp_path, model_folder, script, theirs,
                                                                          message):
    output_dir = tmp_path / "run"
    for name, text in theirs.items():
        (output_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (output_dir / name).write_text(text)
    with pytest.raises(common.InputError, match=re.escape(message.format(script=script))):
        trainer_main(script)(["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir)])
    assert {str(p.relative_to(output_dir)): p.read_text() for p in output_dir.rglob("*") if p.is_file()} == theirs


@pytest.mark.parametrize("script, resume", [("train_ppo.py", ["--resume"]),
                                            ("train_grpo.py", ["--resume_from_checkpoint", "true"])])
def test_a_trainer_continues_its_own_run_only_when_asked_and_only_with_its_model(tmp_path, model_folder, script,
                                                                                 resume):
    output_dir = tmp_path / "run"
    guards.mark_run_folder(output_dir, script, "another/model")
    (output_dir / "transcripts.jsonl").write_text('{"step": 0}\n')
    argv = ["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir)]
    with pytest.raises(common.InputError, match=f"already holds a run; .* or pass {resume[0]} to continue it"):
        trainer_main(script)(argv)
    with pytest.raises(common.InputError, match=f"{resume[0]}: .* holds a run of another/model, not of "):
        trainer_main(script)(argv + resume)
    assert (output_dir / "transcripts.jsonl").read_text() == '{"step": 0}\n'


@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py"])
def test_a_trainer_refuses_an_output_folder_another_run_is_writing_before_marking_it(tmp_path, model_folder, script):
    """Two runs at once in one folder (two resumes, or a second launch) would write the same steps' rows and
    checkpoints."""
    from conftest import held_by_another_process

    output_dir = tmp_path / "run"
    output_dir.mkdir()
    with held_by_another_process(output_dir):
        with pytest.raises(common.InputError, match=f"^--output_dir {output_dir}: another run is writing there now"):
            trainer_main(script)(["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir)])
    assert list(output_dir.iterdir()) == []


@pytest.mark.parametrize("script, resume, changed, message", [
    ("train_ppo.py", ["--resume"], ["--lora_r", "8"], "--lora_r 16 (this run: 8)"),
    ("train_ppo.py", ["--resume"], ["--think", "--variant", "challenging"],
     "--think False (this run: True), --max_reply_tokens 48 (this run: 32), --variant vanilla (this run: challenging)"),
    ("train_grpo.py", ["--resume_from_checkpoint", "true"], ["--num_generations", "2"],
     "--num_generations 4 (this run: 2)"),
    ("train_ppo.py", ["--resume"], ["--profiles", str(REPO / "profiles" / "benchmark.jsonl")],  # what they hold
     f"--profiles {profiles_digest(REPO / 'profiles' / 'train.jsonl')} (this run: "
     f"{profiles_digest(REPO / 'profiles' / 'benchmark.jsonl')})"),
])
def test_a_resume_with_settings_other_than_the_runs_is_refused_naming_them(tmp_path, model_folder, script, resume,
                                                                           changed, message):
    """A resume with --think on a run made without would mix two methods in one run; another LoRA rank fails on
    weights of another shape."""
    output_dir = tmp_path / "run"
    argv = ["--model_name_or_path", str(model_folder), "--output_dir", str(output_dir)]
    if script == "train_ppo.py":
        args, dialogue_args, simulator_args = train_ppo.parse_arguments(argv)
        settings = guards.run_settings(preflight.KEPT_ON_RESUME + preflight.PPO_KEPT_ON_RESUME, args, dialogue_args,
                                       simulator_args)
    else:
        dialogue_args, simulator_args, credit_args, training_args, model_args = train_grpo.parse_arguments(argv)
        settings = guards.run_settings(preflight.KEPT_ON_RESUME + preflight.GRPO_KEPT_ON_RESUME, dialogue_args,
                                       simulator_args, credit_args, model_args, training_args)
    guards.mark_run_folder(output_dir, script, str(model_folder), settings)
    (output_dir / "transcripts.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(common.InputError, match=re.escape(f"holds a run made with {message}; resume it with its "
                                                          "settings, or choose another --output_dir")):
        trainer_main(script)(argv + resume + changed)
    assert (output_dir / "transcripts.jsonl").read_text() == '{"step": 0}\n'


def test_a_folder_holding_only_its_own_runs_marker_is_a_fresh_folder(tmp_path):
    """A run refused after marking its folder (a bad input found late) wrote nothing else: its rerun may start,
    and takes the marker over only once it holds the folder (while the first run loads its model, it holds it:
    test_run_identity.py); the check itself deletes nothing."""
    guards.mark_run_folder(tmp_path / "run", "train_ppo.py", "m")
    guards.check_run_folder(tmp_path / "run", "train_ppo.py", "another", False, "--resume")
    assert [path.name for path in (tmp_path / "run").iterdir()] == [guards.RUN_MARKER]
    guards.mark_run_folder(tmp_path / "run", "train_ppo.py", "another")
    assert json.loads((tmp_path / "run" / guards.RUN_MARKER).read_text())["model"] == "another"
    guards.mark_run_folder(tmp_path / "grpo", "train_grpo.py", "m")
    with pytest.raises(common.InputError, match="holds a train_grpo.py run"):
        guards.check_run_folder(tmp_path / "grpo", "train_ppo.py", "m", False, "--resume")


@needs_repo
@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py", "eval_sentient.py"])
def test_think_with_sages_policy_prompt_is_refused_before_any_model_loads(tmp_path, model_folder, script):
    """SAGE's policy prompt has no think variant: refused at start-up, not at the first dialogue."""
    import eval_sentient

    official = ["--policy_prompts", "sage", "--official_repo", str(OFFICIAL_REPO), "--think"]
    with pytest.raises(common.ArgumentError, match="--policy_prompts sage has no think-mode system prompt"):
        if script == "eval_sentient.py":
            eval_sentient.evaluate(eval_sentient.EvalArguments(model=str(model_folder), think=True,
                                                               output=str(tmp_path / "r.jsonl")),
                                   simulator.SimulatorArguments(policy_prompts="sage", official_repo=str(OFFICIAL_REPO)))
        else:
            trainer_main(script)(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"),
                                  *official])
    assert not (tmp_path / "run").exists() and not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py", "eval_sentient.py", "eval_general.py"])
def test_use_vllm_without_vllm_is_one_line_before_anything_loads(tmp_path, model_folder, script):
    import importlib.util

    import eval_general
    import eval_sentient

    assert importlib.util.find_spec("vllm") is None  # as on a CPU machine
    with pytest.raises(common.InputError, match="--use_vllm needs vLLM, which is not installed here"):
        if script == "eval_sentient.py":
            eval_sentient.evaluate(eval_sentient.EvalArguments(model=str(model_folder), use_vllm=True,
                                                               output=str(tmp_path / "r.jsonl")),
                                   simulator.SimulatorArguments())
        elif script == "eval_general.py":
            eval_general.evaluate(eval_general.GeneralEvalArguments(model=str(model_folder), use_vllm=True,
                                                                    output_dir=str(tmp_path / "general")))
        else:
            trainer_main(script)(["--model_name_or_path", str(model_folder), "--output_dir", str(tmp_path / "run"),
                                  "--use_vllm"])


@pytest.mark.parametrize("script", ["train_ppo.py", "train_grpo.py"])
@pytest.mark.parametrize("broken, message", [
    ({"config.json": "{}"}, "its config.json names no model_type, so transformers cannot tell which model it is"),
    ({"config.json": '{"model_type": "llama",'}, "config.json:1: not valid JSON"),
    ({"model.safetensors": None}, "no weights (*.safetensors or pytorch_model*.bin) beside its config.json"),
    ({"tokenizer_config.json": None}, "no tokenizer (tokenizer_config.json or tokenizer.json)"),
])
def test_a_model_folder_transformers_cannot_load_is_refused_before_it_loads(tmp_path, script, broken, message):
    """transformers would fail with a traceback (ValueError: Unrecognized model), after the endpoint was asked."""
    folder = tmp_path / "model"
    folder.mkdir()
    files = {"config.json": '{"model_type": "llama"}', "model.safetensors": "", "tokenizer_config.json": "{}",
             **broken}
    for name, text in files.items():
        if text is not None:
            (folder / name).write_text(text)
    with pytest.raises(common.InputError, match=re.escape(message)):
        trainer_main(script)(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "run")])


# --------------------------------------------------------------------------------------------
# A resume takes its step from the checkpoint's contents, never from its name alone
# --------------------------------------------------------------------------------------------

def grpo_resume_args(run, given="true"):
    return types.SimpleNamespace(resume_from_checkpoint=given, output_dir=str(run), max_steps=30, save_steps=10)


def test_a_grpo_checkpoint_whose_state_says_another_step_than_its_name_is_passed_over(tmp_path, capsys):
    """A trainer_state.json edited to an earlier step (or a folder renamed) would replay steps from later weights."""
    run = tmp_path / "run"
    for step in (10, 20):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (run / "checkpoint-20" / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    common.append_json_lines(run / "transcripts.jsonl", [{"step": step} for step in range(20)])
    args = grpo_resume_args(run)
    preflight.prepare_resume(args, run / "transcripts.jsonl")
    assert args.resume_from_checkpoint == str(run / "checkpoint-10")
    assert "checkpoint-20: holds step 10, not 20 (renamed, or its state edited?); passed over" in capsys.readouterr().err
    with pytest.raises(common.InputError, match="checkpoint-20: holds step 10, not 20"):
        preflight.prepare_resume(grpo_resume_args(run, str(run / "checkpoint-20")), run / "transcripts.jsonl")


def ppo_checkpoint(folder, step: int):
    """A PPO checkpoint folder whose members are whole (tiny), its state holding `step`."""
    import torch

    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "config.json").write_text("{}")
    torch.save({"step": step}, folder / "state.pt")
    torch.save({}, folder / "critic.pt")
    return folder


def test_a_ppo_checkpoint_renamed_is_not_resumed_at_its_new_name(tmp_path):
    """checkpoint-3 renamed checkpoint-9 would resume "at step 9" and skip six steps; the only checkpoint being
    that one, the resume is refused and the rows of steps 0-4 stay."""
    run = tmp_path / "run"
    folder = ppo_checkpoint(run / "checkpoint-9", step=3)
    transcripts = run / "transcripts.jsonl"
    common.append_json_lines(transcripts, [{"step": step} for step in range(5)])
    common.append_json_lines(run / "metrics.jsonl", [{"step": step} for step in range(5)])
    accelerator = types.SimpleNamespace(print=print, is_main_process=True)
    with pytest.raises(common.InputError, match="checkpoint-9: holds step 3, not 9 .* move them aside to start"):
        preflight.resume_point(run, transcripts, run / "metrics.jsonl", 3, 30, accelerator, *PPO_CHECKPOINTS)
    assert [json.loads(line)["step"] for line in transcripts.read_text().splitlines()] == [0, 1, 2, 3, 4]
    folder.rename(run / "checkpoint-3")
    assert preflight.resume_point(run, transcripts, run / "metrics.jsonl", 3, 30, accelerator,
                                  *PPO_CHECKPOINTS) == (run / "checkpoint-3", 3)


def test_a_grpo_run_stopped_before_its_first_checkpoint_resumes_at_step_0_and_a_finished_one_is_refused(tmp_path,
                                                                                                      capsys):
    """--resume_from_checkpoint true with no checkpoint yet is no dead end: the run starts over at step 0, its
    rows dropped (they are played again). A run that finished without checkpoints is refused (its model saved)."""
    run = tmp_path / "run"
    run.mkdir()
    common.append_json_lines(run / "transcripts.jsonl", [{"step": step} for step in range(3)])
    args = grpo_resume_args(run)
    preflight.prepare_resume(args, run / "transcripts.jsonl")
    assert args.resume_from_checkpoint is None and (run / "transcripts.jsonl").read_text() == ""
    assert "starting again at step 0; dropped the 3 transcript rows" in capsys.readouterr().err
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 30}))
    with pytest.raises(common.InputError, match="holds a finished run without checkpoints"):
        preflight.prepare_resume(grpo_resume_args(run), run / "transcripts.jsonl")


def test_a_full_disk_while_torch_saves_a_checkpoint_is_one_line_not_torchs_traceback():
    def main():  # what torch.save raises when the disk fills (its zip writer's own error, not an OSError)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/3: file write failed")

    with pytest.raises(SystemExit) as stopped, guards.one_line_exits("--resume"):
        main()
    assert str(stopped.value.code).startswith("error: a checkpoint file could not be written: is the disk full?")
    assert "continue with --resume" in str(stopped.value.code)


# --------------------------------------------------------------------------------------------
# A blind round's findings (2026-12-07): resumes onto missing rows, a mistyped folder, told-apart values
# --------------------------------------------------------------------------------------------

def test_a_ppo_resume_whose_transcripts_were_deleted_is_refused_not_continued_without_them(tmp_path):
    run = tmp_path / "run"
    folder = ppo_checkpoint(run / "checkpoint-2", step=2)
    common.append_json_lines(run / "metrics.jsonl", [{"step": 0}, {"step": 1}])
    accelerator = types.SimpleNamespace(print=print, is_main_process=True)
    with pytest.raises(common.InputError, match=r"hold no rows of steps 0, 1, which its checkpoint at step 2 "
                                                r"trained: deleted or moved\?"):
        preflight.resume_point(run, run / "transcripts.jsonl", run / "metrics.jsonl", 1, 30, accelerator,
                               *PPO_CHECKPOINTS)
    common.append_json_lines(run / "transcripts.jsonl", [{"step": 0}, {"step": 1}])
    assert preflight.resume_point(run, run / "transcripts.jsonl", run / "metrics.jsonl", 1, 30,
                                  accelerator, *PPO_CHECKPOINTS) == (folder, 2)


def test_a_grpo_resume_whose_transcripts_were_deleted_is_refused(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    with pytest.raises(common.InputError, match="hold no rows of steps 0, 1"):
        preflight.prepare_resume(grpo_resume_args(run), run / "transcripts.jsonl")


def test_a_resume_flag_on_a_folder_holding_no_run_says_it_starts_a_new_run(tmp_path, capsys):
    """A job script that always resumes starts so; a mistyped folder too, and was silent."""
    guards.check_run_folder(tmp_path / "ppo43x", "train_ppo.py", "m", True, "--resume")
    said = capsys.readouterr().err
    assert said.startswith(f"--resume: {tmp_path / 'ppo43x'} holds no run yet: starting a new run there"), said


def test_a_marker_value_that_reads_like_this_runs_is_shown_so_they_are_told_apart(tmp_path):
    guards.mark_run_folder(tmp_path / "run", "train_ppo.py", "m", {"max_turns": "1"})
    (tmp_path / "run" / "transcripts.jsonl").write_text("")
    with pytest.raises(common.InputError, match=r'--max_turns "1" \(this run: 1\)'):
        guards.check_run_folder(tmp_path / "run", "train_ppo.py", "m", True, "--resume", {"max_turns": 1})


def test_a_bare_checkpoint_name_that_does_not_exist_says_so_and_what_to_give(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(common.InputError, match=r"--resume_from_checkpoint checkpoint-4: no such folder; give its "
                                                r"path, such as .*run/checkpoint-4, or true"):
        preflight.resume_checkpoint(grpo_resume_args(run, "checkpoint-4"))


def test_a_dialogue_budget_too_small_for_any_profile_is_refused_at_start_up_with_the_largest_need(tmp_path):
    """Checked as each profile was drawn, the run stopped hours in, and the figure it said covered only that
    profile: following it failed again on a longer one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(common.resolve_model(common.PACKAGED_MODEL))
    runner = rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(max_dialogue_tokens=60))
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[:6]
    starts = [(profile, "Hi." + " More words here." * index) for index, profile in enumerate(profiles)]
    largest = max(len(runner._prompt(profile, opening)) for profile, opening in starts) + runner.min_turn_tokens
    with pytest.raises(common.InputError, match=rf"raise it to at least {largest}$"):
        runner.check_room(starts)
    runner.close()
