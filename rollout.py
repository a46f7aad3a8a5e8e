"""Multi-turn dialogues between the policy and simulated users, at token level.

Token layout of one dialogue, as TRL's `rollout_func` expects it:

    prompt_ids      = chat template of [policy system prompt, its worked exchanges if any, user opening]
                      + assistant header
    completion_ids  = reply 1 | close + user 2 + header | reply 2 | ... | reply n
    env_mask        =   1...1 |        0...0            |  1...1  | ... |  1...1

`env_mask` is 1 exactly on the tokens the policy sampled and 0 on everything inserted: the user's
messages, the template tokens around them, and the end-of-turn tokens that close a reply cut off by
its token budget. The sequence trained on is exactly the sequence the policy saw while sampling:
sampled ids are kept as sampled, never re-tokenized.

Think-then-say (`think=True`): the system prompt asks for `<think>...</think>` then the reply, and
each policy turn is sampled in two phases. The turn starts with an inserted `<think>` (as the
generation prompts of reasoning models do); the policy thinks until it writes `</think>` or spends
`max_think_tokens`, in which case `</think>` is inserted for it (budget forcing); then it writes
its reply. Only the text after the last `</think>` reaches the simulator. A turn whose thinking
the policy did not close itself, or whose reply is empty or holds more think tags, is a format
violation (counted; `format_penalty` x the share of the dialogue's turns that violated is taken off its reward,
so that a dialogue with one violating turn of two is paid more than one with two).
Difference from the paper: the policy keeps its own earlier thoughts in its context, so one
dialogue is one training row whose tokens are exactly the sampled ones; the paper removed earlier
thoughts and trained each policy turn as its own row.

Every dialogue knob is a field of `DialogueArguments` (below), a flag of both trainers.

Budgets are in tokens: per policy turn `max_think_tokens` and `max_reply_tokens`, and at most
`max_dialogue_tokens` for prompt plus completion; a dialogue that cannot fit another user message
and a minimal turn ends with reason "token_budget".

Two schedules (`--rollout`), which play the same dialogues when the policy decodes greedily or with
per-request seeds (tests/test_rollout_async.py; on a GPU's vLLM only with VLLM_BATCH_INVARIANT=1):
- async (the default): each dialogue is its own task, and asks for its next policy turn as soon as its
  own simulated user has answered. Its turns are sampled by `TurnBatcher` (one batched generate call for
  whichever dialogues are waiting: transformers, in-process vLLM) or sent as requests of their own to a
  vLLM server (`vllm_backends.VLLMServerTurns`). A step costs about its longest dialogue, not the sum over
  turns of each turn's slowest simulator (benchmarks/rollout_bench.py).
- lockstep (the paper's): each turn, one batched generate call for every active dialogue, then all
  their simulators answer. It is what a generator whose calls are collectives needs (every rank the
  same calls: DeepSpeed ZeRO-3 or FSDP across processes, TRL's vLLM in server mode or with tensor
  parallelism), and async falls back to it there, saying so.
Either way at most `simulator_concurrency` simulators answer at once. Each dialogue owns its simulator
(`Dialogue.simulator`); nothing is ever looked up by position in a list of active dialogues, so a
dialogue that ends early cannot mix up the others.

The policy's side (its system prompt, think parsing, transformers sampling) is `generation.py`, the vLLM
backends `vllm_backends.py`; `generate` is any of them. More on the schedules and failure handling:
docs/training.md.
"""
import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import common
import guards
import generation
import simulator

MIN_REPLY_TOKENS = 8  # a dialogue that cannot leave this many tokens for the next reply ends
PHASE_STOP = {"think": generation.THINK_CLOSE, "reply": None}  # a think phase samples up to </think>
END_REASONS = ("farewell", "gave_up", "goodbye", "turn_limit", "token_budget", "simulator_failed")


