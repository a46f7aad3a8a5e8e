"""train_grpo.py end to end on a tiny model, its reward function, and the paper recipes."""
import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import preflight
import common
import guards
import rollout
import train_grpo

GRPO_DEMO = (train_grpo.make_parser(), train_grpo.DEMO_DEFAULTS)  # what preflight checks --config against

REPO = Path(__file__).resolve().parent.parent


def test_reward_reads_the_final_emotion_not_the_completion_text():
    reward = train_grpo.make_emotion_reward(rollout.DialogueArguments(max_turns=2, format_penalty=0.2))
    logged = {}
    rewards = reward(completions=["I am thrilled, 100/100!", "meh"], final_emotion=[20, 90], format_violations=[0, 1],
                     turns=[2, 2], end_reason=["turn_limit", "turn_limit"], think_tokens=[0, 0], reply_tokens=[9, 9],
                     simulator_seconds=[0.1, 0.1], emotions=[[25, 20], [60, 90]], failed=[False, False],
                     simulator_calls=[{"calls": 4, "attempts": 5, "failed": 0, "prompt_tokens": 900, "completion_tokens": 60},
                                      {"calls": 4, "attempts": 4, "failed": 0, "prompt_tokens": 800, "completion_tokens": 50}],
                     log_metric=lambda name, value: logged.__setitem__(name, value))
    assert rewards == pytest.approx([0.2, 0.9 - 0.2 / 2])  # one violating turn of two: half the penalty
    assert (logged["simulator/calls"], logged["simulator/retries"], logged["simulator/prompt_tokens"]) == (8, 1, 1700)
    assert logged["emotion/final_mean"] == 55 and logged["emotion/after_turn_1"] == 42.5
    assert logged["format/violation_rate"] == 0.25 and logged["dialogue/ended_turn_limit"] == 1


def test_a_dialogue_whose_simulator_failed_gets_no_reward_so_trl_gives_it_zero_advantage():
    reward = train_grpo.make_emotion_reward(rollout.DialogueArguments(max_turns=1))
    rewards = reward(completions=["a", "b", "c"], final_emotion=[40, 30, 50], format_violations=[0, 0, 0],
                     turns=[1, 1, 1], end_reason=["turn_limit", "simulator_failed", "turn_limit"],
                     think_tokens=[0, 0, 0], reply_tokens=[5, 5, 5], simulator_seconds=[0.1, 0.1, 0.1],
                     emotions=[[40], [30], [50]], failed=[False, True, False], simulator_calls=[{}] * 3)
    assert rewards[0] == pytest.approx(0.4) and rewards[1] is None and rewards[2] == pytest.approx(0.5)


def test_paper_recipes_are_read_with_the_demo_defaults_underneath_and_leave_none_in_force():
    """The recipes' full checks are in test_recipes.py; this one pins that the script's own parser is used."""
    for recipe in sorted((REPO / "recipes").glob("grpo_*.yaml")):
        dialogue_args, _, _, training_args, model_args = train_grpo.parse_arguments(
            ["--config", str(recipe), "--bf16", "false"])
        assert model_args.use_peft is False and training_args.save_strategy == "steps"
        assert (training_args.learning_rate, training_args.beta, training_args.num_generations) == (1e-6, 0.0, 4)
        assert dialogue_args.max_turns == 8
        assert preflight.demo_defaults_kept(["--config", str(recipe)], *GRPO_DEMO) == {}


def master_weights_check(*argv: str, deepspeed: bool = False, model: str = "Qwen/Qwen2.5-7B-Instruct") -> None:
    """check_master_weights on a command line, as main calls it; `deepspeed`: as `accelerate launch --config_file
    accelerate_configs/zero3.yaml` leaves the arguments (ACCELERATE_USE_DEEPSPEED makes TRL's config hold a
    DeepSpeed plugin; a stand-in here, which needs no process group)."""
    _, _, _, training_args, model_args = train_grpo.parse_arguments([*argv, "--bf16", "false"])
    training_args.model_init_kwargs = {"dtype": model_args.dtype}
    training_args.deepspeed_plugin = object() if deepspeed else None
    preflight.check_master_weights(model, training_args, model_args.use_peft)


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("grpo_*.yaml")), ids=lambda recipe: recipe.name)
def test_a_recipes_full_fine_tune_of_bf16_weights_is_accepted_under_deepspeed_only(recipe):
    master_weights_check("--config", str(recipe), deepspeed=True)
    with pytest.raises(common.InputError, match="without DeepSpeed"):
        master_weights_check("--config", str(recipe))


