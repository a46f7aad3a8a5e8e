"""The simulated user: profiles, emotion bookkeeping and three interchangeable backends.

A simulator plays one person for one dialogue. It opens the dialogue (the profile's `first_talk`,
or a line it writes), then for every policy reply it returns a `UserTurn`: the user's next message,
the new emotion (0-100), the signed change, the reasoning behind it, and whether the dialogue is
over. Termination is decided here, in one place (`Simulator.respond`), for every backend:
emotion >= 100 ("S": thanks and goodbye), emotion < 10 ("F": goodbye), a goodbye in the user's
message, or the turn limit (8 policy turns in the paper's training, 9 judged replies in the
benchmark; the training scripts' is `--max_turns`). Each change is clamped to +-CHANGE_BOUND (the
paper's released training code left it unbounded; the benchmark bounds it) and the emotion to [0, 100].

Backends (`--backend`):
- `rule` (offline default): deterministic, no LLM, English only; `rule_user.py` holds it, its rules
  in its docstring and what each finding costs in one table at its top (`RuleSimulator` below).
- `llm` (any OpenAI-compatible chat endpoint, the paper's) and `local` (the same prompts and parser run
  through a transformers model in this process): llm_user.py, imported only for them
  (rollout.make_simulator chooses).

Variants (`--variant`), after the paper's finding that a forgiving simulator trains better:
- `vanilla`: expressive and forgiving. LLM prompts ask for visible feelings and generous credit
  for partial effort; the rule user says what helped or hurt and nudges toward what it wants.
- `challenging`: restrained and strict. LLM prompts ask for guarded feelings and credit only for
  replies that really meet the hidden need; the rule user needs more for a gain and answers
  tersely without saying why.

Talk to a simulated user in the terminal: `python talk.py --profile en-train-01`.

What it simplifies: the offline default is the rule user, not an LLM (the paper's user is an LLM: `--backend
llm`); each change is bounded in training too; our prompts are our own (the released code's: `--simulator_prompts
sage|rlver`). The rules in full: docs/method.md; the released prompts: docs/official_prompts.md; the rule user:
docs/rule_user.md.
"""
import re
from dataclasses import dataclass, field

import common
import guards
import rule_user

DEFAULT_PROFILES = common.REPO_DIR / "profiles" / "train.jsonl"
DEFAULT_BENCHMARK_PROFILES = common.REPO_DIR / "profiles" / "benchmark.jsonl"

TRAIN_START_EMOTION = 30  # training dialogues start here (paper); rollout.DialogueArguments' default
BENCHMARK_START_EMOTION = 40  # Sentient benchmark dialogues start here (SAGE)
# Policy turns per training dialogue in the paper; the training scripts play rollout.DialogueArguments'
# max_turns (the demo's 2, or a recipe's 8), this is the terminal dialogue's default.
PAPER_MAX_TURNS = 8
# Scored policy replies per benchmark dialogue. SAGE's loop runs 10 turns, the user's opening being
# the first, so it scores 9 replies; the 10th reply it asks for is never judged, so we do not ask.
BENCHMARK_MAX_TURNS = 9
CHANGE_BOUND = 10  # |change| per turn; the benchmark's bound, also used in training (see docstring)
# Our prompts' request settings (SimulatorArguments: the released prompts' calls send none), and the local
# backend's in every mode (it has no server whose defaults could apply).
SIMULATOR_TEMPERATURE, SIMULATOR_MAX_TOKENS = 0.7, 512
MAX_EMOTION = 100
# State labels by lower threshold, highest first: S thanks and leaves, F leaves.
EMOTION_STATES = (("S", 100), ("A", 70), ("B", 40), ("C", 10), ("F", 0))
FAREWELL_AT = 100  # emotion >= this ends the dialogue (state S)
GIVE_UP_BELOW = 10  # emotion < this ends the dialogue (state F)
VARIANTS = ("vanilla", "challenging")
RELEASED_PROMPTS = ("sage", "rlver")  # the released code's prompts (official.SOURCES), besides ours
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
        "You believe you bear no responsibility and made no mistake in what happened, and you want the other person "
        "to agree that you were not at fault",
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



