"""--turn_credit in both trainers: where each turn's emotion change lands, hand-computed advantages,
and off (or a zero weight) changing nothing."""
import json
import subprocess
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import rollout
import train_grpo
import train_ppo

REPO = Path(__file__).resolve().parent.parent

PROMPT = [1, 2, 3]
# Turn 0 samples 10, 11; the user answers (90, 91). Turn 1 (think mode) gets an inserted <think> (80),
# samples 12, 13, a forced </think> is inserted (81), then it samples 14.
COMPLETION = [10, 11, 90, 91, 80, 12, 13, 81, 14]
ENV_MASK = [1, 1, 0, 0, 0, 1, 1, 0, 1]


def two_turn_dialogue(emotions=(35, 45), start=30):
    """A finished two-turn dialogue, built by hand: the user went 30 -> 35 -> 45."""
    return rollout.Dialogue(
        dialogue_id=0, profile=None, simulator=SimpleNamespace(start_emotion=start, emotion=emotions[-1]),
        prompt_ids=list(PROMPT), completion_ids=list(COMPLETION), env_mask=list(ENV_MASK),
        turn_ids=[[10, 11], [12, 13, 14]], thought_ids=[[], [12, 13]], turn_starts=[0, 4],
        emotions=list(emotions), reply_texts=["a", "b"])


# --------------------------------------------------------------------------------------------
# The rollout's per-turn fields
# --------------------------------------------------------------------------------------------

def test_turn_changes_are_each_turns_emotion_difference_and_sum_to_final_minus_start():
    dialogue = two_turn_dialogue()
    assert dialogue.turn_changes == [5, 10]
    assert sum(dialogue.turn_changes) == dialogue.final_emotion - 30
    assert two_turn_dialogue(emotions=(35, 45, 40)).turn_changes == [5, 10, -5]  # each against the one before


def test_sampled_turn_marks_only_the_tokens_each_turn_sampled():
    assert two_turn_dialogue().token_turns() == [0, 0, -1, -1, -1, 1, 1, -1, 1]


def test_in_a_real_think_rollout_each_turn_is_marked_on_exactly_the_tokens_it_sampled(tiny_model_dir):
    from conftest import play_think_dialogue

    dialogue, _ = play_think_dialogue(tiny_model_dir)
    turn_of = dialogue.token_turns()
    for turn, sampled in enumerate(dialogue.turn_ids):
        assert [token for token, t in zip(dialogue.completion_ids, turn_of) if t == turn] == sampled
    assert [t >= 0 for t in turn_of] == [bool(keep) for keep in dialogue.env_mask]
    assert sum(dialogue.turn_changes) == dialogue.final_emotion - rollout.DialogueArguments().start_emotion


# --------------------------------------------------------------------------------------------
# PPO: rewards on each turn's last sampled token
# --------------------------------------------------------------------------------------------

def rewards_of(dialogue, final_reward, turn_credit, per_turn=False):
    rows = train_ppo.dialogue_rows(dialogue, train_ppo.turn_rewards(dialogue, final_reward, turn_credit), per_turn)
    batch = train_ppo.pad_batch(rows, pad_id=0, device="cpu")
    return batch["action_mask"], train_ppo.place_rewards(batch["action_mask"], [row[2] for row in rows])


def test_without_turn_credit_the_final_reward_lands_on_the_last_token_the_policy_sampled():
    _, rewards = rewards_of(two_turn_dialogue(), 0.45, turn_credit=False)
    expected = torch.zeros(1, len(PROMPT) + len(COMPLETION))
    expected[0, 3 + 8] = 0.45
    assert torch.equal(rewards, expected)


def test_turn_credit_puts_each_turns_change_on_that_turns_last_sampled_token():
    _, rewards = rewards_of(two_turn_dialogue(), 0.45, turn_credit=True)
    expected = torch.zeros(1, len(PROMPT) + len(COMPLETION))
    expected[0, 3 + 1], expected[0, 3 + 8] = 0.05, 0.10  # token 11 ends turn 0, token 14 turn 1
    assert torch.allclose(rewards, expected)


def test_turn_credit_takes_the_format_penalty_off_the_last_turn():
    _, rewards = rewards_of(two_turn_dialogue(), 0.45 - 0.2, turn_credit=True)
    assert rewards[0, 3 + 1].item() == pytest.approx(0.05) and rewards[0, 3 + 8].item() == pytest.approx(-0.10)


def test_the_format_penalty_lands_on_the_last_of_three_turns():
    dialogue = two_turn_dialogue(emotions=(35, 45, 40))
    dialogue.turn_starts = [0, 4, 9]
    assert train_ppo.turn_rewards(dialogue, 0.40 - 0.2, turn_credit=True) == pytest.approx([0.05, 0.10, -0.25])
    assert train_ppo.turn_rewards(dialogue, 0.40, turn_credit=False) == [0.0, 0.0, 0.40]


