"""The official prompts of SAGE and RLVER, read from the user's checkout of github.com/Tencent/digitalhuman.

`--simulator_prompts sage|rlver` makes the simulated user speak with the released code's own prompts,
and `--policy_prompts sage|rlver` gives the policy the released system prompt, so that figures can be
compared with the published ones. Nothing of theirs is copied here: the template strings are read at
start-up from the files of a checkout (`--official_repo PATH`), and each is checked against the
sha256 of the version this module reproduces (commit 789ccd6f of the mirror github.com/zzjweb/digitalhuman).
A checkout whose `call_llm` / `call_api` stub has been filled in still loads; one whose prompts differ is
refused, naming the file and the template.

What is reproduced, byte for byte, from `SAGE/simulator_response.py` (the Sentient benchmark's user) and
`RLVER/code/verl/workers/rollout/vllm_rollout/hard_player_simulator_dsv3.py` (RLVER's training user):
- the analysis prompt (`planning_reply`) and the reply prompt (`player_reply`), their placeholders filled
  with `str.replace` in the official order (the order matters: text filled in early is searched by the
  later replacements), the dialogue as `json.dumps(..., ensure_ascii=False, indent=2)` of
  {"role": "你" | "NPC", "content": ...} (SAGE's analysis: the whole dialogue; RLVER's analysis and
  both reply prompts: all but the last two messages, then the last two apart), sent as one user message;
- the parsing of the analysis (full-width colons made ASCII, `*` removed, sections split on their
  headers; SAGE: the first signed integer after `Change:`, clamped to +-10; RLVER: `int()` of the
  first line after `Change:`, or of its last line when the text says "变化") and of the reply
  (the text after the last `Response:`, brackets and curly quotes stripped).

Where the official code cannot run as written, we do what it evidently intends (docs/official_prompts.md
lists the same choices):
1. SAGE `planning_reply` replaces `{{target}}` twice, the second time with `target_prompt[player_data
   ["target"]]`, which raises (a string indexed by a key SAGE's player data never has). The first
   replacement already filled every `{{target}}`, so the second is dropped: the bytes are those the first
   one made.
2. `call_llm` / `call_api` are stubs; we send the prompt as the only (user) message to the configured
   endpoint. RLVER's unused request body names temperature 0.5: the endpoint's temperature is ours.
3. Both loop forever on an output they cannot parse; we ask again at most `parse_attempts` times.
4. `hard_player_simulator_dsv3.py` does not compile (the body of `call_api` is not indented), so the
   templates are read with `tokenize`, which does not need the file to compile, not by importing it.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

SOURCES = ("sage", "rlver")  # besides "ours", the project's own prompts
SAGE_USER = "SAGE/simulator_response.py"
SAGE_POLICY = "SAGE/npc_response.py"
RLVER_USER = "RLVER/code/verl/workers/rollout/vllm_rollout/hard_player_simulator_dsv3.py"
RLVER_POLICY = "RLVER/code/verl/workers/rollout/vllm_rollout/system_prompt.py"
RLVER_TARGET = "eq"  # RLVER's training users are made with generate_role("eq")
MAPPING = {"user": "你", "assistant": "NPC"}  # the official role names, from the user's side
# what the reply prompt gets before there is an analysis
OPENING_PLANNING = "请你以一个简短的回复开启倾诉"
OPENING_HISTORY = "对话开始，你是玩家，请你先发起话题，用简短的回复开启倾诉"
SAGE_CHANGE_BOUND = 10
GOODBYES = ("再见", "拜拜")  # test_npc.py ends a dialogue when the user's message contains either

# (file, function or None for module level, variable) -> sha256 of the string (or JSON of the dict) there,
# at commit 789ccd6f5258f58fcacaa7af6d8e97941c393929.
EXPECTED = {
    (SAGE_USER, None, "target_prompt"):
        "68c304256df6f7ac03ff27b72e538cd2e37dc6f2aa7b5c8a4cd5589d9397cbe5",
    (SAGE_USER, "planning_reply", "template"):
        "5ba8eead6d766e72db660616590713c769094db10ad6c029d9992f5ff7635b49",
    (SAGE_USER, "player_reply", "template"):
        "f2429aa697ea79b37c0dcb26f65178cc7edca1f96ef50490ed388f3841c3754d",
    (SAGE_POLICY, "call_npc", "role_system"):
        "fbb05f2da6f06e36336442cdf7ceb7710855bd2117717d2ff045d6728a2af243",
    (RLVER_USER, None, "target_prompt"):
        "ae8d35ce79403522ca825998b4d620d0fd641c343edb780490d702f331186812",
    (RLVER_USER, "planning_reply", "template"):
        "b8c2eb1791d14171d5552774614dcbc98a15f0c50fe850617ea1862869f8e69f",
    (RLVER_USER, "player_reply", "template"):
        "55f9c7275ebb8cca0315c221beee625294000726a32fb51c8c8f72cd3efa5dae",
    (RLVER_POLICY, None, "system_prompt_train_unthink"):
        "047bcce7e65c46ed7e1d11efd5044a8493e5b66652f3d87f0ce71c7999efaf12",
    (RLVER_POLICY, None, "system_prompt_train_think"):
        "f6af385b221b42ebf68d09ff1c5d310c9740abb53ec51ea6cad36dce817a3281",
}


class OfficialRepoError(ValueError):
    """The checkout is missing, or its prompts are not the version reproduced here."""


def _digest(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def literal_assignments(source: str) -> dict[tuple[str | None, str], object]:
    """Every `name = <literal>` in a Python file, keyed by (enclosing function or None, name). Works on
    tokens, so a file that does not compile (RLVER's simulator) can still be read; nothing is executed."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))

    def position(row_col):
        return offsets[row_col[0] - 1] + row_col[1]

    found, function, tokens = {}, None, list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens):
        if token.type == tokenize.NAME and token.string == "def" and i + 1 < len(tokens):
            function = tokens[i + 1].string
            continue
        starts_statement = i == 0 or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                                            tokenize.NL, tokenize.COMMENT)
        if not (token.type == tokenize.NAME and starts_statement and i + 2 < len(tokens)
                and tokens[i + 1].string == "="):
            continue
        end = next(j for j in range(i + 2, len(tokens)) if tokens[j].type in (tokenize.NEWLINE, tokenize.ENDMARKER))
        expression = source[position(tokens[i + 2].start):position(tokens[end].start)]
        try:
            value = ast.literal_eval(expression.strip())
        except (ValueError, SyntaxError):
            continue
        found[(function if token.start[1] > 0 else None, token.string)] = value
    return found