def test_a_full_fine_tune_of_fp32_weights_and_lora_on_bf16_weights_are_accepted_without_deepspeed(tmp_path):
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    master_weights_check("--use_peft", "false", "--dtype", "float32")
    master_weights_check("--use_peft", "false", "--dtype", "auto", model=str(tmp_path))
    master_weights_check("--use_peft", "true", "--dtype", "bfloat16")


def first_screen(output: str, method: str) -> list[str]:
    """What a run printed before its first step line that is neither its own start line nor a progress bar."""
    shown = []
    for part in re.split(r"[\r\n]+", output):
        if part.startswith("step 1/"):
            return shown
        if part.strip() and not part.startswith(f"{method}: ") and not re.match(r"\s*\d+%\|", part):
            shown.append(part)
    raise AssertionError(f"no step line in: {output[-2000:]}")


@pytest.mark.parametrize("think", [False, True])
def test_a_two_step_run_completes_and_writes_transcripts_and_metrics(tiny_model_dir, tmp_path, think):
    """With --think as the README starts it (`accelerate launch` and nothing else, with the config setup.sh gives
    accelerate), the first screen holds the run's own line and the progress bar, then one line per step."""
    launcher = ([sys.executable, "-m", "accelerate.commands.launch"] if think
                else [sys.executable])  # both ways users start it
    run, accelerate_home = tmp_path / "run", tmp_path / "hf" / "accelerate"
    accelerate_home.mkdir(parents=True)
    shutil.copy(REPO / "accelerate_configs" / "cpu.yaml", accelerate_home / "default_config.yaml")
    command = launcher + [str(REPO / "train_grpo.py"), "--model_name_or_path", str(tiny_model_dir),
                          "--output_dir", str(run), "--max_steps", "2", "--max_turns", "2",
                          "--max_think_tokens", "4", "--max_reply_tokens", "6", "--num_generations", "2",
                          "--per_device_train_batch_size", "4"] + (["--think"] if think else [])
    finished = subprocess.run(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=300, env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1"})
    output = finished.stdout  # and stderr, in the order written, as a terminal shows them
    assert finished.returncode == 0, output[-3000:]
    assert first_screen(output, "GRPO") == []
    assert f"GRPO: {tiny_model_dir} (LoRA){', thinking,' if think else ''} against the rule user, 2 steps; " \
           f"writing {run}" in output
    step_lines = re.findall(r"step \d/2: mean final emotion [\d.]+(?:, format violations \d+%)?, \d+ s", output)
    assert len(step_lines) == 2 and all(("format violations" in line) == think for line in step_lines)
    assert "'loss'" not in output  # the Trainer's dictionary of metrics stays in trainer_state.json
    rows = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {row["step"] for row in rows} == {0, 1}
    assert all(len(row["think_texts"]) == row["turns"] for row in rows)
    assert all(any(t for t in row["think_texts"]) == think for row in rows)
    groups = [rows[i:i + 2] for i in range(0, 8, 2)]  # num_generations dialogues per profile, consecutive
    assert all(a["id"] == b["id"] and a["history"][0] == b["history"][0] for a, b in groups)
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    step_logs = [entry for entry in history if "emotion/final_mean" in entry]
    assert len(step_logs) == 2
    for name in ("reward", "emotion/success_rate", "emotion/failure_rate", "dialogue/turns_mean",
                 "format/violation_rate", "length/think_tokens_per_turn", "length/reply_tokens_per_turn",
                 "simulator/seconds_per_turn", "dialogue/ended_turn_limit", "emotion/after_turn_2"):
        assert name in step_logs[0], name
    assert (run / "adapter_model.safetensors").is_file()


def test_when_the_simulator_endpoint_dies_the_run_stops_after_saving_and_resumes(tiny_model_dir, tmp_path):
    """Step 0 is answered; then the endpoint answers 500 past the client's retries, so step 1 loses
    every simulator: the run saves a full Trainer checkpoint, stops clearly, and resumes from it."""
    from conftest import profile_row, run_against_simulator, write_jsonl

    profiles = write_jsonl(tmp_path / "profiles.jsonl", [profile_row(first_talk="My week was awful.")])
    output_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train_grpo.py"), "--model_name_or_path", str(tiny_model_dir),
               "--output_dir", str(output_dir), "--max_turns", "2", "--max_reply_tokens", "6",
               "--num_generations", "2", "--per_device_train_batch_size", "2", "--profiles", str(profiles),
               "--backend", "llm", "--simulator_model", "sim-model"]
    stopped = run_against_simulator(command, "--max_steps", "3", "--simulator_max_retries", "1",  # less back-off
                                    answered=8)  # 2 dialogues x 2 turns x 2 calls
    assert stopped.returncode != 0
    assert "stopped at step 1" in stopped.stderr and "the simulators of 2 of 2 dialogues failed" in stopped.stderr
    checkpoint = output_dir / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "optimizer.pt").is_file()
    rows = [json.loads(line) for line in (output_dir / "transcripts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 0]  # the failed step wrote nothing
    resumed = run_against_simulator(command, "--max_steps", "2", "--resume_from_checkpoint", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (output_dir / "transcripts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 0, 1, 1]


def test_a_run_killed_mid_step_resumes_without_losing_or_doubling_a_step(tiny_model_dir, tmp_path):
    from conftest import kill_when

    output_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train_grpo.py"), "--model_name_or_path", str(tiny_model_dir),
               "--output_dir", str(output_dir), "--max_turns", "1", "--max_reply_tokens", "6",
               "--num_generations", "2", "--per_device_train_batch_size", "4", "--save_strategy", "steps",
               "--save_steps", "2"]
    process = subprocess.Popen(command + ["--max_steps", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    transcripts = output_dir / "transcripts.jsonl"
    # Killed once step 2 has played its dialogues, before its update finishes.
    kill_when(process, lambda: transcripts.is_file() and any(
        json.loads(line)["step"] == 2 for line in transcripts.read_text().splitlines()))
    assert (output_dir / "checkpoint-2").is_dir() and not (output_dir / "checkpoint-4").exists()
    resumed = subprocess.run(command + ["--max_steps", "4", "--resume_from_checkpoint", str(output_dir / "checkpoint-2")],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in transcripts.read_text().splitlines()]
    assert collections.Counter(steps) == {0: 4, 1: 4, 2: 4, 3: 4}
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "emotion/final_mean" in entry] == [1, 2, 3, 4]


@pytest.mark.parametrize("argv, message", [
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: must be at least 1"),
    (["--learning_rate", "-1"], "--learning_rate -1.0: must be 0 or more"),
    (["--save_steps", "-1"], "--save_steps -1.0: must be above 0"),  # no checkpoint would ever be written
    (["--max_steps", "-5"], "--max_steps -5: must be at least 1 (or -1: as many as --num_train_epochs make)"),
    (["--beta", "-0.1"], "--beta -0.1: must be 0 or more"),
    (["--num_generations", "0"], "a count given as 0 where it divides another (as --num_generations does)"),
    (["--policy_prompt", "nosuch"], "--policy_prompt nosuch: no prompts/<language>/nosuch.txt; the prompts are "
                                    "policy, sentient"),
    (["--policy_prompt", "general"], "--policy_prompt general: no prompts/<language>/general.txt"),
])
def test_values_the_trainer_would_refuse_after_loading_or_never_are_refused_while_parsing(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        train_grpo.parse_arguments(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_max_steps_minus_one_leaves_the_length_to_the_epochs():
    assert train_grpo.parse_arguments(["--max_steps", "-1"])[3].max_steps == -1


@pytest.mark.parametrize("given, resume", [("false", None), ("False", None), ("true", "true"), ("run/checkpoint-10",
                                                                                                  "run/checkpoint-10")])
def test_resume_from_checkpoint_false_starts_a_new_run_not_a_path_named_false(given, resume):
    assert train_grpo.parse_arguments(["--resume_from_checkpoint", given])[3].resume_from_checkpoint == resume


@pytest.mark.slow
def test_impossible_option_values_are_refused_before_any_model_loads(tmp_path):
    finished = subprocess.run([sys.executable, str(REPO / "train_grpo.py"), "--output_dir", str(tmp_path / "run"),
                               "--max_turns", "0", "--simulator_max_retries", "-1"], capture_output=True, text=True,
                              timeout=120)
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].endswith("--max_turns 0: must be from 1 to 100")


def test_a_resume_from_a_folder_without_trainer_state_is_refused_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail_if_called)
    (tmp_path / "run" / "checkpoint-2").mkdir(parents=True)
    guards.mark_run_folder(tmp_path / "run", "train_grpo.py", str(tiny_model_dir))
    with pytest.raises(common.InputError, match="checkpoint-2: no trainer_state.json; give a checkpoint folder"):
        train_grpo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"),
                         "--resume_from_checkpoint", str(tmp_path / "run" / "checkpoint-2")])


def fail_if_called(*args, **kwargs):
    raise AssertionError("loaded")


def test_a_resume_with_no_steps_left_is_refused_before_any_row_is_dropped(tiny_model_dir, tmp_path, monkeypatch):
    """The Trainer would train one step past --max_steps (global_step 3 of 2) and exit 0."""
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail_if_called)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    guards.mark_run_folder(tmp_path / "run", "train_grpo.py", str(tiny_model_dir))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    common.append_json_lines(tmp_path / "run" / "transcripts.jsonl", [{"step": step} for step in (0, 1)])
    with pytest.raises(common.InputError, match=f"{checkpoint} holds 2 trained steps, as many as --max_steps 2 asks"):
        train_grpo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"),
                         "--resume_from_checkpoint", str(checkpoint), "--max_steps", "2"])
    assert (tmp_path / "run" / "transcripts.jsonl").read_text().count("\n") == 2