def test_with_gamma_and_lambda_one_a_turns_return_is_what_followed_it():
    """Zero values: the return of every token of turn k is (final - emotion before turn k) / 100 with turn
    credit, the final emotion / 100 without."""
    for turn_credit, expected in [(False, [0.45, 0.45]), (True, [0.15, 0.10])]:
        mask, rewards = rewards_of(two_turn_dialogue(), 0.45, turn_credit)
        _, returns = train_ppo.masked_gae(rewards, torch.zeros_like(mask), mask, gamma=1.0, gae_lambda=1.0)
        turn_of = two_turn_dialogue().token_turns()
        for position, turn in enumerate(turn_of):
            want = expected[turn] if turn >= 0 else 0.0
            assert returns[0, 3 + position].item() == pytest.approx(want), (turn_credit, position)


def test_per_turn_rows_get_their_turns_return_on_their_last_token():
    for turn_credit, expected in [(False, [0.45, 0.45]), (True, [0.15, 0.10])]:
        rows = train_ppo.dialogue_rows(two_turn_dialogue(),
                                       train_ppo.turn_rewards(two_turn_dialogue(), 0.45, turn_credit), per_turn=True)
        assert [row[2] for row in rows] == [{len(row[0]) - 1: pytest.approx(want)} for row, want in zip(rows, expected)]
        assert all(row[1][len(row[0]) - 1] == 1 for row in rows)  # the last token is a sampled one


def test_an_on_policy_ppo_step_with_turn_credit_logs_the_final_emotion_and_zero_policy_loss(tiny_model_dir, tmp_path):
    """One update on the whole batch: ratio 1, so the policy loss is minus the mean of the whitened
    per-turn advantages, 0; the logged reward stays the paper's."""
    from test_train_ppo import run_ppo

    transcripts, [metrics] = run_ppo(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--turn_credit",
                                     "--minibatch_size", "4")
    finals = [row["emo_point"] for row in transcripts]
    assert metrics["reward"] == pytest.approx(sum(finals) / len(finals) / 100)
    assert metrics["ppo/policy_loss"] == pytest.approx(0.0, abs=1e-5)


# --------------------------------------------------------------------------------------------
# GRPO: the turn term of each turn, and where it lands
# --------------------------------------------------------------------------------------------

def test_turn_terms_are_centred_per_turn_within_each_group_and_scaled_by_their_std():
    # Group 0: three dialogues of 2, 1 and 2 turns and one whose simulator failed. Group 1: equal changes.
    changes = [[5, 10], [-5], [10, 0], [10, 10], [0], [0], [0], [0]]
    failed = [False, False, False, True, False, False, False, False]
    terms = train_grpo.turn_terms(changes, failed, group_size=4, baseline="turn", scale="std", change_bound=10)
    # Turn 0 of group 0: 5, -5, 10 (mean 10/3, sample std 7.6376); turn 1: 10, 0 (mean 5, std 7.0711).
    std0, std1 = 7.637626, 7.071068
    assert terms[0] == pytest.approx([(5 - 10 / 3) / std0, (10 - 5) / std1], abs=1e-4)
    assert terms[1] == pytest.approx([(-5 - 10 / 3) / std0], abs=1e-4)
    assert terms[2] == pytest.approx([(10 - 10 / 3) / std0, (0 - 5) / std1], abs=1e-4)
    assert terms[3] == [0.0, 0.0]  # failed: no credit, and not in its group's statistics
    assert terms[4:] == [[0.0]] * 4  # equal changes: nothing to prefer


def test_a_turn_no_other_dialogue_of_its_group_reached_gets_no_term():
    terms = train_grpo.turn_terms([[5, 10, -5], [0]], [False, False], group_size=2, baseline="turn", scale="std",
                                  change_bound=10)
    assert terms[0][1:] == [0.0, 0.0] and terms[0][0] == pytest.approx((5 - 2.5) / (3.535534 + 1e-4), abs=1e-5)


def test_the_group_baseline_and_the_bound_scale():
    # All four scored turns of the group: 5, 10, -5, 10 (mean 5); divided by the bound, 10.
    terms = train_grpo.turn_terms([[5, 10], [-5, 10]], [False, False], group_size=2, baseline="group",
                                  scale="bound", change_bound=10)
    assert terms == [pytest.approx([0.0, 0.5]), pytest.approx([-1.0, 0.5])]


def test_token_advantages_add_the_weighted_turn_term_only_on_that_turns_sampled_tokens():
    outcome = torch.tensor([0.8, -0.3])
    token_turns = [[0, 0, -1, -1, 1, 1], [0, -1]]  # row 1 is shorter: the rest is padding
    advantages = train_grpo.token_advantages(outcome, [[1.0, -2.0], [0.4]], token_turns, width=7, coef=0.5)
    assert advantages[0].tolist() == pytest.approx([1.3, 1.3, 0.8, 0.8, -0.2, -0.2, 0.8])
    assert advantages[1].tolist() == pytest.approx([-0.1, -0.3, -0.3, -0.3, -0.3, -0.3, -0.3])
    assert advantages.dtype == outcome.dtype


