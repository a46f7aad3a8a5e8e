"""Bad input to the tools around training (report.py, plot_training.py, talk.py's terminal dialogue):
each gets one line saying what is wrong and where, a non-zero exit and no traceback; a transcript cut short by
a killed run still gives what parses. Every script's --help works."""
import json
import os
import runpy
import subprocess
import sys

import pytest
from conftest import REPO
from test_report import Page, transcript_row

import plot_training
import report
import simulator
import talk

SCRIPTS = ("train_grpo.py", "train_ppo.py", "eval_sentient.py", "eval_general.py", "report.py", "plot_training.py",
           "talk.py")
LATIN1_ROW = b'{"id": "Jos\xe9", "history": []}\n'  # "José" saved as Latin-1: byte 0xe9 is not UTF-8


def write_run(folder, rows, tail=""):
    """A training run folder whose transcripts.jsonl holds `rows`, then `tail` (a line cut short, say)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "transcripts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)
    return folder


def steps_run(folder, tail="", steps=3):
    """`steps` steps of two dialogues each; final emotions 40, 45, 50, ... per step (plots need 4 steps)."""
    rows = [transcript_row(step, index, [30, 40 + 5 * step]) for step in range(steps) for index in range(2)]
    return write_run(folder, rows, tail)


def exit_message(main, argv) -> str:
    """The message a script's main exits with; it must be one line starting `error:`, not an exception."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    return message


def simulator_exit(argv) -> str:
    return exit_message(talk.main, ["--profile", "en-train-01", *argv])


# --------------------------------------------------------------------------------------------
# Files that are not UTF-8 text
# --------------------------------------------------------------------------------------------

def test_report_names_a_latin1_result_file_and_its_line(tmp_path):
    path = tmp_path / "result.jsonl"
    path.write_bytes(LATIN1_ROW)
    assert exit_message(report.main, [str(path)]) == (
        f"error: {path}:1: not UTF-8 text (byte 0xe9); is it the transcript or result file? Save it as UTF-8")


def test_report_compare_names_the_run_whose_transcript_is_latin1(tmp_path):
    good = steps_run(tmp_path / "good")
    bad = steps_run(tmp_path / "bad")
    with (bad / "transcripts.jsonl").open("ab") as file:
        file.write(LATIN1_ROW)
    message = exit_message(report.main, ["--compare", str(good), str(bad)])
    assert f"{bad / 'transcripts.jsonl'}:7: not UTF-8 text" in message


def test_plot_training_names_a_latin1_transcript_and_its_line(tmp_path):
    run = write_run(tmp_path / "run", [])
    (run / "transcripts.jsonl").write_bytes(LATIN1_ROW)
    assert f"{run / 'transcripts.jsonl'}:1: not UTF-8 text (byte 0xe9)" in exit_message(plot_training.main, [str(run)])


def test_a_replies_file_that_is_missing_or_not_utf8_is_named(tmp_path):
    assert simulator_exit(["--replies", str(tmp_path / "nope.txt")]) == f"error: {tmp_path / 'nope.txt'}: replies file not found"
    latin1 = tmp_path / "replies.txt"
    latin1.write_bytes(b"I am sorry, Mara.\nThat sounds hard, Jos\xe9.\n")
    assert simulator_exit(["--replies", str(latin1)]) == (
        f"error: {latin1}:2: not UTF-8 text (byte 0xe9); is it the replies file? Save it as UTF-8")


# --------------------------------------------------------------------------------------------
# Paths: folders for files, folders that do not exist yet, where output goes
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_plot_training_writes_beside_the_run_not_into_the_current_folder(tmp_path, monkeypatch, capsys):
    run = steps_run(tmp_path / "run", steps=4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plot_training.main([str(run)])
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert list(elsewhere.iterdir()) == []
    assert f"wrote {run / 'learning_curve.png'}" in capsys.readouterr().out


def test_report_out_into_a_missing_folder_creates_it(tmp_path):
    run = steps_run(tmp_path / "run")
    out = tmp_path / "reports" / "new" / "run.html"
    report.main([str(run), "--out", str(out)])
    assert len(Page(out.read_text(encoding="utf-8")).dialogues) == 6


def test_report_out_under_a_file_is_refused_and_nothing_is_written(tmp_path):
    run = steps_run(tmp_path / "run")
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    assert exit_message(report.main, [str(run), "--out", str(blocker / "run.html")]) == (
        f"error: --out {blocker / 'run.html'}: {blocker} is a file, not a folder")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "run"]


