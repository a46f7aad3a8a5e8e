"""train_ppo.py: GAE over policy tokens, reward placement, masking, end-to-end runs, resume."""
import collections
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import preflight
import common
import guards
import rollout
import train_ppo
from train_ppo import masked_gae, place_rewards, ppo_losses

REPO = Path(__file__).resolve().parent.parent

# Row 0: prompt, two policy tokens, two user-turn tokens, two policy tokens, padding.
# Row 1: a dialogue that ended after its first turn, then padding.
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0],
                     [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float)
VALUES = torch.tensor([[9.0, 0.1, 0.2, 5.0, 5.0, 0.3, 0.4, 9.0],  # 9s and 5s sit on non-actions
                       [9.0, 0.5, 0.6, 9.0, 9.0, 9.0, 9.0, 9.0]])
FINAL_REWARDS = [{6: 1.0}, {2: 0.3}]  # each row's reward on its last action, as dialogue_rows places it


def test_rewards_land_at_their_positions_and_nowhere_else():
    rewards = place_rewards(MASK, [{2: 0.25, 6: 1.0}, {2: 0.3}])
    expected = torch.zeros_like(MASK)
    expected[0, 2], expected[0, 6], expected[1, 2] = 0.25, 1.0, 0.3
    assert torch.equal(rewards, expected)


def test_gae_with_gamma_and_lambda_one_matches_the_hand_computation():
    advantages, returns = masked_gae(place_rewards(MASK, FINAL_REWARDS), VALUES, MASK, gamma=1.0, gae_lambda=1.0)
    # Row 0: A4 = 1 - 0.4; A3 = 0.4 - 0.3 + A4; A2 = 0.3 - 0.2 + A3 (bootstrapping across the user turn); A1 = 0.2 - 0.1 + A2.
    assert advantages[0].tolist() == pytest.approx([0, 0.9, 0.8, 0, 0, 0.7, 0.6, 0])
    # Row 1 ended early: its chain stops at its own last action, with nothing after it.
    assert advantages[1].tolist() == pytest.approx([0, -0.2, -0.3, 0, 0, 0, 0, 0])
    assert returns[0].tolist() == pytest.approx([0, 1.0, 1.0, 0, 0, 1.0, 1.0, 0])


def test_gae_with_discounting_matches_the_hand_computation():
    advantages, _ = masked_gae(place_rewards(MASK, FINAL_REWARDS), VALUES, MASK, gamma=0.9, gae_lambda=0.8)
    a4 = 1 - 0.4
    a3 = (0.9 * 0.4 - 0.3) + 0.72 * a4
    a2 = (0.9 * 0.3 - 0.2) + 0.72 * a3
    a1 = (0.9 * 0.2 - 0.1) + 0.72 * a2
    assert advantages[0].tolist() == pytest.approx([0, a1, a2, 0, 0, a3, a4, 0])


def test_values_on_user_tokens_do_not_change_the_advantages():
    noisy = VALUES.clone()
    noisy[0, 3:5] = -100.0
    assert torch.equal(masked_gae(place_rewards(MASK, FINAL_REWARDS), VALUES, MASK, 1.0, 1.0)[0],
                       masked_gae(place_rewards(MASK, FINAL_REWARDS), noisy, MASK, 1.0, 1.0)[0])


def test_masked_tokens_contribute_nothing_to_either_loss():
    torch.manual_seed(0)
    shape = MASK.shape
    batch = {"action_mask": MASK, "old_logprobs": torch.randn(shape), "old_values": torch.randn(shape),
             "returns": torch.randn(shape), "advantages": torch.randn(shape)}
    new_logprobs, entropy, new_values = torch.randn(shape), torch.rand(shape), torch.randn(shape)
    args = train_ppo.PPOArguments()
    before = ppo_losses(new_logprobs, entropy, new_values, batch, args)
    off = MASK == 0
    perturbed = [t.masked_fill(off, 1e3) for t in (new_logprobs, entropy, new_values)]
    after = ppo_losses(*perturbed, batch, args)
    assert before[0].item() == pytest.approx(after[0].item()) and before[1].item() == pytest.approx(after[1].item())
    moved = [t + MASK * 0.5 for t in (new_logprobs, entropy, new_values)]  # an action's change does count
    assert ppo_losses(*moved, batch, args)[0].item() != pytest.approx(before[0].item())


def losses_of_one_action(advantage=0.0, ratio=1.0, old_value=0.0, new_value=0.0, return_=0.0):
    """ppo_losses on a batch of a single action, sampled with probability 0.25 and now `ratio` times as likely."""
    one = lambda value: torch.tensor([[float(value)]])  # noqa: E731
    old_logprob = math.log(0.25)
    batch = {"action_mask": one(1), "old_logprobs": one(old_logprob), "old_values": one(old_value),
             "returns": one(return_), "advantages": one(advantage)}
    args = train_ppo.PPOArguments(clip_range=0.2, value_clip_range=0.2, entropy_coef=0.0)
    objective, value_loss, stats = ppo_losses(one(old_logprob + math.log(ratio)), one(0), one(new_value), batch, args)
    return objective.item(), value_loss.item(), stats


