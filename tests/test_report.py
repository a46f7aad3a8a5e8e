"""The HTML report: every dialogue on the page, trajectories as in the data, model text inert."""
import os
import re
import shutil
from html.parser import HTMLParser

import pytest
from conftest import profile_row, write_jsonl

import report
import simulator


class Page(HTMLParser):
    """Collects scripts, dialogues (with their chart data) and all text of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.scripts, self.dialogues, self.text, self.tags = [], [], [], []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "script":
            self._in_script = True
            self.scripts.append("")
        if tag == "details" and "dialogue" in attrs.get("class", ""):
            self.dialogues.append({"attrs": attrs, "trajectories": [], "text": ""})
        if tag == "polyline" and "data-trajectory" in attrs and self.dialogues:
            values = attrs["data-trajectory"]
            self.dialogues[-1]["trajectories"].append([int(v) for v in values.split(",")] if values else [])
            self.dialogues[-1].setdefault("points", []).append(attrs["points"])

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data
            return
        self.text.append(data)
        if self.dialogues:
            self.dialogues[-1]["text"] += data


def transcript_row(step, dialogue_id, emotions, reply="I hear that the ceiling stain is not your doing.",
                   think="They want to be told they are right.", intention="not_at_fault", personality="negative"):
    row = profile_row(intention, personality)
    history = [{"role": "user", "content": "My neighbour blames me.", "emotion-point": emotions[0]}]
    for before, after in zip(emotions, emotions[1:]):
        history.append({"role": "assistant", "content": reply, "think": think})
        history.append({"role": "user", "content": "Maybe.", "emotion-point": after, "change": after - before,
                        "reasoning": f"moved by {after - before}"})
    end = "farewell" if emotions[-1] >= 100 else "gave_up" if emotions[-1] < 10 else "turn_limit"
    row.update(emo_point=emotions[-1], history=history, step=step, dialogue_id=dialogue_id, end_reason=end,
               turns=len(emotions) - 1, think_texts=[think] * (len(emotions) - 1))
    return row


@pytest.fixture
def training_run(tmp_path):
    rows = [transcript_row(0, 0, [30, 35, 40]), transcript_row(0, 1, [30, 20, 5], intention="venting"),
            transcript_row(1, 2, [30, 60, 100], personality="passive"),
            transcript_row(1, 3, [30, 30, 31])]
    folder = tmp_path / "run"
    folder.mkdir()
    write_jsonl(folder / "transcripts.jsonl", rows)
    return folder, rows


def test_every_dialogue_is_on_the_page_with_its_trajectory(training_run):
    folder, rows = training_run
    page = Page(report.run_report(folder))
    assert len(page.dialogues) == len(rows)
    for dialogue, row in zip(page.dialogues, rows):
        expected = [m["emotion-point"] for m in row["history"] if m["role"] == "user"]
        assert dialogue["trajectories"] == [expected]
        # The drawn points are the data too: y runs from 100 (top) to 0 (bottom) of the 90-pixel chart.
        ys = [float(point.split(",")[1]) for point in dialogue["points"][0].split()]
        assert [round(100 * (84 - y) / 78) for y in ys] == expected
        assert f"step {row['step']}" in dialogue["text"] and "moved by" in dialogue["text"]
        assert dialogue["attrs"]["data-outcome"] == ("success" if expected[-1] >= 100 else
                                                     "failure" if expected[-1] < 10 else "other")
    assert [d["attrs"]["data-intention"] for d in page.dialogues] == ["not_at_fault", "venting", "not_at_fault",
                                                                      "not_at_fault"]


def injected(tag: str) -> str:
    """A script and an attribute break-out into an image, tagged with the field it was put in."""
    return f'<script>alert("{tag}")</script>"><img src=x onerror=alert("{tag}")>'


def injected_name(tag: str) -> str:
    """The same for a file name, which cannot hold "/": the script tag is left open."""
    return f'<script>alert("{tag}")"><img src=x onerror=alert("{tag}")>'


@pytest.fixture
def injected_runs(tmp_path):
    """Two training runs of one scenario with a payload in every field a transcript row has, rendered or not.
    Scenario id and step are shared (they pair the runs; a step must be a whole number, so it carries none);
    everything else is tagged with its run."""
    folders = []
    for run in ("A", "B"):
        history = [{"role": "user", "content": injected(f"{run}-first user message"), "emotion-point": 40},
                   {"role": "assistant", "content": injected(f"{run}-reply"), "think": injected(f"{run}-thought")},
                   {"role": "user", "content": injected(f"{run}-user message"), "emotion-point": 55, "change": 15,
                    "reasoning": injected(f"{run}-reasoning")}]
        row = {"id": injected("id"), "step": 0, "history": history, "emo_point": 55,
               "task": injected(f"{run}-task"), "main_cha": injected(f"{run}-personality"),
               "player": injected(f"{run}-player"), "scene": injected(f"{run}-scene"),
               "cha_group": [injected(f"{run}-cha_group")], "first_talk": injected(f"{run}-first_talk"),
               "end_reason": injected(f"{run}-end_reason"), "model": injected(f"{run}-model"),
               "dialogue_id": injected(f"{run}-dialogue_id"), "think_texts": [injected(f"{run}-think_texts")]}
        folder = tmp_path / injected_name(f"{run}-folder")
        folder.mkdir()
        write_jsonl(folder / "transcripts.jsonl", [row])
        folders.append(folder)
    return folders


def shown_fields(run: str) -> list[str]:
    """What the page must show of a run's payloads, as text; an unknown hidden intention by its first 60 characters."""
    return [injected(f"{run}-task")[:60], injected(f"{run}-personality")] + [
        injected(f"{run}-{field}") for field in ("first user message", "reply", "thought", "user message", "reasoning")]


