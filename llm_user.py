"""The LLM users, imported only for `--backend llm` or `local` (rollout.make_simulator): the paper's simulated
user, an LLM asked twice a turn, and the released SAGE or RLVER code's own user (`--simulator_prompts sage|rlver`).

`llm` talks to an OpenAI-compatible endpoint (chat_client.ChatClient), `local` to a transformers model in this
process (`LocalChat`). Two calls per user turn as in the paper: an *analysis* call (reasoning, then a last line
`CHANGE: <signed int>`, parsed strictly, asked again at most `--simulator_parse_attempts` times) and a *reply*
call that writes the user's message from that analysis and the discrete state. Our prompts are the text files
in `prompts/<language>/`; the policy's words go into them as JSON-quoted data, never as instructions. The
emotion bookkeeping and the termination rules are simulator.Simulator's, the same for every backend.
"""
import asyncio
import json
import os
import re
import string
import threading

import chat_client
import common
import guards
import official
import simulator


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
        raise AnalysisFormatError(f"'CHANGE:' must be followed by a signed integer of at most 3 digits, got "
                                  f"{lines[-1].strip()!r:.60}")
    reasoning = "\n".join(lines[:-1]).strip()
    if not reasoning:
        raise AnalysisFormatError("the reasoning before the 'CHANGE:' line is empty")
    return int(value.group(1)), reasoning


def load_prompt(language: str, name: str) -> string.Template:
    """A prompt template from prompts/<language>/<name>.txt ($-placeholders)."""
    path = common.PROMPTS_DIR / language / f"{name}.txt"
    if not path.is_file():
        raise simulator.SimulatorError(f"prompt file {path} is missing")
    return string.Template(path.read_text(encoding="utf-8"))


def quoted_dialogue(history: list[dict]) -> str:
    """The dialogue as JSON lines, so nothing either side wrote can pass for an instruction."""
    speaker = {"user": "me", "assistant": "them"}
    return "\n".join(json.dumps({"speaker": speaker[m["role"]], "text": m["content"]}, ensure_ascii=False)
                     for m in history)


class LocalChat:
    """The same chat interface, served by a transformers model in this process (offline LLM path)."""

    def __init__(self, model_name_or_path: str, temperature: float, max_new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = guards.checked_model(model_name_or_path, "simulator_model")
        guards.check_model_folder(path, "simulator_model")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if not self.tokenizer.chat_template:
            raise simulator.SimulatorError(f"{model_name_or_path} has no chat template; use an instruct/chat model")
        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.eval()
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self._lock = threading.Lock()  # one generate at a time; dialogues take turns
        self.totals = common.CallStats()

    def _generate(self, messages: list[dict]) -> tuple[str, common.CallStats]:
        import torch

        inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    return_tensors="pt", return_dict=True)
        sampling = ({"do_sample": True, "temperature": self.temperature} if self.temperature > 0
                    else {"do_sample": False})
        with self._lock, torch.no_grad():
            output = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens,
                                         pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                                         **sampling)
        prompt_tokens = inputs["input_ids"].shape[1]
        call = common.CallStats(calls=1, attempts=1, prompt_tokens=prompt_tokens,
                                completion_tokens=output.shape[1] - prompt_tokens)
        call.failed = int(call.completion_tokens == self.max_new_tokens  # cut before it ended
                          and output[0, -1].item() != self.tokenizer.eos_token_id)
        return self.tokenizer.decode(output[0, prompt_tokens:], skip_special_tokens=True), call

    async def check(self) -> None:
        return None

    async def complete(self, messages: list[dict], stats: common.CallStats | None = None) -> str:
        text, call = await asyncio.to_thread(self._generate, messages)
        call.add_to(self.totals, stats)
        if call.failed:  # never a message (as ChatClient's whole_answers)
            raise simulator.SimulatorError(f"the local simulator's answer was cut at --simulator_max_tokens "
                                           f"{self.max_new_tokens}; raise it")
        return text