def test_a_resume_drops_the_rows_of_the_steps_it_will_play_again_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail_if_called)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    guards.mark_run_folder(tmp_path / "run", "train_grpo.py", str(tiny_model_dir))
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    for name in ("transcripts.jsonl", "transcripts.rank1.jsonl"):
        common.append_json_lines(tmp_path / "run" / name, [{"step": step} for step in (0, 1, 2, 3)])
    with pytest.raises(AssertionError, match="loaded"):
        train_grpo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"),
                         "--resume_from_checkpoint", str(checkpoint)])
    for name in ("transcripts.jsonl", "transcripts.rank1.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / "run" / name).read_text().splitlines()] == [0, 1]


def test_a_checkpoint_of_another_run_folder_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """Its run's settings and rows are in its own folder: resumed into a new one, a reply-only checkpoint went on
    with --think and other budgets, unchecked, and the new folder's rows began at its step."""
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail_if_called)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    with pytest.raises(common.InputError, match=re.escape(
            f"--resume_from_checkpoint {checkpoint}: not a checkpoint of --output_dir {tmp_path / 'new'}; continue "
            f"its run with --output_dir {tmp_path / 'run'}, or start a new run from a saved model with")):
        train_grpo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "new"),
                         "--resume_from_checkpoint", str(checkpoint), "--think"])