def test_a_folder_given_as_the_profile_file_is_said_to_be_a_folder():
    assert simulator_exit(["--profiles", str(REPO / "profiles")]) == (
        f"error: {REPO / 'profiles'}: a folder; give the profile file itself")


def test_the_rule_backend_refuses_chinese_first_naming_the_language_option(tmp_path, capsys):
    """The refusal comes before anything else is read or asked (here a replies file that does not exist)."""
    assert simulator_exit(["--language", "zh", "--replies", str(tmp_path / "nope.txt")]).startswith(
        "error: --language zh: the rule backend has English cues only")
    assert capsys.readouterr().out == ""  # not one turn played


def test_a_replies_file_plays_one_turn_per_non_blank_line(tmp_path, capsys):
    replies = tmp_path / "replies.txt"
    replies.write_bytes(b"I am sorry she missed it.\r\n\r\nWhat happened that morning?\r\n")
    talk.main(["--profile", "en-train-01", "--replies", str(replies)])
    out = capsys.readouterr().out
    assert "[turn 2]" in out and "[turn 3]" not in out and "\r" not in out


# --------------------------------------------------------------------------------------------
# Transcripts cut short by a killed run, or empty
# --------------------------------------------------------------------------------------------

def test_report_leaves_out_a_cut_last_line_with_a_warning(tmp_path, capsys):
    run = steps_run(tmp_path / "run", tail='{"id": "test-venting", "history": [{"role": "us')
    report.main([str(run)])  # returns: exit status 0
    assert len(Page((run / "report.html").read_text(encoding="utf-8")).dialogues) == 6
    assert f"warning: {run / 'transcripts.jsonl'}:7: the last line is cut short" in capsys.readouterr().err


def test_report_names_a_bad_line_in_the_middle_by_file_and_line(tmp_path):
    run = steps_run(tmp_path / "run")
    lines = (run / "transcripts.jsonl").read_text().splitlines(keepends=True)
    (run / "transcripts.jsonl").write_text("".join(lines[:2] + ['{"id": \n'] + lines[2:]))
    message = exit_message(report.main, [str(run)])
    assert f"{run / 'transcripts.jsonl'}:3: not valid JSON" in message and "cut short" not in message


def test_plot_training_plots_what_parses_of_a_cut_transcript(tmp_path, capsys):
    run = steps_run(tmp_path / "run", tail='{"step": 4, "emo_po', steps=4)
    plot_training.main([str(run)])
    captured = capsys.readouterr()
    assert "| run | 4 | 42.5 +- 2.5 | 52.5 +- 2.5 | +10.0 +- 3.5 |" in captured.out  # steps 0-3 only
    assert f"warning: {run / 'transcripts.jsonl'}:9: the last line is cut short" in captured.err
    assert (run / "learning_curve.png").is_file()


def test_plot_training_names_an_empty_transcript(tmp_path):
    run = write_run(tmp_path / "run", [])
    assert exit_message(plot_training.main, [str(run)]) == (
        f"error: {run / 'transcripts.jsonl'}: no transcript rows (empty?); nothing to plot")


def test_plot_training_names_a_row_without_step_or_final_emotion(tmp_path):
    """A benchmark result row (no step) in a run folder: not silently averaged, not a KeyError."""
    row = transcript_row(None, 0, [40, 50])
    run = write_run(tmp_path / "run", [row])
    assert f"{run / 'transcripts.jsonl'}:1: a transcript row needs numbers 'step' and 'emo_point'" in exit_message(
        plot_training.main, [str(run)])
    assert not (run / "learning_curve.png").exists()


# --------------------------------------------------------------------------------------------
# --help
# --------------------------------------------------------------------------------------------

