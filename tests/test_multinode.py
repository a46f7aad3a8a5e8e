"""Multi-node training, rehearsed on one host: each "machine" is its own `accelerate launch` (2 machines x 1
process, gloo over 127.0.0.1), started together with the flags docs/gpu.md gives for real nodes, under the
recipes' own configs with real DeepSpeed: PPO under accelerate_configs/zero2.yaml, GRPO under
accelerate_configs/zero3.yaml, both full fine-tunes in bf16 as in the recipes (test_ppo_gpu_paths.py's wrapper
makes accelerate pick gloo, DS_ACCELERATOR=cpu DeepSpeed's CPU accelerator). Each trains 2 steps, then resumes
from its checkpoint for a third. Also: the start-up check that the output folder is shared by every node, and
the temporary file names of a resume's trimming, which ranks on two nodes must not share. Not rehearsed: NCCL
between real nodes, InfiniBand, a real Slurm allocation (docs/gpu.md)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port
from test_ppo_gpu_paths import DEEPSPEED_ON_CPU, SMALL_RUN, json_lines

import guards

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFIGS = REPO / "accelerate_configs"
MACHINES = 2


def launch_two_machines(folder: Path, config: Path, script: Path, *arguments, env=None, timeout=300) -> list[str]:
    """`script` under `config` as 2 machines of 1 process each: one `accelerate launch` a machine, as on two
    nodes, started at once. Returns each machine's stdout; fails with their stderr if any exited non-zero."""
    port = free_port()
    launches = []
    for rank in range(MACHINES):
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--num_machines", str(MACHINES), "--machine_rank", str(rank), "--num_processes", str(MACHINES),
                   "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                   str(script), *map(str, arguments)]
        # Files, not pipes: a machine blocked on a full pipe would stall the other at the next collective.
        stdout, stderr = (open(folder / f"machine{rank}.{stream}", "w") for stream in ("out", "err"))
        launches.append(subprocess.Popen(command, cwd=folder, stdout=stdout, stderr=stderr, text=True, env={
            **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1",
            **(env or {})}))
        stdout.close()
        stderr.close()
    try:
        codes = [launch.wait(timeout=timeout) for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
    errors = [(folder / f"machine{rank}.err").read_text()[-3000:] for rank in range(MACHINES)]
    assert codes == [0] * MACHINES, "\n".join(f"machine {rank} exited {code}:\n{error}"
                                              for rank, (code, error) in enumerate(zip(codes, errors)))
    return [(folder / f"machine{rank}.out").read_text() for rank in range(MACHINES)]


def deepspeed_on_two_machines(folder: Path, config: str, script: str, *arguments) -> list[str]:
    """A training script of the repository under accelerate_configs/`config` with DeepSpeed on CPU."""
    (folder / "deepspeed_on_cpu.py").write_text(DEEPSPEED_ON_CPU)
    return launch_two_machines(folder, CONFIGS / config, folder / "deepspeed_on_cpu.py", REPO / script, *arguments,
                               env={"DS_ACCELERATOR": "cpu"})


def transcript_steps(output_dir: Path) -> list[list[int]]:
    """The steps of each rank's transcript rows, rank 0 first."""
    return [[row["step"] for row in json_lines(output_dir / f"transcripts.rank{rank}.jsonl")]
            for rank in range(MACHINES)]


# --------------------------------------------------------------------------------------------
# PPO under DeepSpeed ZeRO-2, 2 machines x 1 process
# --------------------------------------------------------------------------------------------

PPO_FLAGS = ["--use_peft", "false", "--dtype", "bfloat16", "--minibatch_size", "2", "--micro_batch_size", "1",
             *SMALL_RUN, "--save_steps", "1"]


def ppo_on_two_machines(folder: Path, model_dir, output_dir: Path, *flags) -> list[str]:
    return deepspeed_on_two_machines(folder, "zero2.yaml", "train_ppo.py", "--model_name_or_path", model_dir,
                                     "--output_dir", output_dir, *PPO_FLAGS, *flags)


@pytest.fixture(scope="module")
def ppo_output(tiny_model_dir, tmp_path_factory):
    """Two PPO steps on 2 machines, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("ppo-2-machines")
    ppo_on_two_machines(folder, tiny_model_dir, folder / "run", "--max_steps", "2")
    return folder / "run"


@pytest.mark.slow
def test_ppo_on_two_machines_trains_every_step_on_both_and_checkpoints_both_shards(ppo_output):
    assert transcript_steps(ppo_output) == [[0, 0, 1, 1]] * MACHINES  # 2 dialogues a rank a step
    shards = sorted(path.name for path in (ppo_output / "checkpoint-2" / "deepspeed" / "pytorch_model").iterdir())
    assert shards == [f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(MACHINES)] + [
        "mp_rank_00_model_states.pt"]  # each machine's optimizer shard, in the one folder
    assert not list(ppo_output.glob(".shared-check-*"))  # the start-up check's marker is gone


@pytest.mark.slow
def test_ppo_on_two_machines_resumes_at_its_checkpoint(ppo_output, tiny_model_dir, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(ppo_output, output_dir)
    stdout = ppo_on_two_machines(tmp_path, tiny_model_dir, output_dir, "--max_steps", "3", "--resume")
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in stdout[0]
    assert transcript_steps(output_dir) == [[0, 0, 1, 1, 2, 2]] * MACHINES


# --------------------------------------------------------------------------------------------
# GRPO under DeepSpeed ZeRO-3, 2 machines x 1 process
# --------------------------------------------------------------------------------------------

# --use_cpu: the Trainer refuses bf16 on a machine without a GPU otherwise.
GRPO_FLAGS = ["--use_cpu", "true", "--bf16", "true", "--use_peft", "false", "--num_generations", "2",
              "--per_device_train_batch_size", "2", "--max_turns", "2", "--max_reply_tokens", "6",
              "--save_strategy", "steps", "--save_steps", "1"]


def grpo_on_two_machines(folder: Path, model_dir, output_dir: Path, *flags) -> list[str]:
    return deepspeed_on_two_machines(folder, "zero3.yaml", "train_grpo.py", "--model_name_or_path", model_dir,
                                     "--output_dir", output_dir, *GRPO_FLAGS, *flags)


@pytest.fixture(scope="module")
def grpo_output(tiny_model_dir, tmp_path_factory):
    """Two GRPO steps on 2 machines, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("grpo-2-machines")
    grpo_on_two_machines(folder, tiny_model_dir, folder / "run", "--max_steps", "2")
    return folder / "run"


@pytest.mark.slow
def test_grpo_on_two_machines_trains_every_step_on_both_and_checkpoints_both_shards(grpo_output):
    assert transcript_steps(grpo_output) == [[0, 0, 1, 1]] * MACHINES  # 2 dialogues a rank a step
    shards = sorted(path.name for path in (grpo_output / "checkpoint-2" / "global_step2").iterdir())
    assert shards == [f"{prefix}zero_pp_rank_{rank}_mp_rank_00_{states}_states.pt"
                      for prefix, states in (("bf16_", "optim"), ("", "model")) for rank in range(MACHINES)]
    assert not list(grpo_output.glob(".shared-check-*"))  # the start-up check's marker is gone


@pytest.mark.slow
def test_grpo_on_two_machines_resumes_at_its_checkpoint(grpo_output, tiny_model_dir, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(grpo_output, output_dir)
    grpo_on_two_machines(tmp_path, tiny_model_dir, output_dir, "--max_steps", "3", "--resume_from_checkpoint",
                         output_dir / "checkpoint-2")
    assert transcript_steps(output_dir) == [[0, 0, 1, 1, 2, 2]] * MACHINES
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "emotion/final_mean" in entry] == [1, 2, 3]


# --------------------------------------------------------------------------------------------
# The Slurm script, with stand-ins for srun, scontrol and accelerate
# --------------------------------------------------------------------------------------------

SLURM_STAND_INS = {
    "scontrol": 'tr "," "\\n" <<< "$3"\n',  # `scontrol show hostnames LIST`, for a list of plain names
    "srun": 'while [[ $1 == --* ]]; do shift; done\n'  # its options, then one task a node
            'for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & done\nwait\n',
    "accelerate": 'printf "%s\\n" "$@" > "$LAUNCHES/node$SLURM_NODEID"\n',
}


def sbatch(tmp_path, *arguments) -> tuple[subprocess.CompletedProcess, dict[int, list[str]]]:
    """recipes/slurm_multinode.sh as Slurm would run it on 2 nodes of 8 GPUs; returns each node's accelerate
    command line."""
    stand_ins, launches = tmp_path / "bin", tmp_path / "launches"
    stand_ins.mkdir(parents=True)
    launches.mkdir()
    for name, body in SLURM_STAND_INS.items():
        (stand_ins / name).write_text(f"#!/bin/bash\n{body}")
        (stand_ins / name).chmod(0o755)
    finished = subprocess.run(["bash", str(REPO / "recipes" / "slurm_multinode.sh"), *map(str, arguments)], cwd=REPO,
                              capture_output=True, text=True, timeout=60, env={
                                  **os.environ, "PATH": f"{stand_ins}:{os.environ['PATH']}", "LAUNCHES": str(launches),
                                  "SLURM_JOB_NODELIST": "gpu-a,gpu-b", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"})
    return finished, {int(path.name[4:]): path.read_text().splitlines() for path in launches.iterdir()}


def test_the_slurm_script_launches_each_node_with_its_rank_the_total_processes_and_the_first_node_as_main(tmp_path):
    """The recipe's localhost base_url is overridden by the flag, so the script goes ahead."""
    finished, launches = sbatch(tmp_path, "train_grpo.py", "--config", "recipes/grpo_qwen2.5-7b.yaml",
                                "--base_url", "http://simulator-host:8001/v1")
    assert finished.returncode == 0, finished.stderr
    for node in (0, 1):
        assert launches[node] == [
            "launch", "--config_file", "accelerate_configs/zero3.yaml", "--num_machines", "2", "--machine_rank",
            str(node), "--num_processes", "16", "--main_process_ip", "gpu-a", "--main_process_port", "29500",
            "train_grpo.py", "--config", "recipes/grpo_qwen2.5-7b.yaml", "--base_url", "http://simulator-host:8001/v1"]


def test_the_slurm_script_refuses_a_simulator_on_localhost_from_the_recipe_or_a_flag(tmp_path):
    finished, launches = sbatch(tmp_path, "train_ppo.py", "--config", "recipes/ppo_qwen2.5-7b.yaml")
    assert finished.returncode == 2 and launches == {}
    assert "the simulator's base_url http://localhost:8001/v1 names each node itself" in finished.stderr
    finished, launches = sbatch(tmp_path / "flag", "train_ppo.py", "--base_url=http://127.0.0.1:8001/v1")
    assert finished.returncode == 2 and launches == {}


# --------------------------------------------------------------------------------------------
# The output folder: shared by every node, checked at start-up
# --------------------------------------------------------------------------------------------

SHARED_CHECK = '''"""guards.check_shared_folder("run") on 2 ranks, each in its own working folder (argv[1 + rank]):
the same folder for both is one shared filesystem; two folders stand for two nodes' own disks, where the same
path names two different folders. Each rank writes what the check said to argv[3]/rank{rank}.txt."""
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

import common
import guards

accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
os.chdir(sys.argv[1 + rank])
try:
    guards.check_shared_folder("run", accelerator)
    outcome = "shared"
except common.InputError as error:
    outcome = f"error: {error}"
(Path(sys.argv[3]) / f"rank{rank}.txt").write_text(outcome)
torch.distributed.destroy_process_group()  # gloo may abort an exit that leaves its group open
'''


def check_on_two_ranks(tmp_path, *working_folders: Path) -> list[str]:
    """What the check said on each rank, rank 0 first."""
    (tmp_path / "check.py").write_text(SHARED_CHECK)
    (tmp_path / "outcomes").mkdir()
    finished = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                               str(free_port()), str(tmp_path / "check.py"), *map(str, working_folders),
                               str(tmp_path / "outcomes")],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    return [(tmp_path / "outcomes" / f"rank{rank}.txt").read_text() for rank in (0, 1)]


@pytest.mark.slow
def test_an_output_folder_every_rank_sees_passes_the_check_and_keeps_no_marker(tmp_path):
    node = tmp_path / "shared"
    node.mkdir()
    assert check_on_two_ranks(tmp_path, node, node) == ["shared", "shared"]
    assert list((node / "run").iterdir()) == []


@pytest.mark.slow
def test_an_output_folder_on_each_nodes_own_disk_is_refused_on_every_rank(tmp_path):
    """Every rank raises, so that none waits for the others at its next collective (NCCL's timeout: 30 minutes)."""
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    for node in nodes:
        node.mkdir()
    host = socket.gethostname()
    refusal = (f"error: --output_dir run is not on a filesystem shared by all nodes (what rank 0 on {host} wrote "
               f"there is not seen by rank 1 on {host}): checkpoints and resume need one; give a folder every node "
               "mounts (NFS, Lustre, ...)")
    assert check_on_two_ranks(tmp_path, *nodes) == [refusal, refusal]
    assert list((nodes[0] / "run").iterdir()) == [] and not (nodes[1] / "run").exists()


# --------------------------------------------------------------------------------------------
# A resume's trimming on two nodes at once
# --------------------------------------------------------------------------------------------

def test_ranks_on_two_nodes_with_the_same_process_id_trim_one_shared_file_without_colliding(tmp_path, monkeypatch):
    """Every GRPO rank trims every rank's transcripts file on resume. Node B's rank, with the same process id as
    node A's, trims the shared file while node A's is about to move its temporary copy into place: with names
    made of the process id alone, B would have overwritten and moved A's copy, and A's move would fail."""
    path = tmp_path / "transcripts.rank0.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in (0, 0, 1, 1, 2, 2)))
    host = {"name": "node-a"}
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    monkeypatch.setattr(socket, "gethostname", lambda: host["name"])
    replace = Path.replace

    def node_b_trims_first(partial: Path, target: Path):
        monkeypatch.setattr(Path, "replace", replace)
        host["name"] = "node-b"
        assert guards.drop_rows_from(path, 2) == 2
        return replace(partial, target)

    monkeypatch.setattr(Path, "replace", node_b_trims_first)
    assert guards.drop_rows_from(path, 2) == 2
    assert [row["step"] for row in json_lines(path)] == [0, 0, 1, 1]
    assert [item.name for item in tmp_path.iterdir()] == [path.name]  # no temporary file left


@pytest.mark.parametrize("flags, refused", [
    (["--vllm_mode", "server", "--vllm_server_host", "localhost"], True),
    (["--vllm_mode", "server"], True),  # TRL's default host, 0.0.0.0
    (["--vllm_mode=server", "--vllm_server_base_url", "http://127.0.0.1:8000"], True),
    (["--vllm_mode", "server", "--vllm_server_host", "vllm-host"], False),
    (["--vllm_mode", "server", "--vllm_server_host", "localhost", "--rollout", "lockstep"], False),
    (["--vllm_mode", "colocate"], False),
])
def test_the_slurm_script_refuses_a_vllm_server_that_names_each_node_itself_where_every_rank_calls_it(tmp_path, flags,
                                                                                                      refused):
    """With --rollout async every rank sends its own turns to GRPO's vLLM server; with lockstep only the main
    process talks to it."""
    finished, launches = sbatch(tmp_path, "train_grpo.py", "--config", "recipes/grpo_qwen2.5-7b.yaml", "--base_url",
                                "http://simulator-host:8001/v1", "--use_vllm", "true", *flags)
    if refused:
        assert finished.returncode == 2 and launches == {}
        assert "names each node itself, and with --rollout async every rank sends its turns there" in finished.stderr
    else:
        assert finished.returncode == 0 and len(launches) == 2, finished.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command, said", [
    (["train_grpo.py", "--backend", "llm", "--base_url", "http://localhost:8001/v1", "--simulator_model", "m"],
     "--base_url http://localhost:8001/v1 names each node itself"),
    (["train_ppo.py", "--backend", "llm", "--base_url", "http://127.0.0.1:8001/v1", "--simulator_model", "m"],
     "--base_url http://127.0.0.1:8001/v1 names each node itself"),
    ([str(REPO / "tests" / "fake_vllm" / "run.py"), "train_grpo.py", "--use_vllm", "--vllm_mode", "server"],
     "the vLLM server at http://0.0.0.0:8000 is named as each node itself"),
])
def test_a_rank_on_a_second_node_refuses_an_address_naming_itself_before_anything_loads(tmp_path, command, said):
    """A process launched as one of 2 nodes' (WORLD_SIZE 2, LOCAL_WORLD_SIZE 1, as torchrun sets them) stops at
    start-up with one line, whatever launcher started it, before any collective or model."""
    finished = subprocess.run([sys.executable, *command, "--output_dir", str(tmp_path / "run")], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})
    assert finished.returncode != 0 and said in finished.stderr, finished.stderr[-2000:]
    assert not (tmp_path / "run").exists()