class ProfileError(common.InputError):
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
    if not row["id"].isprintable():  # it names files' rows, report pages and messages: a newline would break them
        raise ProfileError(f"{where}: field 'id' holds a control character (a newline, a direction mark), got "
                           f"{row['id']!r:.60}")
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
    for number, where, row in common.json_lines(path, "profile file", ProfileError):
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

class SimulatorError(common.EndpointError):
    """The simulator cannot go on (output that never followed the format, a backend that cannot play the
    profile, ...). Its endpoint's own failures are common.EndpointError, this class's parent."""



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

    def __init__(self, profile, *, variant: str, start_emotion: int, max_turns: int, change_bound: int,
                 language: str | None):
        """Every option is required: their defaults are those of the dataclasses the scripts parse (variant,
        change_bound, language: SimulatorArguments; start_emotion, max_turns: rollout.DialogueArguments, or
        the benchmark's), so that no simulator keeps a default of its own."""
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
        self.calls = common.CallStats()  # this dialogue's model calls (none for the rule backend)

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
        "help": f"served model name for llm; path, hub id or {common.PACKAGED_MODEL!r} for local"})
    base_url: str | None = field(default=None, metadata={
        "help": "OpenAI-compatible endpoint for --backend llm, e.g. http://localhost:8000/v1 "
                "(default: $OPENAI_BASE_URL)"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "environment variable holding the API key"})
    simulator_timeout: float = field(default=120.0, metadata={
        "help": "seconds one simulator call may take (llm backend)"})
    simulator_max_retries: int = field(default=3, metadata={
        "help": "retries of a failed call: connection errors, timeouts, 429 (after Retry-After), 5xx (llm backend)"})
    simulator_parse_attempts: int = field(default=3, metadata={
        "help": "times the simulator asks for an analysis that does not parse, or for a user message that came "
                "back empty (ask_again), before the dialogue fails (llm and local backends)"})
    simulator_temperature: float | None = field(default=None, metadata={
        "help": "sampling temperature sent with each simulator call (llm backend); default: 0.7 with our prompts, "
                "none sent with sage/rlver (the released calls send none: the server's own applies)"})
    simulator_max_tokens: int | None = field(default=None, metadata={
        "help": "max_tokens sent with each simulator call (llm backend); default: 512 with our prompts, none "
                "sent with sage/rlver. An answer cut at it is a failed call, never a message"})
    change_bound: int = field(default=CHANGE_BOUND, metadata={"help": "largest |emotion change| per turn"})
    language: str | None = field(default=None, metadata={
        "help": "simulator prompt language (en, zh); default: the profile's", "choices": [None, *LANGUAGES]})
    simulator_prompts: str = field(default="ours", metadata={
        "help": "the simulated user's prompts: ours (prompts/), or the released code's own, read from "
                "--official_repo: sage (the Sentient benchmark's user), rlver (RLVER's training user)",
        "choices": ["ours", *RELEASED_PROMPTS]})
    policy_prompts: str = field(default="ours", metadata={
        "help": "the policy's system prompt: ours (prompts/), sage (SAGE's NPC prompt, no think variant) or "
                "rlver (RLVER's training prompts), the last two read from --official_repo",
        "choices": ["ours", *RELEASED_PROMPTS]})
    official_repo: str | None = field(default=None, metadata={
        "help": "a checkout of github.com/Tencent/digitalhuman, for --simulator_prompts/--policy_prompts sage|rlver"})
    analysis_emotion: str = field(default="current", metadata={
        "help": "with --simulator_prompts rlver, the emotion its analysis prompt shows: current (the user's emotion "
                "now, as the released functions take it) or start (the dialogue's first, on every turn, as the "
                "released PlayerSimulator.reply() shows it)", "choices": ["current", "start"]})
    empty_user_message: str | None = field(default=None, metadata={
        "help": "with --simulator_prompts sage|rlver, a user message that comes back empty: keep (the released "
                "loops go on with it; the default) or ask_again (ours: at most --simulator_parse_attempts times, "
                "then the dialogue fails; our prompts always do)", "choices": [None, "keep", "ask_again"]})

    def __post_init__(self):
        guards.check_options(self, simulator_timeout=guards.CALL_TIMEOUT, simulator_max_retries=guards.RETRIES,
                             simulator_parse_attempts=guards.ATTEMPTS,
                             simulator_temperature=(lambda value: value is None or value >= 0, "0 or more"),
                             simulator_max_tokens=(lambda value: value is None or value >= 1, "at least 1"),
                             change_bound=(lambda value: 1 <= value <= MAX_EMOTION, f"within 1-{MAX_EMOTION}"),
                             base_url=guards.URL)
        if self.analysis_emotion == "start" and self.simulator_prompts != "rlver":
            raise common.ArgumentError("--analysis_emotion start: the released RLVER loop's way, for "
                                       "--simulator_prompts rlver only")
        if self.empty_user_message == "keep" and self.simulator_prompts == "ours":
            raise common.ArgumentError("--empty_user_message keep: our prompts ask again for an empty message; keep "
                                       "is the released loops' way (--simulator_prompts sage or rlver)")
        if self.empty_user_message is None:
            self.empty_user_message = "ask_again" if self.simulator_prompts == "ours" else "keep"
        if self.simulator_prompts == "ours" or self.backend == "local":  # the released calls send neither
            self.simulator_temperature = (SIMULATOR_TEMPERATURE if self.simulator_temperature is None
                                          else self.simulator_temperature)
            self.simulator_max_tokens = self.simulator_max_tokens or SIMULATOR_MAX_TOKENS
        if self.simulator_prompts != "ours" and self.variant != "vanilla":
            raise common.ArgumentError(f"--variant {self.variant}: the {self.simulator_prompts} prompts have one "
                                       "variant; variants are ours (--simulator_prompts ours)")
        for option in ("simulator_prompts", "policy_prompts"):  # read and checked now, before any model loads
            source = getattr(self, option)
            if source == "ours":
                continue
            if not self.official_repo:
                raise common.ArgumentError(f"--{option} {source} needs --official_repo PATH, a checkout of "
                                           "github.com/Tencent/digitalhuman")
            import official  # the released code's prompts: only when asked for

            try:
                official.load(source, self.official_repo)
            except official.OfficialRepoError as error:
                raise common.ArgumentError(str(error)) from None

    def released_prompts(self, option: str):
        """The released code's prompts chosen for `option` ("simulator_prompts" or "policy_prompts"), an
        official.OfficialPrompts, or None for ours."""
        source = getattr(self, option)
        if source == "ours":
            return None
        import official

        return official.load(source, self.official_repo)


