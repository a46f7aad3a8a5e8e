"""plot_training.py: the first/last comparison of one run, and arms averaged over seeds."""
import json

import pytest
from test_bad_input_tools import write_run
from test_report import transcript_row

import plot_training


def run_of(folder, finals_per_step):
    """A run whose step s has one dialogue per final emotion in finals_per_step[s]."""
    rows = [transcript_row(step, index, [30, final]) for step, finals in enumerate(finals_per_step)
            for index, final in enumerate(finals)]
    return write_run(folder, rows)


def test_first_and_last_twenty_percent_of_ten_steps_are_two_steps_each():
    means = {step: float(step) for step in range(10)}
    edges = plot_training.compare_edges(means)
    assert (edges["edge_steps"], edges["first"], edges["last"], edges["difference"]) == (2, 0.5, 8.5, 8.0)
    assert edges["first_se"] == pytest.approx(0.5) and edges["difference_se"] == pytest.approx(0.5 * 2 ** 0.5)


def test_an_arm_is_the_mean_over_its_seeds_with_the_standard_error_over_seeds(tmp_path, capsys):
    # Four-step runs: edges of 2 steps. Seed a: first (30+40)/2 = 35, last (50+60)/2 = 55, +20.
    # Seed b: first 32.5, last 42.5, +10. Arm: first 33.75 +- 1.25, last 48.75 +- 6.25, +15 +- 5.
    seed_a = run_of(tmp_path / "a", [[30], [40], [50], [60]])
    seed_b = run_of(tmp_path / "b", [[30, 30], [35, 35], [40, 40], [45, 45]])
    plot_training.main(["--arm", "PPO", str(seed_a), str(seed_b), "--out", str(tmp_path / "arms.png")])
    out = capsys.readouterr().out
    assert "| PPO | 2 | 33.8 +- 1.2 | 48.8 +- 6.2 | +15.0 +- 5.0 |" in out
    assert (tmp_path / "arms.png").read_bytes()[:4] == b"\x89PNG"


def test_an_arms_curve_averages_the_steps_every_seed_has():
    steps, means, errors = plot_training.arm_curve([{0: 30.0, 1: 40.0, 2: 50.0}, {0: 20.0, 1: 30.0}])
    assert steps == [0, 1] and means == [25.0, 35.0] and errors == pytest.approx([5.0, 5.0])


def test_an_arm_without_runs_is_refused(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        plot_training.main(["--arm", "PPO"])
    assert exit_info.value.code == 2


def test_the_format_metric_is_violating_turns_over_all_turns_of_a_step(tmp_path, capsys):
    # Step 0: a 1-turn dialogue that broke it and a 3-turn one that broke 2: (1 + 2) / (1 + 3) = 0.75, not the mean
    # of the dialogues' shares (1 + 2/3) / 2 = 0.83. Step 1: 0 of 2 turns. Step 2: 1 of 4 turns. Step 3: 0 of 2.
    rows = []
    for step, dialogues in enumerate([[(1, 1), (3, 2)], [(2, 0)], [(2, 1), (2, 0)], [(2, 0)]]):
        for index, (turns, violations) in enumerate(dialogues):
            row = transcript_row(step, index, [30] + [35] * turns)
            row["format_violations"] = violations
            rows.append(row)
    run = write_run(tmp_path / "think", rows)
    assert plot_training.step_means(run, "format") == pytest.approx({0: 0.75, 1: 0.0, 2: 0.25, 3: 0.0})
    assert plot_training.step_means(run) == {0: 35, 1: 35, 2: 35, 3: 35}  # the emotion, by default
    plot_training.main([str(run), "--metric", "format", "--out", str(tmp_path / "format.png")])
    # first (0.75 + 0) / 2 +- 0.375 (as computed, a hair under), last (0.25 + 0) / 2 +- 0.125
    assert "| think | 4 | 0.38 +- 0.37 | 0.12 +- 0.12 | -0.25 +- 0.40 |" in capsys.readouterr().out


@pytest.mark.parametrize("think", [False, True])
def test_the_format_metric_refuses_a_run_trained_without_think(think, tmp_path):
    """Its curve would be a flat 0: no thought, so no format to break."""
    row = transcript_row(0, 0, [30, 35])
    row["format_violations"] = 0
    run = write_run(tmp_path / "run", [row, {**row, "step": 1}])
    (run / "rlver-run.json").write_text(json.dumps({"script": "train_grpo.py", "model": "m",
                                                    "settings": {"think": think}}))
    if think:
        assert plot_training.step_means(run, "format") == {0: 0.0, 1: 0.0}
    else:
        with pytest.raises(plot_training.common.InputError, match=f"^{run}: trained without --think, so it has no "
                                                                  "think format to break"):
            plot_training.step_means(run, "format")
    assert plot_training.step_means(run) == {0: 35, 1: 35}  # its emotion plots either way


def test_the_format_metric_refuses_a_transcript_without_its_fields(tmp_path):
    row = transcript_row(0, 0, [30, 35])
    row.pop("format_violations", None)
    run = write_run(tmp_path / "old", [row])
    with pytest.raises(plot_training.common.InputError, match="needs numbers 'step', 'format_violations' and 'turns'"):
        plot_training.step_means(run, "format")


@pytest.mark.parametrize("out, said", [
    ("plot", "--out {out}: give a .png path"),  # savefig would add .png and replace someone's plot.png
    ("plot.txt", "--out {out}: give a .png path"),
])
def test_an_out_path_that_is_not_a_png_is_refused_before_anything_is_written(out, said, tmp_path, capsys):
    run = run_of(tmp_path / "a", [[30], [40]])
    (tmp_path / "plot.png").write_bytes(b"someone's plot")
    with pytest.raises(SystemExit) as exit_info:
        plot_training.main([str(run), "--out", str(tmp_path / out)])
    assert exit_info.value.code == 2
    assert said.format(out=tmp_path / out) in capsys.readouterr().err
    assert (tmp_path / "plot.png").read_bytes() == b"someone's plot"


def test_a_run_given_twice_is_refused_not_counted_as_two_seeds(tmp_path, capsys):
    run = run_of(tmp_path / "a", [[30], [40]])
    (tmp_path / "link").symlink_to(run)
    with pytest.raises(SystemExit) as exit_info:
        plot_training.main(["--arm", "PPO", str(run), str(tmp_path / "link"), "--out", str(tmp_path / "arms.png")])
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'link'}: the same run as {run}; give each run once" in capsys.readouterr().err