def trainer_checkpoint(folder, step):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "adapter_model.safetensors").write_bytes(b"")  # made whole or broken by the caller
    return folder


def test_resume_from_checkpoint_true_takes_the_newest_whole_checkpoint_naming_a_broken_one(tiny_model_dir, tmp_path,
                                                                                          monkeypatch, capsys):
    """checkpoint-3 was cut short while saving (its weights empty): checkpoint-2 is resumed from, rows of steps 2
    and later dropped."""
    import transformers
    from safetensors.torch import save_file

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail_if_called)
    run = tmp_path / "run"
    guards.mark_run_folder(run, "train_grpo.py", str(tiny_model_dir))
    save_file({"w": torch.zeros(2)}, trainer_checkpoint(run / "checkpoint-2", 2) / "adapter_model.safetensors")
    trainer_checkpoint(run / "checkpoint-3", 3)
    common.append_json_lines(run / "transcripts.jsonl", [{"step": step} for step in range(4)])
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run)]
    with pytest.raises(common.InputError, match="checkpoint-3: adapter_model.safetensors is empty; .* the newest "
                                                "whole one is .*checkpoint-2, or true for the newest"):
        train_grpo.main(argv + ["--resume_from_checkpoint", str(run / "checkpoint-3")])
    with pytest.raises(AssertionError, match="loaded"):
        train_grpo.main(argv + ["--resume_from_checkpoint", "true"])
    assert "checkpoint-3: adapter_model.safetensors is empty; passed over" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "transcripts.jsonl").read_text().splitlines()] == [0, 1]
    (run / "checkpoint-2" / "trainer_state.json").write_text("{")
    with pytest.raises(common.InputError, match="no checkpoint of .* can be resumed from .*checkpoint-3: adapter_model"
                                                ".safetensors is empty; checkpoint-2: trainer_state.json does not read"):
        train_grpo.main(argv + ["--resume_from_checkpoint", "true"])
    assert [json.loads(line)["step"] for line in (run / "transcripts.jsonl").read_text().splitlines()] == [0, 1]