@dataclass
class DialogueArguments:
    """Every dialogue knob, in one place: who the policy talks to, for how long, with what budgets. The
    options of train_grpo.py and train_ppo.py (flags or --config keys), and what the runner reads;
    eval_sentient.py sets the benchmark's. The simulated user's own knobs (backend, variant, change bound,
    language, prompts) are simulator.SimulatorArguments. Defaults: the offline CPU demo, paper's in the help."""

    think: bool = field(default=False, metadata={"help": "think-then-say: <think>...</think> before each reply"})
    profiles: str = field(default=str(simulator.DEFAULT_PROFILES), metadata={"help": "training profiles (JSON Lines)"})
    start_emotion: int = field(default=simulator.TRAIN_START_EMOTION, metadata={
        "help": "the simulated user's emotion at the opening (paper: 30 in training; the benchmark: 40)"})
    max_turns: int = field(default=2, metadata={"help": "policy turns per dialogue (paper: 8; demo: 2 for CPU time)"})
    max_think_tokens: int = field(default=16, metadata={"help": "thinking tokens per turn (paper: up to ~5k a turn)"})
    max_reply_tokens: int | None = field(default=None, metadata={
        "help": "reply tokens per turn; default 48, or 32 with --think so that a demo turn samples at most 48 "
                "tokens either way (paper: up to ~5k a turn)"})
    max_dialogue_tokens: int = field(default=1024, metadata={"help": "prompt + completion tokens per dialogue"})
    format_penalty: float = field(default=0.0, metadata={
        "help": "x the share of a dialogue's turns that violated the think format, subtracted from its reward"})
    turn_credit: bool = field(default=False, metadata={
        "help": "credit each policy turn with the emotion change it caused (GRPO: a term of its tokens' advantage, "
                "train_grpo.TurnCreditArguments; PPO: its reward); paper: the final emotion only"})
    policy_prompt: str = field(default="policy", metadata={
        "help": "the policy's system prompt: prompts/<language>/<name>[_think].txt"})
    prefix_cache: bool = field(default=True, metadata={
        "help": "transformers generation: reuse the previous turn's key-value cache (same samples, faster)"})
    rollout: Literal["async", "lockstep"] = field(default="async", metadata={
        "help": "async: each dialogue asks for its next turn as soon as its user answered; lockstep: each turn "
                "waits for every dialogue's user (the paper's; what collective generators need)"})
    batch_wait: float = field(default=0.05, metadata={
        "help": "async with a batched generator: seconds the first waiting dialogue waits for others to join "
                "its generate call, unless every unfinished dialogue is already waiting"})
    # A vLLM server batches hundreds of requests at once: the cap is for rate-limited commercial APIs.
    simulator_concurrency: int = field(default=64, metadata={
        "help": "dialogues whose simulated user answers at once (its analysis call, then its reply call)"})
    max_failed_share: float = field(default=0.5, metadata={
        "help": "stop (after saving) when more of a step's dialogues than this lose their simulator"})

    def __post_init__(self):
        if self.max_reply_tokens is None:  # 16 thinking + 32 reply tokens: a demo turn samples 48 either way
            self.max_reply_tokens = 32 if self.think else 48
        guards.check_options(
            self, start_emotion=(lambda value: 0 <= value <= simulator.MAX_EMOTION,
                                 f"within 0-{simulator.MAX_EMOTION}"),
            max_turns=guards.TURNS, max_think_tokens=guards.AT_LEAST_ONE, max_reply_tokens=guards.AT_LEAST_ONE,
            max_dialogue_tokens=guards.AT_LEAST_ONE, format_penalty=guards.NOT_NEGATIVE,
            batch_wait=guards.NOT_NEGATIVE, simulator_concurrency=guards.AT_LEAST_ONE, max_failed_share=guards.FRACTION)
        file_name = f"{self.policy_prompt}_think.txt" if self.think else f"{self.policy_prompt}.txt"
        if not list(common.PROMPTS_DIR.glob(f"*/{file_name}")) or "/" in self.policy_prompt:
            suffix = "_think.txt" if self.think else ".txt"
            names = sorted({name for path in common.PROMPTS_DIR.glob(f"*/*{suffix}")
                           if not (name := path.name.removesuffix(suffix)).endswith("_think")
                           and name not in ("analysis", "opening", "reply", "system") and not name.startswith("style_")})
            raise common.ArgumentError(f"--policy_prompt {self.policy_prompt}: no prompts/<language>/{file_name}; "
                                       f"the prompts{' with a think variant' if self.think else ''} are "
                                       f"{', '.join(names)}")


# --------------------------------------------------------------------------------------------
# Chat-template pieces: what is inserted between the policy's sampled turns
# --------------------------------------------------------------------------------------------

