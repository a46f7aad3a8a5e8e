"""The multi-rank functions with ranks that differ in what they hold, in the fast subset: one 2-process gloo run
of tests/ranks_seams.py (a few seconds) plays every check, and each test states what both ranks must get, from a
single-process oracle where there is one: PPO's gradient and stats over every rank's actions, the step's whitening,
the failure share, the stop, the run folder claimed once, GRPO's turn terms, the lockstep vLLM calls, the server's
length, the steps' profiles and each rank's own seed and files."""
import json
import random

import pytest
import torch
from conftest import REPO, two_ranks

import train_grpo
import train_ppo

RANK_ROWS = {
    # (values, mask) per rank: 3 actions on rank 0, 1 on rank 1 (its second position padding)
    "whiten": [([[1.0, 2.0, 3.0, 0.0]], [[1, 1, 1, 0]]), ([[10.0, 99.0]], [[1, 0]])],
    # a minibatch's rows per rank: (ids, attention, actions, advantages, returns, old log-probs, old values);
    # 6 actions in 3 rows on rank 0, 3 in one row on rank 1 (micro-batches of 1: rank 1 adds placeholders)
    "ppo": [[([1, 5, 7, 9, 2, 3], [1] * 6, [0, 0, 1, 1, 0, 1], [0, 0, 0.5, -1.0, 0, 2.0], [0, 0, 1.0, 0.5, 0, -1.0],
              [0, 0, -2.0, -3.0, 0, -2.5], [0, 0, 0.2, 0.1, 0, -0.3]),
             ([3, 3, 6, 2, 8, 1], [1] * 6, [0, 0, 0, 1, 1, 0], [0, 0, 0, 1.5, 0.3, 0], [0, 0, 0, 0.2, 0.9, 0],
              [0, 0, 0, -3.2, -3.6, 0], [0, 0, 0, 0.4, -0.2, 0]),
             ([2, 9, 9, 4, 0, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, -0.7, 0, 0], [0, 0, 0, 0.3, 0, 0],
              [0, 0, 0, -3.0, 0, 0], [0, 0, 0, 0.5, 0, 0])],
            [([4, 4, 8, 1, 0, 0], [1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0], [0, 2.0, -0.5, 1.0, 0, 0],
              [0, 0.4, -0.6, 1.2, 0, 0], [0, -3.1, -2.9, -3.4, 0, 0], [0, 0.1, 0.0, -0.1, 0, 0])]],
    # (failed or not per dialogue, per rank; max_failed_share): 3 of 8 under 0.5 (rank 1 alone: 3 of 4), then
    # 4 of 8 over 0.4 (rank 1 alone: 1 of 4)
    "failures": [([[False] * 4, [True, True, True, False]], 0.5), ([[True, True, True, False], [True] + [False] * 3], 0.4)],
    # GRPO rows per rank (as many on each), one group of 4 spanning both ranks
    "turn_terms": [[{"turn_changes": [3, -2, 5], "failed": False}, {"turn_changes": [0, 4], "failed": False}],
                   [{"turn_changes": [-5, 2, 1], "failed": False}, {"turn_changes": [6], "failed": True}]],
    # (contexts, budgets) per rank for the lockstep vLLM generator
    "budgets": [([[11], [12], [13]], [5, 3, 5]), ([[21]], [5])],
}


def ppo_args():
    return train_ppo.PPOArguments(micro_batch_size=1, clip_range=0.1, value_clip_range=0.35, entropy_coef=0.01,
                                  max_grad_norm=1e6, temperature=0.9)


def ppo_batch(rows) -> dict:
    names = ("input_ids", "attention_mask", "action_mask", "advantages", "returns", "old_logprobs", "old_values")
    batch = {name: torch.tensor([row[i] for row in rows]) for i, name in enumerate(names)}
    return {name: value.float() if name in names[3:] else value.long() for name, value in batch.items()}


