"""See what a model learned: one self-contained HTML page of dialogues and emotion trajectories.

    python report.py runs/grpo-demo                              # a training run (its transcripts)
    python report.py runs/sentient/smollm2-135m-instruct.jsonl   # a benchmark result file (ours or SAGE's)
    python report.py --compare BASE TRAINED                      # two runs on the same scenarios

The page (`report.html` beside the input, or `--out`) needs no network: styles, the small filter
script and every chart (inline SVG) are in the file. It shows the summary figures, the distribution
of final emotions, for training runs the mean final emotion and success and failure rates per step,
and every dialogue with its emotion trajectory beside the conversation, the simulated user's reason
for each change and the policy's thoughts folded away; filters select by hidden intention,
personality type and outcome. `--compare` pairs the dialogues of two runs (by scenario id; in
training runs by step, scenario and order within the step), overlays their trajectories and names
the turn where they first diverge. `--screenshot PNG` renders the page with headless Chromium.

A transcript whose last line was cut short (a run killed while writing it) is reported without that
line, with a warning; any other line that is not a transcript row is an error naming file and line.

Everything that comes from a model or a profile is HTML-escaped: a transcript holding `<script>`
shows it as text. The only script on the page is the filter below.
"""
import argparse
import html
import os
import shutil
import subprocess
import sys
from pathlib import Path

import common
import guards
import simulator

COLORS = ("#2b6cb0", "#dd6b20")  # run A, run B


class ReportError(common.InputError):
    """An input that is not a transcript or result file."""


# --------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------

def read_rows(path: Path) -> list[dict]:
    """Rows of a result file, or of a training run folder's transcripts (one file per rank). A last line
    cut short (a run killed while writing it) is left out with a warning; any other bad line is an error."""
    files = sorted(path.glob("transcripts*.jsonl")) if path.is_dir() else [path]
    if not files or not path.exists():
        raise ReportError(f"{path}: no such result file, and no transcripts*.jsonl in it")
    rows = []
    for file in files:
        parsed_lines = common.json_lines(file, "transcript or result file", ReportError, skip_cut_last_line=True)
        last_step = {}
        for _, where, row in parsed_lines:
            if not isinstance(row, dict) or not isinstance(row.get("history"), list) or "id" not in row:
                raise ReportError(f"{where}: a row needs 'id' and a 'history' list")
            if not all(isinstance(message, dict) for message in row["history"]):
                raise ReportError(f"{where}: each 'history' entry must be a message (an object)")
            points = [row.get("emo_point"), *(message.get("emotion-point") for message in row["history"])]
            if any(isinstance(point, bool) or not isinstance(point, (int, float, type(None))) for point in points):
                raise ReportError(f"{where}: 'emo_point' and each 'emotion-point' must be numbers")
            step = row.get("step")
            if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
                raise ReportError(f"{where}: 'step' must be a whole number (a training step), got {step!r}")
            if step is not None:
                guards.check_steps_in_order(where, step, last_step)
            rows.append(row)
    if not rows:
        raise ReportError(f"{path}: no dialogues")
    return rows


def dialogue_view(row: dict) -> dict:
    """What the page shows of one row: labels, the emotion trajectory and the turns."""
    user_turns = [m for m in row["history"] if m.get("role") == "user"]
    trajectory = [int(m["emotion-point"]) for m in user_turns if "emotion-point" in m]
    final = row.get("emo_point", trajectory[-1] if trajectory else 0)
    if row.get("end_reason") == "simulator_failed":
        outcome = "simulator failed"
    else:
        outcome = ("success" if final >= simulator.FAREWELL_AT
                   else "failure" if final < simulator.GIVE_UP_BELOW else "other")
    task = str(row.get("task", ""))
    personality = str(row.get("main_cha", ""))
    return {"id": str(row["id"]), "step": row.get("step"), "final": final, "trajectory": trajectory,
            "intention": simulator.INTENTION_BY_TEXT.get(task, task[:60] or "unknown"),
            "personality": simulator.PERSONALITY_BY_TEXT.get(personality, personality or "unknown"),
            "outcome": outcome, "history": row["history"], "end_reason": row.get("end_reason")}


def pair_key(view: dict, seen: dict) -> tuple:
    """Scenario id (and step) plus its occurrence: the dialogues of one step of one profile are paired in order."""
    base = (view["step"], view["id"])
    seen[base] = seen.get(base, -1) + 1
    return base + (seen[base],)


