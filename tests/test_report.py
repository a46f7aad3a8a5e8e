"""The HTML report: every dialogue on the page, trajectories as in the data, model text inert."""
import shutil
from html.parser import HTMLParser

import pytest
from conftest import profile_row, write_jsonl

import report
import simulator

ATTACK = '<script>alert("pwned")</script><img src=x onerror=alert(1)>'


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
            transcript_row(1, 3, [30, 30, 31], reply=ATTACK, think=ATTACK)]
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


def test_model_text_holding_a_script_stays_inert_text(training_run):
    folder, _ = training_run
    text = report.run_report(folder)
    page = Page(text)
    assert page.scripts == [report.SCRIPT]  # our filter script only
    assert not any(tag == "img" for tag, _ in page.tags)  # the injected tag was not parsed as one
    assert sum(ATTACK in dialogue["text"] for dialogue in page.dialogues) == 1  # shown, as text
    assert text.count("&lt;script&gt;") == 4  # two turns, each a reply and a thought


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


def test_compare_pairs_the_same_scenarios_and_names_where_they_diverge(tmp_path):
    base = write_jsonl(tmp_path / "base.jsonl", [
        {**transcript_row(None, 0, [40, 45, 50]), "id": "s1"}, {**transcript_row(None, 1, [40, 30, 20]), "id": "s2"},
        {**transcript_row(None, 2, [40, 40]), "id": "only-in-base"}])
    trained = write_jsonl(tmp_path / "trained.jsonl", [
        {**transcript_row(None, 0, [40, 30, 20]), "id": "s2"}, {**transcript_row(None, 1, [40, 45, 70]), "id": "s1"}])
    text = report.compare_report(base, trained)
    page = Page(text)
    assert len(page.dialogues) == 2 and "1 in one run only" in "".join(page.text)
    by_id = {d["text"].split(" · ")[0].strip(): d for d in page.dialogues}
    assert by_id["s1"]["trajectories"] == [[40, 45, 50], [40, 45, 70]]
    assert by_id["s1"]["attrs"]["data-divergence"] == "2"
    assert by_id["s2"]["attrs"]["data-divergence"] == ""  # the same trajectory
    assert [d["text"].split(" · ")[0].strip() for d in page.dialogues] == ["s1", "s2"]  # largest change first


def test_a_malformed_line_is_named_by_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [transcript_row(0, 0, [30, 35]), "{not json"])
    with pytest.raises(report.ReportError, match=r"r\.jsonl:2: not JSON"):
        report.read_rows(path)
    with pytest.raises(SystemExit, match="no such result file"):
        report.main([str(tmp_path / "missing.jsonl")])


def test_the_report_reads_what_a_real_rollout_wrote(tiny_model_dir, tmp_path):
    """Transcripts as rollout.write_transcripts writes them (rule user, tiny policy), think on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import rollout

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    runner = rollout.DialogueRunner(tokenizer, rollout.RolloutConfig(think=True, max_turns=2, max_think_tokens=4,
                                                                     max_reply_tokens=6))
    profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[:2]
    openings = runner.openings(profiles)
    generate = rollout.TransformersGenerator(model, tokenizer, GenerationConfig(
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