def tiny_policy_and_critic():
    """A one-layer Llama policy and critic of width 16, the same on every rank (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    policy, body = LlamaForCausalLM(config), LlamaModel(config)
    critic = train_ppo.Critic(body, 16)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # not zero: the body's gradient shows too
    return train_ppo.PolicyAndCritic(policy, critic)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    finished = two_ranks(REPO / "tests" / "ranks_seams.py", out, out, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def both(ranks, name):
    for result in (ranks[0][name], ranks[1][name]):
        assert not (isinstance(result, dict) and "error" in result), result
    return ranks[0][name], ranks[1][name]


def test_ppos_whitening_is_over_every_ranks_actions(ranks):
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    mean, std = values.mean(), values.std(unbiased=False)
    rank0, rank1 = both(ranks, "whiten")
    assert rank0[0][:3] == pytest.approx(((values[:3] - mean) / std).tolist(), abs=1e-5) and rank0[0][3] == 0
    assert rank1[0] == pytest.approx([((10 - mean) / std).item(), 0.0], abs=1e-5)


def test_a_ppo_update_on_ranks_with_different_rows_is_one_update_on_all_rows(ranks):
    """Every rank applies the gradient one process would over all 4 rows (9 actions), whatever each rank holds;
    the stats are the all-rows stats."""
    from accelerate import Accelerator

    model = tiny_policy_and_critic()
    accelerator = Accelerator(cpu=True)
    optimizer = train_ppo.make_optimizer(model, ppo_args())
    stats = train_ppo.ppo_update(accelerator, model, optimizer, ppo_batch(RANK_ROWS["ppo"][0] + RANK_ROWS["ppo"][1]),
                                 ppo_args())
    expected = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    for result in both(ranks, "ppo_update"):
        assert len(result["grads"]) == len(expected)
        for got, want in zip(result["grads"], expected):
            assert torch.allclose(torch.tensor(got), want, atol=1e-5, rtol=1e-4)
        assert result["stats"] == pytest.approx(stats, abs=1e-5)


def test_a_ppo_update_with_no_rows_on_one_rank_is_the_update_on_the_other_ranks_rows(ranks):
    """All of rank 1's dialogues failed: it agrees on rank 0's count of minibatches, pads its empty minibatch, and
    both ranks apply the gradient one process would over rank 0's 3 rows alone, with their stats."""
    from accelerate import Accelerator

    model = tiny_policy_and_critic()
    optimizer = train_ppo.make_optimizer(model, ppo_args())
    stats = train_ppo.ppo_update(Accelerator(cpu=True), model, optimizer, ppo_batch(RANK_ROWS["ppo"][0]), ppo_args())
    expected = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    for result in both(ranks, "ppo_update_with_no_rows_on_one_rank"):
        assert result["agreed"] == 3
        assert len(result["grads"]) == len(expected)
        for got, want in zip(result["grads"], expected):
            assert torch.allclose(torch.tensor(got), want, atol=1e-5, rtol=1e-4)
        assert result["stats"] == pytest.approx(stats, abs=1e-5)


def test_the_simulator_failure_share_is_decided_over_every_rank_alike(ranks):
    rank0, rank1 = both(ranks, "check_failures")
    assert rank0 == rank1
    assert rank0[0] == "go on" and "4 of 8 dialogues failed" in rank0[1]


def test_a_stop_asked_on_any_rank_stops_every_rank(ranks):
    assert both(ranks, "stop_agreed") == ([False, True, True], [False, True, True])


def test_the_run_folder_is_claimed_once_by_the_main_process(ranks):
    """Marked and held by rank 0 only (a second rank's lock would refuse the folder), one launch id seen by both."""
    rank0, rank1 = both(ranks, "claim_run_folder")
    assert rank0 == rank1


def test_grpos_turn_terms_are_computed_over_every_ranks_rows_and_each_takes_its_own(ranks):
    rows = RANK_ROWS["turn_terms"][0] + RANK_ROWS["turn_terms"][1]
    terms = train_grpo.turn_terms([row["turn_changes"] for row in rows], [row["failed"] for row in rows], 4,
                                  "group", "bound", 10)
    assert both(ranks, "turn_terms") == (terms[:2], terms[2:])
    assert terms[:2] != terms[2:]


def test_lockstep_vllm_calls_are_the_same_on_every_rank_each_padded_to_the_largest_count(ranks):
    rank0, rank1 = both(ranks, "lockstep_vllm_calls")
    assert rank0["calls"] == [[[12]], [[11], [13]]]  # one call per budget, in increasing order: 3, then 5
    assert rank1["calls"] == [[[0]], [[21], [0]]]  # rank 1 pads with the end token to rank 0's counts
    assert rank0["sampled"] == [[11] * 4, [12] * 3, [13] * 4] and rank1["sampled"] == [[21] * 4]


def test_the_vllm_servers_length_asked_by_rank_0_reaches_every_rank(ranks):
    assert both(ranks, "server_max_model_len") == (1234, 1234)


def test_ppos_ranks_play_disjoint_slices_of_one_seeded_stream_of_profiles(ranks):
    rank0, rank1 = both(ranks, "ppo_step_profiles")
    order, stream = random.Random(3), []
    while len(stream) < 12:
        stream += order.sample(range(7), 7)
    for step in range(3):
        assert rank0[step] + rank1[step] == stream[4 * step:4 * step + 4]


def test_each_rank_has_its_own_torch_seed_and_transcripts_file_and_one_metrics_file(ranks):
    rank0, rank1 = both(ranks, "ppo_seeds_and_files")
    torch.manual_seed(6)
    assert rank1["torch"] == pytest.approx(torch.rand(2).tolist()) and rank0["torch"] != rank1["torch"]
    assert rank0["files"] == ["out/transcripts.rank0.jsonl", "out/metrics.jsonl"]
    assert rank1["files"] == ["out/transcripts.rank1.jsonl", "out/metrics.jsonl"]


def test_a_launch_ppo_cannot_run_is_refused_on_every_rank_and_said_once(ranks):
    rank0, rank1 = both(ranks, "ppo_launch_checks")
    assert rank0[0] == rank1[0] == "runs"
    assert "supports a single training process" in rank0[1] and rank1[1] == "1"


def test_ppos_step_metrics_are_over_every_ranks_dialogues_in_rank_order(ranks):
    expected = {"final_emotion": [40, 50, 60], "rewards": [0.4, 0.5, 0.6]}
    assert both(ranks, "ppo_step_dialogues") == (expected, expected)


def test_grpos_clipped_share_is_over_every_ranks_trained_tokens(ranks):
    """2 of rank 0's 4 trained tokens were cut, none of rank 1's one (its second token is not trained): 2 of 5."""
    assert both(ranks, "clipped_share") == (pytest.approx(0.4), pytest.approx(0.4))