class LLMSimulator(simulator.Simulator):
    """The paper's simulator: an analysis call, then a reply call, through `chat.complete`."""

    def __init__(self, profile, chat, *, parse_attempts: int, **options):
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
        raise simulator.SimulatorError(f"profile {self.profile.id}: the analysis did not follow the format after "
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
        raise simulator.SimulatorError(f"profile {self.profile.id}: the simulator returned an empty message "
                                       f"{self.parse_attempts} times")


class OfficialSimulator(simulator.Simulator):
    """The simulated user of the released SAGE or RLVER code, with their own prompts (`official.py`): an
    analysis call, then a reply call, each prompt sent as the only message, built and parsed as there.
    What stays ours: the bounded retries, the change bound (RLVER's own is none), call counting, and the
    termination rules, except that a goodbye is "再见" or "拜拜" anywhere in the message, as in SAGE."""

    def __init__(self, profile, chat, prompts: "official.OfficialPrompts", *, parse_attempts: int,
                 empty_user_message: str, analysis_emotion: str, **options):
        super().__init__(profile, **options)
        self.chat, self.prompts, self.parse_attempts = chat, prompts, parse_attempts
        self.format_retries = 0
        self.keep_empty = empty_user_message == "keep"  # as both released loops do (SimulatorArguments)
        self.analysis_emotion = analysis_emotion

    async def _ask(self, prompt: str) -> str:
        return await self.chat.complete([{"role": "user", "content": prompt}], stats=self.calls)

    def _says_goodbye(self, message: str) -> bool:
        return official.says_goodbye(message)

    async def _opening(self) -> str:
        return await self._message(self.prompts.reply_prompt(self.profile, f"Emotion-{self.state}", [], None))

    async def _judge(self, reply_text: str) -> tuple[int, str]:
        history = self.history + [{"role": "assistant", "content": reply_text}]
        # RLVER's released reply() copies only the history back into its player data: its analysis prompts all
        # show the starting emotion (SimulatorArguments.analysis_emotion).
        shown = self.start_emotion if self.analysis_emotion == "start" else self.emotion
        prompt = self.prompts.analysis_prompt(self.profile, shown, history)
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
        raise simulator.SimulatorError(f"profile {self.profile.id}: the {self.prompts.source} analysis could not be "
                                       f"parsed after {self.parse_attempts} attempts ({problem})")

    async def _write_message(self, reply_text: str, reasoning: str, change: int) -> str:
        history = self.history  # the policy's reply is in it by now
        return await self._message(self.prompts.reply_prompt(self.profile, f"Emotion-{self.state}", history, reasoning))

    async def _message(self, prompt: str) -> str:
        for _ in range(self.parse_attempts):
            message = official.reply_message(await self._ask(prompt))
            if message.strip() or self.keep_empty:
                return message
        raise simulator.SimulatorError(f"profile {self.profile.id}: the simulator returned an empty message "
                                       f"{self.parse_attempts} times")


def make_chat(args: "simulator.SimulatorArguments"):
    """The chat transport of --backend llm (an OpenAI-compatible endpoint) or local (a model in this process)."""
    if not args.simulator_model:
        raise simulator.SimulatorError(f"--backend {args.backend} needs --simulator_model (a served model name, or a "
                                       "local path)")
    if args.backend == "llm":
        base_url = args.base_url or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise simulator.SimulatorError("--backend llm needs --base_url, e.g. http://localhost:8000/v1 for "
                                           "`vllm serve`")
        if not args.base_url and not guards.is_url(base_url):  # the flag is checked while parsing
            raise simulator.SimulatorError(f"$OPENAI_BASE_URL {base_url!r} (the simulator's address, as no --base_url "
                                           f"is given): must be {guards.URL[1]}; set it so, or pass --base_url")
        return chat_client.ChatClient(base_url, args.simulator_model, args.api_key_env,
                                      temperature=args.simulator_temperature, max_tokens=args.simulator_max_tokens,
                                      timeout=args.simulator_timeout, max_retries=args.simulator_max_retries,
                                      whole_answers=True)
    if args.backend == "local":
        return LocalChat(args.simulator_model, args.simulator_temperature, args.simulator_max_tokens)
    raise ValueError(f"backend must be one of {simulator.BACKENDS}, got {args.backend!r}")


def make_simulator(profile, chat, args: "simulator.SimulatorArguments", options: dict) -> simulator.Simulator:
    """An LLM user for one dialogue (rollout.make_simulator), talking through `chat` (make_chat), with our
    prompts or the released code's."""
    released = args.released_prompts("simulator_prompts")
    if released is not None:
        return OfficialSimulator(profile, chat, released, parse_attempts=args.simulator_parse_attempts,
                                 empty_user_message=args.empty_user_message, analysis_emotion=args.analysis_emotion,
                                 **options)
    return LLMSimulator(profile, chat, parse_attempts=args.simulator_parse_attempts, **options)