def rule_backend_refusal(profile, language: str | None) -> str:
    why = f"--language {language}" if language else f"profile {profile.id} is Chinese"
    return (f"{why}: the rule backend has English cues only and will not score Chinese text with them; "
            "use --backend llm or local")


def check_policy_prompts(args: SimulatorArguments, think: bool) -> None:
    """Refuse, before any model loads, official policy prompts without the mode asked for (SAGE's has no
    think variant): found otherwise at the first dialogue, after the model loaded and the openings were made."""
    released = args.released_prompts("policy_prompts")
    if released is not None:
        import official

        try:
            released.policy_prompt(think)
        except official.OfficialRepoError as error:
            raise common.ArgumentError(str(error)) from None


def check_backend(profiles, args: SimulatorArguments) -> None:
    """Refuse, before any model loads, dialogues the chosen backend cannot play."""
    if args.backend == "rule":
        if args.simulator_prompts != "ours":
            raise SimulatorError(f"--simulator_prompts {args.simulator_prompts} needs an LLM: "
                                 "use --backend llm or local")
        for profile in profiles:
            if (args.language or profile.language) != "en":
                raise SimulatorError(rule_backend_refusal(profile, args.language))


def load_playable_profiles(path, args: SimulatorArguments, think: bool) -> list[Profile]:
    """A trainer's profiles, after refusing, before any model loads, what the chosen backend cannot play and
    official policy prompts without the mode asked for."""
    profiles = load_profiles(path)
    check_backend(profiles, args)
    check_policy_prompts(args, think)
    return profiles


class RuleSimulator(rule_user.RuleUser, Simulator):
    """The offline rule user: rule_user.py's rules on this module's emotion bookkeeping. English only."""

    def __init__(self, profile, **options):
        Simulator.__init__(self, profile, **options)
        if self.language != "en":
            raise SimulatorError(rule_backend_refusal(profile, options.get("language")))
        try:
            rule_user.RuleUser.__init__(self, profile)
        except rule_user.MissingOwnWords as error:
            raise SimulatorError(str(error)) from None