class ChatSegments:
    """Token ids the chat template puts around turns, found once by rendering a sample dialogue.

    Only the inserted pieces are tokenized (the user's messages with their template tokens); the
    policy's sampled ids are never decoded and re-encoded into the sequence."""

    def __init__(self, tokenizer):
        if not tokenizer.chat_template:
            raise ValueError("the policy tokenizer has no chat template; use an instruct/chat model")
        self.tokenizer = tokenizer
        marker_reply, marker_user = "QQREPLYQQ", "QQUSERQQ"
        history = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                   {"role": "assistant", "content": marker_reply}]
        closed = tokenizer.apply_chat_template(history, tokenize=False)
        extended = tokenizer.apply_chat_template(history + [{"role": "user", "content": marker_user}],
                                                 tokenize=False, add_generation_prompt=True)
        if not extended.startswith(closed):
            raise ValueError("the chat template renders earlier turns differently once a turn is added; "
                             "multi-turn token-level rollouts need a prefix-stable template")
        self.close_text = closed[closed.rindex(marker_reply) + len(marker_reply):]  # e.g. "<|im_end|>\n"
        self.user_prefix, self.user_suffix = extended[len(closed):].split(marker_user)
        self.eos_ids = generation.end_of_turn_ids(tokenizer)
        self.think_open, self.think_close = self.encode(generation.THINK_OPEN), self.encode(generation.THINK_CLOSE)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, policy_messages: list[dict], opening: str) -> list[int]:
        """The chat template of the policy's messages (`generation.policy_messages`) and the user's opening."""
        messages = policy_messages + [{"role": "user", "content": opening}]
        return self.encode(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def closing_ids(self, sampled: list[int]) -> list[int]:
        """Template tokens that end a policy turn, minus the end-of-turn token if the policy sampled it."""
        text = self.close_text
        if sampled and sampled[-1] in self.eos_ids:
            eos_text = self.tokenizer.decode([sampled[-1]])
            text = text[len(eos_text):] if text.startswith(eos_text) else text
        return self.encode(text) if text else []

    def user_turn_ids(self, message: str) -> list[int]:
        return self.encode(self.user_prefix + message + self.user_suffix)


# --------------------------------------------------------------------------------------------
# Dialogues
# --------------------------------------------------------------------------------------------

@dataclass
class Dialogue:
    """One dialogue's tokens, texts and scores. `simulator` belongs to this dialogue alone."""

    dialogue_id: int
    profile: simulator.Profile
    simulator: simulator.Simulator
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turn_ids: list[list[int]] = field(default_factory=list)  # the ids the policy sampled, per turn
    thought_ids: list[list[int]] = field(default_factory=list)  # the sampled thinking part of each turn
    turn_starts: list[int] = field(default_factory=list)  # where each policy turn begins in completion_ids
    think_texts: list[str] = field(default_factory=list)
    reply_texts: list[str] = field(default_factory=list)
    emotions: list[int] = field(default_factory=list)  # after each turn
    reasons: list[str] = field(default_factory=list)
    format_violations: int = 0
    think_tokens: int = 0
    reply_tokens: int = 0
    simulator_seconds: float = 0.0
    end_reason: str | None = None
    failure: str | None = None  # the simulator's error, when it failed past its retries: no score
    # --turn_groups (train_grpo.py): the dialogue whose replies this one takes over for its first
    # `shared_turns` turns (None: its own), and how many; those turns are not trained.
    leader: "Dialogue | None" = None
    shared_turns: int = 0

    @property
    def done(self) -> bool:
        return self.end_reason is not None

    @property
    def final_emotion(self) -> int:
        return self.simulator.emotion

    @property
    def turn_changes(self) -> list[int]:
        """The emotion change each answered policy turn caused (after it minus before it); they sum to the
        final emotion minus the start. A turn whose simulator failed has none."""
        before = [self.simulator.start_emotion] + self.emotions[:-1]
        return [after - prior for after, prior in zip(self.emotions, before)]

    def token_turns(self) -> list[int]:
        """For each completion token, the index of the policy turn that sampled it; -1 for inserted tokens
        (user turns, template tokens, a forced </think>)."""
        ends = self.turn_starts[1:] + [len(self.completion_ids)]
        return [turn if sampled else -1 for turn, (start, end) in enumerate(zip(self.turn_starts, ends))
                for sampled in self.env_mask[start:end]]

    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def append(self, ids: list[int], sampled: bool, logprobs=None) -> None:
        self.completion_ids += ids
        self.env_mask += [1 if sampled else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [None] * len(ids)

    def transcript(self, step: int | None = None) -> dict:
        """A benchmark result row (SAGE format) plus training fields."""
        return {**self.simulator.result_row(self.think_texts), "step": step, "dialogue_id": self.dialogue_id,
                "end_reason": self.end_reason, "turns": len(self.reply_texts), "think_texts": self.think_texts,
                "format_violations": self.format_violations, "failure": self.failure}


def make_chat(simulator_args: simulator.SimulatorArguments):
    """The chat transport the simulated users talk through, one shared by every dialogue: None for the rule user,
    else an endpoint's client or a model in this process (llm_user.make_chat)."""
    if simulator_args.backend == "rule":
        return None
    import llm_user  # the LLM users: only for --backend llm or local

    return llm_user.make_chat(simulator_args)


def make_simulator(profile, chat, simulator_args: simulator.SimulatorArguments, *, start_emotion: int,
                   max_turns: int) -> simulator.Simulator:
    """A fresh simulated user for one dialogue, every setting from `simulator_args`: the rule user for --backend
    rule, else an LLM user talking through `chat` (make_chat), with our prompts or the released code's."""
    options = dict(start_emotion=start_emotion, max_turns=max_turns, variant=simulator_args.variant,
                   change_bound=simulator_args.change_bound, language=simulator_args.language)
    if simulator_args.backend == "rule":
        return simulator.RuleSimulator(profile, **options)
    import llm_user

    return llm_user.make_simulator(profile, chat, simulator_args, options)


def new_simulator(profile, chat, dialogue_args: DialogueArguments,
                  simulator_args: simulator.SimulatorArguments) -> simulator.Simulator:
    """A fresh simulated user for one dialogue: the dialogue's start and turn limit, the simulator's options."""
    return make_simulator(profile, chat, simulator_args, start_emotion=dialogue_args.start_emotion,
                          max_turns=dialogue_args.max_turns)


class DialogueRunner:
    """Runs batches of dialogues for one policy tokenizer, one set of dialogue options and one simulator
    set-up (`chat`: the simulator's chat transport, None for the rule user).

    It owns one event loop for its whole life, so an async HTTP client (the LLM simulator) is
    always used from the loop it was made on."""

    def __init__(self, tokenizer, args: DialogueArguments, simulator_args: simulator.SimulatorArguments | None = None,
                 chat=None):
        self.tokenizer = tokenizer
        self.args = args
        self.simulator_args = simulator_args or simulator.SimulatorArguments()
        if (chat is None) != (self.simulator_args.backend == "rule"):  # the backend decides the user, not `chat`
            raise ValueError(f"--backend {self.simulator_args.backend} takes "
                             f"{'no chat' if chat is not None else 'a chat (make_chat)'}")
        self.chat = chat
        self.segments = ChatSegments(tokenizer)
        # The least room a turn needs: a minimal reply, and in think mode the inserted think tags and
        # one token of thought.
        self.min_turn_tokens = MIN_REPLY_TOKENS + (
            len(self.segments.think_open) + len(self.segments.think_close) + 1 if args.think else 0)
        self.loop = asyncio.new_event_loop()
        self._next_id = 0
        self._told_lockstep = False

    def close(self) -> None:
        """Close the loop, first ending any dialogue a Ctrl-C left running on it (else each would be torn down
        later against a closed loop, with a traceback)."""
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def check_chat(self) -> None:
        """Fail now, with what to check, when the simulator's endpoint cannot serve (a wrong URL, key or model
        name), before any model loads; on the loop that will use its connections."""
        if self.chat is not None:
            self.loop.run_until_complete(self.chat.check())

    def new_simulator(self, profile) -> simulator.Simulator:
        return new_simulator(profile, self.chat, self.args, self.simulator_args)

    def openings(self, profiles) -> dict[str, str]:
        """Each profile's opening line, made once (first_talk, or the simulator's own opening), so the
        dialogues of a group share it; at most simulator_concurrency asked at once, as the dialogues' turns."""
        async def open_all():
            gate = asyncio.Semaphore(self.args.simulator_concurrency)

            async def open_one(profile):
                async with gate:
                    return await self.new_simulator(profile).open()
            return await asyncio.gather(*(open_one(p) for p in profiles))
        return dict(zip((p.id for p in profiles), self.loop.run_until_complete(open_all())))

    def run(self, starts: list[tuple], generate, shared: list[tuple[int, int]] | None = None) -> list[Dialogue]:
        """Play one dialogue per (profile, opening line), in order; `generate(contexts, max_new_tokens)`
        returns (sampled ids per context, their logprobs or None). `shared` (train_grpo.py's --turn_groups):
        per dialogue, (index of the dialogue whose replies it takes over, for how many first turns); the
        taken-over turns are played once, by that dialogue, and trained in none of them."""
        return self.loop.run_until_complete(self._run(starts, generate, shared))

    def prompt_ids(self, profile, opening: str) -> list[int]:
        """The policy's prompt for a dialogue (system prompt and the user's opening); refused when it leaves
        no room for one turn within max_dialogue_tokens."""
        prompt_ids = self._prompt(profile, opening)
        self._check_room([(profile, len(prompt_ids))])
        return prompt_ids

    def check_room(self, starts: list[tuple]) -> None:
        """prompt_ids' check for every (profile, opening) of the run at once, at start-up: a max_dialogue_tokens too
        small for one of them would otherwise stop the run when that profile is first drawn, and the figure said
        is the one the longest prompt needs."""
        self._check_room([(profile, len(self._prompt(profile, opening))) for profile, opening in starts])

    def _check_room(self, prompt_lengths: list[tuple]) -> None:
        profile, length = max(prompt_lengths, key=lambda item: item[1])
        needed = length + self.min_turn_tokens
        if needed > self.args.max_dialogue_tokens:
            raise common.InputError(f"--max_dialogue_tokens {self.args.max_dialogue_tokens}: profile {profile.id} "
                                    f"needs {needed} tokens for its prompt and a short reply; raise it to at least "
                                    f"{needed}")

    def _prompt(self, profile, opening: str) -> list[int]:
        args, language = self.args, self.simulator_args.language or profile.language
        messages = generation.policy_messages(language, args.think, args.policy_prompt,
                                              self.simulator_args.released_prompts("policy_prompts"))
        return self.segments.prompt_ids(messages, opening)

    # The turn: what one policy turn does to a dialogue, whichever schedule plays it.

    @staticmethod
    def _begin_turn(dialogue: Dialogue) -> None:
        dialogue.turn_ids.append([])
        dialogue.thought_ids.append([])
        dialogue.turn_starts.append(len(dialogue.completion_ids))

    def _open_phase(self, dialogue: Dialogue, phase: str) -> int:
        """Start a phase of the dialogue's turn (a think phase inserts <think>); its token budget."""
        if phase == "think":
            dialogue.append(self.segments.think_open, sampled=False)
        room = self.args.max_dialogue_tokens - len(dialogue.context())
        if phase == "think":
            return min(self.args.max_think_tokens, room - len(self.segments.think_close) - MIN_REPLY_TOKENS)
        return min(self.args.max_reply_tokens, room)

    def _take(self, dialogue: Dialogue, phase: str, ids: list[int], logprobs, trained: bool = True):
        """Append a phase's sampled ids (`trained`: in the loss). Think phase: cut at </think>, force-close if
        needed; returns whether the policy closed its thinking. Reply phase: returns the reply's ids."""
        if phase == "think":
            ids, closed = self._cut_thought(ids)
            logprobs = logprobs[:len(ids)] if logprobs else None
        dialogue.append(ids, sampled=trained, logprobs=logprobs if trained else None)
        dialogue.turn_ids[-1] += ids
        if phase == "reply":
            return ids
        dialogue.thought_ids[-1] = ids
        if not closed:
            dialogue.append(self.segments.think_close, sampled=False)  # budget forcing
        return closed

    def _cut_thought(self, ids: list[int]) -> tuple[list[int], bool]:
        """Keep sampled thinking up to and including the first </think>; drop an end-of-turn token
        sampled before it (the turn is not over: the reply comes next). Dropping a suffix of sampled
        tokens keeps the rest exactly as sampled."""
        for end in range(1, len(ids) + 1):
            if ids[end - 1] in self.segments.eos_ids:
                return ids[:end - 1], False
            if generation.THINK_CLOSE in self.tokenizer.decode(ids[max(0, end - 8):end]):
                return ids[:end], True
        return ids, False

    def _read_turn(self, dialogue: Dialogue, thought_closed: bool, reply_ids: list[int]) -> None:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        text = decode(reply_ids)
        if self.args.think:
            closing = "" if thought_closed else generation.THINK_CLOSE  # a forced close reads as written
            text = generation.THINK_OPEN + decode(dialogue.thought_ids[-1]) + closing + text
        thought, reply, well_formed = generation.split_think(text, self.args.think)
        dialogue.think_texts.append(thought)
        dialogue.reply_texts.append(reply)
        dialogue.format_violations += not (well_formed and thought_closed)
        dialogue.think_tokens += len(self.segments.encode(thought)) if thought else 0
        dialogue.reply_tokens += len(self.segments.encode(reply)) if reply else 0

    async def _answer(self, dialogue: Dialogue, gate: asyncio.Semaphore) -> None:
        async with gate:
            started = time.perf_counter()
            try:
                turn = await dialogue.simulator.respond(dialogue.reply_texts[-1])
            except common.EndpointError as error:  # a SimulatorError, or its endpoint's failure
                # Failed past the client's retries: the dialogue has no trustworthy score. It ends here
                # and the trainers leave it out of the loss; it is never scored 0 or 100.
                dialogue.failure, dialogue.end_reason = str(error), "simulator_failed"
                return
            finally:
                dialogue.simulator_seconds += time.perf_counter() - started
        dialogue.emotions.append(turn.emotion)
        dialogue.reasons.append(turn.reasoning)
        if turn.done:
            dialogue.end_reason = turn.end_reason
            return
        inserted = self.segments.closing_ids(dialogue.completion_ids) + self.segments.user_turn_ids(turn.message)
        if len(dialogue.context()) + len(inserted) + self.min_turn_tokens > self.args.max_dialogue_tokens:
            dialogue.end_reason = "token_budget"  # the next user message and a reply would not fit
            return
        dialogue.append(inserted, sampled=False)

    # The schedules: lockstep (one generate call a turn for every dialogue) or async (each dialogue on its
    # own, its turns batched by TurnBatcher below or sent to a server).

    async def _run(self, starts, generate, shared) -> list[Dialogue]:
        dialogues = []
        for profile, opening in starts:
            user = self.new_simulator(profile)
            await user.open(opening)
            dialogues.append(Dialogue(self._next_id, profile, user, self.prompt_ids(profile, opening)))
            self._next_id += 1
        for dialogue, (leader, turns) in zip(dialogues, shared or []):
            dialogue.shared_turns = turns
            dialogue.leader = dialogues[leader] if dialogues[leader] is not dialogue else None
        gate = asyncio.Semaphore(self.args.simulator_concurrency)
        lockstep_reason = getattr(generate, "lockstep_reason", None)
        if shared and not lockstep_reason:  # followers wait for their leader's turn: one turn at a time
            lockstep_reason = "the dialogues of a turn group share their first turns (--turn_groups)"
        if self.args.rollout == "lockstep" or lockstep_reason:
            if self.args.rollout == "async" and not self._told_lockstep:
                print(f"--rollout async: lockstep instead, as {lockstep_reason}", flush=True)
                self._told_lockstep = True
            await self._lockstep(dialogues, generate, gate)
        elif hasattr(generate, "sample"):  # a server: each turn its own request
            try:
                await run_all([self._play(d, generate.sample, gate) for d in dialogues])
            finally:
                await generate.aclose()
        else:
            batcher = TurnBatcher(generate, len(dialogues), self.args.batch_wait)
            await run_all([batcher.serve()] + [self._play(d, batcher.sample, gate, batcher.finished)
                                               for d in dialogues])
        return dialogues

    async def _lockstep(self, dialogues: list[Dialogue], generate, gate: asyncio.Semaphore) -> None:
        think = self.args.think
        for _ in range(self.args.max_turns):  # a fixed number of generate calls: ranks stay in lockstep
            active = [d for d in dialogues if not d.done]
            for dialogue in active:
                self._begin_turn(dialogue)
            if think:
                thoughts_closed = self._sample(active, generate, phase="think")
            replies = self._sample(active, generate, phase="reply")
            for index, dialogue in enumerate(active):
                self._read_turn(dialogue, thoughts_closed[index] if think else True, replies[index])
            await asyncio.gather(*(self._answer(d, gate) for d in active))

    def _sample(self, active: list[Dialogue], generate, phase: str) -> list:
        """One batched generate call for every active dialogue (lockstep); `_take`'s result for each. A dialogue
        within its shared turns (--turn_groups) is not sampled: it takes its leader's ids, untrained."""
        budgets = [self._open_phase(dialogue, phase) for dialogue in active]
        turn = len(active[0].turn_ids) - 1 if active else 0
        source = [d.leader if d.leader is not None and turn < d.shared_turns else d for d in active]
        own = [index for index, d in enumerate(active) if source[index] is d]
        sampled, logprobs = generate([active[i].context() for i in own], [budgets[i] for i in own],
                                     stop=PHASE_STOP[phase])
        by_source = {id(active[i]): (ids, logprobs[n] if logprobs else None)
                     for n, (i, ids) in enumerate(zip(own, sampled))}
        return [self._take(d, phase, *by_source[id(source[index])], trained=turn >= d.shared_turns)
                for index, d in enumerate(active)]

    async def _play(self, dialogue: Dialogue, sample, gate: asyncio.Semaphore, finished=lambda: None) -> None:
        """One dialogue on its own: each policy turn asked for as soon as its user has answered.
        `sample(context, budget, stop, key)` is awaited for each phase's ids and logprobs."""
        try:
            for turn in range(self.args.max_turns):
                if dialogue.done:
                    return
                self._begin_turn(dialogue)
                thought_closed = True
                for phase in ("think", "reply") if self.args.think else ("reply",):
                    budget = self._open_phase(dialogue, phase)
                    ids, logprobs = await sample(dialogue.context(), budget, PHASE_STOP[phase],
                                                 (dialogue.dialogue_id, turn, phase))
                    result = self._take(dialogue, phase, ids, logprobs)
                    if phase == "think":
                        thought_closed = result
                self._read_turn(dialogue, thought_closed, result)
                await self._answer(dialogue, gate)
        finally:
            finished()


async def run_all(coroutines) -> None:
    """Run the coroutines as tasks until all are done; when one fails, cancel the others (none is left on the
    runner's loop to wake up in its next run) and raise its error."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class TurnBatcher:
    """The policy's turns for dialogues played as tasks of their own (--rollout async), from a batched
    `generate(contexts, budgets, stop)`: whichever dialogues are waiting share one call. A call is made
    once every unfinished dialogue waits, or `wait` seconds after the first of them began waiting; it
    serves the phase of the longest-waiting request (one stop string a call), rows in dialogue order, in
    a worker thread (on the devices the rank selected: `generation.on_callers_devices`), so the simulators'
    calls go on meanwhile. One call at a time: a generator serves one batch (transformers' prefix cache, an
    in-process vLLM engine). When the simulated users answer at once (the rule user), every call holds the
    same dialogues, in the same order, as lockstep's."""

    def __init__(self, generate, dialogues: int, wait: float):
        self.generate = generation.on_callers_devices(generate)  # made in the rank's main thread
        self.wait = wait
        self.playing = dialogues  # dialogues not finished
        self.waiting = []  # (dialogue id, context, budget, stop, future)
        self.changed = asyncio.Event()

    async def sample(self, context: list[int], budget: int, stop: str | None, key: tuple):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((key[0], context, budget, stop, future))
        self.changed.set()
        return await future

    def finished(self) -> None:
        self.playing -= 1
        self.changed.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while self.playing:
            if not self.waiting:
                self.changed.clear()
                await self.changed.wait()
                continue
            deadline = loop.time() + self.wait
            while len(self.waiting) < self.playing and (left := deadline - loop.time()) > 0:
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), left)
                except TimeoutError:
                    break
            await self._call()

    async def _call(self) -> None:
        stop = self.waiting[0][3]
        batch = sorted((request for request in self.waiting if request[3] == stop), key=lambda request: request[0])
        self.waiting = [request for request in self.waiting if request[3] != stop]
        try:
            sampled, logprobs = await asyncio.to_thread(self.generate, [request[1] for request in batch],
                                                        [request[2] for request in batch], stop=stop)
        except Exception as error:
            for *_, future in batch:
                future.set_exception(error)
            raise
        for index, (*_, future) in enumerate(batch):
            future.set_result((sampled[index], logprobs[index] if logprobs else None))