def test_ctrl_c_lets_the_step_finish_saves_its_checkpoint_and_says_how_to_continue(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    import os
    import signal

    run = tmp_path / "run"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run), "--max_steps", "3",
            "--max_turns", "1", "--max_reply_tokens", "4", "--num_generations", "2",
            "--per_device_train_batch_size", "2"]
    play = rollout.DialogueRunner.run

    def ctrl_c_then_play(runner, *args):  # Ctrl-C while step 0's dialogues are played
        os.kill(os.getpid(), signal.SIGINT)
        return play(runner, *args)

    monkeypatch.setattr(rollout.DialogueRunner, "run", ctrl_c_then_play)
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        train_grpo.main(argv)
    assert stopped.value.code == 130
    said = capsys.readouterr().err
    checkpoint = run / "checkpoint-1"
    assert "Ctrl-C: stopping once this step is done, with a checkpoint" in said
    assert f"interrupted after step 0 (1 step trained): {checkpoint} holds its state; continue with: python train_grpo.py" in said
    assert said.rstrip().endswith(f"--resume_from_checkpoint {checkpoint}")
    assert guards.checkpoint_problem(checkpoint, ("trainer_state.json",)) is None
    assert json.loads((run / "rlver-run.json").read_text())["interrupted"] == [
        {"after_step": 0, "checkpoint": str(checkpoint)}]
    assert not (run / "adapter_model.safetensors").exists()  # the finished run's weights: not written
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_folder_removed_while_training_stops_the_run_instead_of_making_a_new_one(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Writing on would make a folder holding only the later steps' rows and weights, with no marker to resume from."""
    from conftest import remove_during_step_1

    run = tmp_path / "run"
    remove_during_step_1(monkeypatch, run)
    with pytest.raises(common.InputError, match=rf"^{run} was removed while this run wrote it: stopped without writing more"):
        train_grpo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run), "--max_steps", "3",
                         "--max_turns", "1", "--max_reply_tokens", "4", "--num_generations", "2",
                         "--per_device_train_batch_size", "2"])
    assert not run.exists()