# --------------------------------------------------------------------------------------------
# Charts: inline SVG built from numbers only; labels are escaped
# --------------------------------------------------------------------------------------------

def _svg(width: int, height: int, body: str, label: str) -> str:
    return (f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="{html.escape(label)}">{body}</svg>')


def trajectory_chart(trajectories: list[list[int]], width: int = 220, height: int = 90) -> str:
    """Emotion after each turn (0-100), one polyline per run; `data-trajectory` holds the values."""
    pad, body = 6, []
    turns = max((len(t) for t in trajectories), default=1)
    x = lambda i: pad + (width - 2 * pad) * (i / max(1, turns - 1))  # noqa: E731
    y = lambda e: pad + (height - 2 * pad) * (1 - e / simulator.MAX_EMOTION)  # noqa: E731
    for level in (simulator.GIVE_UP_BELOW, 50, simulator.FAREWELL_AT):
        body.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y(level):.1f}" y2="{y(level):.1f}" class="grid"/>')
    for trajectory, color in zip(trajectories, COLORS):
        points = " ".join(f"{x(i):.1f},{y(e):.1f}" for i, e in enumerate(trajectory))
        values = ",".join(map(str, trajectory))
        body.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2" '
                    f'data-trajectory="{values}"/>')
        body += [f'<circle cx="{x(i):.1f}" cy="{y(e):.1f}" r="2.5" fill="{color}"><title>turn {i}: {e}</title></circle>'
                 for i, e in enumerate(trajectory)]
    return _svg(width, height, "".join(body), "emotion after each turn")


def histogram(finals_per_run: list[list[int]], width: int = 520, height: int = 180) -> str:
    """Final emotions in bins of ten (the last bin is exactly 100), one bar colour per run."""
    bins = [f"{low}-{low + 9}" for low in range(0, 100, 10)] + ["100"]
    counts = [[0] * len(bins) for _ in finals_per_run]
    for run, finals in enumerate(finals_per_run):
        for final in finals:
            counts[run][min(int(final) // 10, 10)] += 1
    top = max((max(c) for c in counts), default=1) or 1
    slot, bottom, body = (width - 40) / len(bins), height - 24, []
    bar = slot * 0.8 / len(finals_per_run)
    for index, label in enumerate(bins):
        x0 = 30 + index * slot
        for run, color in enumerate(COLORS[:len(finals_per_run)]):
            value = counts[run][index]
            tall = (bottom - 10) * value / top
            body.append(f'<rect x="{x0 + run * bar:.1f}" y="{bottom - tall:.1f}" width="{bar - 1:.1f}" '
                        f'height="{tall:.1f}" fill="{color}" data-bin="{label}" data-count="{value}">'
                        f'<title>{label}: {value}</title></rect>')
        body.append(f'<text x="{x0 + slot * 0.4:.1f}" y="{height - 8}" class="tick">{label}</text>')
    body.append(f'<text x="2" y="12" class="tick">{top}</text><line x1="28" x2="{width}" y1="{bottom}" '
                f'y2="{bottom}" class="axis"/>')
    return _svg(width, height, "".join(body), "distribution of final emotions")


def step_chart(views: list[dict], width: int = 520, height: int = 200) -> str:
    """Per training step: mean final emotion, and success and failure rates in percent (one 0-100 axis)."""
    steps = sorted({v["step"] for v in views})
    series = {"mean final emotion": [], "success %": [], "failure %": []}
    for step in steps:
        finals = [v["final"] for v in views if v["step"] == step and v["outcome"] != "simulator failed"]
        count = max(len(finals), 1)  # a step whose every simulator failed: all three at 0
        series["mean final emotion"].append(sum(finals) / count)
        series["success %"].append(100 * sum(f >= simulator.FAREWELL_AT for f in finals) / count)
        series["failure %"].append(100 * sum(f < simulator.GIVE_UP_BELOW for f in finals) / count)
    left, bottom, top = 30, height - 24, 10
    x = lambda i: left + (width - left - 10) * (i / max(1, len(steps) - 1))  # noqa: E731
    y = lambda v: bottom - (bottom - top) * v / 100  # noqa: E731
    body = [f'<line x1="{left}" x2="{width}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
            f'<text x="2" y="{y(v) + 4:.1f}" class="tick">{v}</text>' for v in (0, 50, 100)]
    for (name, values), color in zip(series.items(), ("#2b6cb0", "#38a169", "#e53e3e")):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(values))
        body.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2" '
                    f'data-series="{html.escape(name)}" data-values="{",".join(f"{v:.2f}" for v in values)}"/>')
    body.append(f'<text x="{left}" y="{height - 6}" class="tick">step {html.escape(str(steps[0]))}</text>'
                f'<text x="{width - 60}" y="{height - 6}" class="tick">step {html.escape(str(steps[-1]))}</text>')
    legend = " ".join(f'<span style="color:{c}">&#9632; {n}</span>'
                      for n, c in zip(series, ("#2b6cb0", "#38a169", "#e53e3e")))
    return _svg(width, height, "".join(body), "per-step emotion") + f'<div class="legend">{legend}</div>'