def grpo_command(tiny_model_dir, output_dir, *flags):
    return [sys.executable, str(REPO / "train_grpo.py"), "--model_name_or_path", str(tiny_model_dir),
            "--output_dir", str(output_dir), "--max_steps", "1", "--max_turns", "2", "--max_reply_tokens", "6",
            "--num_generations", "2", "--per_device_train_batch_size", "4", *flags]


def adapter(output_dir):
    from safetensors.torch import load_file
    return load_file(Path(output_dir) / "adapter_model.safetensors")


def test_grpo_with_turn_credit_at_weight_zero_trains_exactly_as_without(tiny_model_dir, tmp_path):
    """The (rows, tokens) advantages path with a zero term against TRL's own: the same weights, bit for bit."""
    for name, flags in [("off", []), ("zero", ["--turn_credit", "--turn_credit_coef", "0"])]:
        finished = subprocess.run(grpo_command(tiny_model_dir, tmp_path / name, *flags), cwd=tmp_path,
                                  capture_output=True, text=True, timeout=300)
        assert finished.returncode == 0, finished.stderr[-3000:]
    off, zero = adapter(tmp_path / "off"), adapter(tmp_path / "zero")
    assert off.keys() == zero.keys() and all(torch.equal(off[key], zero[key]) for key in off)
    assert (tmp_path / "off" / "transcripts.jsonl").read_text() == (tmp_path / "zero" / "transcripts.jsonl").read_text()


def test_grpo_with_turn_credit_gives_turns_a_term_from_the_simulators_changes(tiny_model_dir, tmp_path):
    """End to end against an LLM simulator whose change depends on the reply: the trainer reads the rollout's
    per-turn fields and logs a nonzero turn term."""
    from fake_openai import FakeOpenAIServer

    def respond(body):
        change = ["+5", "-5", "+10", "0"][zlib.crc32(json.dumps(body["messages"]).encode()) % 4]
        return f"Fine.\nCHANGE: {change}"

    output_dir = tmp_path / "run"
    with FakeOpenAIServer(respond=respond) as server:
        finished = subprocess.run(grpo_command(tiny_model_dir, output_dir, "--turn_credit", "--backend", "llm",
                                               "--simulator_model", "sim-model", "--base_url", server.base_url),
                                  capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    [logged] = [entry for entry in history if "turn_credit/mean_abs_term" in entry]
    assert logged["turn_credit/mean_abs_term"] > 0


def test_turn_credit_options_are_checked_and_off_by_default():
    dialogue_args = train_grpo.parse_arguments([])[0]
    assert dialogue_args.turn_credit is False and train_ppo.parse_arguments([])[1].turn_credit is False
    with pytest.raises(SystemExit):
        train_grpo.parse_arguments(["--turn_credit_coef", "-1"])
    with pytest.raises(SystemExit):
        train_grpo.parse_arguments(["--turn_credit_baseline", "dialogue"])


# --------------------------------------------------------------------------------------------
# GRPO: TRL's options written for one advantage per dialogue
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, reason", [
    (["--importance_sampling_level", "sequence"], "--importance_sampling_level sequence (GSPO): one ratio per dialogue "
     "gives each of its tokens the gradient of the dialogue's mean advantage"),
    (["--loss_type", "vespo"], "--loss_type vespo: VESPO weighs a whole dialogue by its sequence-level ratio"),
    (["--off_policy_mask_threshold", "0.5"], "--off_policy_mask_threshold: the mask drops an off-policy dialogue"),
    (["--off_policy_mask_threshold", "0"], "--off_policy_mask_threshold: the mask drops an off-policy dialogue"),
    (["--scale_rewards", "none"], "--scale_rewards none and --turn_credit_scale std: the outcome term would stay in "
     "reward units and the turn term in standard deviations"),
], ids=["gspo", "vespo", "off_policy_mask", "off_policy_mask_zero", "unscaled_outcome"])
def test_turn_credit_refuses_the_trl_options_whose_meaning_token_advantages_would_change(flags, reason, capsys):
    with pytest.raises(SystemExit) as stopped:
        train_grpo.parse_arguments(["--turn_credit", *flags])
    assert stopped.value.code == 2 and reason in capsys.readouterr().err.strip().splitlines()[-1]
    train_grpo.parse_arguments(flags)  # without turn credit: TRL's own meaning, accepted


def test_turn_credit_keeps_the_trl_options_that_mean_the_same_for_token_advantages():
    for flags in (["--scale_rewards", "none", "--turn_credit_scale", "bound"], ["--scale_rewards", "batch"],
                  ["--use_vllm", "--vllm_importance_sampling_mode", "sequence_mask"], ["--loss_type", "sapo"],
                  ["--loss_type", "cispo"], ["--loss_type", "luspo"], ["--top_entropy_quantile", "0.2"]):
        assert train_grpo.parse_arguments(["--turn_credit", *flags])[0].turn_credit, flags
