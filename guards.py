"""The guards around the method, called from a few visible places in the trainers, the rollout and the tools:
option checks, --config YAML files, signals and Ctrl-C, output files and run-folder claims and locks, resume,
and models checked by name (a hub id, a trained LoRA adapter merged for evaluation).

They are why a bad file, line or value gets one line naming it and what to do, before anything slow (model
loading) starts, and why no run writes over another's files. The method runs without them: a copy may leave this
file and preflight.py out, deleting the statements that call them (docs/copying.md).
"""
import argparse
import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import stat
import sys
import threading
import uuid
from dataclasses import fields
from pathlib import Path

from common import (PACKAGED_MODEL, ArgumentError, EndpointError, InputError, append_json_lines, json_lines,
                    model_cache, packaged_model_folder, read_text, resolve_model, split_config_flag, write_folder_once)

# --------------------------------------------------------------------------------------------
# Outputs written only while they are this run's own, and input files of one run
# --------------------------------------------------------------------------------------------

_outputs = {}  # an output's absolute path: its state as this run last left it (_output_state)


def _output_state(path) -> tuple | None:
    """(device, inode, size for a file) of a path, or None where nothing is there."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino, found.st_size if stat.S_ISREG(found.st_mode) else None


def note_output(path, again: bool = False) -> None:
    """Remember an output (a file or a folder) as this run leaves it: check_output_kept compares. `again`: only
    if this run remembered it before (after rewriting it itself)."""
    if not again or os.path.abspath(path) in _outputs:
        _outputs[os.path.abspath(path)] = _output_state(path)


def check_output_kept(path) -> None:
    """Stop before writing into an output that is not as this run last left it (note_output): removed, replaced
    (another run's moved into its place) or changed by another writer. Writing on would mix two runs' rows, or
    replace files another run made; a summary would cover rows this run never wrote."""
    key = os.path.abspath(path)
    if key not in _outputs or _output_state(path) == _outputs[key]:
        return
    was, now = _outputs[key], _output_state(path)
    if now is None:
        happened = "was removed"
    elif was is None:
        happened = "was made by another process"
    elif now[:2] != was[:2]:
        happened = "was replaced (another run's moved into its place?)"
    else:
        happened = f"was changed by another writer ({was[2]} bytes as this run left it, {now[2]} now)"
    raise InputError(f"{path} {happened} while this run wrote it: stopped without writing more, so that no two runs' "
                     "files mix; put it back and run the same command to go on, or start again with another output")


@contextlib.contextmanager
def own_output(path):
    """Around a write to an output of this run's: check_output_kept before it, note_output after."""
    check_output_kept(path)
    yield
    note_output(path)


def append_rows_kept(path, rows) -> None:
    """append_json_lines to an output of this run's (own_output)."""
    with own_output(path):
        append_json_lines(path, rows)


def check_steps_in_order(where: str, step: int, last: dict) -> None:
    """Refuse a training transcript file holding two runs' rows (one appended to the other): in one run's file
    the steps never go back, as a resumed run first drops the rows of the steps it plays again. `last` carries
    the file's previous step between calls."""
    if step < last.get("step", step):
        raise InputError(f"{where}: step {step} after step {last['step']}: this file holds the rows of two runs (one "
                         "appended to the other?), whose figures would be taken for one run's; give one run's "
                         "transcripts")
    last["step"] = step


# --------------------------------------------------------------------------------------------
# Options and --config files
# --------------------------------------------------------------------------------------------

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


# figures no longer move.
BOOTSTRAP_SAMPLES = (lambda value: 1 <= value <= 100_000, "from 1 to 100000")


# generate calls must match): beyond this a mistyped value runs for hours, saying nothing.
TURNS = (lambda value: 1 <= value <= 100, "from 1 to 100")


SEED = (lambda value: 0 <= value < 2**31, "from 0 to 2147483647")


CALL_TIMEOUT = (lambda value: 0 < value <= 3600, "above 0 and at most 3600")  # seconds


RETRIES = (lambda value: 0 <= value <= 20, "from 0 to 20")


ATTEMPTS = (lambda value: 1 <= value <= 20, "from 1 to 20")


FRACTION = (lambda value: 0 <= value <= 1, "within 0-1")


def is_url(text: str) -> bool:
    """An http(s) URL with a host and, if any, a numeric port: an endpoint's address. Without a scheme it
    would read as a connection error later, with a bad port as a traceback."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, a bracketed host left open
        return False


URL = (is_url, "an http(s) URL, e.g. http://localhost:8000/v1")


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
    lines = {}  # an option set twice: YAML keeps the last value without a word
    for key_node, _ in yaml.compose(text, Loader=yaml.SafeLoader).value:
        if key_node.value in lines:
            raise InputError(f"{path}:{key_node.start_mark.line + 1}: {key_node.value} is set again (first on line "
                             f"{lines[key_node.value]}); keep one")
        lines[key_node.value] = key_node.start_mark.line + 1
    known = {action.dest for action in parser._actions} - {"help", "config"} | set(extra_keys)
    unknown = [str(key) for key in config if key not in known]
    if unknown:
        hints = [f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(key, known, 1)) else key
                 for key in unknown]
        raise InputError(f"{path}: unknown option(s): {', '.join(hints)}")
    check_config_values(path, text, config, parser)
    if "env" in config:  # TrlParser sets each as str(value): a list, a null or a number as a name gets through
        env = config["env"]
        names_ok = isinstance(env, dict) and all(isinstance(name, str) and name and not set(name) & {"=", "\0"}
                                                 for name in env)
        if not names_ok or any(not isinstance(value, (str, int, float, bool)) for value in env.values()):
            raise InputError(f"{path}:{lines['env']}: env: give environment variables as NAME: value, one a line "
                             f"(a name without '=', a text or number as the value), got {env!r}")
    return config


def check_config_values(path, text: str, config: dict, parser) -> None:
    """Refuse a config value its flag would refuse: the parser converts a flag's text by the option's type,
    but takes a YAML value as it is (`max_steps: 1.5`, `learning_rate: [0.1]` would reach the trainer). Each
    value, or each item of a list option, must read as that type (its text: `true` for a boolean) and be one
    of the option's choices."""
    actions = {action.dest: action for action in parser._actions}
    for key, value in config.items():
        action = actions.get(key)
        if action is None:
            continue
        line = next((number for number, text_line in enumerate(text.splitlines(), 1)
                     if text_line.startswith(f"{key}:")), None)
        where = f"{path}:{line}" if line else str(path)
        if value is None and action.default is not None:  # `max_steps:` or `max_steps: null`
            raise InputError(f"{where}: {key}: no value (null); give one, or leave the line out for the default "
                             f"({action.default})")
        if value is None or action.type is None:
            continue
        many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
        if isinstance(value, (list, dict)) != many and not (isinstance(value, dict) and action.type is str):
            kind = "a list" if many else "one value"
            raise InputError(f"{where}: {key}: {value!r} is not {kind}")
        for item in value if isinstance(value, list) else [value]:
            text_value = str(item).lower() if isinstance(item, bool) else str(item)
            try:
                converted = action.type(text_value) if not isinstance(item, dict) else item
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                type_name = getattr(action.type, "__name__", "of the option's type")
                type_name = {"string_to_bool": "true or false"}.get(type_name, type_name)
                raise InputError(f"{where}: {key}: {item!r} is not {type_name}") from None
            if action.choices is not None and converted not in action.choices:
                raise InputError(f"{where}: {key}: {item!r} is not one of {', '.join(map(str, action.choices))}")


def config_file(argv: list[str]) -> str | None:
    """The YAML file of `--config FILE` or `--config=FILE`, None without one."""
    argv = split_config_flag(argv)
    if "--config" not in argv:
        return None
    if argv.count("--config") > 1:  # TrlParser reads the first and calls the second an unused argument
        raise ArgumentError("--config is given twice; give one YAML file (flags after it override its values)")
    index = argv.index("--config") + 1
    if index == len(argv) or argv[index].startswith("--"):
        raise ArgumentError("--config needs a YAML file")
    return argv[index]


@contextlib.contextmanager
def usage_errors(parser, argv: list[str], hint=lambda message: ""):
    """Around parsing the dataclasses of a TrlParser from `argv` (and checking their values): a faulty --config
    file raises InputError naming its file and line, before TrlParser reads it; a value that cannot work or an
    unknown flag prints usage and exits 2, with `hint(message)` appended."""
    try:
        path = config_file(argv)
        if path is not None:
            read_config(path, parser, extra_keys=("env",))
        yield
    except ArgumentError as error:  # a value that cannot work: usage and what to fix, exit 2
        parser.error(str(error))
    except InputError:  # a bad --config file: one line naming it, exit 1, no usage
        raise
    except ValueError as error:  # the libraries' own checks, and unknown flags
        parser.error(str(error).rstrip(".") + closest_flags(parser, argv) + hint(str(error)))
    except ZeroDivisionError:  # a library's own check dividing by a count given as 0 (TRL's num_generations)
        parser.error("a count given as 0 where it divides another (as --num_generations does): counts must be at "
                     "least 1")


def parse_arguments(parser, argv: list[str], hint=lambda message: "") -> tuple:
    """The dataclasses of a TrlParser: their defaults, then the --config YAML file's values (and its `env:`
    variables), then the flags; faults as usage_errors says."""
    with usage_errors(parser, argv, hint):
        return parser.parse_args_and_config(split_config_flag(argv))


def closest_flags(parser, argv: list[str]) -> str:
    """"; did you mean ...?" for the flags in argv the parser does not know, where one of its own is close."""
    import difflib

    known = [flag for action in parser._actions for flag in action.option_strings]
    guesses = []
    for given in (item.split("=", 1)[0] for item in argv if item.startswith("--")):
        if given not in known and (close := difflib.get_close_matches(given, known, n=1)):
            guesses.append(f"{close[0]} for {given}")
    return f"; did you mean {', '.join(guesses)}?" if guesses else ""


# --------------------------------------------------------------------------------------------
# Output paths, checked before any work
# --------------------------------------------------------------------------------------------

MIN_FREE_BYTES = 64 * 2**20  # less free space than this on an output's filesystem is refused before any work


def check_output_folder(path, option: str, given=None) -> None:
    """Refuse an output folder that cannot be created or written, or whose filesystem is (nearly) full,
    without creating it (a run that fails later would leave it behind empty); `given` is the path as the
    option named it, if not the folder. `option` is a flag's name, or an environment variable's ($NAME)."""
    import shutil

    path = Path(path)
    label = option if option.startswith("$") else f"--{option}"
    try:
        real_path(path)
    except InputError as error:  # a link loop
        raise InputError(f"{label} {error}") from None
    existing = next(folder for folder in [path, *path.parents] if folder.exists())
    if not existing.is_dir():
        raise InputError(f"{label} {given or path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{label} {given or path}: {existing} is not writable")
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        raise InputError(f"{label} {given or path}: only {free / 2**20:.0f} MB free on its filesystem (full, or "
                         "not a disk, as /proc is)")


def check_output_file(path, option: str, made_here=None, inputs=()) -> None:
    """Refuse, before any work, an output file path that is a folder or not a regular file (/dev/full), one
    of the `inputs`, an existing file that `made_here(path)` does not recognise as this script's own (it
    would be replaced), or one that cannot be created (its folder is made when writing)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"--{option} {path}: a folder; give the path of the file to write")
    real_path(path)  # a link loop: said as such
    if path.is_symlink() and not path.exists():
        raise InputError(f"--{option} {path}: a link to {os.readlink(path)}, which does not exist; give another path")
    for given in inputs:  # by the file (a link, a hard link) or by the name (x/../in.jsonl while x is missing)
        if Path(given).is_file() and (path.exists() and path.samefile(given)
                                      or os.path.abspath(path) == os.path.abspath(given)):
            raise InputError(f"--{option} {path}: that is an input of this run; give another path")
    if path.exists() and not path.is_file():
        raise InputError(f"--{option} {path}: not a regular file; give the path of a file to write")
    if path.exists() and path.stat().st_size and not (made_here and made_here(path)):
        raise InputError(f"--{option} {path}: a file this script did not write; give another path, or delete it")
    check_output_folder(path.parent, option, given=path)


def starts_with(marker: bytes, size: int = 4096):
    """made_here for check_output_file: whether a file's first `size` bytes hold `marker`."""
    def made_here(path) -> bool:
        with open(path, "rb") as file:
            return marker in file.read(size)
    return made_here


def json_object_with(key: str):
    """made_here for check_output_file: whether a file is a JSON object holding `key` (a summary)."""
    def made_here(path) -> bool:
        try:
            made = json.loads(Path(path).read_bytes())
        except ValueError:  # not JSON, not UTF-8
            return False
        return isinstance(made, dict) and key in made
    return made_here


# --------------------------------------------------------------------------------------------
# Signals, Ctrl-C, and errors in one line
# --------------------------------------------------------------------------------------------

def start_script(on_terminate: str) -> None:
    """Called by each script run as a program, before its slow imports. Its output never fails on a character
    the terminal's encoding lacks (PYTHONIOENCODING=ascii and a path with an accent: the summary was lost to
    a UnicodeEncodeError after the work was done); it is escaped instead. Ctrl-C before main() runs (while torch
    and transformers load: seconds) exits 130 with one line instead of the cut import's traceback; from main()
    on it is Python's KeyboardInterrupt, which each script handles. SIGTERM (a scheduler ending the job, or a
    launcher ending the other processes when one failed) exits 143 at once, saving nothing new, with one line
    ending in `on_terminate`: what was kept and how to go on. It does not save: with a process gone, the
    others would wait forever for its part of a checkpoint."""
    def interrupt(signum, frame):
        while frame is not None:
            if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "__main__":
                raise KeyboardInterrupt
            frame = frame.f_back
        print("\ninterrupted while starting: nothing done", file=sys.stderr, flush=True)
        os._exit(130)

    def terminate(signum, frame):
        sys.stdout.flush()
        print(f"\nstopped by SIGTERM: nothing new saved; {on_terminate}", file=sys.stderr, flush=True)
        os._exit(143)  # not SystemExit: exit handlers may wait on a process that is gone

    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # not where a caller swapped the stream for its own
            stream.reconfigure(errors="backslashreplace")
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, terminate)