# --------------------------------------------------------------------------------------------
# Page parts
# --------------------------------------------------------------------------------------------

def summary_figures(views: list[dict]) -> dict:
    scored = [v for v in views if v["outcome"] != "simulator failed"]
    count = max(len(scored), 1)  # no scored dialogue: every figure 0, not a 100% failure rate
    return {"dialogues": len(views),
            "mean final emotion": sum(v["final"] for v in scored) / count,
            "success %": 100 * sum(v["final"] >= simulator.FAREWELL_AT for v in scored) / count,
            "failure %": 100 * sum(v["final"] < simulator.GIVE_UP_BELOW for v in scored) / count,
            "mean turns": sum(max(0, len(v["trajectory"]) - 1) for v in scored) / count}


def summary_table(names: list[str], figures: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    if len(figures) == 2:
        head += "<th>B - A</th>"
    rows = []
    for key in figures[0]:
        cells = "".join(f"<td>{f[key]:.1f}</td>" if isinstance(f[key], float) else f"<td>{f[key]}</td>"
                        for f in figures)
        if len(figures) == 2:
            cells += f"<td>{figures[1][key] - figures[0][key]:+.1f}</td>"
        rows.append(f"<tr><th>{html.escape(key)}</th>{cells}</tr>")
    return f'<table class="summary"><tr><th></th>{head}</tr>{"".join(rows)}</table>'


def conversation(view: dict) -> str:
    """The turns: user messages with their emotion, change and reason; replies with thoughts folded."""
    parts = []
    for message in view["history"]:
        text = html.escape(str(message.get("content", "")))
        if message.get("role") == "assistant":
            thought = message.get("think")
            folded = (f'<details class="think"><summary>thought</summary>{html.escape(str(thought))}</details>'
                      if thought else "")
            parts.append(f'<div class="msg policy"><div class="who">policy</div>{folded}'
                         f'<div class="text">{text}</div></div>')
        else:
            emotion = message.get("emotion-point", "")
            change = f' ({int(message["change"]):+d})' if "change" in message else ""
            reason = message.get("reasoning")
            why = f'<div class="reason">{html.escape(str(reason))}</div>' if reason else ""
            parts.append(f'<div class="msg user"><div class="who">user &middot; emotion {html.escape(str(emotion))}'
                         f'{change}</div><div class="text">{text}</div>{why}</div>')
    return f'<div class="conversation">{"".join(parts)}</div>'


def _filter_attributes(view: dict) -> str:
    return " ".join(f'data-{name}="{html.escape(str(view[name]))}"' for name in ("intention", "personality", "outcome"))


def dialogue_block(view: dict, expanded: bool) -> str:
    step = f"step {html.escape(str(view['step']))} &middot; " if view["step"] is not None else ""
    start = view["trajectory"][0] if view["trajectory"] else "?"
    summary = (f"{step}{html.escape(view['id'])} &middot; {html.escape(view['intention'])} &middot; "
               f"{html.escape(view['personality'])} &middot; {start} &rarr; <b>{view['final']}</b> &middot; "
               f"{html.escape(view['outcome'])}")
    return (f'<details class="dialogue" {_filter_attributes(view)}{" open" if expanded else ""}>'
            f'<summary>{summary}</summary>'
            f'<div class="body">{trajectory_chart([view["trajectory"]])}{conversation(view)}</div></details>')


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for turn, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return turn
    return None if len(a) == len(b) else min(len(a), len(b))


def pair_block(a: dict, b: dict, expanded: bool) -> str:
    turn = first_divergence(a["trajectory"], b["trajectory"])
    where = "same trajectory" if turn is None else f"diverge after turn {turn}"
    step = f"step {html.escape(str(a['step']))} &middot; " if a["step"] is not None else ""
    summary = (f"{step}{html.escape(a['id'])} &middot; {html.escape(a['intention'])} &middot; "
               f"{html.escape(a['personality'])} &middot; A <b>{a['final']}</b> / B <b>{b['final']}</b> "
               f"({b['final'] - a['final']:+g}) &middot; {where}")
    return (f'<details class="dialogue pair" {_filter_attributes(b)} data-divergence="{"" if turn is None else turn}"'
            f'{" open" if expanded else ""}>'
            f'<summary>{summary}</summary>{trajectory_chart([a["trajectory"], b["trajectory"]])}'
            f'<div class="sides"><div><h4 style="color:{COLORS[0]}">A</h4>{conversation(a)}</div>'
            f'<div><h4 style="color:{COLORS[1]}">B</h4>{conversation(b)}</div></div></details>')


def filters(views: list[dict]) -> str:
    selects = []
    for name in ("intention", "personality", "outcome"):
        values = sorted({str(v[name]) for v in views})
        options = "".join(f'<option value="{html.escape(v)}">{html.escape(v)}</option>' for v in values)
        selects.append(f'<label>{name} <select data-filter="{name}">'
                       f'<option value="">all</option>{options}</select></label>')
    return f'<div class="filters">{" ".join(selects)} <span id="shown"></span></div>'


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1a202c;max-width:1200px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px} h4{margin:4px 0}
table.summary{border-collapse:collapse} \
table.summary td,table.summary th{border:1px solid #cbd5e0;padding:4px 10px;text-align:right}
.chart .grid{stroke:#e2e8f0} .chart .axis{stroke:#a0aec0} .chart .tick{font-size:10px;fill:#4a5568}
.legend{font-size:12px} .filters{margin:10px 0;position:sticky;top:0;background:#fff;padding:6px 0}
details.dialogue{border:1px solid #e2e8f0;border-radius:6px;margin:6px 0;padding:4px 8px}
details.dialogue>summary{cursor:pointer} .body{display:flex;gap:16px;align-items:flex-start;margin-top:6px}
.sides{display:flex;gap:16px} .sides>div{flex:1} .conversation{flex:1}
.msg{margin:4px 0;padding:6px 8px;border-radius:6px} .user{background:#f7fafc} .policy{background:#ebf8ff}
.who{font-size:11px;color:#4a5568} .reason{font-size:12px;color:#4a5568;font-style:italic;margin-top:3px}
.text{white-space:pre-wrap;word-break:break-word} details.think{font-size:12px;color:#4a5568}
"""

# Our only script: it reads the select boxes and hides dialogues; it never reads transcript text.
SCRIPT = """
function applyFilters(){
  const chosen={};document.querySelectorAll('select[data-filter]').forEach(s=>{chosen[s.dataset.filter]=s.value;});
  let shown=0;const all=document.querySelectorAll('details.dialogue');
  all.forEach(d=>{const hide=Object.keys(chosen).some(k=>chosen[k]&&d.dataset[k]!==chosen[k]);\
d.hidden=hide;if(!hide)shown++;});
  document.getElementById('shown').textContent=shown+' of '+all.length+' shown';
}
document.querySelectorAll('select[data-filter]').forEach(s=>s.addEventListener('change',applyFilters));
applyFilters();
"""


# In every page's head: an existing --out is replaced only when this script wrote it.
GENERATOR = '<meta name="generator" content="RLVER report.py">'


def page(title: str, sections: list[str]) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">{GENERATOR}<title>{html.escape(title)}</title>'
            f'<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{"".join(sections)}'
            f'<script>{SCRIPT}</script></body></html>')


def run_report(path: Path) -> str:
    views = [dialogue_view(row) for row in read_rows(path)]
    sections = [summary_table([str(path)], [summary_figures(views)]), "<h2>Final emotions</h2>",
                histogram([[v["final"] for v in views]])]
    if any(v["step"] is not None for v in views):
        sections += ["<h2>Per training step</h2>", step_chart([v for v in views if v["step"] is not None])]
    sections += [f"<h2>Dialogues ({len(views)})</h2>", filters(views),  # the first one open, as an example
                 *(dialogue_block(view, expanded=index == 0) for index, view in enumerate(views))]
    return page(f"Dialogues: {path}", sections)


def compare_report(path_a: Path, path_b: Path) -> str:
    runs = []
    for path in (path_a, path_b):
        seen, keyed = {}, {}
        for view in map(dialogue_view, read_rows(path)):
            keyed[pair_key(view, seen)] = view
        runs.append(keyed)
    shared = [key for key in runs[0] if key in runs[1]]
    if not shared:
        raise ReportError(f"{path_a} and {path_b} share no scenario: nothing to compare")
    pairs = [(runs[0][key], runs[1][key]) for key in shared]
    pairs.sort(key=lambda pair: -abs(pair[1]["final"] - pair[0]["final"]))  # the largest differences first
    only = len(runs[0]) + len(runs[1]) - 2 * len(shared)
    sections = [f'<p>A = <span style="color:{COLORS[0]}">{html.escape(str(path_a))}</span>, B = '
                f'<span style="color:{COLORS[1]}">{html.escape(str(path_b))}</span>: {len(shared)} shared dialogues'
                f'{f", {only} in one run only (left out)" if only else ""}.</p>',
                summary_table(["A", "B"], [summary_figures([a for a, _ in pairs]),
                                           summary_figures([b for _, b in pairs])]),
                "<h2>Final emotions</h2>", histogram([[a["final"] for a, _ in pairs], [b["final"] for _, b in pairs]]),
                f"<h2>Pairs ({len(pairs)}), largest difference first</h2>", filters([b for _, b in pairs]),
                *(pair_block(a, b, expanded=index == 0) for index, (a, b) in enumerate(pairs))]
    return page(f"Compare: {path_a} vs {path_b}", sections)


SCREENSHOT_SOFTWARE = "RLVER report.py"  # in each screenshot's PNG text


def screenshot(html_path: Path, png_path: Path, width: int = 1280, height: int = 1600) -> None:
    """Render the page with headless Chromium (Debian package `chromium`) into a PNG."""
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(name)), None)
    if browser is None:
        raise ReportError("--screenshot needs Chromium (Debian: apt install chromium); the report itself was written")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png_path.resolve()}",
                    html_path.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    from PIL import Image, PngImagePlugin

    image, marked = Image.open(png_path), PngImagePlugin.PngInfo()
    marked.add_text("Software", SCREENSHOT_SOFTWARE)  # so that a later --screenshot may replace it
    image.save(png_path, pnginfo=marked)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", type=Path, help="a training run folder or a benchmark result file")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="two runs on the same scenarios")
    parser.add_argument("--out",
                        help="the HTML file (default: report.html beside the input); its folder is made if missing")
    parser.add_argument("--screenshot", type=Path, metavar="PNG", help="also render the page into this PNG")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.compare is None):
        parser.error("give one run, or --compare A B")
    try:
        read = [{guards.real_path(path)
                 for path in (given.glob("transcripts*.jsonl") if given.is_dir() else [given])}
                for given in args.compare or [args.run]]  # each input's transcript files
        inputs = [path for paths in read for path in paths]
        if args.compare and read[0] & read[1]:
            raise ReportError(f"--compare: {args.compare[0]} and {args.compare[1]} are the same run; give two runs")
        if args.compare:
            second = args.compare[1]
            default = (second if second.is_dir() else second.parent) / "compare.html"
        else:
            default = args.run / "report.html" if args.run.is_dir() else args.run.with_suffix(".html")
        if args.out and args.out.endswith(os.sep):  # Path() would drop the slash and write a file of that name
            raise ReportError(f"--out {args.out}: a folder; give the HTML file's path")
        out = Path(args.out) if args.out else default
        # Checked before the runs are read; the folder is made when writing.
        guards.check_output_file(out, "out", guards.starts_with(GENERATOR.encode()), inputs)
        if args.screenshot and guards.real_path(args.screenshot) == guards.real_path(out):
            raise ReportError(f"--screenshot {args.screenshot}: the same file as the page (--out {out}); give a .png")
        if args.screenshot:
            guards.check_output_file(args.screenshot, "screenshot", guards.starts_with(SCREENSHOT_SOFTWARE.encode(), 8192),
                                     inputs)
        text = compare_report(*args.compare) if args.compare else run_report(args.run)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out} ({len(text) / 1e6:.1f} MB)")
        if args.screenshot:
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot(out, args.screenshot)
            print(f"wrote {args.screenshot}")
    except common.InputError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    guards.start_script("run it again (a page being written may be cut short)")
    try:
        main()
    except KeyboardInterrupt:
        guards.exit_interrupted("run it again (a page being written may be cut short)")