@pytest.mark.parametrize("mode", ["single", "compare"])
def test_text_from_the_data_shows_as_text_in_every_field_and_runs_nothing(injected_runs, mode):
    folder_a, folder_b = injected_runs
    text = report.run_report(folder_a) if mode == "single" else report.compare_report(folder_a, folder_b)
    page = Page(text)
    # Nothing from the data became markup: the one script is ours, and no image was made.
    assert page.scripts == [report.SCRIPT] and text.count("<script") == 1
    assert "<img" not in text and not any(tag == "img" for tag, _ in page.tags)
    # Each payload reaches the reader unchanged, as text (the parser undoes the escaping).
    visible = "".join(page.text)
    expected = [str(folder_a), injected("id"), *shown_fields("A")]
    if mode == "compare":
        expected += [str(folder_b), *shown_fields("B")]
    assert [field for field in expected if field not in visible] == []
    # Filter labels sit in attributes, of the dialogue and of the filter's options: quotes in them do not end the
    # attribute, so choosing the option still selects the dialogue.
    (dialogue,) = page.dialogues
    run = "A" if mode == "single" else "B"  # a pair is filtered by its trained run's labels
    labels = {"intention": injected(f"{run}-task")[:60], "personality": injected(f"{run}-personality")}
    options = [attrs["value"] for tag, attrs in page.tags if tag == "option"]
    for name, label in labels.items():
        assert dialogue["attrs"][f"data-{name}"] == label and label in options


def test_summary_histogram_and_per_step_figures_match_the_data(training_run):
    folder, _ = training_run
    page = Page(report.run_report(folder))
    bars = {attrs["data-bin"]: int(attrs["data-count"]) for tag, attrs in page.tags if tag == "rect"}
    assert bars["40-49"] == 1 and bars["0-9"] == 1 and bars["100"] == 1 and bars["30-39"] == 1
    assert sum(bars.values()) == 4
    series = {attrs["data-series"]: [float(v) for v in attrs["data-values"].split(",")]
              for tag, attrs in page.tags if tag == "polyline" and "data-series" in attrs}
    assert series["mean final emotion"] == [22.5, 65.5]  # (40 + 5) / 2, (100 + 31) / 2
    assert series["success %"] == [0.0, 50.0] and series["failure %"] == [50.0, 0.0]


def test_a_step_whose_every_simulator_failed_plots_zero_not_a_failure_rate(tmp_path):
    rows = [transcript_row(0, 0, [30, 60]), {**transcript_row(1, 1, [30, 5]), "end_reason": "simulator_failed"}]
    folder = tmp_path / "run"
    folder.mkdir()
    write_jsonl(folder / "transcripts.jsonl", rows)
    series = {attrs["data-series"]: attrs["data-values"] for tag, attrs in Page(report.run_report(folder)).tags
              if tag == "polyline" and "data-series" in attrs}
    assert series == {"mean final emotion": "60.00,0.00", "success %": "0.00,0.00", "failure %": "0.00,0.00"}


