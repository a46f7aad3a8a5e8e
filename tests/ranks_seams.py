"""The project's multi-rank functions on 2 CPU processes (gloo) whose ranks hold different things, for
tests/test_ranks.py (which states what each must give, from single-process oracles):

    python -m torch.distributed.run --nproc_per_node 2 tests/ranks_seams.py OUT_DIR SHARED_FOLDER

Rank 0 holds more than rank 1 everywhere (rows, actions, dialogues, failures, budgets). Each check's result, or
the error it raised, goes to OUT_DIR/rank<N>.json."""
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from accelerate import Accelerator, InitProcessGroupKwargs  # noqa: E402

import common  # noqa: E402
import guards  # noqa: E402
import vllm_backends  # noqa: E402
import preflight  # noqa: E402
import rollout  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402

out_dir, shared = Path(sys.argv[1]), Path(sys.argv[2])
accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=60))])
rank = accelerator.process_index
results = {}


def check(function):
    """Run a check on this rank; its result, or its error's type and message."""
    try:
        results[function.__name__] = function()
    except Exception as error:  # noqa: BLE001 (the test reads it)
        results[function.__name__] = {"error": f"{type(error).__name__}: {error}",
                                      "trace": traceback.format_exc()[-800:]}
    return function


# Per rank: a minibatch's rows, as lists (RANK_ROWS in tests/test_ranks.py makes the same tensors)
from test_ranks import RANK_ROWS, ppo_args, ppo_batch, tiny_policy_and_critic  # noqa: E402


@check
def whiten():
    values, mask = (torch.tensor(x, dtype=torch.float) for x in RANK_ROWS["whiten"][rank])
    return train_ppo.whiten(values, mask).tolist()


@check
def ppo_update():
    model = tiny_policy_and_critic()
    optimizer = train_ppo.make_optimizer(model, ppo_args())
    model, optimizer = accelerator.prepare(model, optimizer)
    stats = train_ppo.ppo_update(accelerator, model, optimizer, ppo_batch(RANK_ROWS["ppo"][rank]), ppo_args())
    networks = accelerator.unwrap_model(model)
    # the gradient every rank applied (DDP's average), before the step: the step itself is AdamW's
    return {"stats": stats, "grads": [p.grad.flatten().tolist() for p in networks.parameters() if p.grad is not None]}


@check
def ppo_update_with_no_rows_on_one_rank():
    """A step whose dialogues all failed on rank 1: no rows there (main's minibatch_rows gives it empty minibatches
    of the count the ranks agree on), while rank 0 trains."""
    model = tiny_policy_and_critic()
    optimizer = train_ppo.make_optimizer(model, ppo_args())
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = RANK_ROWS["ppo"][0] if rank == 0 else []
    agreed = train_ppo.most_over_ranks(len(rows), accelerator.device)
    batch = train_ppo.select_rows(ppo_batch(RANK_ROWS["ppo"][0]), list(range(len(rows))))
    stats = train_ppo.ppo_update(accelerator, model, optimizer, batch, ppo_args())
    networks = accelerator.unwrap_model(model)
    return {"agreed": agreed, "stats": stats,
            "grads": [p.grad.flatten().tolist() for p in networks.parameters() if p.grad is not None]}


@check
def check_failures():
    decisions = []
    for failures, share in RANK_ROWS["failures"]:
        dialogues = [SimpleNamespace(failure="endpoint down" if failed else None) for failed in failures[rank]]
        try:
            rollout.check_failures(dialogues, share, accelerator)
            decisions.append("go on")
        except rollout.TooManySimulatorFailures as error:
            decisions.append(str(error))
    return decisions


@check
def stop_agreed():
    agreed = []
    for asking in (None, 1, 0):
        request = guards.StopRequest(show=False)
        request.requested = rank == asking
        agreed.append(request.stop_agreed())
    return agreed


@check
def claim_run_folder():
    guards.claim_run_folder(shared / "run", "train_ppo.py", "tiny", False, "--resume", {"seed": 1}, accelerator)
    accelerator.wait_for_everyone()
    guards.check_run_folder_kept(shared / "run")
    return json.loads((shared / "run" / guards.RUN_MARKER).read_text())["launch"]


@check
def turn_terms():
    credit = SimpleNamespace(turn_credit_baseline="group", turn_credit_scale="bound")
    own, _ = train_grpo.ranks_turn_terms(RANK_ROWS["turn_terms"][rank], rank, 4, credit, change_bound=10)
    return own


@check
def clipped_share():
    args = SimpleNamespace(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                           vllm_importance_sampling_clip_min=None)
    ratio, trained = ([[2.0, 1.0, 2.0, 1.0]], [[1, 1, 1, 1]]) if rank == 0 else ([[1.0, 2.0]], [[1, 0]])
    return train_grpo.ranks_clipped_share(torch.tensor(ratio), torch.tensor(trained), args, accelerator)


@check
def lockstep_vllm_calls():
    calls = []

    def generate(prompts, images, num_generations):
        calls.append([list(p) for p in prompts])
        return None, [[p[0]] * 4 for p in prompts], [[[-1.0]] * 4 for _ in prompts], None

    vllm = SimpleNamespace(processing_class=SimpleNamespace(eos_token_id=0), mode="server", tensor_parallel_size=1,
                           enable_sleep_mode=False, generation_kwargs=None, max_completion_length=None,
                           generate=generate)
    contexts, budgets = RANK_ROWS["budgets"][rank]
    sampled, _ = vllm_backends.VLLMGenerator(SimpleNamespace(vllm_generation=vllm))(contexts, budgets)
    return {"calls": calls, "sampled": sampled}


@check
def server_max_model_len():
    client = SimpleNamespace(get_server_info=lambda: {"model_config": {"max_model_len": 1234}}) if rank == 0 else None
    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(mode="server", vllm_client=client),
                              accelerator=accelerator)
    return vllm_backends.trainer_max_model_len(trainer)


@check
def ppo_step_profiles():
    args = SimpleNamespace(profiles_per_step=2, seed=3)
    return [train_ppo.step_profiles(list(range(7)), args, step, accelerator) for step in range(3)]


@check
def ppo_seeds_and_files():
    train_ppo.seed_everything(5, rank)
    return {"torch": torch.rand(2).tolist(), "files": [str(p) for p in train_ppo.run_files(Path("out"), accelerator)]}


@check
def ppo_step_dialogues():
    def played(dialogue_id, emotion):
        user = SimpleNamespace(emotion=emotion, start_emotion=30, calls=common.CallStats())
        return rollout.Dialogue(dialogue_id, None, user, [1, 2], emotions=[emotion], reply_texts=["Reply."])

    mine = [played(0, 40), played(1, 50)] if rank == 0 else [played(2, 60)]
    columns, rewards = train_ppo.step_dialogues(mine, [d.final_emotion / 100 for d in mine], accelerator)
    return {"final_emotion": columns["final_emotion"], "rewards": rewards}


@check
def ppo_launch_checks():
    said = []
    for use_vllm in (False, True):  # PPO's vLLM push is from one process
        try:
            preflight.check_launch(SimpleNamespace(use_vllm=use_vllm), accelerator)
            said.append("runs")
        except SystemExit as refused:
            said.append(str(refused.code))
    return said


(out_dir / f"rank{rank}.json").write_text(json.dumps(results))
accelerator.wait_for_everyone()
torch.distributed.destroy_process_group()
