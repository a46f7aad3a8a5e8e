import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import simulator  # noqa: E402

# Property-based tests: the same generated examples on every run (a failure reproduces in CI and here), few
# enough for the unit subset to stay under a minute, no per-example deadline (2 shared CPU cores).
settings.register_profile("suite", max_examples=50, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")

# The official RLVER files are third-party data, never committed: tests that need them read the folder
# named by $RLVER_OFFICIAL_DATA and are skipped without it.
OFFICIAL_DATA = Path(os.environ.get("RLVER_OFFICIAL_DATA", "/nonexistent"))


@pytest.fixture(autouse=True)
def ctrl_c_handler_restored():
    """A script's Ctrl-C handling, run in this process, leaves pytest's own handler in place after the test."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def pytest_terminal_summary(terminalreporter):
    """The run's last lines say whether the official-prompt and official-data tests ran (also under -q)."""
    for name in ("RLVER_OFFICIAL_REPO", "RLVER_OFFICIAL_DATA"):
        terminalreporter.write_line(f"{name}: {os.environ.get(name) or 'not set, so the tests that need it were skipped'}")

OWN_WORDS = [
    "My sister Dana skipped my wedding in Lisbon and I still can't stop thinking about it.",
    "She texted the morning of the ceremony saying her flight was cancelled, but her photos showed her at a concert.",
    "We planned the wedding for a year and I saved her a seat next to our mother.",
    "When I asked her about the concert she said I was making a scene over nothing.",
    "Our mother keeps telling me to forgive Dana before the holidays.",
    "I wrote Dana a long letter and never sent it.",
]


def profile_row(intention="venting", personality="negative", **fields):
    """An English profile row in our format, for tests that need one small known profile."""
    own_words = "\n".join(f'- "{line}"' for line in OWN_WORDS)
    row = {
        "id": f"test-{intention}",
        "player": "* Name: Mara Silva\n* Age: 34\n* Gender: female\n* Occupation: architect",
        "scene": ("## Backstory\nMara's sister Dana missed her wedding.\n\n"
                  f"## In Mara's own words\n{own_words}\n\n## Hidden theme\n{simulator.INTENTIONS[intention][0]}"),
        "main_cha": personality,
        "cha_group": ["proud", "sensitive", "loyal"],
        "task": simulator.INTENTIONS[intention][0],
    }
    row.update(fields)
    return row


@pytest.fixture
def make_profile():
    def make(intention="venting", personality="negative", **fields):
        return simulator.parse_profile(profile_row(intention, personality, **fields))
    return make


@pytest.fixture
def official_profiles():
    """The official RLVER files, from $RLVER_OFFICIAL_DATA (never committed here)."""
    if not (OFFICIAL_DATA / "train_profile.jsonl").is_file():
        pytest.skip("official profiles not found: set RLVER_OFFICIAL_DATA to their folder")
    return OFFICIAL_DATA


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n"
                            for row in rows), encoding="utf-8")
    return path


SIMULATOR_ANSWER = "Fine.\nCHANGE: +5"  # serves as an analysis and as a user message


def run_against_simulator(command: list, *flags: str, answered: int | None = None):
    """Run a training command against a scripted simulator endpoint on 127.0.0.1 that answers every
    call, or only the first `answered` ones and then 500s (past the client's retries)."""
    from fake_openai import FakeOpenAIServer

    script, default = ([SIMULATOR_ANSWER] * answered, None) if answered is not None else ((), SIMULATOR_ANSWER)
    with FakeOpenAIServer(script, default=default) as server:
        return subprocess.run(command + ["--base_url", server.base_url, *flags], capture_output=True, text=True,
                              timeout=300)


def kill_when(process, ready, seconds: float = 240) -> None:
    """SIGKILL `process` as soon as `ready()` holds (or after `seconds`): a run dying mid-step."""
    import signal
    import time

    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def held_by_another_process(path):
    """`path` (an output folder or file) held by another process's guards.hold, as by a run writing there now."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, guards; guards.hold(sys.argv[1], '--x'); print('held', "
                               "flush=True); sys.stdin.read()", str(path)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def remove_during_step_1(monkeypatch, folder: Path) -> None:
    """Delete `folder` while a trainer plays step 1's dialogues (the second rollout), as a user cleaning up might."""
    import shutil

    import rollout

    play, calls = rollout.DialogueRunner.run, []

    def play_then_remove(runner, *args):
        calls.append(1)
        if len(calls) == 2:
            shutil.rmtree(folder)
        return play(runner, *args)

    monkeypatch.setattr(rollout.DialogueRunner, "run", play_then_remove)


def signal_rank_1(script: str, run: Path, sent: int, *flags: str) -> tuple[str, int]:
    """Train `script` on 2 gloo ranks (torch.distributed.run, as accelerate launch starts them) into `run`, send
    `sent` to rank 1 alone once it has written a step's rows, and return (the launch's output, its exit status).
    A rank left waiting forever at a collective fails here, after 120 s."""
    import time

    import psutil

    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
         str(REPO / script), "--output_dir", str(run), "--max_steps", "40", "--save_steps", "30", *flags],
        cwd=run.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"})
    workers = []  # in sessions of their own: killing the launcher would leave them running
    try:
        deadline = time.time() + 240
        while not ((run / "transcripts.rank1.jsonl").is_file() and (run / "transcripts.rank1.jsonl").read_text()):
            assert launcher.poll() is None and time.time() < deadline, launcher.stdout.read()[-3000:]
            time.sleep(0.2)
        workers = [child for child in psutil.Process(launcher.pid).children(recursive=True)
                   if "RANK" in child.environ()]
        [rank_1] = [worker for worker in workers if worker.environ()["RANK"] == "1"]
        rank_1.send_signal(sent)
        said, _ = launcher.communicate(timeout=120)
    finally:
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
        if launcher.poll() is None:
            launcher.kill()
    return said, launcher.returncode


