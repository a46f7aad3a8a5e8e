"""train_ppo.py on the paths the CPU demo never takes, each rehearsed on CPU: pushing weights to a vLLM
server (the fake of tests/fake_vllm), tensors on an accelerator, real DeepSpeed ZeRO-2 on 2 CPU
processes (deepspeed is in the shared pins), and what its outputs must hold for the evaluations."""
import copy
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import preflight
import train_ppo

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE = TESTS / "fake_vllm"
SMALL_RUN = ["--max_turns", "2", "--max_think_tokens", "4", "--max_reply_tokens", "6", "--profiles_per_step", "1",
             "--dialogues_per_profile", "2"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def networks(model_dir):
    """Policy and critic (full weights) from `model_dir`, the value head non-zero so that values vary."""
    from transformers import AutoModel, AutoModelForCausalLM

    body = AutoModel.from_pretrained(model_dir)
    critic = train_ppo.Critic(body, body.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)
    return train_ppo.PolicyAndCritic(AutoModelForCausalLM.from_pretrained(model_dir), critic)


def rows_of_three_dialogues():
    """(ids, action mask) rows of different lengths, actions in two turns with a user turn between."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompt, first, user, second in [(4, 3, 2, 3), (6, 2, 0, 0), (3, 5, 1, 2)]:
        ids = torch.randint(0, 1000, (prompt + first + user + second,), generator=generator).tolist()
        rows.append((ids, [0] * prompt + [1] * first + [0] * user + [1] * second))
    return rows


# --------------------------------------------------------------------------------------------
# vLLM server: one weight session per push, every context its own completion, tokenizer saved
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_run(tiny_model_dir, tmp_path_factory):
    """Two PPO steps (LoRA, think) against the fake `trl vllm-serve`, a checkpoint after each;
    yields (output dir, server log rows, the client's generate calls)."""
    folder = tmp_path_factory.mktemp("ppo-vllm")
    port, server_log, client_log = free_port(), folder / "server.log", folder / "client.log"
    server = subprocess.Popen([sys.executable, str(FAKE / "server.py"), "--port", str(port), "--model",
                               str(tiny_model_dir), "--log", str(server_log)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        finished = subprocess.run(
            [sys.executable, str(FAKE / "run.py"), "train_ppo.py", "--use_vllm", "--vllm_server_host", "127.0.0.1",
             "--vllm_server_port", str(port), "--model_name_or_path", str(tiny_model_dir),
             "--output_dir", str(folder / "run"), "--think", "--max_steps", "2", "--save_steps", "1", *SMALL_RUN],
            cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "FAKE_VLLM_LOG": str(client_log)})
    finally:
        server.kill()
        server.wait()
    assert finished.returncode == 0, finished.stderr[-3000:]
    generate_calls = [row for row in json_lines(client_log) if row["event"] in ("generate_call", "turn_request")]
    return folder / "run", json_lines(server_log), generate_calls


def test_vllm_gets_all_weights_in_one_update_session_per_step(vllm_run, tiny_model_dir):
    """vLLM rebuilds each layer touched in a session: a fused qkv_proj or gate_up_proj sent in parts over
    several sessions would keep uninitialised memory (the fake server applies that rule)."""
    from safetensors import safe_open

    _, server_log, _ = vllm_run
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as checkpoint:
        weights = len(list(checkpoint.keys()))
    assert not [row for row in server_log if row["event"] == "update_weights_rejected"]  # PEFT names mapped
    sessions = [row for row in server_log if row["event"] == "finish_weight_update"]
    assert len(sessions) == 2  # one per step
    for pushes, session in enumerate(sessions, start=1):
        assert session["corrupted_fused_layers"] == []
        assert session["stats"]["rounds"] == pushes and session["stats"]["tensors"] == pushes * weights
        assert session["stats"]["layer_restores_with_warning"] == 0  # every weight sent every time


def test_every_vllm_request_gets_its_own_completion(vllm_run):
    """--rollout async (the default): each dialogue's turn its own request, each with its own seed."""
    _, server_log, requests = vllm_run
    assert len(requests) == 16  # 2 steps x 2 dialogues x 2 turns x (think, reply)
    for request in requests:
        assert request["event"] == "turn_request" and request["verdict"] == "own" and request["logprobs_ok"]
    assert len({request["seed"] for request in requests}) == 16
    assert not [row for row in server_log if row["event"] == "completions_during_weight_update"]


def test_outputs_and_checkpoints_hold_the_tokenizer_for_the_evaluations(vllm_run, tiny_model_dir):
    from transformers import AutoTokenizer

    output_dir, _, _ = vllm_run
    text = "I hear you. That sounds exhausting."
    expected = AutoTokenizer.from_pretrained(tiny_model_dir)(text).input_ids
    for folder in (output_dir, output_dir / "checkpoint-1" / "policy", output_dir / "checkpoint-2" / "policy"):
        assert (folder / "adapter_model.safetensors").is_file()
        assert AutoTokenizer.from_pretrained(folder)(text).input_ids == expected


# --------------------------------------------------------------------------------------------
# Devices: every tensor follows its inputs
# --------------------------------------------------------------------------------------------

def test_ppo_tensors_are_made_on_the_device_of_the_models_and_batch(tiny_model_dir):
    """On a GPU, a tensor made without device= lands on the CPU and mixing it with CUDA tensors raises.
    Rehearsal: the models and the batch on the CPU while the default device is `meta`, so a tensor made
    without a device lands on meta and mixing it with the CPU's raises the same way."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = networks(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rows, args = rows_of_three_dialogues(), train_ppo.PPOArguments()
    with torch.device("meta"):
        batch = train_ppo.pad_batch(rows, pad_id=0, device="cpu")
        mask = batch["action_mask"]
        old_logprobs, old_values, _ = train_ppo.old_logprobs_and_values(model, batch, [2, 0, 1], args.temperature,
                                                                        micro_batch_size=2)
        ref_logprobs, _ = train_ppo.token_logprobs(reference, batch["input_ids"], batch["attention_mask"], mask,
                                                   args.temperature)
        on_last_action = [{len(ids) - 1: reward} for (ids, _), reward in zip(rows, [0.3, 0.5, 0.4])]
        rewards = train_ppo.place_rewards(mask, on_last_action, old_logprobs, ref_logprobs, kl_coef=0.1)
        advantages, returns = train_ppo.masked_gae(rewards, old_values, mask, gamma=0.9, gae_lambda=0.8)
        batch.update(old_logprobs=old_logprobs, old_values=old_values, returns=returns,
                     advantages=train_ppo.whiten(advantages, mask))
        minibatch = train_ppo.select_rows(batch, [1])
        policy_loss, value_loss, _ = train_ppo.ppo_losses(*train_ppo.forward(model, minibatch, args.temperature),
                                                          minibatch, args)
        (policy_loss + value_loss).backward()
    for tensor in (*batch.values(), rewards, policy_loss, value_loss, model.critic.value_head.weight.grad):
        assert tensor.device.type == "cpu"


# --------------------------------------------------------------------------------------------
# One module, one optimizer (DeepSpeed's one model per Accelerator), the demo's updates unchanged
# --------------------------------------------------------------------------------------------

def test_one_optimizer_clips_and_steps_each_network_as_an_optimizer_per_network_did(tiny_model_dir):
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    args = train_ppo.PPOArguments(max_grad_norm=0.01)  # small: clipping bites, each network by its own norm
    model = networks(tiny_model_dir)
    twin = copy.deepcopy(model)
    optimizer = train_ppo.make_optimizer(model, args)
    twin_optimizers = [(twin.policy, torch.optim.AdamW(twin.policy.parameters(), lr=args.learning_rate)),
                       (twin.critic, torch.optim.AdamW(twin.critic.parameters(), lr=args.critic_learning_rate))]
    batch = train_ppo.pad_batch(rows_of_three_dialogues(), pad_id=0, device="cpu")
    batch.update({key: torch.randn(batch["action_mask"].shape)
                  for key in ("old_logprobs", "old_values", "returns", "advantages")})
    for _ in range(2):
        train_ppo.ppo_update(accelerator, model, optimizer, batch, args)
        twin_losses = train_ppo.ppo_losses(*train_ppo.forward(twin, batch, 1.0), batch, args)[:2]
        for loss, (network, network_optimizer) in zip(twin_losses, twin_optimizers):
            network_optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(network.parameters(), args.max_grad_norm)
            network_optimizer.step()
    for (name, parameter), twin_parameter in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(parameter, twin_parameter), name


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_an_update_in_micro_batches_is_the_update_on_the_whole_minibatch(tiny_model_dir, micro_batch_size):
    """Gradient accumulation: each micro-batch's losses are its share of the minibatch's token-means
    (its rows hold 6, 2 and 7 actions), and clipping and the step come once, after the last one (the
    last minibatch of a batch may be short: here 3 rows of 4, so micro-batches of 2 end on one row).
    Gradients, weights and the logged stats are those of one pass over the whole minibatch."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = networks(tiny_model_dir)
    twin = copy.deepcopy(model)
    batch = train_ppo.pad_batch(rows_of_three_dialogues(), pad_id=0, device="cpu")
    batch.update({key: torch.randn(batch["action_mask"].shape)
                  for key in ("old_logprobs", "old_values", "returns", "advantages")})
    stats = []
    for network, micro in ((model, 4), (twin, micro_batch_size)):
        args = train_ppo.PPOArguments(max_grad_norm=0.01, minibatch_size=4, micro_batch_size=micro)  # clipping bites
        stats.append(train_ppo.ppo_update(accelerator, network, train_ppo.make_optimizer(network, args), batch, args))
    assert stats[1] == pytest.approx(stats[0], rel=1e-5)
    for (name, parameter), twin_parameter in zip(model.named_parameters(), twin.parameters()):
        gradient, twin_gradient = parameter.grad, twin_parameter.grad
        assert (gradient - twin_gradient).abs().max() <= 1e-5 * gradient.abs().max(), name  # fp32 sums in another order
        assert torch.allclose(parameter, twin_parameter, atol=1e-5), name  # Adam's first step: ~lr = 1e-3 a weight


# --------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2, as the recipe launches it, on 2 CPU ranks
# --------------------------------------------------------------------------------------------

DEEPSPEED_ON_CPU = '''"""Runs a script under accelerate + DeepSpeed on CPU: gloo stands in for NCCL, everything else is real."""
import os
import runpy
import sys

import deepspeed.comm.torch
from accelerate.state import PartialState

find_backend = PartialState._prepare_backend


def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    found, distributed_type = find_backend(self, cpu, sagemaker_dp, backend)
    return found or "gloo", distributed_type  # accelerate finds no backend without a GPU


PartialState._prepare_backend = prepare_backend
# DeepSpeed's shared-memory all-reduce exists for CPUs only (a GPU run never builds it) and is compiled at its first
# use, a minute or more; the rehearsal's collectives go through gloo without it.
deepspeed.comm.torch.build_shm_op = lambda: None
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def zero2_launch(folder: Path, script: Path, *arguments) -> subprocess.CompletedProcess:
    """`script` under accelerate_configs/zero2.yaml on 2 CPU ranks, train_ppo importable."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    config.update(num_processes=2, main_process_port=free_port())
    (folder / "zero2.yaml").write_text(yaml.safe_dump(config))
    (folder / "deepspeed_on_cpu.py").write_text(DEEPSPEED_ON_CPU)
    finished = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(folder / "zero2.yaml"),
         str(folder / "deepspeed_on_cpu.py"), str(script), *map(str, arguments)],
        cwd=folder, capture_output=True, text=True, timeout=400,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished


def zero2_run(model_dir, folder: Path, output_dir: Path, *flags) -> subprocess.CompletedProcess:
    """train_ppo.py under ZeRO-2 with the recipe's full fine-tune in bf16 and its micro-batches of one
    dialogue: each rank's 2 dialogues are one minibatch of 2 micro-batches."""
    return zero2_launch(folder, REPO / "train_ppo.py", "--model_name_or_path", model_dir, "--output_dir", output_dir,
                        "--use_peft", "false", "--dtype", "bfloat16", "--gradient_checkpointing",
                        "--minibatch_size", "2", "--micro_batch_size", "1", "--max_grad_norm", "0.5", *SMALL_RUN, *flags)


@pytest.fixture(scope="module")
def zero2_output(tiny_model_dir, tmp_path_factory):
    """Two steps under ZeRO-2, a checkpoint after each."""
    folder = tmp_path_factory.mktemp("ppo-zero2")
    zero2_run(tiny_model_dir, folder, folder / "run", "--max_steps", "2", "--save_steps", "1")
    return folder / "run"


def test_the_recipe_setup_trains_both_networks_under_deepspeed_zero2(zero2_output, tiny_model_dir):
    """accelerate prepares one model under DeepSpeed, takes the micro-batch size and accumulation steps
    (no dataloader) and the clipping norm from train_ppo, and ZeRO-2 trains both networks."""
    from safetensors.torch import load_file

    for rank in (0, 1):  # each rank played its own dialogues
        assert [row["step"] for row in json_lines(zero2_output / f"transcripts.rank{rank}.jsonl")] == [0, 0, 1, 1]
    assert [row["step"] for row in json_lines(zero2_output / "metrics.jsonl")] == [0, 1]  # the step's, all ranks'
    engine = torch.load(zero2_output / "checkpoint-2" / "deepspeed" / "pytorch_model" / "mp_rank_00_model_states.pt",
                        weights_only=False)
    config = engine["ds_config"]
    assert config["zero_optimization"]["stage"] == 2 and config["bf16"]["enabled"]
    assert config["train_micro_batch_size_per_gpu"] == 1 and config["gradient_accumulation_steps"] == 2
    assert config["gradient_clipping"] == 0.5
    assert engine["global_steps"] == 2  # 2 steps x 1 minibatch of 2 micro-batches: one engine step per minibatch
    trained, start = load_file(zero2_output / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert all(trained[name].dtype == torch.bfloat16 for name in trained)
    assert any(not torch.equal(trained[name].float(), start[name].float()) for name in start)
    assert torch.load(zero2_output / "critic.pt")["value_head.weight"].abs().sum() > 0  # zero-initialised


def test_a_zero2_run_resumes_from_its_checkpoint(zero2_output, tiny_model_dir, tmp_path):
    """Every rank saves its optimizer shard into the checkpoint and --resume restores the engine's state."""
    output_dir = tmp_path / "run"
    shutil.copytree(zero2_output, output_dir)
    finished = zero2_run(tiny_model_dir, tmp_path, output_dir, "--max_steps", "3", "--save_steps", "1", "--resume")
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in finished.stdout
    output = finished.stdout + finished.stderr  # both ranks': the run's lines are the main process's alone
    assert output.count("PPO: ") == 1 and output.count("step 3/3: mean final emotion") == 1
    for rank in (0, 1):
        assert [row["step"] for row in json_lines(output_dir / f"transcripts.rank{rank}.jsonl")] == [0, 0, 1, 1, 2, 2]
    assert [row["step"] for row in json_lines(output_dir / "metrics.jsonl")] == [0, 1, 2]
    engine = torch.load(output_dir / "checkpoint-3" / "deepspeed" / "pytorch_model" / "mp_rank_00_model_states.pt",
                        weights_only=False)
    assert engine["global_steps"] == 3  # the engine's 2 steps restored, then step 2's minibatch


ZERO2_UPDATE = '''"""One train_ppo.ppo_update under DeepSpeed: a minibatch of 2 rows per rank (3 and 9 actions), in
micro-batches of argv[2] rows; rank 0 saves the engine's step count and gradient norm, the stats, and
the weights before and after to argv[3]."""
import sys

import torch
from accelerate import Accelerator

import train_ppo

model_dir, micro_batch_size, output = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = train_ppo.PPOArguments(model_name_or_path=model_dir, use_peft=False, dtype="bfloat16", minibatch_size=2,
                              micro_batch_size=micro_batch_size, critic_learning_rate=1e-3)
accelerator = Accelerator()
torch.manual_seed(0)
model, _ = train_ppo.load_models(args)
model, optimizer = train_ppo.prepare(accelerator, model, train_ppo.make_optimizer(model, args), args)
networks = accelerator.unwrap_model(model)
before = {name: weight.float().clone() for name, weight in networks.state_dict().items()}
generator = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own rows
rows = [([int(token) for token in torch.randint(0, 1000, (prompt + actions,), generator=generator)],
         [0] * prompt + [1] * actions) for prompt, actions in ((5, 3), (4, 9))]
batch = train_ppo.pad_batch(rows, pad_id=0, device=accelerator.device)
old_logprobs, old_values, first = train_ppo.old_logprobs_and_values(model, batch, [0, 1], 1.0, micro_batch_size)
shape = batch["action_mask"].shape
batch.update(old_logprobs=old_logprobs, old_values=old_values, returns=torch.rand(shape, generator=generator),
             advantages=torch.randn(shape, generator=generator))
stats = train_ppo.ppo_update(accelerator, model, optimizer, batch, args, first)
if accelerator.is_main_process:
    torch.save({"global_steps": model.global_steps, "grad_norm": float(model.get_global_grad_norm()), "stats": stats,
                "before": before, "after": {name: weight.float() for name, weight in networks.state_dict().items()}},
               output)
'''


def test_under_zero2_an_update_in_micro_batches_is_the_update_on_the_whole_minibatch(tiny_model_dir, tmp_path):
    """The engine accumulates the micro-batches and steps once per minibatch, and its own scaling of
    each loss by 1 / gradient_accumulation_steps is off: the gradient it clips and applies (its norm
    before clipping, over both ranks) is that of the whole minibatch, to bf16's precision."""
    (tmp_path / "update.py").write_text(ZERO2_UPDATE)
    updates = []
    for micro_batch_size in (2, 1):
        folder = tmp_path / f"micro-{micro_batch_size}"
        folder.mkdir()
        zero2_launch(folder, tmp_path / "update.py", tiny_model_dir, micro_batch_size, folder / "update.pt")
        updates.append(torch.load(folder / "update.pt"))
    whole, split = updates
    assert whole["global_steps"] == split["global_steps"] == 1
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=0.02)  # 1 / 2 if scaled twice
    assert split["stats"] == pytest.approx(whole["stats"], rel=0.02, abs=1e-4)
    steps = [torch.cat([(update["after"][name] - update["before"][name]).flatten() for name in update["before"]])
             for update in updates]
    assert steps[0].abs().max() > 0
    assert torch.nn.functional.cosine_similarity(steps[0], steps[1], dim=0) > 0.99


# --------------------------------------------------------------------------------------------
# Several processes holding different numbers of rows: one step over all ranks' rows
# --------------------------------------------------------------------------------------------

UNEVEN_UPDATE = '''"""The same 4 rows (3, 9, 1 and 6 actions), split over the processes as argv[2] says ("3,1": rank 0 the
first 3, rank 1 the last), each row its own micro-batch: one train_ppo.ppo_update with SGD at learning rate
1 and no clipping, so the weights move by minus the gradient the ranks average; and train_ppo.whiten and
value_metrics of fixed values at the rank's rows. Each rank saves what it got to argv[3].rank<i>."""
import sys

import torch
from accelerate import Accelerator

import train_ppo

model_dir, split, output = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], sys.argv[3]
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
args = train_ppo.PPOArguments(model_name_or_path=model_dir, use_peft=False, minibatch_size=4, micro_batch_size=1,
                              max_grad_norm=1e9)
torch.manual_seed(0)
model, _ = train_ppo.load_models(args)
torch.nn.init.normal_(model.critic.value_head.weight)  # values that vary
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
networks = accelerator.unwrap_model(model)
before = {name: weight.detach().clone() for name, weight in networks.named_parameters()}
generator = torch.Generator().manual_seed(0)
rows = [([int(token) for token in torch.randint(0, 1000, (prompt + actions,), generator=generator)],
         [0] * prompt + [1] * actions) for prompt, actions in ((5, 3), (4, 9), (6, 1), (2, 6))]
advantages, returns = torch.randn(4, 13, generator=generator), torch.rand(4, 13, generator=generator)
mine = list(range(sum(split[:rank]), sum(split[:rank + 1])))
batch = train_ppo.pad_batch([rows[row] for row in mine], pad_id=0, device=accelerator.device)
width = batch["action_mask"].shape[1]
old_logprobs, old_values, first = train_ppo.old_logprobs_and_values(model, batch, list(range(len(mine))), 1.0, 1)
batch.update(old_logprobs=old_logprobs, old_values=old_values, returns=returns[mine, :width],
             advantages=advantages[mine, :width])
whitened = train_ppo.whiten(batch["advantages"], batch["action_mask"])
values = train_ppo.value_metrics(batch["returns"], batch["advantages"], batch["action_mask"])
stats = train_ppo.ppo_update(accelerator, model, optimizer, batch, args, first)
torch.save({"rows": mine, "stats": stats, "whitened": whitened, "value_metrics": values,
            "step": {name: weight.detach() - before[name] for name, weight in networks.named_parameters()}},
           f"{output}.rank{rank}")
'''


def uneven_update(tiny_model_dir, folder: Path, split: str) -> list[dict]:
    """UNEVEN_UPDATE with the rows split over len(split) processes (gloo, DDP on CPU): each rank's results."""
    script, output = folder / "update.py", folder / f"update-{split.replace(',', '-')}"
    script.write_text(UNEVEN_UPDATE)
    processes = len(split.split(","))
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                str(free_port())] if processes > 1 else []
    finished = subprocess.run([sys.executable, *launcher, str(script), str(tiny_model_dir), split, str(output)],
                              cwd=folder, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert finished.returncode == 0, finished.stderr[-3000:]
    return [torch.load(f"{output}.rank{rank}", weights_only=False) for rank in range(processes)]


@pytest.fixture(scope="module")
def uneven_updates(tiny_model_dir, tmp_path_factory):
    """{split: each rank's results} for the 4 rows in one process, and over two as 2+2, 3+1 and 4+0."""
    folder = tmp_path_factory.mktemp("uneven")
    return {split: uneven_update(tiny_model_dir, folder, split) for split in ("4", "2,2", "3,1", "4,0")}


@pytest.mark.parametrize("split", ["2,2", "3,1", "4,0"])
def test_an_update_over_ranks_holding_different_rows_is_the_update_on_all_their_rows(uneven_updates, split):
    """Ranks with 3 and 1 rows (micro-batches), or 4 and none, make the same passes, and their averaged
    gradient is that of the token-mean losses over all 4 rows, as one process computes it: each rank's
    losses are divided by all ranks' actions / the number of processes (2+2, with 12 and 7 actions, would
    weigh one rank's actions 12/7 as much as the other's if each divided by its own). The stats are the
    step's, on every rank."""
    whole, ranks = uneven_updates["4"][0], uneven_updates[split]
    for rank in ranks:
        assert rank["stats"] == pytest.approx(whole["stats"], rel=1e-4, abs=1e-6)
        for name, step in whole["step"].items():
            torch.testing.assert_close(rank["step"][name], step, rtol=1e-4, atol=1e-6)
    assert max(step.abs().max() for step in whole["step"].values()) > 0


@pytest.mark.parametrize("split", ["2,2", "3,1", "4,0"])
def test_advantages_are_whitened_over_every_ranks_actions(uneven_updates, split):
    """Each rank's whitened values are those of all 4 rows' actions whitened together in one process, which
    a plain loop confirms centred and scaled (population std); the value metrics are the step's too."""
    whole = uneven_updates["4"][0]
    actions = [value for row in whole["whitened"].tolist() for value in row if value != 0.0]
    assert len(actions) == 3 + 9 + 1 + 6
    assert abs(sum(actions) / len(actions)) < 1e-5
    assert (sum(value ** 2 for value in actions) / len(actions)) ** 0.5 == pytest.approx(1, abs=1e-4)
    for rank in uneven_updates[split]:
        for row, whitened in zip(rank["rows"], rank["whitened"]):
            torch.testing.assert_close(whitened, whole["whitened"][row][:len(whitened)], rtol=1e-5, atol=1e-5)
        assert rank["value_metrics"] == pytest.approx(whole["value_metrics"], rel=1e-5, abs=1e-6)


def lost_dialogues_server(rank_0_profile_at_step_2):
    """An LLM simulator endpoint for 3 PPO steps on 2 ranks, 2 dialogues of 2 turns a rank: in step 0 one
    simulated user says goodbye after the first turn (its dialogue ends there, nothing fails); in step 1 one
    analysis call fails (no retries: its dialogue is lost, 1 of 4); in step 2 every analysis of rank 0's
    profile fails (its 2 dialogues lost, 2 of 4: within max_failed_share 0.5)."""
    import threading

    from fake_openai import FakeOpenAIServer

    analyses, user_messages, lock = [0], [0], threading.Lock()
    name = rank_0_profile_at_step_2.player.split("\n")[0]  # "* Name: ...", in the simulator's prompts

    def respond(body):
        prompt = body["messages"][-1]["content"]
        with lock:
            if "start the conversation" in prompt:  # an opening line
                return "I had a rough week."
            if "CHANGE" not in prompt:  # the user's next message; the first of the run says goodbye
                user_messages[0] += 1
                return "Thanks, I have to go now. Bye." if user_messages[0] == 1 else "Okay. It still hurts, though."
            analyses[0] += 1  # step 0 makes 7: 3 dialogues of 2 turns, one of 1
            if analyses[0] == 7 + 2 or any(name in message["content"] for message in body["messages"]):
                return {"status": 500}
            return f"They listened to me.\nCHANGE: {analyses[0] % 7 - 2:+d}"

    return FakeOpenAIServer(respond=respond)


def test_ppo_on_two_ranks_trains_through_lost_dialogues_and_per_turn_rows(tiny_model_dir, tmp_path):
    """The recipe's launch (ZeRO-2, full fine-tune, micro-batches of one row) with the paper's per-turn rows,
    3 steps: ranks hold 3|4 or 4|3 rows (a dialogue ended after one turn), then 4|2 or 2|4 (a dialogue
    lost), then 0|4 (rank 0 lost both its dialogues). Every step trains on both ranks, and the step's metrics (metrics.jsonl, the tracker's)
    are over both ranks' dialogues."""
    import rollout
    import simulator

    profiles = simulator.load_profiles(rollout.DialogueArguments().profiles)
    rank_0 = SimpleNamespace(num_processes=2, process_index=0)
    at_step_2 = train_ppo.step_profiles(profiles, train_ppo.PPOArguments(profiles_per_step=1), 2, rank_0)[0]
    with lost_dialogues_server(at_step_2) as server:
        zero2_run(tiny_model_dir, tmp_path, tmp_path / "run", "--per_turn_rows", "--max_steps", "3",
                  "--save_steps", "100", "--backend", "llm", "--base_url", server.base_url,
                  "--simulator_model", "sim-model", "--simulator_max_retries", "0")
    transcripts = [json_lines(tmp_path / "run" / f"transcripts.rank{rank}.jsonl") for rank in (0, 1)]
    lost = [[sum(row["failure"] is not None for row in rows if row["step"] == step) for step in range(3)]
            for rows in transcripts]
    assert lost[0][1] + lost[1][1] == 1 and lost[0][0] == lost[1][0] == 0 and lost[0][2] == 2 and lost[1][2] == 0
    assert sorted(row["turns"] for rows in transcripts for row in rows if row["step"] == 0) == [1, 2, 2, 2]
    metrics = json_lines(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [0, 1, 2]
    for step, row in enumerate(metrics):
        scored = [dialogue["emo_point"] for rows in transcripts for dialogue in rows
                  if dialogue["step"] == step and dialogue["failure"] is None]
        assert row["emotion/final_mean"] == pytest.approx(sum(scored) / len(scored))
        assert row["reward"] == pytest.approx(sum(scored) / len(scored) / 100)
    assert (tmp_path / "run" / "critic.pt").is_file()


# --------------------------------------------------------------------------------------------
# Refused at start-up
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_missing_tracker_package_stops_the_run_before_any_model_loads(tmp_path):
    from accelerate.tracking import get_available_trackers

    available = {tracker.value for tracker in get_available_trackers()}
    missing = next((name for name in ("trackio", "wandb", "tensorboard") if name not in available), None)
    if missing is None:
        pytest.skip("trackio, wandb and tensorboard are all installed")
    finished = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--report_to", missing,
                               "--model_name_or_path", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "run")],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0 and "Traceback" not in finished.stderr
    assert f"pip install {missing}" in finished.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("zero_stage, processes, use_vllm, refused", [
    (3, 1, False, "does not support DeepSpeed ZeRO-3"), (2, 2, True, "supports a single training process"),
    (2, 2, False, None), (2, 1, True, None)])
def test_launches_the_loop_cannot_run_are_refused_before_any_model_loads(zero_stage, processes, use_vllm, refused):
    """ZeRO-3 would partition the weights the rollout generates with (a hang) and save empty tensors;
    --use_vllm pushes weights from one process. Each refusal is one line saying what to launch instead."""
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=processes,
                                  state=SimpleNamespace(deepspeed_plugin=DeepSpeedPlugin(zero_stage=zero_stage)),
                                  is_main_process=True)
    args = train_ppo.PPOArguments(use_vllm=use_vllm)
    if refused is None:
        preflight.check_launch(args, accelerator)
        return
    with pytest.raises(SystemExit, match=refused) as stopped:
        preflight.check_launch(args, accelerator)
    assert "\n" not in str(stopped.value) and ("zero2.yaml" in str(stopped.value) or "transformers" in str(stopped.value))
    accelerator.is_main_process = False  # the other ranks refuse too, without saying it again
    with pytest.raises(SystemExit) as stopped:
        preflight.check_launch(args, accelerator)
    assert stopped.value.code == 1


def test_a_bf16_full_fine_tune_without_deepspeed_is_refused(tiny_model_dir, tmp_path):
    """Plain AdamW on bf16 weights would round its small steps away and silently not learn."""
    finished = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
                               "--output_dir", str(tmp_path / "run"), "--use_peft", "false", "--dtype", "bfloat16"],
                              capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0 and "Traceback" not in finished.stderr
    assert "needs fp32 master weights" in finished.stderr and "zero2.yaml" in finished.stderr


# --------------------------------------------------------------------------------------------
# vLLM server, sampling and weights: each context its own budget, LoRA pushed without touching the base
# --------------------------------------------------------------------------------------------

def test_a_think_rollout_filling_max_model_len_sends_no_request_vllm_refuses(tiny_model_dir, tmp_path, monkeypatch):
    """8 think-mode dialogues with a patient rule user, played to max_dialogue_tokens = the server's
    max_model_len (400), as the recipes run vLLM: near the end a long context's budget is the room left,
    and vLLM 0.31 refuses (HTTP 400) a request in which any prompt is longer than max_model_len - max_tokens,
    so each budget goes in its own request (the fake server refuses as vLLM does)."""
    from transformers import AutoTokenizer
    from trl.generation import vllm_client

    import vllm_backends
    import rollout
    import simulator

    # TRL's real client over HTTP, without vLLM installed here and without the CUDA-only weight channel
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", lambda self, device=0: None)
    port, log = free_port(), tmp_path / "server.log"
    server = subprocess.Popen([sys.executable, str(FAKE / "server.py"), "--port", str(port), "--model",
                               str(tiny_model_dir), "--log", str(log), "--max_model_len", "400"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        generate = vllm_backends.VLLMServerGenerator("127.0.0.1", port, temperature=1.0)
        runner = rollout.DialogueRunner(AutoTokenizer.from_pretrained(tiny_model_dir), rollout.DialogueArguments(
            think=True, max_turns=8, max_think_tokens=64, max_reply_tokens=32, max_dialogue_tokens=400),
            simulator.SimulatorArguments(change_bound=2))
        profiles = simulator.load_profiles(simulator.DEFAULT_PROFILES)[:8]
        openings = runner.openings(profiles)
        dialogues = runner.run([(profile, openings[profile.id]) for profile in profiles], generate)
        runner.close()
    finally:
        server.kill()
        server.wait()
    assert not [row for row in json_lines(log) if row["event"] == "completions_refused"]
    assert {dialogue.end_reason for dialogue in dialogues} == {"token_budget"}  # every dialogue filled its 400
    requests = [row for row in json_lines(log) if row["event"] == "completions"]
    assert len({row["max_tokens"] for row in requests}) > 2  # budgets below 64 and 32: the room left


class RecordingClient:
    """Stands in for TRL's VLLMClient in push_weights: keeps a copy of what each push sent."""

    def __init__(self, host=None, server_port=None, connection_timeout=None):
        self.pushes = []

    def init_communicator(self, device=0):
        pass

    def update_named_params(self, metadata, named_params):
        sent = {name: tensor.clone() for name, tensor in named_params}
        assert [(name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape))
                for name, tensor in sent.items()] == metadata
        self.pushes.append(sent)

    def reset_prefix_cache(self):
        pass


def test_pushing_lora_weights_sends_the_merged_weights_and_leaves_the_bf16_base_bit_identical(tiny_model_dir,
                                                                                              monkeypatch):
    """Merging the adapter in place and unmerging it after rounds a bf16 base differently each time: the
    frozen weights would drift with every push. 20 pushes must leave every weight as it was and send,
    each time, what peft's merge gives."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.generation import vllm_client

    import vllm_backends

    monkeypatch.setattr(vllm_client, "VLLMClient", RecordingClient)
    torch.manual_seed(0)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                            LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))  # lora_B non-zero
    before = {name: parameter.detach().clone() for name, parameter in policy.named_parameters()}
    merged = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    server = vllm_backends.VLLMServerGenerator("127.0.0.1", 8000, temperature=1.0)
    for _ in range(20):
        server.push_weights(policy)
    for name, parameter in policy.named_parameters():
        assert torch.equal(parameter, before[name]), name
    pushes = server.client.pushes
    assert len(pushes) == 20 and set(pushes[0]) == set(merged)
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): weight
            for name, weight in before.items() if "lora_" not in name}
    assert any(not torch.equal(merged[name], base[name]) for name in merged)  # the adapter changes some weights
    for sent in (pushes[0], pushes[-1]):
        for name, weight in merged.items():
            assert sent[name].dtype == torch.bfloat16 and torch.equal(sent[name], weight), name


def test_ppo_refuses_a_vllm_server_shorter_than_the_dialogue_budget_before_the_first_rollout(tiny_model_dir, tmp_path):
    from conftest import serving

    with serving(tiny_model_dir, tmp_path / "server.log", max_model_len=300) as url:
        finished = subprocess.run(
            [sys.executable, str(FAKE / "run.py"), "train_ppo.py", "--use_vllm", "--vllm_server_host", "127.0.0.1",
             "--vllm_server_port", url.rsplit(":", 1)[1], "--model_name_or_path", str(tiny_model_dir),
             "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--max_dialogue_tokens", "400", *SMALL_RUN],
            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert finished.returncode != 0
    assert "vLLM's max_model_len is 300, below --max_dialogue_tokens 400" in finished.stderr, finished.stderr[-3000:]
    assert not (tmp_path / "run" / "transcripts.jsonl").exists()