def _read(repo: Path, relative: str) -> dict:
    path = repo / relative
    if not path.is_file():
        found = "is a folder, not a file" if path.is_dir() else "is missing"
        raise OfficialRepoError(f"--official_repo {repo}: {relative} {found}; expected a checkout of "
                                "github.com/Tencent/digitalhuman (SAGE/ and RLVER/ at its top)")
    try:
        return literal_assignments(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, tokenize.TokenError, SyntaxError) as error:
        raise OfficialRepoError(f"--official_repo {repo}: {relative} cannot be read as Python ({error})") from None


def _take(repo: Path, relative: str, function: str | None, name: str):
    value = _read(repo, relative).get((function, name))
    where = f"{relative}: {name} in {function}()" if function else f"{relative}: module-level {name}"
    if value is None:
        raise OfficialRepoError(f"--official_repo {repo}: {where} is missing; this project reproduces the "
                                "file at commit 789ccd6f of github.com/zzjweb/digitalhuman")
    expected = EXPECTED[(relative, function, name)]
    if _digest(value) != expected:
        raise OfficialRepoError(f"--official_repo {repo}: {where} differs from the version this project "
                                f"reproduces (commit 789ccd6f; sha256 {expected[:12]}..., found "
                                f"{_digest(value)[:12]}...): its prompts would not be the published ones")
    return value