class DialogueProgress:
    """A rich progress bar of dialogues played, with the mean final emotion the caller reports.
    On a terminal it redraws in place; in a log file it is written once, at the end."""

    def __init__(self, total: int, completed: int = 0, description: str = "dialogues", show: bool = True):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("mean emotion {task.fields[mean_emotion]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), disable=not show)
        self.task = self.progress.add_task(description, total=total, completed=completed, mean_emotion="-")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def advance(self, dialogues: int, mean_emotion: float) -> None:
        self.progress.update(self.task, advance=dialogues, mean_emotion=f"{mean_emotion:.1f}")


# --------------------------------------------------------------------------------------------
# Results: what TRL's rollout_func returns, metrics, transcripts
# --------------------------------------------------------------------------------------------

def reward(final_emotion: int, format_violations: int, turns: int, format_penalty: float = 0.0) -> float:
    """The paper's reward: final emotion / 100, given once per dialogue, minus the optional format penalty times
    the share of its turns that violated the think format. Graded, not all-or-nothing: a small model leaves most
    of its thoughts open (the packaged one closes 8% told the format in words, 33% shown it: generation.py), and
    a penalty for any violation would fall on nearly every dialogue of a group alike, leaving GRPO no difference
    to learn from."""
    return final_emotion / simulator.MAX_EMOTION - format_penalty * format_violations / max(turns, 1)


def dialogue_record(dialogue: Dialogue) -> dict:
    """What one dialogue reports besides its tokens: the per-row fields TRL hands the reward functions as
    keyword arguments, and what dialogue_metrics and turn credit read, by these names. A new logged
    quantity or reward input is one more key here, read by name where it is used."""
    return {
        "final_emotion": dialogue.final_emotion,
        "format_violations": dialogue.format_violations,
        "turns": len(dialogue.reply_texts),
        "end_reason": dialogue.end_reason,
        "think_tokens": dialogue.think_tokens,
        "reply_tokens": dialogue.reply_tokens,
        "simulator_seconds": dialogue.simulator_seconds,
        "emotions": dialogue.emotions,
        "turn_changes": dialogue.turn_changes,  # for --turn_credit
        "token_turns": dialogue.token_turns(),  # for --turn_credit (train_grpo.py)
        "failed": dialogue.failure is not None,
        "simulator_calls": asdict(dialogue.simulator.calls),
    }


def dialogue_columns(dialogues: list[Dialogue]) -> dict[str, list]:
    """The dialogues' records as columns (one list per key), as TRL passes them to the reward functions."""
    records = [dialogue_record(dialogue) for dialogue in dialogues]
    return {key: [record[key] for record in records] for key in (records[0] if records else ())}


def rollout_output(dialogues: list[Dialogue], with_logprobs: bool) -> dict:
    """The dict TRL's GRPOTrainer expects from `rollout_func`: the tokens, then the dialogues' records,
    which reach the reward functions as per-row keyword arguments."""
    return {
        "prompt_ids": [d.prompt_ids for d in dialogues],
        "completion_ids": [d.completion_ids for d in dialogues],
        "logprobs": [d.logprobs for d in dialogues] if with_logprobs else None,
        "env_mask": [d.env_mask for d in dialogues],
        **dialogue_columns(dialogues),
    }


def dialogue_metrics(columns: dict[str, list], max_turns: int) -> dict[str, float]:
    """The fixed set of training metrics (docs/usage.md lists them), from the columns of dialogue_record (keys
    it does not read are ignored: TRL's reward keyword arguments hold more). Emotions, lengths and formats
    are over the scored dialogues; `dialogue/ended_simulator_failed` is the share of all dialogues whose
    simulator failed; the simulator's calls, retries, failed calls and tokens are totals over all
    dialogues (zero for the rule backend)."""
    end_reasons = columns["end_reason"]
    metrics = {f"dialogue/ended_{reason}": sum(r == reason for r in end_reasons) / len(end_reasons)
               for reason in END_REASONS}
    calls = common.CallStats()
    for dialogue_calls in columns["simulator_calls"]:
        calls.add(common.CallStats(**dialogue_calls))
    metrics.update({"simulator/calls": calls.calls, "simulator/retries": calls.retries,
                    "simulator/failed_calls": calls.failed, "simulator/prompt_tokens": calls.prompt_tokens,
                    "simulator/completion_tokens": calls.completion_tokens})
    scored = [i for i, failed in enumerate(columns["failed"]) if not failed]
    if not scored:
        return metrics

    def total(key: str):
        return sum(columns[key][i] for i in scored)

    final_emotions = [columns["final_emotion"][i] for i in scored]
    count, policy_turns = len(scored), max(1, total("turns"))
    metrics.update({
        "emotion/final_mean": sum(final_emotions) / count,
        "emotion/success_rate": sum(e >= simulator.FAREWELL_AT for e in final_emotions) / count,
        "emotion/failure_rate": sum(e < simulator.GIVE_UP_BELOW for e in final_emotions) / count,
        "dialogue/turns_mean": total("turns") / count,
        "format/violation_rate": total("format_violations") / policy_turns,
        "length/think_tokens_per_turn": total("think_tokens") / policy_turns,
        "length/reply_tokens_per_turn": total("reply_tokens") / policy_turns,
        "simulator/seconds_per_turn": total("simulator_seconds") / policy_turns,
    })
    emotions = [columns["emotions"][i] for i in scored]
    for turn in range(max_turns):  # the emotion trajectory; an ended dialogue keeps its final emotion
        metrics[f"emotion/after_turn_{turn + 1}"] = sum(e[min(turn, len(e) - 1)] for e in emotions) / count
    return metrics


def run_line(method: str, model: str, lora: bool, backend: str, think: bool, steps: int, output_dir) -> str:
    """What a training run says before its first step: what it trains and where it writes."""
    return (f"{method}: {model}{' (LoRA)' if lora else ''}{', thinking,' if think else ''} against the {backend} "
            f"user, {steps} step{'s' if steps != 1 else ''}; writing {output_dir}")


def step_line(step: int, max_steps: int, metrics: dict, think: bool) -> str:
    """A training step in one line: the mean final emotion, the share of turns that broke the think format
    (thinking), and the step's seconds; every metric is in the run folder and the tracker."""
    line = f"step {step}/{max_steps}: mean final emotion {metrics.get('emotion/final_mean', float('nan')):.1f}"
    if think:
        line += f", format violations {metrics.get('format/violation_rate', float('nan')):.0%}"
    return line + f", {metrics['step_time']:.0f} s"


class TooManySimulatorFailures(simulator.SimulatorError):
    """More of a batch's dialogues had their simulator fail than `max_failed_share` allows."""


def check_failures(dialogues: list[Dialogue], max_failed_share: float, accelerator=None) -> None:
    """Raise when the simulators of too many of a step's dialogues failed. With several processes the
    decision is over all ranks' dialogues, and every rank makes it: a rank stopping alone would start
    saving a checkpoint (collectives) that the others never join, and the job would hang."""
    failed = [d for d in dialogues if d.failure is not None]
    counts = [(len(failed), len(dialogues), failed[-1].failure if failed else None)]
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        counts = gather_object(counts)
    failed_count, total = sum(n for n, _, _ in counts), sum(t for _, t, _ in counts)
    if failed_count and (failed_count > max_failed_share * total or failed_count == total):
        last_error = next(error for _, _, error in reversed(counts) if error is not None)
        raise TooManySimulatorFailures(
            f"the simulators of {failed_count} of {total} dialogues failed, more than max_failed_share="
            f"{max_failed_share} allows; check the simulator endpoint. Last error: {last_error}")


def write_transcripts(path, dialogues: list[Dialogue], step: int | None = None) -> None:
    """Append each dialogue's benchmark result row (plus step and thoughts) to a JSON Lines file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with guards.own_output(path):
        common.append_json_lines(path, [dialogue.transcript(step) for dialogue in dialogues])
