"""A run's outputs are its own: a second run started on the same output is refused at any moment and changes
nothing; an output removed, replaced or written by another process mid-run stops the run before its next write.
The identity is the output's (device, inode, size) as the run last left it and the run marker's launch id."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import common
import guards
import eval_sentient

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def forget_outputs(monkeypatch):
    """Each test starts as a new process would: no output remembered, none held."""
    monkeypatch.setattr(guards, "_outputs", {}, raising=False)
    monkeypatch.setattr(guards, "_held", {})


def test_a_file_removed_replaced_or_written_by_another_process_stops_the_next_append(tmp_path):
    path = tmp_path / "rows.jsonl"
    guards.note_output(path)
    guards.append_rows_kept(path, [{"a": 1}])
    guards.append_rows_kept(path, [{"a": 2}])  # its own appends: fine
    for change, said in [(lambda: path.open("a").write('{"other": 1}\n'), "changed by another writer"),
                         (lambda: (tmp_path / "theirs").write_text('{"b": 1}\n') and
                          (tmp_path / "theirs").replace(path), "was replaced"),
                         (lambda: path.unlink(), "was removed")]:
        guards.note_output(path)
        before = path.read_bytes() if path.exists() else None
        change()
        after = path.read_bytes() if path.exists() else None
        with pytest.raises(common.InputError, match=said):
            guards.append_rows_kept(path, [{"a": 3}])
        assert (path.read_bytes() if path.exists() else None) == after != before  # nothing written


def test_a_new_output_made_by_another_process_meanwhile_is_not_written_into(tmp_path):
    path = tmp_path / "new.jsonl"
    guards.note_output(path)  # absent when the run started
    path.write_text('{"theirs": 1}\n')
    with pytest.raises(common.InputError, match="was made by another process"):
        guards.append_rows_kept(path, [{"a": 1}])
    assert path.read_text() == '{"theirs": 1}\n'


def claimed(folder, model="m"):
    from accelerate import PartialState

    guards.claim_run_folder(folder, "train_ppo.py", model, False, "--resume", {}, PartialState(cpu=True))
    return json.loads((folder / guards.RUN_MARKER).read_text())["launch"]


def test_a_run_folder_replaced_or_its_marker_taken_over_stops_the_run_before_it_writes(tmp_path):
    run = tmp_path / "run"
    claimed(run)
    (run / "transcripts.jsonl").write_text("")
    guards.check_run_folder_kept(run)  # its own files inside: fine
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / guards.RUN_MARKER).write_text(json.dumps({"script": "train_ppo.py", "model": "m"}))
    run.rename(tmp_path / "moved-away")
    finished.rename(run)  # a finished run's folder in its place
    with pytest.raises(common.InputError, match="was replaced"):
        guards.check_run_folder_kept(run)
    # The same folder, its marker written by another launch (another run copied over it, or a second start).
    guards._outputs.clear()
    guards._held.clear()
    other = tmp_path / "other"
    claimed(other)
    (other / guards.RUN_MARKER).write_text(json.dumps({"script": "train_ppo.py", "model": "m", "launch": "x"}))
    with pytest.raises(common.InputError, match="rlver-run.json was"):
        guards.check_run_folder_kept(other)


def test_an_evaluations_result_file_replaced_mid_run_gets_no_rows_and_no_summary(tmp_path):
    """Another model's results moved into its place between two batches: this run stops before appending, and
    that file is left as it was."""
    output = tmp_path / "results.jsonl"
    eval_sentient.append_rows(output, [{"id": "a", "made_by": {"model": "mine"}}])
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text(json.dumps({"id": "b", "made_by": {"model": "theirs"}}) + "\n")
    theirs.replace(output)
    kept = output.read_bytes()
    with pytest.raises(common.InputError, match="was replaced"):
        eval_sentient.append_rows(output, [{"id": "c", "made_by": {"model": "mine"}}])
    assert output.read_bytes() == kept


# --------------------------------------------------------------------------------------------
# Two runs on one output folder, the second started at several moments of the first
# --------------------------------------------------------------------------------------------

HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[1])
script, argv = sys.argv[2], sys.argv[3:]
if script == "train_grpo.py":  # its start-up as main() runs it, up to the folder's claim
    import common, preflight, simulator, train_grpo
    dialogue_args, simulator_args, credit_args, training_args, model_args = train_grpo.parse_arguments(argv)
    preflight.check_grpo_start(argv, train_grpo.make_parser(), train_grpo.DEMO_DEFAULTS, training_args, model_args)
    training_args.model_init_kwargs = {"dtype": model_args.dtype}
    profiles = {p.id: p for p in simulator.load_playable_profiles(dialogue_args.profiles, simulator_args, False)}
    preflight.check_grpo_run(common.resolve_model(model_args.model_name_or_path), profiles, dialogue_args,
                             simulator_args, credit_args, training_args, model_args)
else:
    from accelerate import Accelerator
    import preflight, train_ppo
    args, dialogue_args, simulator_args = train_ppo.parse_arguments(argv)
    preflight.check_ppo_start(args, simulator_args)
    preflight.check_ppo_launch(args, dialogue_args, simulator_args, Accelerator())
print("claimed", flush=True)
time.sleep(90)  # a run loading its model, or between two steps
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
@pytest.mark.parametrize("moment", ["loading", "mid-run", "mid-run, resuming"])
def test_a_second_run_on_a_held_folder_is_refused_and_changes_nothing(tmp_path, script, moment):
    """The first run holds its folder from the moment it marks it: while it loads its model (only the marker is
    there) and mid-run (rows and checkpoints there), a second start of the same command, resuming or not, is
    refused in one line and deletes, writes and replaces nothing."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO), script, "--output_dir", str(run)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        if moment != "loading":
            (run / "transcripts.jsonl").write_text('{"step": 0}\n')
            (run / "checkpoint-1").mkdir()
            (run / "checkpoint-1" / "trainer_state.json").write_text('{"global_step": 1}')
        before = {path: (path.stat().st_ino, path.read_bytes() if path.is_file() else None) for path in run.rglob("*")}
        resume = {"train_grpo.py": ["--resume_from_checkpoint", "true"], "train_ppo.py": ["--resume"]}[script]
        second = subprocess.run([sys.executable, script, "--output_dir", str(run),
                                 *(resume if moment.endswith("resuming") else [])],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        said = "another run is writing there now" if moment != "mid-run" else "already holds a run"
        assert said in second.stderr and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert {path: (path.stat().st_ino, path.read_bytes() if path.is_file() else None)
                for path in run.rglob("*")} == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_two_grpo_runs_started_together_on_one_folder_one_trains_whole_and_the_other_is_refused(tiny_model_dir,
                                                                                            tmp_path):
    """Started at the same moment, before either has marked the folder: the one that holds it first trains all
    its steps and saves; the other is refused and leaves nothing of its own."""
    run = tmp_path / "run"
    command = [sys.executable, "train_grpo.py", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run),
               "--max_steps", "2", "--max_turns", "2", "--max_reply_tokens", "8", "--save_steps", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    runs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [(process.wait(timeout=400), process.stderr.read()) for process in runs]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] != 0, [said[-1500:] for _, said in results]
    refused = next(said for code, said in results if code != 0)
    assert "another run is writing there now" in refused or "already holds a run" in refused, refused[-1500:]
    state = json.loads((run / "trainer_state.json").read_text())
    rows = [json.loads(line) for line in (run / "transcripts.jsonl").open()]
    assert state["global_step"] == 2 and sorted({row["step"] for row in rows}) == [0, 1] and len(rows) == 16


@pytest.mark.slow
def test_a_grpo_run_whose_folder_is_replaced_mid_run_stops_without_writing_into_the_other(tiny_model_dir, tmp_path):
    """A finished run's folder moved into a running run's place: the running one stops at its next write, and
    the folder moved in keeps exactly what it held."""
    run, finished = tmp_path / "run", tmp_path / "finished"
    finished.mkdir()
    (finished / guards.RUN_MARKER).write_text(json.dumps({"script": "train_grpo.py", "model": "m"}) + "\n")
    (finished / "transcripts.jsonl").write_text('{"step": 0}\n')
    command = [sys.executable, "train_grpo.py", "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run),
               "--max_steps", "30", "--max_turns", "2", "--max_reply_tokens", "8", "--save_steps", "100"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (run / "transcripts.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        run.rename(tmp_path / "moved-away")
        finished.rename(run)
        before = {path.name: path.read_bytes() for path in run.iterdir()}
        code = process.wait(timeout=300)
    finally:
        process.kill()
    said = process.stderr.read()
    assert code != 0 and "was replaced" in said, said[-2000:]
    assert {path.name: path.read_bytes() for path in run.iterdir()} == before