@pytest.mark.slow
def test_ctrl_c_reaching_one_rank_stops_both_after_the_same_step_with_one_whole_checkpoint(tiny_model_dir, tmp_path):
    """2 gloo ranks (torch.distributed.run, as accelerate launch starts them): the signal reaches rank 1 only, as on
    a node where Ctrl-C was pressed while the other node trains on. Both must stop after the same step (a rank
    stopping alone would leave the other waiting forever at its next collective), the Trainer saving one
    checkpoint of that step, and exit 130."""
    from conftest import ctrl_c_on_rank_1

    run = tmp_path / "run"
    said, last = ctrl_c_on_rank_1("train_grpo.py", run, "--model_name_or_path", str(tiny_model_dir), "--max_turns", "1",
                                 "--max_reply_tokens", "4", "--num_generations", "2", "--per_device_train_batch_size",
                                 "2", "--use_cpu", "true")
    checkpoint = run / f"checkpoint-{last + 1}"
    assert (f"interrupted after step {last} ({last + 1} step{'s' if last else ''} trained): {checkpoint} holds its "
            "state; continue with: torchrun [its options, as before] train_grpo.py --output_dir ") in said
    assert [path.name for path in run.glob("checkpoint-*")] == [checkpoint.name]
    assert guards.checkpoint_problem(checkpoint, ("trainer_state.json",)) is None
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == last + 1
    assert json.loads((run / "rlver-run.json").read_text())["interrupted"] == [
        {"after_step": last, "checkpoint": str(checkpoint)}]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_other_in_one_line_instead_of_a_hang(tiny_model_dir, tmp_path):
    """As in test_train_ppo.py: rank 1 killed mid-run; rank 0 ends at once in one line, no traceback."""
    import signal

    from conftest import signal_rank_1

    said, status = signal_rank_1("train_grpo.py", tmp_path / "run", signal.SIGKILL, "--model_name_or_path",
                                 str(tiny_model_dir), "--max_turns", "1", "--max_reply_tokens", "4",
                                 "--num_generations", "2", "--per_device_train_batch_size", "2", "--use_cpu", "true")
    rank_0 = [line for line in said.splitlines() if "[rank0]" in line]  # torch's prefix on a worker's output
    assert status != 0 and "Traceback" not in "\n".join(rank_0), said[-3000:]
    assert ("stopped by SIGTERM: nothing new saved" in said
            or "error: a collective with the run's other processes failed" in said), said[-3000:]


def test_turn_groups_part_each_group_at_the_next_turn_across_groups_ranks_and_steps():
    ids = ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert train_grpo.turn_group_plan(ids, 3, 2, first_group=0) == [(0, 0)] * 3 + [(3, 1)] * 3 + [(6, 0)] * 3
    assert train_grpo.turn_group_plan(ids, 3, 4, first_group=5) == [(0, 1)] * 3 + [(3, 2)] * 3 + [(6, 3)] * 3
    with pytest.raises(common.InputError, match="multiple of --num_generations"):
        train_grpo.turn_group_plan(["a", "a", "b", "b"], 3, 2, first_group=0)  # a group split across ranks
    with pytest.raises(common.InputError, match="whole groups"):
        train_grpo.turn_group_plan(["a", "a", "b", "b"], 4, 2, first_group=0)


def test_turn_groups_need_a_user_that_answers_one_reply_one_way(capsys):
    with pytest.raises(SystemExit):
        train_grpo.parse_arguments(["--turn_groups", "--backend", "llm", "--base_url", "http://127.0.0.1:9/v1"])
    assert "--turn_groups with --backend llm" in capsys.readouterr().err


@pytest.mark.slow
def test_a_turn_groups_run_shares_its_second_groups_first_reply(tiny_model_dir, tmp_path):
    command = [sys.executable, str(REPO / "train_grpo.py"), "--model_name_or_path", str(tiny_model_dir),
               "--output_dir", str(tmp_path), "--max_steps", "1", "--max_turns", "2", "--max_reply_tokens", "8",
               "--num_generations", "3", "--per_device_train_batch_size", "6", "--turn_groups"]
    finished = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "transcripts.jsonl").read_text().splitlines()]
    first_replies = [[m["content"] for m in row["history"] if m["role"] == "assistant"][0] for row in rows]
    assert len(set(first_replies[3:])) == 1  # the second group parts at its second turn
    assert len(set(first_replies[:3])) > 1  # the first at its first
    assert "lockstep instead" in finished.stdout