@pytest.mark.slow  # imports both trainers' libraries (seconds)
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_prints_its_help_and_exits_0(script, monkeypatch, capsys):
    """As `python SCRIPT --help` runs it (its `__main__` block), in this process, whose imports the scripts share."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as finished:
        runpy.run_path(str(REPO / script), run_name="__main__")
    assert finished.value.code in (0, None) and "usage:" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Outputs: never written over a file the script did not make, or over an input
# --------------------------------------------------------------------------------------------

def test_report_refuses_to_write_its_page_over_its_own_input(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"id": "a", "emo_point": 50, "history": []}) + "\n")
    before = results.read_bytes()
    message = exit_message(report.main, [str(results), "--out", str(results)])
    assert "an input of this run" in message and results.read_bytes() == before


@pytest.mark.parametrize("name", ["README.md", "report.html"])  # a page someone else wrote, under our default name
def test_report_refuses_to_replace_a_file_it_did_not_write_and_replaces_its_own(tmp_path, name):
    run = steps_run(tmp_path / "run")
    theirs = run / name
    theirs.write_text("<html>my notes</html>")
    out = ["--out", str(theirs)] if name != "report.html" else []
    assert "a file this script did not write" in exit_message(report.main, [str(run), *out])
    assert theirs.read_text() == "<html>my notes</html>"
    theirs.unlink()
    report.main([str(run), *out])
    report.main([str(run), *out])  # its own page, replaced
    assert report.GENERATOR in theirs.read_text()


def test_plot_training_refuses_a_device_a_foreign_file_and_its_input_and_replaces_its_own_plot(tmp_path):
    run = steps_run(tmp_path / "run", steps=4)
    (tmp_path / "full.png").symlink_to("/dev/full")
    assert "not a regular file" in exit_message(plot_training.main, [str(run), "--out", str(tmp_path / "full.png")])
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n someone's picture")
    assert "did not write" in exit_message(plot_training.main, [str(run), "--out", str(photo)])
    transcripts = run / "transcripts.jsonl"
    (tmp_path / "link.png").symlink_to(transcripts)
    (tmp_path / "dangling.png").symlink_to(tmp_path / "gone" / "x.png")
    assert f"a link to {tmp_path / 'gone' / 'x.png'}, which does not exist" in exit_message(
        plot_training.main, [str(run), "--out", str(tmp_path / "dangling.png")])
    assert "an input of this run" in exit_message(plot_training.main, [str(run), "--out", str(tmp_path / "link.png")])
    plot_training.main([str(run), "--out", str(tmp_path / "curve.png")])
    plot_training.main([str(run), "--out", str(tmp_path / "curve.png")])  # its own plot, replaced
    assert photo.read_bytes().endswith(b"someone's picture") and transcripts.read_text().count("\n") == 8


def test_an_output_on_a_full_filesystem_is_refused_before_any_work(tmp_path, monkeypatch):
    import shutil

    import common
    import guards

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20))
    run = steps_run(tmp_path / "run")
    assert "only 1 MB free" in exit_message(report.main, [str(run)])
    with pytest.raises(common.InputError, match="only 1 MB free"):
        guards.check_output_folder(tmp_path / "new", "output_dir")


def test_report_compare_of_a_run_with_itself_is_refused(tmp_path):
    """A run against its own transcripts (or a link to it) would make a page of zero differences."""
    run = steps_run(tmp_path / "run")
    (tmp_path / "link").symlink_to(run)
    for second in (run, run / "transcripts.jsonl", tmp_path / "link"):
        assert exit_message(report.main, ["--compare", str(run), str(second)]) == (
            f"error: --compare: {run} and {second} are the same run; give two runs")
    assert not (run / "compare.html").exists()


def test_report_names_a_row_whose_emotion_is_not_a_number_and_an_out_path_ending_in_a_slash(tmp_path):
    run = steps_run(tmp_path / "run")
    rows = (run / "transcripts.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([rows[0], rows[1].replace('"emo_point": ', '"emo_point": "high", "was": ', 1)]) + "\n")
    assert exit_message(report.main, [str(bad)]) == (
        f"error: {bad}:2: 'emo_point' and each 'emotion-point' must be numbers")
    assert exit_message(report.main, [str(run), "--out", f"{tmp_path}/newdir/"]) == (
        f"error: --out {tmp_path}/newdir/: a folder; give the HTML file's path")
    assert not (tmp_path / "newdir").exists()


def started_handling_signals(process, timeout=30) -> None:
    """Wait until the process catches SIGTERM (guards.start_script ran): /proc's SigCgt mask, bit 15 - 1."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        status = open(f"/proc/{process.pid}/status").read()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & (1 << 14):
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    raise AssertionError("the script never set its SIGTERM handler")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process's signal mask in /proc")
@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py", "eval_sentient.py", "eval_general.py",
                                    "benchmarks/rollout_bench.py"])