@pytest.mark.parametrize("advantage, ratio, expected", [
    (+1.0, 1.5, -1.2),  # a good action made likelier: the gain stops at ratio 1 + clip
    (-1.0, 0.5, 0.8),  # a bad action made rarer: the gain stops at ratio 1 - clip
    (+1.0, 0.5, -0.5),  # a good action made rarer: the unclipped, larger loss counts in full
    (-1.0, 1.5, 1.5),  # a bad action made likelier: the unclipped, larger loss counts in full
])
def test_policy_loss_is_the_larger_of_the_clipped_and_unclipped_losses(advantage, ratio, expected):
    """loss = max(-A * r, -A * clip(r, 0.8, 1.2)): clipping removes the incentive to move the ratio
    further, never the penalty for having moved it the wrong way."""
    policy_loss, _, stats = losses_of_one_action(advantage, ratio)
    assert policy_loss == pytest.approx(expected, abs=1e-6)
    assert stats["ppo/policy_loss"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("old_value, new_value, return_, expected", [
    (0.0, 1.0, 1.0, 0.32),  # moved onto the return, but the clipped value 0.2 is still 0.8 off: 0.5 * 0.8^2
    (0.0, 1.0, 0.0, 0.5),  # moved away from the return: the unclipped error 1 counts, 0.5 * 1^2
    (0.0, -1.0, -1.0, 0.32),  # clipped from below too: -0.2 is 0.8 off
    (0.0, 0.1, 1.0, 0.405),  # within the clip range both agree: 0.5 * 0.9^2
    (0.0, 2.0, 0.0, 2.0),  # far off the return: the unclipped error 2 counts, 0.5 * 2^2
    (0.5, 0.6, 0.0, 0.18),  # the clip is around the old value 0.5: 0.6 is within it, 0.5 * 0.6^2
])
def test_value_loss_is_half_the_larger_of_the_clipped_and_unclipped_squared_errors(old_value, new_value, return_,
                                                                                   expected):
    _, value_loss, stats = losses_of_one_action(old_value=old_value, new_value=new_value, return_=return_)
    assert value_loss == pytest.approx(expected, abs=1e-6)
    assert stats["ppo/value_loss"] == pytest.approx(expected, abs=1e-6)


def test_entropy_bonus_is_subtracted_from_the_policy_loss():
    """On-policy (ratio 1) with zero advantages the policy loss is 0, so the objective is the bonus
    alone: -entropy_coef x the mean entropy over actions (the masked token's entropy is left out)."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    zeros = torch.zeros_like(mask)
    batch = {"action_mask": mask, "old_logprobs": zeros, "old_values": zeros, "returns": zeros, "advantages": zeros}
    args = train_ppo.PPOArguments(entropy_coef=0.01)
    objective, _, stats = ppo_losses(zeros, torch.tensor([[1.0, 3.0, 100.0]]), zeros, batch, args)
    assert stats["ppo/entropy"] == pytest.approx(2.0)
    assert objective.item() == pytest.approx(-0.01 * 2.0)


def test_clip_fraction_is_the_share_of_actions_whose_ratio_left_the_clip_range():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    ratios = torch.tensor([[1.5, 1.1, 0.5, 0.9, 3.0]])  # 1.5 and 0.5 are clipped; 3.0 is no action
    zeros = torch.zeros_like(mask)
    batch = {"action_mask": mask, "old_logprobs": zeros, "old_values": zeros, "returns": zeros, "advantages": zeros}
    _, _, stats = ppo_losses(ratios.log(), zeros, zeros, batch, train_ppo.PPOArguments(clip_range=0.2))
    assert stats["ppo/clip_fraction"] == pytest.approx(0.5)


def test_masked_mean_with_a_count_divides_the_sum_over_actions_by_that_count():
    """A micro-batch's share of its minibatch's token-mean: its sum over actions over the minibatch's count."""
    values, mask = torch.tensor([[2.0, 4.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]])
    assert train_ppo.masked_mean(values, mask).item() == pytest.approx(3.0)
    assert train_ppo.masked_mean(values, mask, count=torch.tensor(4.0)).item() == pytest.approx(1.5)


def test_kl_penalty_is_taken_off_every_action_and_only_actions():
    logprobs = torch.tensor([[-7.0, -1.0, -2.0, -7.0, -7.0, -0.5, -1.5, -7.0],
                             [-7.0, -1.0, -1.0, -7.0, -7.0, -7.0, -7.0, -7.0]])
    ref_logprobs = torch.tensor([[-1.0, -1.5, -1.0, -1.0, -1.0, -0.5, -2.5, -1.0],  # logp - ref: .5, -1, 0, 1
                                 [-1.0, -3.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])  # logp - ref: 2, 0
    rewards = place_rewards(MASK, FINAL_REWARDS, logprobs, ref_logprobs, kl_coef=0.1)
    assert rewards[0].tolist() == pytest.approx([0, -0.05, 0.1, 0, 0, 0, 1.0 - 0.1, 0])
    assert rewards[1].tolist() == pytest.approx([0, -0.2, 0.3, 0, 0, 0, 0, 0])


def run_ppo(tiny_model_dir, output_dir, *flags, launcher=(sys.executable,)):
    command = list(launcher) + [str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
                                "--output_dir", str(output_dir), "--max_turns", "2", "--max_think_tokens", "4",
                                "--max_reply_tokens", "6", "--profiles_per_step", "2", "--dialogues_per_profile", "2",
                                *flags]
    finished = subprocess.run(command, cwd=output_dir.parent, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    # The progress bar (written once when not on a terminal) and the pointer to the report.
    assert "PPO dialogues" in finished.stdout and "mean emotion" in finished.stdout
    shown = os.path.relpath(REPO / "report.py", output_dir.parent)  # as it runs from where the run was started
    assert f"read the dialogues: python {shown} {output_dir}" in finished.stdout
    transcripts = [json.loads(line) for line in (output_dir / "transcripts.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    # What it trains and where it writes, then one short line a step; every metric is in metrics.jsonl.
    assert re.search(rf"^PPO: {re.escape(str(tiny_model_dir))}.* against the \w+ user, \d+ steps?; writing "
                     rf"{re.escape(str(output_dir))}$", finished.stdout, re.MULTILINE)
    steps = re.findall(r"^step (\d+)/\d+: mean final emotion [\d.]+(?:, format violations \d+%)?, \d+ s$",
                       finished.stdout, re.MULTILINE)
    assert steps and [int(step) for step in steps] == [row["step"] + 1 for row in metrics][-len(steps):]
    assert "{'" not in finished.stdout
    return transcripts, metrics


@pytest.mark.parametrize("think", [False, True])
def test_a_two_step_run_completes_and_writes_transcripts_and_metrics(tiny_model_dir, tmp_path, think):
    launcher = ((sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu") if think
                else (sys.executable,))
    transcripts, metrics = run_ppo(tiny_model_dir, tmp_path / "run", "--max_steps", "2",
                                   *(["--think"] if think else []), launcher=launcher)
    assert len(transcripts) == 8 and {row["step"] for row in transcripts} == {0, 1}
    assert all(any(t for t in row["think_texts"]) == think for row in transcripts)
    assert [m["step"] for m in metrics] == [0, 1]
    for name in ("reward", "emotion/final_mean", "format/violation_rate", "ppo/policy_loss", "ppo/value_loss",
                 "ppo/entropy", "ppo/explained_variance", "dialogue/ended_turn_limit"):
        assert name in metrics[0]
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def on_policy_step(tiny_model_dir, tmp_path_factory):
    """(transcripts, metrics) of one PPO step of 4 dialogues (2 turns each) whose only update is on-policy:
    one epoch, one minibatch of the whole batch in one micro-batch, so that its forward pass is the one
    the old log-probs came from (ratio exactly 1); and the critic blank (zero-initialised head: V = 0). The user
    is a scripted endpoint whose changes differ from dialogue to dialogue (conftest.SlowUser, without delays), so
    that the returns vary: the rule user judges the tiny model's random tokens all alike."""
    from conftest import SlowUser
    from fake_openai import FakeOpenAIServer

    with FakeOpenAIServer(respond=SlowUser(seed=0, most=0)) as server:
        transcripts, [metrics] = run_ppo(tiny_model_dir, tmp_path_factory.mktemp("ppo") / "run", "--max_steps", "1",
                                         "--ppo_epochs", "1", "--minibatch_size", "4", "--micro_batch_size", "4",
                                         "--backend", "llm", "--simulator_model", "sim-model", "--base_url",
                                         server.base_url)
    return transcripts, metrics


def test_an_on_policy_update_has_zero_policy_loss_as_advantages_are_whitened_over_the_actions(on_policy_step):
    """At ratio 1 the policy loss is minus the mean over actions of the advantages: 0 when they were
    whitened over those actions (a whitening over all tokens leaves the actions' mean off zero)."""
    _, metrics = on_policy_step
    assert metrics["ppo/policy_loss"] == pytest.approx(0.0, abs=1e-5)


def test_an_on_policy_update_clips_no_ratio(on_policy_step):
    _, metrics = on_policy_step
    assert metrics["ppo/clip_fraction"] == 0.0


def test_the_logged_reward_is_the_mean_final_emotion_over_one_hundred(on_policy_step):
    transcripts, metrics = on_policy_step
    final = [row["emo_point"] for row in transcripts]
    after_first_turn = [[m for m in row["history"] if m["role"] == "user"][1]["emotion-point"] for row in transcripts]
    assert sum(after_first_turn) != sum(final)  # so that reading the wrong turn would show
    assert metrics["reward"] == pytest.approx(sum(final) / len(final) / 100)


def test_a_blank_critic_explains_none_of_the_returns_variance(on_policy_step):
    """V = 0 everywhere: the unexplained variance of returns - V is all of the returns' variance."""
    transcripts, metrics = on_policy_step
    assert len({row["emo_point"] for row in transcripts}) > 1  # the returns vary (else 0 / 0)
    assert metrics["ppo/value_mean"] == 0.0
    assert metrics["ppo/explained_variance"] == pytest.approx(0.0, abs=1e-6)


def test_resume_continues_where_an_interrupted_run_stopped_and_a_new_run_there_is_refused(tiny_model_dir, tmp_path):
    output_dir = tmp_path / "run"
    small = ["--profiles_per_step", "1", "--max_turns", "1", "--save_steps", "2"]
    run_ppo(tiny_model_dir, output_dir, "--max_steps", "3", *small)  # "interrupted" after step 3
    assert (output_dir / "checkpoint-2").is_dir()
    transcripts, metrics = run_ppo(tiny_model_dir, output_dir, "--max_steps", "4", "--resume", *small)
    per_step = collections.Counter(row["step"] for row in transcripts)
    assert per_step == {0: 2, 1: 2, 2: 2, 3: 2}  # step 2 played again once, nothing lost or doubled
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(output_dir)]
    with pytest.raises(common.InputError, match="already holds a run"):  # in-process: refused before any model loads
        train_ppo.main(argv + ["--max_steps", "1"])
    rows = (output_dir / "transcripts.jsonl").read_text()
    with pytest.raises(common.InputError, match=re.escape(  # nothing left to train: refused, no row dropped
            f"--resume: {output_dir / 'checkpoint-4'} holds 4 trained steps, as many as --max_steps 3 asks; raise "
            "--max_steps to train on")):
        train_ppo.main(argv + ["--max_reply_tokens", "6", "--max_steps", "3", "--resume", *small])
    assert (output_dir / "transcripts.jsonl").read_text() == rows


def test_per_turn_rows_drop_earlier_thoughts_and_train_one_turn_each(tiny_model_dir):
    from conftest import play_think_dialogue

    dialogue, tokenizer = play_think_dialogue(tiny_model_dir)
    rows = train_ppo.per_turn_rows(dialogue)
    assert len(rows) == len(dialogue.turn_ids) == 3
    segments = rollout.ChatSegments(tokenizer)
    user_blocks = [dialogue.completion_ids[end:start] for end, start in zip(
        [s + len(t) + len(segments.think_open) + (0 if tokenizer.decode(th).endswith("</think>") else len(segments.think_close))
         for s, t, th in zip(dialogue.turn_starts, dialogue.turn_ids, dialogue.thought_ids)],
        dialogue.turn_starts[1:])]
    context = list(dialogue.prompt_ids)
    for turn, (ids, mask) in enumerate(rows):
        actions = [token for token, keep in zip(ids, mask) if keep]
        assert actions == dialogue.turn_ids[turn]  # only this turn is trained
        assert ids[:len(context)] == context  # earlier turns appear as replies only
        thought = dialogue.thought_ids[turn]
        context = context + dialogue.turn_ids[turn][len(thought):] + user_blocks[turn] if turn < 2 else context
    after_prompt = tokenizer.decode(rows[2][0][len(dialogue.prompt_ids):])
    assert after_prompt.count("<think>") == 1  # only the current turn's thought


def test_a_per_turn_rows_run_completes(tiny_model_dir, tmp_path):
    transcripts, metrics = run_ppo(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--think", "--per_turn_rows")
    assert len(transcripts) == 4 and metrics[0]["step"] == 0


def test_with_a_blank_critic_the_first_update_is_grpos_with_one_group(tiny_model_dir):
    """V = 0 (the zero-initialised head) and one profile per batch: the whitened per-token advantages
    are the group-normalised rewards, so the policy gradient points where GRPO's would."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    lengths = [(5, 6), (5, 9), (5, 4), (5, 7)]  # (prompt and user tokens, sampled tokens) per dialogue
    rows = [(torch.randint(0, 1000, (p + a,)).tolist(), [0] * p + [1] * a) for p, a in lengths]
    batch = train_ppo.pad_batch(rows, pad_id=0, device="cpu")
    mask, rewards = batch["action_mask"], torch.tensor([0.30, 0.35, 0.40, 0.30])
    on_last_action = [{p + a - 1: reward} for (p, a), reward in zip(lengths, rewards.tolist())]
    advantages, _ = masked_gae(place_rewards(mask, on_last_action), torch.zeros_like(mask), mask, 1.0, 1.0)
    advantages = train_ppo.whiten(advantages, mask)
    logprobs, _ = train_ppo.token_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, 1.0)
    params = list(model.parameters())
    ppo = torch.autograd.grad(train_ppo.masked_mean(-advantages * logprobs, mask), params, retain_graph=True)
    token_weights = mask.sum(1)  # whitening weighs each dialogue by its number of sampled tokens
    mean = (rewards * token_weights).sum() / token_weights.sum()
    grpo_advantages = (rewards - mean)[:, None] * mask
    grpo = torch.autograd.grad(train_ppo.masked_mean(-grpo_advantages * logprobs, mask), params)
    flat = [torch.cat([g.flatten() for g in grads]) for grads in (ppo, grpo)]
    assert torch.nn.functional.cosine_similarity(flat[0], flat[1], dim=0) > 0.9999


def _rows_with_actions_at_different_places(seed=0):
    torch.manual_seed(seed)
    lengths = [(4, 3, 2, 3), (6, 2, 0, 0), (3, 5, 1, 2)]  # prompt, turn 1, user turn, turn 2 per row
    rows = []
    for prompt, first, user, second in lengths:
        ids = torch.randint(0, 1000, (prompt + first + user + second,)).tolist()
        rows.append((ids, [0] * prompt + [1] * first + [0] * user + [1] * second))
    return train_ppo.pad_batch(rows, pad_id=0, device="cpu")


def test_log_probs_at_actions_match_the_full_logits(tiny_model_dir):
    """Logits are computed only where some row has an action; an off-by-one there would score the
    wrong token, so compare against log_softmax over the full output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _rows_with_actions_at_different_places()
    ids, mask = batch["input_ids"], batch["action_mask"]
    logprobs, entropy = train_ppo.token_logprobs(model, ids, batch["attention_mask"], mask, 0.7, with_entropy=True)
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=ids, attention_mask=batch["attention_mask"]).logits / 0.7, dim=-1)
    expected = torch.zeros_like(mask)
    expected[:, 1:] = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected_entropy = torch.zeros_like(mask)
    expected_entropy[:, 1:] = -(full.exp() * full).sum(-1)[:, :-1]
    actions = mask > 0
    assert torch.allclose(logprobs[actions], expected[actions], atol=1e-5)
    assert torch.allclose(entropy[actions], expected_entropy[actions], atol=1e-4)
    assert logprobs.requires_grad


def _all_positions_at_once(model, batch, temperature: float):
    """Log-probs and entropies at the actions as scored before chunking: the model's own logits at
    every action position of the batch, all at once."""
    ids, mask = batch["input_ids"], batch["action_mask"]
    targets = mask.any(dim=0).nonzero().squeeze(-1)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], logits_to_keep=targets - 1).logits
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen, entropy = torch.zeros_like(mask), torch.zeros_like(mask)
    chosen[:, targets] = logprobs.gather(-1, ids[:, targets, None]).squeeze(-1)
    entropy[:, targets] = -(logprobs.exp() * logprobs).sum(-1)
    return chosen, entropy


def test_log_probs_scored_in_chunks_and_their_gradients_equal_those_of_all_positions_at_once(
        tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _rows_with_actions_at_different_places()
    mask = batch["action_mask"]
    assert int(mask.any(dim=0).sum()) == 8
    monkeypatch.setattr(train_ppo, "LOGPROB_CHUNK", 3)  # 8 action positions: chunks of 3, 3 and 2
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0))  # every position its own weight
    scored = []
    for score in (lambda: train_ppo.token_logprobs(model, batch["input_ids"], batch["attention_mask"], mask, 0.7,
                                                   with_entropy=True),
                  lambda: _all_positions_at_once(model, batch, 0.7)):
        model.zero_grad()
        logprobs, entropy = score()
        ((logprobs * weights + entropy * weights.flip(1)) * mask).sum().backward()
        scored.append((logprobs.detach() * mask, entropy.detach() * mask, [p.grad.clone() for p in model.parameters()]))
    (chunked_logprobs, chunked_entropy, chunked_grads), (logprobs, entropy, grads) = scored
    assert torch.allclose(chunked_logprobs, logprobs, atol=1e-5) and torch.allclose(chunked_entropy, entropy, atol=1e-5)
    for (name, _), chunked, whole in zip(model.named_parameters(), chunked_grads, grads):
        assert (chunked - whole).abs().max() < 1e-5 * whole.abs().max(), name  # fp32 sums in another order


def test_the_forward_pass_keeps_no_logits_for_the_backward_pass(tiny_model_dir):
    """Each chunk's logits are recomputed in the backward pass: the forward pass saves no tensor as
    wide as the vocabulary (all positions at once would save the log-softmax and its exp)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _rows_with_actions_at_different_places()
    saved = []

    def keep_shape(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda tensor: tensor):
        logprobs, _ = train_ppo.token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                               batch["action_mask"], 1.0, with_entropy=True)
    assert logprobs.requires_grad and saved  # the body's tensors, saved as usual
    assert [shape for shape in saved if shape[-1] == model.config.vocab_size] == []


@pytest.mark.parametrize("order, micro_batch_size", [([2, 0, 1], 3), ([1, 2, 0], 1), ([2, 0, 1], 2)])
def test_old_log_probs_and_values_are_those_of_plain_no_grad_passes(tiny_model_dir, order, micro_batch_size):
    """The first micro-batch's training pass doubles as its old pass; every row must still get exactly
    what a separate pass before the update gives, and the reused pass must be that micro-batch's."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(1)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    body = AutoModel.from_pretrained(tiny_model_dir)
    critic = train_ppo.Critic(body, body.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)  # non-zero values, so a mix-up of rows shows
    batch = _rows_with_actions_at_different_places()
    mask = batch["action_mask"]
    model = train_ppo.PolicyAndCritic(policy, critic)
    old_logprobs, old_values, first = train_ppo.old_logprobs_and_values(model, batch, order, 1.0, micro_batch_size)
    with torch.no_grad():
        plain_logprobs, _ = train_ppo.token_logprobs(policy, batch["input_ids"], batch["attention_mask"], mask, 1.0)
        plain_values = train_ppo.state_values(critic, batch["input_ids"], batch["attention_mask"]) * mask
    assert torch.allclose(old_logprobs * mask, plain_logprobs * mask, atol=1e-5)
    assert torch.allclose(old_values, plain_values, atol=1e-5)
    assert not old_logprobs.requires_grad and not old_values.requires_grad
    logprobs, _, values = first
    assert logprobs.requires_grad and values.requires_grad
    first_micro_batch = order[:micro_batch_size]
    rows_mask = mask[first_micro_batch]
    assert torch.allclose(logprobs.detach() * rows_mask, plain_logprobs[first_micro_batch] * rows_mask, atol=1e-5)


def critic_with_a_random_head(tiny_model_dir):
    """The tiny body under a random value head: values that differ from position to position, so a
    value read one position off shows."""
    from transformers import AutoModel

    torch.manual_seed(1)
    body = AutoModel.from_pretrained(tiny_model_dir)
    critic = train_ppo.Critic(body, body.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)
    torch.nn.init.normal_(critic.value_head.bias)
    return critic


def test_the_value_of_an_action_is_the_critics_output_at_the_position_before_it(tiny_model_dir):
    critic = critic_with_a_random_head(tiny_model_dir)
    batch = _rows_with_actions_at_different_places()
    with torch.no_grad():
        direct = critic(batch["input_ids"], batch["attention_mask"])
        values = train_ppo.state_values(critic, batch["input_ids"], batch["attention_mask"])
    assert not torch.allclose(direct[:, 1:], direct[:, :-1], atol=1e-3)  # neighbours differ: a shift would show
    assert torch.equal(values[:, 0], torch.zeros(3))  # position 0 follows no state
    assert torch.allclose(values[:, 1:], direct[:, :-1], atol=1e-6)


def test_old_values_are_the_critics_outputs_one_position_before_each_action_and_zero_elsewhere(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    critic = critic_with_a_random_head(tiny_model_dir)
    model = train_ppo.PolicyAndCritic(AutoModelForCausalLM.from_pretrained(tiny_model_dir), critic)
    batch = _rows_with_actions_at_different_places()
    mask = batch["action_mask"]
    # micro-batches of one row: row 2 is scored by the reused training pass, rows 0 and 1 without graphs
    _, old_values, _ = train_ppo.old_logprobs_and_values(model, batch, [2, 0, 1], 1.0, 1)
    with torch.no_grad():
        direct = critic(batch["input_ids"], batch["attention_mask"])
    expected = torch.zeros_like(mask)
    expected[:, 1:] = direct[:, :-1]
    assert torch.allclose(old_values, expected * mask, atol=1e-5)


def test_when_the_simulator_endpoint_dies_the_run_stops_after_saving_and_resumes(tiny_model_dir, tmp_path):
    """Step 0 is answered; from then on the endpoint answers 500 (past the client's retries), so every
    dialogue of step 1 loses its simulator: the run saves, stops with a clear error and resumes later."""
    from conftest import SIMULATOR_ANSWER, profile_row, run_against_simulator, write_jsonl

    profiles = write_jsonl(tmp_path / "profiles.jsonl", [profile_row(first_talk="My week was awful.")])
    output_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
               "--output_dir", str(output_dir), "--max_turns", "2", "--max_reply_tokens", "6",
               "--profiles", str(profiles), "--profiles_per_step", "1", "--dialogues_per_profile", "2",
               "--backend", "llm", "--simulator_model", "sim-model", "--save_steps", "10"]
    stopped = run_against_simulator(command, "--max_steps", "3", "--simulator_max_retries", "1",  # less back-off
                                    answered=8)  # 2 dialogues x 2 turns x 2 calls
    assert stopped.returncode != 0
    assert "stopped at step 1" in stopped.stderr and "the simulators of 2 of 2 dialogues failed" in stopped.stderr
    assert (output_dir / "checkpoint-1").is_dir()
    rows = [json.loads(line) for line in (output_dir / "transcripts.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 0]  # the failed step wrote nothing
    resumed = run_against_simulator(command, "--max_steps", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (output_dir / "transcripts.jsonl").read_text().splitlines()]
    assert collections.Counter(row["step"] for row in rows) == {0: 2, 1: 2}
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    # Step 1 as replayed: 2 dialogues x 2 turns x (analysis + message), no retry, tokens as the server counted.
    assert (metrics[1]["simulator/calls"], metrics[1]["simulator/retries"], metrics[1]["simulator/failed_calls"]) == (8, 0, 0)
    assert metrics[1]["simulator/completion_tokens"] == 8 * len(SIMULATOR_ANSWER.split()) and metrics[1]["simulator/prompt_tokens"] > 0


def test_a_run_killed_mid_step_resumes_without_losing_or_doubling_a_step(tiny_model_dir, tmp_path):
    from conftest import kill_when

    output_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
               "--output_dir", str(output_dir), "--max_turns", "2", "--max_reply_tokens", "6",
               "--profiles_per_step", "2", "--dialogues_per_profile", "2", "--save_steps", "2"]
    process = subprocess.Popen(command + ["--max_steps", "50"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = output_dir / "metrics.jsonl"
    kill_when(process, lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3)  # in step 3
    assert (output_dir / "checkpoint-2").is_dir() and not (output_dir / "checkpoint-4").exists()
    transcripts, metrics = run_ppo(tiny_model_dir, output_dir, "--max_steps", "5", "--save_steps", "2", "--resume")
    assert collections.Counter(row["step"] for row in transcripts) == {step: 4 for step in range(5)}
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]


def test_a_wrong_simulator_endpoint_fails_in_seconds_before_any_model_loads(tiny_model_dir, tmp_path):
    import time

    started = time.monotonic()
    finished = subprocess.run([sys.executable, str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
                               "--output_dir", str(tmp_path / "run"), "--backend", "llm", "--simulator_model", "m",
                               "--base_url", "http://127.0.0.1:9/v1"], capture_output=True, text=True, timeout=120)
    assert finished.returncode != 0 and "Traceback" not in finished.stderr
    assert finished.stderr.strip().splitlines()[-1].startswith("error: cannot reach the simulator endpoint http://127.0.0.1:9/v1")
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("argv, message", [
    (["--gamma", "1.5"], "--gamma 1.5: must be within 0-1"),
    (["--max_turns", "0"], "--max_turns 0: must be from 1 to 100"),
    (["--max_turns", "101"], "--max_turns 101: must be from 1 to 100"),  # each turn is played in step: hours
    (["--max_failed_share", "-0.1"], "--max_failed_share -0.1: must be within 0-1"),
    (["--simulator_timeout", "0"], "--simulator_timeout 0.0: must be above 0"),
    (["--learning_rate", "0", "--minibatch_size", "0"], "--learning_rate 0.0: must be above 0; --minibatch_size 0"),
    (["--minibatch_size", "4", "--micro_batch_size", "3"],
     "--micro_batch_size 3: must be at least 1 and divide --minibatch_size 4"),
    (["--policy_prompt", "nosuch", "--think"], "--policy_prompt nosuch: no prompts/<language>/nosuch_think.txt; the "
                                               "prompts with a think variant are general, policy, sentient"),
    (["--policy_prompt", "../policy"], "--policy_prompt ../policy: no prompts/<language>/../policy.txt"),
])
def test_impossible_option_values_are_refused_at_parsing_with_the_option_named(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        train_ppo.parse_arguments(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_micro_batches_are_whole_minibatches_unless_asked():
    assert train_ppo.parse_arguments(["--minibatch_size", "4"])[0].micro_batch_size == 4
    assert train_ppo.parse_arguments(["--minibatch_size", "4", "--micro_batch_size", "2"])[0].micro_batch_size == 2


def test_whitening_is_over_the_actions_only_to_mean_zero_and_unit_spread():
    """Advantages 1, 2, 3 on actions and 100 off them: mean 2, standard deviation sqrt(2/3) over the actions."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    whitened = train_ppo.whiten(torch.tensor([[1.0, 2.0, 100.0, 3.0]]), mask)
    spread = math.sqrt(2 / 3)
    assert whitened.tolist()[0] == pytest.approx([-1 / spread, 0.0, 0.0, 1 / spread], abs=1e-5)


def test_the_mean_over_no_actions_is_zero_not_nan():
    """A row with no actions (a dialogue the policy never spoke in) must not turn a loss into nan."""
    assert train_ppo.masked_mean(torch.tensor([[5.0, 7.0]]), torch.zeros(1, 2)).item() == 0.0


# --------------------------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------------------------

def test_ctrl_c_finishes_the_step_saves_it_marks_the_run_and_says_how_to_continue(tiny_model_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    import signal

    run = tmp_path / "run"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run), "--max_steps", "3",
            "--max_turns", "1", "--max_reply_tokens", "4", "--dialogues_per_profile", "2", "--minibatch_size", "2",
            "--save_steps", "10"]
    train = train_ppo.ppo_update

    def ctrl_c_then_train(*args):  # Ctrl-C in the middle of the step's update
        if args[-1] is not None:  # the step's first minibatch (it reuses the scoring pass)
            os.kill(os.getpid(), signal.SIGINT)
        return train(*args)

    monkeypatch.setattr(train_ppo, "ppo_update", ctrl_c_then_train)
    monkeypatch.setattr(sys, "argv", ["/somewhere/train_ppo.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        train_ppo.main(argv)
    assert stopped.value.code == 130
    said = capsys.readouterr().err
    assert "Ctrl-C: stopping once this step is done, with a checkpoint" in said
    assert (f"interrupted after step 0 (1 step trained): {run / 'checkpoint-1'} holds its state; continue with: python train_ppo.py "
            f"--model_name_or_path {tiny_model_dir}") in said and said.rstrip().endswith("--save_steps 10 --resume")
    assert json.loads((run / "rlver-run.json").read_text())["interrupted"] == [
        {"after_step": 0, "checkpoint": str(run / "checkpoint-1")}]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest's own again

    # A broken checkpoint-2 (a copy cut short) is passed over at resume; a Ctrl-C in step 1 must then save
    # checkpoint-2 afresh, not take the broken folder for its own save.
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "state.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        train_ppo.main(argv + ["--resume"])
    assert guards.checkpoint_problem(run / "checkpoint-2", train_ppo.CHECKPOINT_MEMBERS) is None
    assert json.loads((run / "rlver-run.json").read_text())["interrupted"][1] == {
        "after_step": 1, "checkpoint": str(run / "checkpoint-2")}
    monkeypatch.setattr(train_ppo, "ppo_update", train)
    train_ppo.main(argv + ["--resume"])
    steps = [json.loads(line)["step"] for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert steps == [0, 0, 1, 1, 2, 2]


def test_processes_launched_together_that_each_see_themselves_alone_are_refused(monkeypatch):
    """torchrun without GPUs and without ACCELERATE_USE_CPU: accelerate gives every process rank 0 of 1; each
    would train alone over the same files."""
    from types import SimpleNamespace

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(common.InputError, match=r"launched as 2 processes \(WORLD_SIZE\), but each sees itself alone: "
                                                r"without GPUs, set ACCELERATE_USE_CPU=1"):
        guards.check_process_count(SimpleNamespace(num_processes=1))
    guards.check_process_count(SimpleNamespace(num_processes=2))
    monkeypatch.delenv("WORLD_SIZE")
    guards.check_process_count(SimpleNamespace(num_processes=3))  # an MPI launch: no WORLD_SIZE to compare


@pytest.mark.parametrize("run_id, timeout, deadline", [
    (None, None, ""), ("1", None, "; the launcher kills the processes 30 s after its Ctrl-C"),
    ("1", "900", "; the launcher kills the processes 900 s after its Ctrl-C")])
def test_under_torchs_elastic_launcher_the_ctrl_c_notice_gives_its_deadline(run_id, timeout, deadline, monkeypatch,
                                                                             capsys):
    """torchrun and accelerate launch (several processes) pass a Ctrl-C on to the processes and kill them
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds later (30 unless set): a user with longer steps must learn it."""
    import signal

    for name, value in (("TORCHELASTIC_RUN_ID", run_id), ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", timeout)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    guards.StopRequest().handle(signal.SIGINT, None)
    said = capsys.readouterr().err.strip()
    assert said.startswith("Ctrl-C: stopping once this step is done, with a checkpoint (Ctrl-C again quits now, "
                           "without saving)")
    assert said.endswith(deadline + (": for longer steps, launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT set higher"
                                     if deadline else ")"))


@pytest.mark.parametrize("sent, status, said", [
    (["SIGINT", "SIGINT"], 130, ["Ctrl-C: stopping once this step is done", "Ctrl-C again: quitting now, without saving"]),
    (["SIGTERM"], 143, ["stopped by SIGTERM: nothing new saved; every checkpoint in --output_dir is whole: continue "
                        "with --resume (from the newest, or from step 0 before the first)\n"]),
])
def test_a_second_ctrl_c_or_a_sigterm_quits_at_once_without_saving(sent, status, said, tiny_model_dir, tmp_path):
    """The signals arrive while step 0 waits on a simulator that does not answer: no step ends, nothing saved.
    SIGTERM (a scheduler, or the launcher when another rank failed) does not wait for the step: with a rank
    gone, a checkpoint's collectives would wait forever."""
    import signal
    import time

    from fake_openai import FakeOpenAIServer

    def respond(body):
        prompt = body["messages"][-1]["content"]
        if "start the conversation" in prompt:
            return "I had a rough week."
        return {"hang": 60} if "CHANGE" in prompt else "Okay."

    run = tmp_path / "run"
    with FakeOpenAIServer(respond=respond) as server:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "train_ppo.py"), "--model_name_or_path", str(tiny_model_dir),
             "--output_dir", str(run), "--max_steps", "5", "--max_turns", "1", "--max_reply_tokens", "4",
             "--dialogues_per_profile", "2", "--minibatch_size", "2", "--backend", "llm", "--base_url", server.base_url,
             "--simulator_model", "sim-model", "--simulator_timeout", "90"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not any("CHANGE" in body["messages"][-1]["content"] for body in server.requests) and time.time() < deadline:
            time.sleep(0.2)
        for name in sent:
            process.send_signal(getattr(signal, name))
            time.sleep(0.5)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == status and all(line in stderr for line in said), stderr[-2000:]
    assert "Traceback" not in stderr and not list(run.glob("checkpoint-*"))



@pytest.mark.slow
def test_ctrl_c_reaching_one_rank_stops_both_after_the_same_step_with_one_whole_checkpoint(tiny_model_dir, tmp_path):
    """2 gloo ranks (torch.distributed.run, as accelerate launch starts them): the signal reaches rank 1 only, as
    on a node where Ctrl-C was pressed while the other node trains on. Both ranks must stop after the same step
    (a rank stopping alone would leave the other waiting forever at its next collective), save one checkpoint
    holding that step, and exit 130."""
    from conftest import ctrl_c_on_rank_1

    run = tmp_path / "run"
    said, last = ctrl_c_on_rank_1("train_ppo.py", run, "--model_name_or_path", str(tiny_model_dir), "--max_turns", "1",
                                 "--max_reply_tokens", "4", "--profiles_per_step", "1", "--dialogues_per_profile", "2",
                                 "--minibatch_size", "2")
    assert (f"interrupted after step {last} ({last + 1} step{'s' if last else ''} trained): "
            f"{run / f'checkpoint-{last + 1}'} holds its state; continue with: torchrun [its options, as before] "
            "train_ppo.py --output_dir ") in said
    assert [path.name for path in run.glob("checkpoint-*")] == [f"checkpoint-{last + 1}"]
    assert guards.checkpoint_problem(run / f"checkpoint-{last + 1}", train_ppo.CHECKPOINT_MEMBERS) is None
    assert json.loads((run / "rlver-run.json").read_text())["interrupted"] == [
        {"after_step": last, "checkpoint": str(run / f"checkpoint-{last + 1}")}]


@pytest.mark.parametrize("report_to, message", [
    ("nonsense", "--report_to nonsense: not a tracker accelerate knows; give one of none, all, "),
    ("all", "--report_to all: no tracker's package is installed"),
])
def test_a_tracker_accelerate_would_refuse_after_loading_or_silently_drop_is_refused_first(report_to, message,
                                                                                            monkeypatch):
    monkeypatch.setattr(preflight, "get_available_trackers", lambda: [])
    with pytest.raises(SystemExit) as stopped:
        preflight.check_tracker(report_to)
    assert str(stopped.value.code).startswith(message)
    preflight.check_tracker("none")


def test_a_run_folder_removed_while_training_stops_the_run_instead_of_making_a_new_one(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Writing on would make a folder holding only the later steps' rows, with no marker to resume from, and exit 0."""
    from conftest import remove_during_step_1

    run = tmp_path / "run"
    remove_during_step_1(monkeypatch, run)
    with pytest.raises(common.InputError, match=rf"^{run} was removed while this run wrote it: stopped without writing more"):
        train_ppo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(run), "--max_steps", "3",
                        "--max_turns", "1", "--max_reply_tokens", "4", "--dialogues_per_profile", "2",
                        "--minibatch_size", "2"])
    assert not run.exists()


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_other_in_one_line_instead_of_a_hang(tiny_model_dir, tmp_path):
    """Rank 1 killed mid-run (out of memory, a lost node): rank 0 must end at once in one line, not wait at a
    collective nor save half a checkpoint: its collective fails (gloo: at once; guards.lost_process), or the
    launcher's SIGTERM ends it first (guards.start_script), whichever comes first."""
    import signal

    from conftest import signal_rank_1

    run = tmp_path / "run"
    said, status = signal_rank_1("train_ppo.py", run, signal.SIGKILL, "--model_name_or_path", str(tiny_model_dir),
                                 "--max_turns", "1", "--max_reply_tokens", "4", "--profiles_per_step", "1",
                                 "--dialogues_per_profile", "2", "--minibatch_size", "2")
    rank_0 = [line for line in said.splitlines() if "[rank0]" in line]  # torch's prefix on a worker's output
    assert status != 0 and "Traceback" not in "\n".join(rank_0), said[-3000:]
    assert ("stopped by SIGTERM: nothing new saved; every checkpoint in --output_dir is whole: continue with "
            "--resume" in said or "error: a collective with the run's other processes failed" in said)
    assert not list(run.glob("checkpoint-*"))