@pytest.mark.parametrize("steps", [1, 3])
def test_a_run_too_short_for_separate_first_and_last_steps_is_refused(steps, tmp_path):
    """One step has no error (nan); with 2 or 3 the first and last 20% (2 steps each) share steps: a 2-step run
    showed the same figure at both ends, a difference of 0."""
    run = run_of(tmp_path / "a", [[30, 40 + step] for step in range(steps)])
    with pytest.raises(SystemExit) as exit_info:
        plot_training.main([str(run), "--out", str(tmp_path / "p.png")])
    assert exit_info.value.code == (f"error: {run}: {steps} step{'s' if steps > 1 else ''}; comparing its first "
                                    "and last steps needs at least 4 (2 at each end)")
    assert not (tmp_path / "p.png").exists()


def test_runs_of_the_same_folder_name_are_told_apart_by_their_paths(tmp_path, capsys):
    first, second = run_of(tmp_path / "a" / "run", [[30], [40], [50], [60]]), run_of(tmp_path / "b" / "run",
                                                                                     [[30], [30], [30], [30]])
    plot_training.main([str(first), str(second), "--out", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert f"| {first} | 4 |" in out and f"| {second} | 4 |" in out


def test_an_arm_of_one_seed_says_it_has_no_standard_error_instead_of_nan(tmp_path, capsys):
    run = run_of(tmp_path / "a", [[30], [40], [50], [60]])
    plot_training.main(["--arm", "one seed", str(run), "--out", str(tmp_path / "p.png")])
    assert "| one seed | 1 | 35.0 +- n/a | 55.0 +- n/a | +20.0 +- n/a |" in capsys.readouterr().out


def test_two_arms_of_one_label_are_refused_not_merged_into_the_last(tmp_path, capsys):
    """A dict by label kept the second arm and dropped the first, silently."""
    first, second = run_of(tmp_path / "a", [[30], [40]]), run_of(tmp_path / "b", [[30], [50]])
    with pytest.raises(SystemExit) as exit_info:
        plot_training.main(["--arm", "GRPO", str(first), "--arm", "GRPO", str(second), "--out",
                            str(tmp_path / "arms.png")])
    assert exit_info.value.code == 2 and "--arm 'GRPO' is given twice" in capsys.readouterr().err


def test_a_transcripts_file_holding_two_runs_rows_is_refused_not_averaged(tmp_path):
    """A second run's rows appended after the first's: the steps go back to 0."""
    rows = [transcript_row(step, index, [30, 40]) for _ in range(2) for step in range(4) for index in range(2)]
    run = write_run(tmp_path / "run", rows)
    with pytest.raises(plot_training.common.InputError, match=r"transcripts.jsonl:9: step 0 after step 3: this file "
                                                             "holds the rows of two runs"):
        plot_training.step_means(run)