@pytest.fixture
def compared_runs(tmp_path):
    """Three shared scenarios (s2 unchanged at 20, s1 up from 50 to 70, s3 down from 60 to 30), one in the base only."""
    base = write_jsonl(tmp_path / "base.jsonl", [
        {**transcript_row(None, 0, [40, 30, 20]), "id": "s2"}, {**transcript_row(None, 1, [40, 45, 50]), "id": "s1"},
        {**transcript_row(None, 2, [40, 50, 60]), "id": "s3"}, {**transcript_row(None, 3, [40, 40]), "id": "only-in-base"}])
    trained = write_jsonl(tmp_path / "trained.jsonl", [
        {**transcript_row(None, 0, [40, 35, 30]), "id": "s3"}, {**transcript_row(None, 1, [40, 30, 20]), "id": "s2"},
        {**transcript_row(None, 2, [40, 45, 70]), "id": "s1"}])
    return base, trained


def pair_id(dialogue: dict) -> str:
    return dialogue["text"].split(" · ")[0].strip()


def test_compare_pairs_the_same_scenarios_and_names_where_they_diverge(compared_runs):
    page = Page(report.compare_report(*compared_runs))
    assert "3 shared dialogues, 1 in one run only (left out)" in "".join(page.text)
    by_id = {pair_id(d): d for d in page.dialogues}
    assert by_id["s1"]["trajectories"] == [[40, 45, 50], [40, 45, 70]]
    assert by_id["s1"]["attrs"]["data-divergence"] == "2" and "diverge after turn 2" in by_id["s1"]["text"]
    assert by_id["s3"]["attrs"]["data-divergence"] == "1" and "A 60 / B 30 (-30)" in by_id["s3"]["text"]
    assert by_id["s2"]["attrs"]["data-divergence"] == "" and "same trajectory" in by_id["s2"]["text"]
    # The largest change first, a drop as much as a gain; the first pair is open as an example.
    assert [pair_id(d) for d in page.dialogues] == ["s3", "s1", "s2"]
    assert ["open" in d["attrs"] for d in page.dialogues] == [True, False, False]


def test_compare_pairs_a_step_s_repeats_of_one_scenario_in_order(tmp_path):
    """A training step plays each profile several times (a GRPO group): the n-th play pairs with the n-th."""
    runs = []
    for name, ends in (("base", (20, 30)), ("trained", (60, 70))):
        folder = tmp_path / name
        folder.mkdir()
        write_jsonl(folder / "transcripts.jsonl", [{**transcript_row(0, n, [40, end]), "id": "p"} for n, end in enumerate(ends)])
        runs.append(folder)
    page = Page(report.compare_report(*runs))
    assert sorted(d["trajectories"] for d in page.dialogues) == [[[40, 20], [40, 60]], [[40, 30], [40, 70]]]


def summary_table(text: str) -> dict[str, list[str]]:
    """The summary table's rows: figure name -> its cells, as shown."""
    table = re.search(r'<table class="summary">(.*?)</table>', text).group(1)
    return {name: re.findall(r"<td>(.*?)</td>", cells) for name, cells in re.findall(r"<tr><th>([^<]+)</th>(.*?)</tr>", table)}


def test_summary_figures_count_the_thresholds_exactly_and_leave_out_failed_simulators(tmp_path):
    rows = [transcript_row(None, 0, [40, 70, 100]),  # reaches 100: a success
            transcript_row(None, 1, [99]),  # one short of it, and no turn at all
            transcript_row(None, 2, [40, 20, 10]),  # at 10 the user has not given up yet
            transcript_row(None, 3, [40, 30, 9]),  # below 10: a failure
            transcript_row(None, 4, [40, 0]),
            {**transcript_row(None, 5, [40, 60, 80]), "end_reason": "simulator_failed"}]  # counted, not scored
    text = report.run_report(write_jsonl(tmp_path / "r.jsonl", rows))
    assert summary_table(text) == {"dialogues": ["6"],
                                   "mean final emotion": ["43.6"],  # (100 + 99 + 10 + 9 + 0) / 5
                                   "success %": ["20.0"], "failure %": ["40.0"],
                                   "mean turns": ["1.4"]}  # (2 + 0 + 2 + 2 + 1) / 5
    page = Page(text)
    assert [d["attrs"]["data-outcome"] for d in page.dialogues] == ["success", "other", "other", "failure", "failure",
                                                                    "simulator failed"]
    assert [d["text"].split(" · ")[3] for d in page.dialogues[:2]] == ["40 → 100", "99 → 99"]  # start → final
    bars = {attrs["data-bin"]: int(attrs["data-count"]) for tag, attrs in page.tags if tag == "rect"}
    assert (bars["100"], bars["90-99"], bars["10-19"], bars["0-9"]) == (1, 1, 1, 2)