def ctrl_c_on_rank_1(script: str, run: Path, *flags: str) -> tuple[str, int]:
    """Ctrl-C on rank 1 alone (signal_rank_1), as on a node where it was pressed while the other trains on:
    (the launch's output, the last step both ranks wrote, checked to be the same steps on both)."""
    said, _ = signal_rank_1(script, run, signal.SIGINT, *flags)
    steps = [[json.loads(line)["step"] for line in (run / f"transcripts.rank{rank}.jsonl").read_text().splitlines()]
             for rank in (0, 1)]
    last = steps[0][-1]
    assert steps[0] == steps[1] == [step for step in range(last + 1) for _ in range(2)], said[-3000:]
    assert last < 39 and "exitcode  : 130" in said, said[-3000:]
    return said, last


def user_options(**overrides) -> dict:
    """A simulated user's options (all required by simulator.Simulator), the paper's training dialogue unless
    overridden: what a test that builds a user by hand passes."""
    import simulator

    return dict(variant="vanilla", start_emotion=simulator.TRAIN_START_EMOTION, max_turns=simulator.PAPER_MAX_TURNS,
                change_bound=simulator.CHANGE_BOUND, language=None) | overrides


def official_user_options(**overrides) -> dict:
    """An OfficialSimulator's options: user_options plus its own, at SimulatorArguments' defaults."""
    return user_options(parse_attempts=3, empty_user_message="keep", analysis_emotion="current") | overrides


def llm_user_options(**overrides) -> dict:
    """An LLMSimulator's options: user_options plus its parse attempts, at SimulatorArguments' default."""
    return user_options(parse_attempts=3) | overrides


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous or a fake server)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(model_dir, log: Path, max_model_len: int | None = None, update_seconds: float = 0.0,
            latency: float = 0.0, seed: int = 0):
    """The fake `trl vllm-serve` of tests/fake_vllm on 127.0.0.1 (`--max_model_len` as vLLM's; each weight update
    taking `update_seconds`, each completion up to `latency` seconds); yields its base URL."""
    port = free_port()
    command = [sys.executable, str(REPO / "tests" / "fake_vllm" / "server.py"), "--port", str(port), "--model",
               str(model_dir), "--log", str(log), "--update_seconds", str(update_seconds), "--latency", str(latency),
               "--seed", str(seed), *(["--max_model_len", str(max_model_len)] if max_model_len else [])]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def two_ranks(*arguments, env=None, timeout=400) -> subprocess.CompletedProcess:
    """A script on 2 CPU processes (torch.distributed.run, gloo), from the repository's folder."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), *map(str, arguments)]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", **(env or {})})


class SlowUser:
    """A fake simulator endpoint's answers (FakeOpenAIServer's `respond`), each after a random latency of up to
    `most` seconds drawn from its own RNG, so dialogues' turns come back in a random order. The answer itself is
    a function of the request alone, so two schedules get the same answers to the same dialogue; its changes
    are large enough that dialogues end at different turns."""

    def __init__(self, seed: int, most: float = 0.06):
        import random
        import threading

        self.delays, self.most, self.lock = random.Random(seed), most, threading.Lock()

    def __call__(self, body: dict) -> dict:
        import zlib

        with self.lock:
            wait = self.delays.uniform(0, self.most)
        digest = zlib.crc32(json.dumps(body["messages"]).encode())
        if "CHANGE" in body["messages"][-1]["content"]:
            return {"hang": wait, "text": f"They said something.\nCHANGE: {['+25', '-25', '+8', '-12', '+30'][digest % 5]}"}
        return {"hang": wait, "text": ["Work has been a lot lately.", "I do not know what to do.",
                                       "Nobody listens to me."][digest % 3]}


@pytest.fixture(scope="session")
def packaged_model():
    """The offline SmolLM2-135M-Instruct, converted once into the repository's cache folder."""
    return common.resolve_model(common.PACKAGED_MODEL)


@pytest.fixture(scope="session")
def tokenizer():
    """The packaged model's tokenizer (SmolLM2's, as the tiny model's), without any weights: a fast test's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(common.resolve_model(common.PACKAGED_MODEL))


@pytest.fixture(scope="session")
def tiny_model_dir(packaged_model, tmp_path_factory):
    """A tiny random Llama (2 layers, width 64) on the real SmolLM2 tokenizer: fast, untrained."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(packaged_model)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def play_think_dialogue(model_dir, max_turns: int = 3):
    """(one think-mode dialogue a tiny sampling policy plays against the rule user, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import generation
    import rollout

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    generate = generation.TransformersGenerator(model, tokenizer, GenerationConfig(
        do_sample=True, top_k=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    runner = rollout.DialogueRunner(tokenizer, rollout.DialogueArguments(
        think=True, max_turns=max_turns, max_think_tokens=5, max_reply_tokens=6, max_dialogue_tokens=8192))
    profile = simulator.load_profiles(simulator.DEFAULT_PROFILES)[0]
    [dialogue] = runner.run([(profile, runner.openings([profile])[profile.id])], generate)
    runner.close()
    return dialogue, tokenizer


MODEL_FIXTURES = {"packaged_model", "tiny_model_dir"}


def pytest_collection_modifyitems(items):
    """A test that loads a model (through these fixtures) is `slow`, as are those marked so by hand (scripts
    run as processes, servers answering after seconds): `pytest -m "not slow"` runs the rest in under a minute."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