@dataclass(frozen=True)
class OfficialPrompts:
    """One official source's templates: the simulated user's two prompts, its conversation target, and the
    policy's system prompts (by think mode; SAGE has no think variant)."""

    source: str
    analysis: str
    reply: str
    target: str
    policy: dict  # {False: no-think prompt, True: think prompt (RLVER only)}

    def policy_prompt(self, think: bool) -> str:
        if think not in self.policy:
            raise OfficialRepoError(f"--policy_prompts {self.source} has no think-mode system prompt; "
                                    "use --policy_prompts rlver or ours with --think")
        return self.policy[think]

    # --- the analysis call (planning_reply) -------------------------------------------------------

    def analysis_prompt(self, profile, emotion: int, history: list[dict]) -> str:
        """What planning_reply sends; `history` ends with the policy's latest reply."""
        if self.source == "sage":
            prompt = (self.analysis.replace("{{emotion}}", str(emotion)).replace("{{simulator_role}}", profile.player)
                      .replace("{{simulator_scene}}", profile.scene).replace("{{target}}", self.target))
            return prompt.replace("{{dialog_history}}", dialogue_json(history))
        prompt = (self.analysis.replace("{{emotion}}", str(emotion)).replace("{{player_type}}", profile.player)
                  .replace("{{player_topic}}", profile.scene).replace("{{target}}", self.target))
        return prompt.replace("{{dialog_history}}", dialogue_json(history[:-2])).replace(
            "{{new_history}}", dialogue_json(history[-2:]))

    def parse_analysis(self, output: str) -> tuple[int, dict]:
        """(change, planning) as planning_reply reads them; raises ValueError (IndexError included) where
        the official code would raise and ask again. SAGE's change is clamped to +-10 here, as there."""
        text = output.replace("：", ":").replace("*", "")
        if self.source == "sage":
            planning = {"activity": _section(text, "Activity:", "Analyse:\n"),
                        "TargetCompletion": _section(text, "TargetCompletion:", "Activity:\n"),
                        "content": _section(text, "Content:", "TargetCompletion:\n"),
                        "analyse": _section(text, "Analyse:", "Change:\n")}
            change = text.split("Change:")[-1].strip("\n").strip("[").strip("]")
            numbers = re.findall(r"[+-]?\d+", change)
            if not numbers:
                raise ValueError("no integer after 'Change:'")
            planning["change"] = max(-SAGE_CHANGE_BOUND, min(SAGE_CHANGE_BOUND, int(numbers[0])))
            return planning["change"], planning
        planning = {name: _section(text, header, until).replace("\n\n", "\n") for name, header, until in (
            ("content", "Content:", "Reason:\n"), ("reason", "Reason:", "Activity:\n"),
            ("activity", "Activity:", "Analyse:\n"), ("analyse", "Analyse:", "Change:\n"))}
        change = text.split("Change:")[-1].strip("\n")
        change = change.split("\n")[-1] if "变化" in change else change.split("\n")[0]
        planning["change"] = change.strip("[").strip("]").strip("“").strip("”")
        return int(planning["change"]), planning  # int() refuses anything but an integer, as there

    def planning_text(self, planning: dict) -> str:
        """The analysis as the reply prompt shows it (its {{planning}})."""
        if self.source == "sage":
            return ("对NPC回复的客观分析：\n" + planning["TargetCompletion"]
                    + "\n对NPC回复的主观分析：\n"
                    + planning["activity"] + planning["analyse"])
        return ("对NPC回复的客观分析：\n" + planning["reason"]
                + "\n对NPC回复的主观分析：\n" + planning["analyse"])

    # --- the reply call (player_reply) ------------------------------------------------------------

    def reply_prompt(self, profile, state: str, history: list[dict], planning_text: str | None) -> str:
        """What player_reply sends: `state` is "Emotion-S" ... "Emotion-F" after this turn's change;
        `planning_text` None for the opening (no analysis yet)."""
        prompt = self.reply.replace("{{planning}}", OPENING_PLANNING if planning_text is None else planning_text)
        prompt = prompt.replace("{{target}}", self.target).replace("{{emotion}}", state)
        persona = lambda text: text.replace("{{player_type}}", profile.player).replace(
            "{{player_topic}}", profile.scene)
        if self.source == "sage":
            prompt = persona(prompt)
        if history:
            prompt = prompt.replace("{{dialog_history}}", dialogue_json(history[:-2])).replace(
                "{{new_history}}", dialogue_json(history[-2:]))
        else:
            prompt = prompt.replace("{{dialog_history}}", OPENING_HISTORY).replace("{{new_history}}", "")
        return prompt if self.source == "sage" else persona(prompt)  # RLVER fills the persona last


def dialogue_json(history: list[dict]) -> str:
    return json.dumps([{"role": MAPPING[m["role"]], "content": m["content"]} for m in history],
                      ensure_ascii=False, indent=2)


def _section(text: str, header: str, until: str) -> str:
    return text.split(header)[-1].split(until)[0].strip("\n").strip("[").strip("]")


def reply_message(output: str) -> str:
    """The user's message as player_reply cuts it from the reply call's output."""
    return output.split("Response:")[-1].strip("\n").strip("[").strip("]").strip("“").strip("”")


def says_goodbye(message: str) -> bool:
    return any(word in message for word in GOODBYES)


@functools.lru_cache(maxsize=None)
def load(source: str, repo: str) -> OfficialPrompts:
    """The templates of `source` ("sage" or "rlver") from the checkout at `repo`, checked; read once."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    folder = Path(repo).expanduser()
    if not folder.is_dir():
        raise OfficialRepoError(f"--official_repo {repo}: no such folder; give a checkout of "
                                "github.com/Tencent/digitalhuman")
    if source == "sage":
        return OfficialPrompts(
            "sage", _take(folder, SAGE_USER, "planning_reply", "template"),
            _take(folder, SAGE_USER, "player_reply", "template"), _take(folder, SAGE_USER, None, "target_prompt"),
            {False: _take(folder, SAGE_POLICY, "call_npc", "role_system")})
    return OfficialPrompts(
        "rlver", _take(folder, RLVER_USER, "planning_reply", "template"),
        _take(folder, RLVER_USER, "player_reply", "template"),
        _take(folder, RLVER_USER, None, "target_prompt")[RLVER_TARGET],
        {False: _take(folder, RLVER_POLICY, None, "system_prompt_train_unthink"),
         True: _take(folder, RLVER_POLICY, None, "system_prompt_train_think")})