@pytest.mark.parametrize("scored, figures", [
    ([], ["2", "0.0", "0.0", "0.0", "0.0"]),  # nothing to score: zeros, not an error or a 100% failure rate
    ([[40, 50, 60]], ["3", "60.0", "0.0", "0.0", "2.0"]),
], ids=["none scored", "one scored"])
def test_the_figures_are_over_the_scored_dialogues_however_few(tmp_path, scored, figures):
    failed = [{**transcript_row(None, 0, [40, 5]), "end_reason": "simulator_failed"}] * 2
    rows = failed + [transcript_row(None, 1, emotions) for emotions in scored]
    table = summary_table(report.run_report(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert table == dict(zip(["dialogues", "mean final emotion", "success %", "failure %", "mean turns"],
                             ([figure] for figure in figures)))


def test_compare_gives_each_run_its_own_figures_bars_and_difference(compared_runs):
    text = report.compare_report(*compared_runs)
    figures = summary_table(text)  # over the three shared scenarios only: A ends at 20, 50, 60; B at 20, 70, 30
    assert figures["dialogues"] == ["3", "3", "+0.0"]
    assert figures["mean final emotion"] == ["43.3", "40.0", "-3.3"]  # columns A, B, B - A
    bars = {}
    for tag, attrs in Page(text).tags:
        if tag == "rect" and int(attrs["data-count"]):
            bars.setdefault(attrs["fill"], {})[attrs["data-bin"]] = int(attrs["data-count"])
    assert bars == {report.COLORS[0]: {"20-29": 1, "50-59": 1, "60-69": 1},
                    report.COLORS[1]: {"20-29": 1, "30-39": 1, "70-79": 1}}


def test_histogram_bars_are_to_scale_side_by_side_and_in_bin_order():
    svg = report.histogram([[5, 7, 55], [8, 100, 100, 100]])  # A: 2 in 0-9, 1 in 50-59; B: 1 in 0-9, 3 in 100
    tags = Page(svg).tags
    bars = [{"bin": attrs["data-bin"], "fill": attrs["fill"], "count": int(attrs["data-count"]),
             **{name: float(attrs[name]) for name in ("x", "y", "width", "height")}} for tag, attrs in tags if tag == "rect"]
    axis = next(float(attrs["y1"]) for tag, attrs in tags if tag == "line")
    assert 10 < axis < 172  # inside the 180-pixel chart, above the bin labels (y = 172)
    # Heights in proportion to the counts: the tallest (3) reaches the top (y = 10), and every bar stands on the axis.
    drawn = 0.1  # coordinates are written to one decimal
    assert re.search(r'<text x="2" y="12" class="tick">(\d+)</text>', svg).group(1) == "3"  # the scale's top
    assert all(bar["height"] == pytest.approx((axis - 10) * bar["count"] / 3, abs=drawn) for bar in bars)
    assert all(bar["y"] + bar["height"] == pytest.approx(axis, abs=drawn) for bar in bars)
    assert min(bar["y"] for bar in bars) == 10
    # Left to right: the bins in order, in each A then B, no bar overlapping the next, all inside the chart.
    bins = [f"{low}-{low + 9}" for low in range(0, 100, 10)] + ["100"]
    assert [(bar["bin"], bar["fill"]) for bar in bars] == [(name, color) for name in bins for color in report.COLORS]
    assert bars[0]["x"] >= 28 and bars[-1]["x"] + bars[-1]["width"] <= 520
    assert all(left["x"] + left["width"] < right["x"] for left, right in zip(bars, bars[1:]))
    # Each bin's label sits under its pair of bars.
    ticks = re.findall(r'<text x="([\d.]+)" y="172" class="tick">([\d-]+)</text>', svg)
    assert [label for _, label in ticks] == bins
    assert all(a["x"] <= float(x) <= b["x"] + b["width"] for (x, _), a, b in zip(ticks, bars[::2], bars[1::2]))


@pytest.mark.parametrize("a, b, turn", [
    ([40, 45, 50], [40, 45, 50], None),
    ([40, 45, 50], [41, 45, 50], 0),
    ([40, 45, 50], [40, 45, 70], 2),
    ([40, 45], [40, 45, 50], 2),  # one dialogue went on longer: they diverge where the shorter one ended
    ([40, 45, 50, 60], [40, 45], 2),
])
def test_the_divergence_turn_is_the_first_turn_whose_emotions_differ(a, b, turn):
    assert report.first_divergence(a, b) == turn


def test_compare_reads_scores_that_are_not_whole_numbers(tmp_path):
    """SAGE's format allows any number within 0-100 (eval_sentient reads 55.5)."""
    base = write_jsonl(tmp_path / "base.jsonl", [{**transcript_row(None, 0, [40, 50]), "id": "s1", "emo_point": 50.5}])
    trained = write_jsonl(tmp_path / "trained.jsonl", [{**transcript_row(None, 0, [40, 60]), "id": "s1", "emo_point": 60}])
    (pair,) = Page(report.compare_report(base, trained)).dialogues
    assert "A 50.5 / B 60 (+9.5)" in pair["text"]


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [transcript_row(0, 0, [30, 35]), "{not json"])
    with pytest.raises(report.ReportError, match=r"r\.jsonl:2: not valid JSON"):
        report.read_rows(path)
    with pytest.raises(SystemExit, match="no such result file"):
        report.main([str(tmp_path / "missing.jsonl")])


def test_the_report_reads_what_a_real_rollout_wrote(tiny_model_dir, tmp_path):
    """Transcripts as rollout.write_transcripts writes them (rule user, tiny policy), think on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import generation
    import rollout

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    runner = rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(
        think=True, max_turns=2, max_think_tokens=4, max_reply_tokens=6, max_dialogue_tokens=8192))
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[:2]
    openings = runner.openings(profiles)
    generate = generation.TransformersGenerator(model, tokenizer, GenerationConfig(
        do_sample=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    dialogues = runner.run([(p, openings[p.id]) for p in profiles], generate)
    runner.close()
    rollout.write_transcripts(tmp_path / "transcripts.jsonl", dialogues, step=0)
    page = Page(report.run_report(tmp_path))
    starts = [d.simulator.history[0]["emotion-point"] for d in dialogues]
    assert [d["trajectories"] for d in page.dialogues] == [[[start] + d.emotions] for start, d in zip(starts, dialogues)]
    thoughts = sum(bool(text) for d in dialogues for text in d.think_texts)
    assert sum(tag == "details" and attrs.get("class") == "think" for tag, attrs in page.tags) == thoughts


def test_screenshot_renders_the_page_with_headless_chromium(training_run, tmp_path):
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("Chromium not installed (Debian: apt install chromium): the screenshot check needs it")
    folder, _ = training_run
    png = tmp_path / "report.png"
    report.main([str(folder), "--screenshot", str(png)])
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_rows_of_the_official_format_without_steps_are_read(tmp_path):
    row = transcript_row(None, 0, [40, 50])
    for key in ("step", "dialogue_id", "end_reason", "turns", "think_texts"):
        row.pop(key)
    row["history"][1].pop("think")
    page = Page(report.run_report(write_jsonl(tmp_path / "sage.jsonl", [row])))
    assert page.dialogues[0]["trajectories"] == [[40, 50]] and "step" not in page.dialogues[0]["text"]


FAKE_CHROMIUM = """#!{python}
import sys
from PIL import Image
# headless Chromium's contract as report.py uses it: --screenshot=PATH, the page's URL last
path = next(arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--screenshot="))
assert sys.argv[-1].startswith("file://")
Image.new("RGB", (8, 8), "white").save(path)
"""


def test_a_screenshot_names_its_maker_so_that_only_its_own_is_ever_replaced(training_run, tmp_path, monkeypatch):
    """Chromium is faked at the process edge (a program writing a PNG where it is told to): what is tested is
    report.py's side: the PNG marked as its own, replaced on a second run, someone else's PNG refused."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "chromium").write_text(FAKE_CHROMIUM.format(python=sys.executable))
    (bin_dir / "chromium").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    folder, _ = training_run
    png = tmp_path / "shot.png"
    report.main([str(folder), "--out", str(tmp_path / "r.html"), "--screenshot", str(png)])
    report.main([str(folder), "--out", str(tmp_path / "r.html"), "--screenshot", str(png)])
    assert report.SCREENSHOT_SOFTWARE.encode() in png.read_bytes()[:8192]
    theirs = tmp_path / "theirs.png"
    theirs.write_bytes(b"\x89PNG\r\n\x1a\n someone's picture")
    with pytest.raises(SystemExit, match="a file this script did not write"):
        report.main([str(folder), "--out", str(tmp_path / "r.html"), "--screenshot", str(theirs)])
    assert theirs.read_bytes().endswith(b"someone's picture")


def test_a_file_holding_two_runs_rows_is_refused_not_shown_as_one_run(tmp_path):
    from test_bad_input_tools import write_run

    rows = [transcript_row(step, index, [30, 40]) for _ in range(2) for step in range(2) for index in range(2)]
    with pytest.raises(report.common.InputError, match="step 0 after step 1: this file holds the rows of two runs"):
        report.read_rows(write_run(tmp_path / "run", rows))