@pytest.mark.parametrize("sent, status, said", [
    ("SIGINT", 130, "interrupted while starting: nothing done"),
    ("SIGTERM", 143, "stopped by SIGTERM: nothing new saved; "),
])
def test_a_signal_while_the_libraries_load_ends_the_script_in_one_line(script, sent, status, said):
    """Sent as torch and transformers load (seconds): the cut import's traceback would be all a user saw."""
    import signal

    process = subprocess.Popen([sys.executable, str(REPO / script)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        started_handling_signals(process)
        process.send_signal(getattr(signal, sent))
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()  # without the handler, the script would go on to run its demo
    assert process.returncode == status and err.startswith(f"\n{said}") and err.count("\n") == 2, err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("tool", ["report", "plot"])
def test_an_input_that_is_a_symbolic_link_loop_is_named_in_one_line(tool, tmp_path):
    loop = tmp_path / "loopA"
    loop.symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(loop)
    main, argv = (report.main, [str(loop)]) if tool == "report" else (plot_training.main, [str(loop)])
    assert exit_message(main, argv) == f"error: {loop}: a symbolic link that leads back to itself (a loop); give " \
                                       "the real path"


def test_a_transcript_step_that_is_not_a_whole_number_is_named_with_its_line(tmp_path):
    rows = [transcript_row(0, 0, [30, 40]), {**transcript_row(1, 0, [30, 45]), "step": "1"}]
    run = write_run(tmp_path / "run", rows)
    assert exit_message(report.main, [str(run)]) == (f"error: {run / 'transcripts.jsonl'}:2: 'step' must be a whole "
                                                     "number (a training step), got '1'")


def test_a_run_folder_where_an_arm_s_label_goes_is_refused(tmp_path, capsys):
    """--arm RUN_A RUN_B (label forgotten) took RUN_A as the label and plotted RUN_B alone, as an arm of one seed."""
    first, second = steps_run(tmp_path / "a", steps=4), steps_run(tmp_path / "b", steps=4)
    with pytest.raises(SystemExit) as stopped:
        plot_training.main(["--arm", str(first), str(second), "--out", str(tmp_path / "x.png")])
    assert stopped.value.code == 2 and f"--arm {first} ...: that is a run folder where the label goes" in \
        capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_report_refuses_a_screenshot_that_is_the_page_itself(tmp_path):
    run = steps_run(tmp_path / "run")
    assert exit_message(report.main, [str(run), "--out", str(tmp_path / "x.html"), "--screenshot",
                                      str(tmp_path / "x.html")]) == (
        f"error: --screenshot {tmp_path / 'x.html'}: the same file as the page (--out {tmp_path / 'x.html'}); give a "
        ".png")
    assert not (tmp_path / "x.html").exists()


def test_a_profile_id_with_a_control_character_is_named_with_its_line(tmp_path):
    from conftest import profile_row, write_jsonl

    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="en-\u202ex\ny")])
    with pytest.raises(simulator.ProfileError, match=rf"^{path}:1: field 'id' holds a control character"):
        simulator.load_profiles(path)


def test_a_missing_profile_id_names_the_file_searched(capsys):
    with pytest.raises(SystemExit) as stopped:
        talk.main(["--profile", "en-bench-01"])
    assert stopped.value.code.startswith(f"error: no profile with id 'en-bench-01' in {simulator.DEFAULT_PROFILES} "
                                         "(--profiles); its ids look like ")


def test_a_json_document_given_for_json_lines_is_named_as_one(tmp_path):
    """An evaluation's summary (indented JSON) given to report.py: its first line alone is not JSON."""
    summary = tmp_path / "r.summary.json"
    summary.write_text(json.dumps({"score": 50, "n": 2}, indent=2))
    assert exit_message(report.main, [str(summary)]) == (
        f"error: {summary}:1: not valid JSON (Expecting property name enclosed in double quotes at column 1); a JSON "
        "document over several lines, not JSON Lines (is it the transcript or result file?)")


@pytest.mark.slow
def test_a_path_the_terminal_cannot_encode_is_printed_escaped_not_a_traceback(tmp_path):
    """PYTHONIOENCODING=ascii and a folder with an accent: the last print failed after the work was done."""
    run = steps_run(tmp_path / "ünï", steps=4)
    finished = subprocess.run([sys.executable, str(REPO / "report.py"), str(run)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert finished.returncode == 0 and "Traceback" not in finished.stderr, finished.stderr[-2000:]
    assert "wrote " in finished.stdout and "\\xfcn\\xef" in finished.stdout and (run / "report.html").is_file()