def lost_process(error: BaseException) -> bool:
    """Whether `error` is a collective of several processes failing (torch.distributed, DDP, DeepSpeed): another process
    of the run died (gloo says "Connection reset by peer" at once; NCCL times out), and this one can only stop."""
    import traceback

    # Raised in Python collectives (torch.distributed, DDP's buffers, DeepSpeed) or, from DDP's gradient hooks,
    # in the autograd engine, where only the message (the backend's own) tells.
    collectives = ("torch/distributed/", "torch/nn/parallel/distributed.py", "deepspeed/comm/")
    return (isinstance(error, RuntimeError) and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and (any(place in frame.filename for frame in traceback.extract_tb(error.__traceback__)
                     for place in collectives)
                 or any(backend in str(error) for backend in ("gloo/transport", "NCCL", "ProcessGroup"))))


def exit_if_lost_process(error: BaseException, resume_flag: str) -> None:
    """A trainer's one line for a lost process (lost_process); any other error is the caller's to raise."""
    if lost_process(error):
        raise SystemExit(f"error: a collective with the run's other processes failed, so one of them stopped (its "
                         f"own lines say why): {str(error).splitlines()[0][:200]}; the checkpoints in --output_dir "
                         f"are whole (continue from the newest with {resume_flag})") from None


def exit_interrupted(message: str):
    """Ctrl-C outside a training step: one line saying what was kept and how to go on, exit status 130. A
    Ctrl-C while it is said quits at once (the default action: no traceback)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(f"\ninterrupted: {message}", file=sys.stderr, flush=True)
    raise SystemExit(130)


@contextlib.contextmanager
def one_line_exits(resume_flag: str):
    """Around a trainer's `main()`: say in one line, without a traceback, what the user can fix: bad input or an
    endpoint, a full disk (OSError), a lost process, Ctrl-C outside a training step (inside one, the trainer
    saves first). Each line says how to continue from the checkpoints, which are whole."""
    kept = f"every checkpoint in --output_dir is whole (continue with {resume_flag})"
    try:
        yield
    except (InputError, EndpointError) as error:  # the simulator's errors are EndpointErrors
        raise SystemExit(f"error: {error}") from None
    except OSError as error:  # a full disk, a name too long, a file moved away while it was needed
        raise SystemExit(f"error: {error} (fix it, then continue with {resume_flag})") from None
    except RuntimeError as error:
        if "PytorchStreamWriter failed writing" in str(error):  # torch.save's full disk: an OSError of its own
            raise SystemExit(f"error: a checkpoint file could not be written: is the disk full? (fix it: {kept}; a "
                             "checkpoint cut short is passed over)") from None
        exit_if_lost_process(error, resume_flag)
        raise
    except KeyboardInterrupt:
        exit_interrupted(f"outside a training step: nothing new saved; {kept}")


class StopRequest:
    """Ctrl-C in a training run. The first asks the run to stop once the step in progress is done, with a
    checkpoint (a step cut in half would save weights half-updated); a second quits at once, saving nothing.
    Each rank catches its own signal, and stop_agreed makes every rank decide alike at the end of a step (a
    rank saving alone would wait forever for the others' part of a checkpoint)."""

    def __init__(self, show: bool = True):
        self.requested, self.show, self.previous = False, show, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self.handle)
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def handle(self, signum, frame) -> None:
        if self.requested:
            if self.show:
                print("\nCtrl-C again: quitting now, without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        if self.show:
            print("\nCtrl-C: stopping once this step is done, with a checkpoint (Ctrl-C again quits now, without "
                  f"saving){launcher_deadline()}", file=sys.stderr, flush=True)

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop; every rank calls it at the same point of each step."""
        from accelerate import PartialState
        from accelerate.utils import gather_object

        if PartialState().num_processes == 1:
            return self.requested
        return any(gather_object([self.requested]))


def launcher_deadline() -> str:
    """Under torchrun or accelerate launch with several processes (torch's elastic agent: TORCHELASTIC_RUN_ID),
    the launcher passes its Ctrl-C on to the processes and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds
    later (30 unless set): a step that ends later saves nothing. Said with the Ctrl-C notice; "" elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    seconds = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
    return (f"; the launcher kills the processes {seconds} s after its Ctrl-C: for longer steps, launch with "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT set higher")


# --------------------------------------------------------------------------------------------
# Resume: the command that continues a run, the rows of the steps played again, checkpoints
# --------------------------------------------------------------------------------------------

def resume_command(option: str, value: str | None = None) -> str:
    """The command line that continues this run: this script and its options, with `option` (and its
    `value`) in place of any it had, after the launcher that started it. A process cannot see its
    launcher's own options, so those are left for the user to repeat."""
    import shlex

    argv, kept = sys.argv[1:], []
    while argv:
        arg = argv.pop(0)
        if arg == option and value is not None and argv and not argv[0].startswith("--"):
            argv.pop(0)  # the old value
        elif arg != option and not arg.startswith(option + "="):
            kept.append(arg)
    if "ACCELERATE_MIXED_PRECISION" in os.environ:  # set by accelerate launch for the processes it starts
        launcher = "accelerate launch [its options, as before] "
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun (python -m torch.distributed.run)
        launcher = "torchrun [its options, as before] "
    else:
        launcher = "python "
    return launcher + shlex.join([Path(sys.argv[0]).name, *kept, option, *([value] if value is not None else [])])


def check_steps_left(resume_flag: str, checkpoint, trained: int, max_steps: int) -> None:
    """Refuse a resume whose checkpoint holds `max_steps` steps already: it would train nothing (PPO) or a step
    past the limit (the Trainer), and exit 0. Called before any row of the replayed steps is dropped."""
    if max_steps != -1 and trained >= max_steps:
        raise InputError(f"{resume_flag}: {checkpoint} holds {trained} trained steps, as many as --max_steps "
                         f"{max_steps} asks; raise --max_steps to train on")


def check_rows_up_to(paths: list, step: int, what: str = "transcripts") -> None:
    """Refuse a resume at `step` whose rows of the steps before are gone (a file deleted or moved): the run would
    go on, and its figures would start where the rows do."""
    present = {row.get("step") for path in paths if Path(path).is_file()
               for _, _, row in json_lines(path, what, skip_cut_last_line=True) if isinstance(row, dict)}
    missing = sorted(set(range(step)) - present)
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise InputError(f"the run's {what} ({', '.join(map(str, paths))}) hold no rows of steps {shown}, "
                                f"which its checkpoint at step {step} trained: deleted or moved? put them back, or "
                                "start a new run in another --output_dir")


def drop_rows_from(path, step: int, what: str = "transcripts file") -> int:
    """Drop the rows written for steps >= `step` (a resumed run plays them again); returns how many it dropped.
    A last line cut short (a run killed while writing it) is dropped with a warning; any other line that is not a
    row with its step is an error naming file:line, and the file is left as it was."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    try:
        rows = list(json_lines(path, what, skip_cut_last_line=True))
    except InputError as error:
        raise InputError(f"{error}; mend or delete that line, then resume again (nothing was changed)") from None
    for _, where, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise InputError(f"{where}: a row without its step; is {path.name} a training run's {what}?")
        if row["step"] < step:
            kept.append(row)
        else:
            dropped += 1
    # A kill while writing leaves the old file whole. The name is the process's own, as every GRPO rank
    # trims every rank's file (with the same result): its host's as well, as ranks on two nodes sharing the
    # output folder can have the same process id.
    partial = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.partial")
    partial.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept), encoding="utf-8")
    partial.replace(path)
    note_output(path, again=True)  # this run's own rewrite
    return dropped


def note_interruption(folder, step: int, checkpoint, resume: str) -> None:
    """Mark a run stopped by Ctrl-C in its RUN_MARKER (after which step, the checkpoint that holds it), and
    say so with the `resume` command. Steps count from 0, as in the transcripts; checkpoint-N holds N steps."""
    marker = Path(folder) / RUN_MARKER
    made = json.loads(marker.read_text())
    made.setdefault("interrupted", []).append({"after_step": step, "checkpoint": str(checkpoint)})
    marker.write_text(json.dumps(made) + "\n")
    note_output(marker, again=True)  # this run's own change
    print(f"interrupted after step {step} ({step + 1} step{'s' if step else ''} trained): {checkpoint} holds its "
          f"state; continue with: {resume}", file=sys.stderr)


def checkpoint_problem(folder, required: tuple[str, ...], step_of=None) -> str | None:
    """Why a checkpoint folder cannot be resumed from (None if it can): a `required` member missing, an
    empty file, a torch file (.pt, .bin, .pth: zip archives) cut short, a safetensors file or JSON file
    that does not parse (a kill while saving, a full disk or a copy cut short leaves such a folder); or, with
    `step_of(folder)` (the step its state holds), a step other than its name's `checkpoint-N` (a folder renamed,
    or its state edited: a resume would skip or replay steps)."""
    import zipfile

    from safetensors import safe_open

    folder = Path(folder)
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        return f"no {missing[0]}"
    for path in sorted(path for path in folder.rglob("*") if path.is_file()):
        name = path.relative_to(folder)
        if path.stat().st_size == 0:
            return f"{name} is empty"
        try:
            if path.suffix in (".pt", ".bin", ".pth") and not zipfile.is_zipfile(path):
                return f"{name} is cut short or not a torch file"
            if path.suffix == ".safetensors":
                with safe_open(str(path), "pt"):
                    pass
            if path.suffix == ".json":
                json.loads(path.read_text(encoding="utf-8"))
        except Exception as error:  # any parse error: the file is not whole
            return f"{name} does not read ({type(error).__name__})"
    named = folder.name.removeprefix("checkpoint-")
    if step_of is not None and named.isdigit():
        try:
            held = step_of(folder)
        except Exception as error:  # a state that does not say its step
            return f"its state does not say its step ({type(error).__name__})"
        if held != int(named):
            return f"holds step {held}, not {named} (renamed, or its state edited?)"
    return None


def newest_whole_checkpoint(output_dir, required: tuple[str, ...], say=print, step_of=None) -> Path | None:
    """The newest checkpoint-N folder of `output_dir` that checkpoint_problem finds whole, `say`ing why each
    newer one was passed over; None if there is none. Refused when there are checkpoints and none is whole:
    starting over would drop every step the run trained."""
    folders = sorted((path for path in Path(output_dir).glob("checkpoint-*") if path.name.split("-")[1].isdigit()),
                     key=lambda path: int(path.name.split("-")[1]), reverse=True)
    problems = []
    for folder in folders:
        problem = checkpoint_problem(folder, required, step_of)
        if problem is None:
            return folder
        say(f"{folder}: {problem}; passed over for an earlier checkpoint")
        problems.append(f"{folder.name}: {problem}")
    if problems:
        raise InputError(f"no checkpoint of {output_dir} can be resumed from ({'; '.join(problems)}); mend one, or "
                         "move them aside to start the run over at step 0 (its later rows are then dropped)")
    return None


# --------------------------------------------------------------------------------------------
# Run folders: claimed, marked, held, shared by every node
# --------------------------------------------------------------------------------------------

RUN_MARKER = "rlver-run.json"  # written into a trainer's output folder when its run starts: whose run it is


def run_settings(names, *options) -> dict:
    """{name: value} of each of `names` found on one of the option objects (dataclasses), as JSON keeps it."""
    settings = {}
    for name in names:
        holder = next((given for given in options if hasattr(given, name)), None)
        if holder is not None:
            value = getattr(holder, name)
            settings[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
    if settings.get("think") is False:  # the thought's budget shapes only think runs
        settings.pop("max_think_tokens", None)
    if "profiles" in settings:  # the steps' profiles are drawn from its lines: what it holds, not its name
        import hashlib

        settings["profiles"] = "sha256:" + hashlib.sha256(Path(settings["profiles"]).read_bytes()).hexdigest()[:12]
    return settings


def check_run_folder(folder, script: str, model: str, resuming: bool, resume_flag: str,
                     settings: dict | None = None) -> None:
    """Refuse an output folder that holds anything but a run of `script` (its RUN_MARKER), or a run of it
    when not resuming, or, resuming, a run of another model or other `settings` (run_settings): a trainer
    writes weights, a tokenizer, a model card and checkpoints there, over whatever files of the same names it
    finds. Every rank calls it before any rank writes (the folder-sharing check's own marker is not a file of
    anyone's)."""
    folder = Path(folder)
    found = sorted(path.name for path in folder.iterdir()  # not the sharing check's marker, nor a marker cut short
                   if not path.name.startswith((".shared-check-", f".{RUN_MARKER}"))) if folder.is_dir() else []
    if not found:
        if resuming:  # a job script that always resumes starts this way; a mistyped folder does too: say which
            print(f"{resume_flag}: {folder} holds no run yet: starting a new run there (if you meant to continue "
                  "another run, stop now and give its folder)", file=sys.stderr, flush=True)
        return
    marker = folder / RUN_MARKER
    if not marker.is_file():
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise InputError(f"--output_dir {folder}: holds files that no {script} run wrote ({shown}); "
                         "choose a new or empty folder")
    try:
        made = json.loads(read_text(marker, "run marker"))
        owner, owner_model = made["script"], made["model"]
    except (ValueError, KeyError, TypeError):
        raise InputError(f"{marker}: not a run marker ({{\"script\": ..., \"model\": ...}}); choose a new "
                         "--output_dir") from None
    if owner != script:
        raise InputError(f"--output_dir {folder}: holds a {owner} run; choose another folder for {script}")
    if found == [RUN_MARKER]:  # a run of ours that stopped before writing anything, or one loading its model:
        return  # mark_run_folder takes it over, or refuses it while that run holds it
    if not resuming:
        raise InputError(f"--output_dir {folder}: already holds a run; choose another --output_dir, delete it, or "
                         f"pass {resume_flag} to continue it")
    if owner_model != model:
        raise InputError(f"{resume_flag}: {folder} holds a run of {owner_model}, not of {model}; resume it with "
                         "the same model, or choose another --output_dir")
    made_with = made.get("settings", {})
    differing = [(name, made_with[name], value) for name, value in (settings or {}).items()
                 if name in made_with and made_with[name] != value]
    shown = json.dumps if any(str(was) == str(now) for _, was, now in differing) else str  # "1" and 1 told apart
    changed = [f"--{name} {shown(was)} (this run: {shown(now)})" for name, was, now in differing]
    if changed:
        raise InputError(f"{resume_flag}: {folder} holds a run made with {', '.join(changed)}; resume it with "
                         "its settings, or choose another --output_dir")


def mark_run_folder(folder, script: str, model: str, settings: dict | None = None) -> None:
    """RUN_MARKER, on the main process, once every rank has passed check_run_folder: whose run, of which
    model, with which run_settings, and this launch's own id (a resume's launch takes the run over); the folder
    held (hold) while the run lasts."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hold(folder, "--output_dir")  # before the marker: a second run started at once must not write one
    marker = folder / RUN_MARKER
    try:  # a resume keeps what the run's marker recorded (its interruptions); a first launch finds none
        made = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        made = {}
    made = {**(made if isinstance(made, dict) else {}), "script": script, "model": model, "settings": settings or {},
            "launch": uuid.uuid4().hex}
    partial = folder / f".{RUN_MARKER}.partial"  # replaced whole: a kill while writing leaves the old one
    partial.write_text(json.dumps(made) + "\n")
    partial.replace(marker)


def claim_run_folder(folder, script: str, model: str, resuming: bool, resume_flag: str, settings: dict,
                     state) -> None:
    """A trainer's output folder at start-up: free, or this run's own on a resume with the same settings
    (check_run_folder); one folder that every process sees, as checkpoints hold every rank's DeepSpeed shard
    (check_shared_folder); then marked as this run's, and on every rank remembered as it is then
    (check_run_folder_kept). `state`: the Accelerator or its PartialState."""
    check_run_folder(folder, script, model, resuming, resume_flag, settings)
    check_shared_folder(folder, state)
    if state.is_main_process:
        mark_run_folder(folder, script, model, settings)
    state.wait_for_everyone()
    note_output(folder)
    note_output(Path(folder) / RUN_MARKER)


def real_path(path) -> Path:
    """The path with its links followed (Path.resolve), or one line where the links lead back to themselves
    (resolve's RuntimeError, a traceback otherwise)."""
    try:
        return Path(path).resolve()
    except RuntimeError:
        raise InputError(f"{path}: a symbolic link that leads back to itself (a loop); give the real path") from None


_held = {}  # path: the open file whose lock this process holds until it exits


def hold(path, option: str, create: str | None = None) -> None:
    """Lock an output (a folder or a file) for as long as this process runs, or refuse it in one line while
    another process holds it: two runs writing the same output at once would mix their rows (two evaluations
    each playing the scenarios missing from it: every one twice). `create` ("file" or "folder"): make it now,
    failing if it exists, for a run that found none when it started (another run may have made it since, and
    written rows this run did not count). A process holds a path once; the lock (flock) ends with the process."""
    import fcntl

    path = Path(path)
    if str(real_path(path)) in _held:
        return
    try:
        if create == "folder":
            path.mkdir()
        handle = os.open(path, os.O_RDONLY | (os.O_CREAT | os.O_EXCL if create == "file" else 0), 0o644)
    except FileExistsError:
        raise InputError(f"{option} {path}: another run began writing there after this one started; run the same "
                         "command again to go on from its rows") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(handle)
        raise InputError(f"{option} {path}: another run is writing there now; let it finish, or give another "
                         "path") from None
    _held[str(real_path(path))] = handle
    note_output(path)


def check_run_folder_kept(folder) -> None:
    """Stop a run, before it writes rows, weights or a checkpoint, whose output folder or marker is not the one it
    claimed (claim_run_folder): removed, replaced by another run's folder, or taken over by another launch."""
    check_output_kept(folder)
    check_output_kept(Path(folder) / RUN_MARKER)


def check_process_count(state) -> None:
    """Refuse a launch whose processes do not see each other: torchrun (or any launcher setting WORLD_SIZE)
    on a machine without GPUs starts processes that accelerate, unless told to use the CPU, takes for single
    ones; each would train alone and write the same files. `state`: an `Accelerator` or `PartialState`."""
    launched = int(os.environ.get("WORLD_SIZE", state.num_processes))
    if launched != state.num_processes:
        raise InputError(f"launched as {launched} processes (WORLD_SIZE), but each sees itself alone: without GPUs, "
                         "set ACCELERATE_USE_CPU=1 for the processes to train together")


def check_shared_folder(folder, accelerator, option: str = "output_dir") -> None:
    """Refuse, on every rank at once, an output folder that some rank does not share with the main process:
    on several nodes it must be on a filesystem all of them mount (NFS, Lustre, ...), as checkpoints hold
    every rank's DeepSpeed shard and only the main process renames a finished one into place. Called on
    every rank (an `Accelerator` or accelerate's `PartialState`); one process checks nothing. The main
    process writes a marker named by a fresh token into the folder (creating the folder), hands the token
    to the others (the broadcast also waits for the write), each says whether it sees the marker, and the
    main process deletes it: a file write, two collectives, no file left behind."""
    from accelerate.utils import broadcast_object_list, gather_object

    if accelerator.num_processes == 1:
        return
    folder = Path(folder)
    token = [None]
    if accelerator.is_main_process:
        token = [uuid.uuid4().hex]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".shared-check-{token[0]}").write_text(socket.gethostname())
    marker = folder / f".shared-check-{broadcast_object_list(token)[0]}"
    # One entry a rank, in rank order: (host, sees the marker); gather_object joins the ranks' lists.
    seen = gather_object([(socket.gethostname(), marker.is_file())])
    if accelerator.is_main_process:
        marker.unlink()
    blind = [f"rank {rank} on {host}" for rank, (host, sees) in enumerate(seen) if not sees]
    if blind:
        raise InputError(f"--{option} {folder} is not on a filesystem shared by all nodes (what rank 0 on {seen[0][0]} "
                         f"wrote there is not seen by {', '.join(blind)}): checkpoints and resume need one; give a "
                         "folder every node mounts (NFS, Lustre, ...)")


# --------------------------------------------------------------------------------------------
# Result files: which model and settings made their rows, and which inputs they answered
# --------------------------------------------------------------------------------------------

def model_record(model: str, base_url: str | None = None) -> dict:
    """Which model made a result: an endpoint's served model name; a hub id or the packaged model by its
    name; a local folder by its path and a fingerprint of its files (each one's name, size and first and
    last MiB: retrained weights change it, and it reads MBs, not a 15 GB model), an adapter also by the
    base model its config names."""
    import hashlib

    if base_url:  # the served name: a restarted server on another address serves the same model
        return {"model": model, "served": True}
    folder = Path(model)
    if not folder.is_dir():
        return {"model": model}
    digest = hashlib.sha256()
    for path in sorted(path for path in folder.rglob("*") if path.is_file()):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(folder)}\0{size}\0".encode())
        with path.open("rb") as file:
            digest.update(file.read(2**20))
            file.seek(max(2**20, size - 2**20))
            digest.update(file.read())
    record = {"model": str(folder.resolve()), "model_fingerprint": digest.hexdigest()[:16]}
    if (folder / "adapter_config.json").is_file():
        record["base_model"] = json.loads(read_text(folder / "adapter_config.json", "adapter config")).get(
            "base_model_name_or_path")
    return record


def digest(value) -> str:
    """A short fingerprint of a JSON value (an input item, a profile), for a row to record what it answered."""
    import hashlib

    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)  # default: a library's own objects
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_inputs_unchanged(path, rows: list[dict], current: dict[str, str], what: str) -> None:
    """Refuse to resume onto rows whose input (`current`: id -> digest of the input now) changed since they were
    written (each row's "input_digest"): the old answer would be scored as this input's."""
    for row in rows:
        if "input_digest" in row and row["id"] in current and row["input_digest"] != current[row["id"]]:
            raise InputError(f"{path}: the row of {what} {row['id']!r} answered another version of it (its text "
                             "changed since); choose another output, or delete that row to play it again")


def check_made_by(path, rows: list[dict], made_by: dict) -> None:
    """Refuse to add rows to a result file whose rows another model or other settings made (each row's
    "made_by"), naming what differs: a file mixing two models would be scored as one."""
    for number, row in enumerate(rows, 1):
        theirs = row.get("made_by")
        if theirs is None:
            raise InputError(f"{path}: row {number} does not say which model and settings made it; choose "
                             "another output to start afresh")
        differ = sorted(key for key in theirs.keys() | made_by.keys() if theirs.get(key) != made_by.get(key))
        if differ:
            was = ", ".join(f"{key}={theirs.get(key)!r}" for key in differ)
            now = ", ".join(f"{key}={made_by.get(key)!r}" for key in differ)
            raise InputError(f"{path}: its rows were made with {was}; this run has {now}. Resume with the "
                             "same model and settings, or choose another output")


# --------------------------------------------------------------------------------------------
# Models by name: a folder, a hub id, the packaged offline model, a trained adapter merged for evaluation
# --------------------------------------------------------------------------------------------

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


def check_model(name_or_path: str, option: str | None = None) -> None:
    """Refuse, before anything loads, a model that cannot be had (check_model_source) or, for the packaged model
    not yet converted, a cache folder the conversion cannot write to."""
    if name_or_path != PACKAGED_MODEL:
        check_model_source(name_or_path, option)
    elif not (packaged_model_folder() / "config.json").is_file():
        check_output_folder(model_cache(), "$RLVER_CACHE")  # the conversion writes there


def checked_model(name_or_path: str, option: str | None = None) -> str:
    """resolve_model, after check_model."""
    check_model(name_or_path, option)
    return resolve_model(name_or_path)


def loadable_model(name_or_path: str) -> str:
    """--model as a folder (or hub id) that transformers and vLLM both load, its tokenizer beside it: the
    packaged model's short name converted once (resolve_model), a PEFT adapter folder merged
    onto its base once (merged_adapter), a full model folder as it is."""
    path = Path(name_or_path)
    if not path.is_dir():
        return checked_model(name_or_path)  # the packaged model or a hub id
    if (path / "adapter_config.json").is_file():
        if not any((path / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
            raise InputError(f"{path} holds an adapter's config (adapter_config.json) but not its weights "
                             "(adapter_model.safetensors): moved or deleted? put them back, or give the run's "
                             "checkpoint-N/policy folder")
        return merged_adapter(path)
    if not (path / "config.json").is_file():
        raise InputError(f"{path} holds neither a model (config.json) nor a PEFT adapter (adapter_config.json)")
    if not (path / "tokenizer_config.json").is_file():
        raise InputError(
            f"{path} holds a model but no tokenizer (tokenizer_config.json), and no adapter_config.json names a base "
            "model to take one from; save the tokenizer of the model it was trained from into it: "
            f"AutoTokenizer.from_pretrained(BASE).save_pretrained({str(path)!r})")
    check_model_folder(path, "model")
    return str(path)


def check_model_folder(name_or_path, option: str, tokenizer: bool = True) -> None:
    """Refuse, just before it loads, a local model folder transformers would fail on with a traceback: a
    config.json that is not JSON or names no model_type, no weights, no tokenizer (when one is loaded from
    it). A hub id, or a folder holding a PEFT adapter, passes."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir() or (path / "adapter_config.json").is_file():
        return
    config_path = path / "config.json"
    try:
        config = json.loads(read_text(config_path, "model config"))
    except json.JSONDecodeError as error:
        raise InputError(f"{config_path}:{error.lineno}: not valid JSON ({error.msg})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise InputError(f"--{option} {name_or_path}: its config.json names no model_type, so transformers cannot "
                         "tell which model it is; give a folder saved by save_pretrained")
    weights = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
    if not any(next(path.glob(pattern), None) for pattern in weights):
        raise InputError(f"--{option} {name_or_path}: no weights (*.safetensors or pytorch_model*.bin) beside its "
                         "config.json; give a folder saved by save_pretrained")
    if tokenizer and not any((path / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
        raise InputError(f"--{option} {name_or_path}: no tokenizer (tokenizer_config.json or tokenizer.json); save "
                         "the model's tokenizer into it with save_pretrained")


def merged_adapter(path: Path) -> str:
    """The adapter merged onto its base model, in a cache folder named by the adapter folder's path and
    newest file time (a retrained adapter gets a new merge), written once, atomically. The tokenizer is
    the folder's own (TRL saves it) or else the base model's (train_ppo.py saves none)."""
    import hashlib

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = path.resolve()
    stamp = max(f.stat().st_mtime_ns for f in path.iterdir() if f.is_file())
    digest = hashlib.sha256(f"{path}:{stamp}".encode()).hexdigest()[:12]
    target = model_cache() / "merged" / f"{path.name}-{digest}"
    if (target / "config.json").is_file():
        return str(target)
    check_output_folder(model_cache(), "$RLVER_CACHE")  # the merged model is written there
    try:
        config = json.loads(read_text(path / "adapter_config.json", "adapter config"))
    except json.JSONDecodeError as error:
        raise InputError(f"{path}/adapter_config.json:{error.lineno}: not valid JSON ({error.msg})") from None
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not base:
        raise InputError(f"{path}/adapter_config.json does not name its base model (base_model_name_or_path)")
    base = checked_model(base)
    tokenizer_source = path if (path / "tokenizer_config.json").is_file() else base
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    except (OSError, ValueError) as error:  # no such hub id; a folder without tokenizer files
        raise InputError(f"{path} holds no tokenizer (tokenizer_config.json), nor does its base model "
                         f"{base!r} (adapter_config.json): {error}") from None
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).merge_and_unload()
    write_folder_once(target, lambda folder: (model.save_pretrained(folder), tokenizer.save_pretrained(folder)))
    return str(target)


def check_local_model(args) -> None:
    """Refuse at once, before anything slow, a local --model that is neither a folder here nor a hub id
    to be had (an endpoint's model is checked by the endpoint; the packaged model is converted on demand)."""
    if not args.model_base_url and args.model != PACKAGED_MODEL:
        check_model_source(args.model, "model")
        check_model_folder(args.model, "model", tokenizer=False)  # loadable_model says which tokenizer is missing


def check_vllm(use_vllm: bool) -> None:
    """Refuse --use_vllm, before anything loads, where vLLM is not installed (a GPU machine's package)."""
    if use_vllm and importlib.util.find_spec("vllm") is None:
        raise InputError("--use_vllm needs vLLM, which is not installed here: on a GPU machine, pip install -r "
                         "requirements-gpu.txt; or leave --use_vllm out to generate with transformers")

