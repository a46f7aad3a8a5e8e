"""train_ppo.py against oracles written apart from it: plain Python loops from the equations (GAE, whitening,
the clipped losses, reward placement, explained variance), the networks' own full logits, and one update on a
whole minibatch against the same update in micro-batches. Every pair of options that could be mixed up (gamma
and lambda, the policy and value clip ranges, the two learning rates, minibatch and micro-batch sizes,
profiles per step and dialogues per profile) holds different values here, so reading the wrong one shows."""
import math
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import common
import guards
import train_ppo
from test_rollout_properties import byte_tokenizer  # noqa: F401 (a fixture)

# --------------------------------------------------------------------------------------------
# Random batches: rows of different lengths, actions with gaps (inserted user turns), padding
# --------------------------------------------------------------------------------------------

# float32-exact numbers, so the oracles (float64) and the code (float32) start from the same values
NUMBERS = st.floats(-2, 2, allow_nan=False, width=32)


@st.composite
def masked_rows(draw, min_actions: int = 0):
    """(action mask, values) as lists of rows: 1 to 4 rows, 2 to 10 positions, a mask with gaps."""
    rows, width = draw(st.integers(1, 4)), draw(st.integers(2, 10))
    mask = [[int(keep) for keep in draw(st.lists(st.booleans(), min_size=width, max_size=width))] for _ in range(rows)]
    values = [draw(st.lists(NUMBERS, min_size=width, max_size=width)) for _ in range(rows)]
    if sum(map(sum, mask)) < min_actions:
        mask[0][-min_actions:] = [1] * min_actions
    return mask, values


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float)


def actions_of(mask_row) -> list[int]:
    return [t for t, keep in enumerate(mask_row) if keep]


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------

def gae_by_hand(rewards, values, mask, gamma, lam):
    """Per row, its actions in order form the chain: delta_t = r_t + gamma * V_next - V_t and
    A_t = delta_t + gamma * lam * A_next, where next is the row's next action (across inserted tokens)
    and V and A after its last action are 0. Returns = A + V, on actions; 0 elsewhere."""
    advantages = [[0.0] * len(row) for row in mask]
    returns = [[0.0] * len(row) for row in mask]
    for r, row in enumerate(mask):
        next_value = next_advantage = 0.0
        for t in reversed(actions_of(row)):
            delta = rewards[r][t] + gamma * next_value - values[r][t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[r][t], returns[r][t] = next_advantage, next_advantage + values[r][t]
            next_value = values[r][t]
    return advantages, returns


def test_gae_discounts_the_bootstrap_by_gamma_and_the_trace_by_gamma_times_lambda():
    """One row of three actions with a user turn between the first two, gamma 0.9 and lambda 0.5: a swap
    of the two, or lambda in the bootstrap, changes every advantage but the last."""
    mask = [[0, 1, 0, 0, 1, 1]]
    values = [[7.0, 0.5, 7.0, 7.0, 0.25, -0.5]]  # the 7s sit on a prompt and user tokens: never read
    rewards = [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]
    advantages, _ = train_ppo.masked_gae(tensor(rewards), tensor(values), tensor(mask), gamma=0.9, gae_lambda=0.5)
    a5 = 1.0 - (-0.5)
    a4 = 0.9 * -0.5 - 0.25 + 0.45 * a5
    a1 = 0.9 * 0.25 - 0.5 + 0.45 * a4
    assert advantages[0].tolist() == pytest.approx([0, a1, 0, 0, a4, a5], abs=1e-6)


@given(masked_rows(), st.data(), st.floats(0, 1), st.floats(0, 1))
def test_gae_is_the_recursion_over_each_rows_actions(rows, data, gamma, lam):
    mask, values = rows
    rewards = [[data.draw(NUMBERS) if keep else 0.0 for keep in row] for row in mask]  # rewards sit on actions
    advantages, returns = train_ppo.masked_gae(tensor(rewards), tensor(values), tensor(mask), gamma, lam)
    want_advantages, want_returns = gae_by_hand(rewards, values, mask, gamma, lam)
    assert advantages.tolist() == [pytest.approx(row, abs=1e-5) for row in want_advantages]
    assert returns.tolist() == [pytest.approx(row, abs=1e-5) for row in want_returns]


# --------------------------------------------------------------------------------------------
# Means and whitening over actions
# --------------------------------------------------------------------------------------------

def mean_by_hand(values, mask, count=None):
    total = sum(v for row_v, row_m in zip(values, mask) for v, keep in zip(row_v, row_m) if keep)
    return total / (count if count is not None else max(sum(map(sum, mask)), 1))


def test_a_mean_over_actions_ignores_an_infinite_value_off_the_actions():
    values, mask = tensor([[math.inf, 1.0, 3.0], [-math.inf, math.nan, 5.0]]), tensor([[0, 1, 1], [0, 0, 1]])
    assert train_ppo.masked_mean(values, mask).item() == pytest.approx(3.0)
    assert train_ppo.step_mean(values, mask).item() == pytest.approx(3.0)


@given(masked_rows())
def test_masked_mean_is_the_mean_over_the_actions_of_every_row(rows):
    mask, values = rows
    assert train_ppo.masked_mean(tensor(values), tensor(mask)).item() == pytest.approx(mean_by_hand(values, mask),
                                                                                      abs=1e-5)
    assert train_ppo.step_mean(tensor(values), tensor(mask)).item() == pytest.approx(mean_by_hand(values, mask),
                                                                                    abs=1e-5)


@given(masked_rows(min_actions=1), st.integers(1, 5))
def test_masked_mean_with_a_count_divides_by_that_count_not_by_its_own_actions(rows, extra):
    """A micro-batch's share of its minibatch's mean: the minibatch holds `extra` more actions than it."""
    mask, values = rows
    count = sum(map(sum, mask)) + extra
    share = train_ppo.masked_mean(tensor(values), tensor(mask), count=torch.tensor(float(count)))
    assert share.item() == pytest.approx(mean_by_hand(values, mask, count), abs=1e-5)


def whiten_by_hand(values, mask):
    """(x - mean) / (std + 1e-8) on actions, 0 elsewhere; mean and (population) std over all rows' actions."""
    chosen = [v for row_v, row_m in zip(values, mask) for v, keep in zip(row_v, row_m) if keep]
    mean = sum(chosen) / len(chosen)
    std = math.sqrt(sum((v - mean) ** 2 for v in chosen) / len(chosen))
    return [[(v - mean) / (std + 1e-8) if keep else 0.0 for v, keep in zip(row_v, row_m)]
            for row_v, row_m in zip(values, mask)], std


def test_whitening_pools_rows_of_different_lengths_by_action_not_by_row():
    """Row 0 has three actions (1, 2, 3), row 1 one (7): the mean is 13 / 4, not the mean of row means."""
    mask = [[0, 1, 1, 0, 1], [0, 0, 0, 1, 0]]
    values = [[50.0, 1.0, 2.0, 50.0, 3.0], [50.0, 50.0, 50.0, 7.0, 50.0]]
    expected, _ = whiten_by_hand(values, mask)
    assert train_ppo.whiten(tensor(values), tensor(mask)).tolist() == [pytest.approx(row, abs=1e-5)
                                                                       for row in expected]


@given(masked_rows(min_actions=2))
def test_whitening_is_over_every_rows_actions_with_the_population_std(rows):
    mask, values = rows
    expected, std = whiten_by_hand(values, mask)
    if std < 1e-2:  # all actions nearly equal: the result is float32 rounding error over 1e-8
        return
    assert train_ppo.whiten(tensor(values), tensor(mask)).tolist() == [pytest.approx(row, abs=1e-4)
                                                                       for row in expected]


# --------------------------------------------------------------------------------------------
# Reward placement, with the KL penalty
# --------------------------------------------------------------------------------------------

def rewards_by_hand(mask, rewards_at, logprobs, ref_logprobs, kl_coef):
    rewards = [[0.0] * len(row) for row in mask]
    for r, placed in enumerate(rewards_at):
        for position, reward in placed.items():
            rewards[r][position] = reward
    for r, row in enumerate(mask):
        for t in actions_of(row):
            rewards[r][t] -= kl_coef * (logprobs[r][t] - ref_logprobs[r][t])
    return rewards


@given(masked_rows(min_actions=1), st.data(), st.sampled_from([0.0, 0.05, 0.3]))
def test_rewards_land_on_their_positions_and_the_kl_penalty_on_every_action(rows, data, kl_coef):
    mask, logprobs = rows
    ref_logprobs = [data.draw(st.lists(NUMBERS, min_size=len(row), max_size=len(row))) for row in mask]
    rewards_at = []
    for row in mask:  # a row without actions gets no reward (dialogue_rows puts them on sampled tokens)
        positions = data.draw(st.lists(st.sampled_from(actions_of(row)), max_size=3, unique=True)) \
            if any(row) else []
        rewards_at.append({position: data.draw(NUMBERS) for position in positions})
    rewards = train_ppo.place_rewards(tensor(mask), rewards_at, tensor(logprobs), tensor(ref_logprobs), kl_coef)
    expected = rewards_by_hand(mask, rewards_at, logprobs, ref_logprobs, kl_coef)
    assert rewards.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


# --------------------------------------------------------------------------------------------
# The losses
# --------------------------------------------------------------------------------------------

# The policy clip and the value clip far apart, so that reading one for the other changes the losses.
LOSS_ARGS = dict(clip_range=0.1, value_clip_range=0.35, entropy_coef=0.05)


def losses_by_hand(new_logprobs, entropy, new_values, batch, clip, value_clip, entropy_coef, count=None):
    """(objective, value loss, stats) from the PPO equations, one action at a time: per action
    ratio r = exp(logp - logp_old), policy term max(-A r, -A clip(r, 1 - clip, 1 + clip)), value term
    0.5 max((V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2); each a mean over actions
    (over `count` when given); objective = policy loss - entropy_coef x mean entropy."""
    policy, value, entropies, clipped = 0.0, 0.0, 0.0, 0
    mask = batch["action_mask"].tolist()
    old_logprobs, old_values, returns, advantages = (batch[key].tolist() for key in
                                                     ("old_logprobs", "old_values", "returns", "advantages"))
    for r, row in enumerate(mask):
        for t in actions_of(row):
            ratio = math.exp(new_logprobs[r][t] - old_logprobs[r][t])
            advantage = advantages[r][t]
            policy += max(-advantage * ratio, -advantage * min(max(ratio, 1 - clip), 1 + clip))
            moved = min(max(new_values[r][t] - old_values[r][t], -value_clip), value_clip)
            value += 0.5 * max((new_values[r][t] - returns[r][t]) ** 2, (old_values[r][t] + moved - returns[r][t]) ** 2)
            entropies += entropy[r][t]
            clipped += abs(ratio - 1) > clip
    count = count if count is not None else max(sum(map(sum, mask)), 1)
    stats = {"ppo/policy_loss": policy / count, "ppo/value_loss": value / count, "ppo/entropy": entropies / count,
             "ppo/clip_fraction": clipped / count}
    return stats["ppo/policy_loss"] - entropy_coef * stats["ppo/entropy"], stats["ppo/value_loss"], stats


@st.composite
def loss_inputs(draw):
    """(new log-probs, entropy, new values, batch) as lists: ratios within exp(+-0.375) of 1 and values moved by up to
    1 from the old ones, so that some actions are clipped and some are not."""
    mask, old_logprobs = draw(masked_rows(min_actions=1))
    shape = (len(mask), len(mask[0]))

    def grid(elements):
        return [draw(st.lists(elements, min_size=shape[1], max_size=shape[1])) for _ in range(shape[0])]

    moves, value_moves = grid(st.floats(-0.375, 0.375, width=32)), grid(st.floats(-1, 1, width=32))
    old_values, returns, advantages = grid(NUMBERS), grid(NUMBERS), grid(NUMBERS)
    entropy = grid(st.floats(0, 3, width=32))
    new_logprobs = tensor(old_logprobs) + tensor(moves)
    new_values = tensor(old_values) + tensor(value_moves)
    batch = {"action_mask": tensor(mask), "old_logprobs": tensor(old_logprobs), "old_values": tensor(old_values),
             "returns": tensor(returns), "advantages": tensor(advantages)}
    return new_logprobs, tensor(entropy), new_values, batch


def test_the_policy_clip_and_the_value_clip_are_separate_options():
    """Ratio 1.2 and a value moved by 0.2 towards its return: outside the policy clip (0.1) but inside the
    value clip (0.35), so the policy term is clipped at 1.1 and the value term is not clipped at all."""
    one = lambda value: torch.tensor([[float(value)]])  # noqa: E731
    batch = {"action_mask": one(1), "old_logprobs": one(0), "old_values": one(0), "returns": one(1),
             "advantages": one(1)}
    objective, value_loss, stats = train_ppo.ppo_losses(one(math.log(1.2)), one(0), one(0.2), batch,
                                                        train_ppo.PPOArguments(**LOSS_ARGS))
    assert objective.item() == pytest.approx(-1.1)  # max(-1.2, -1.1)
    assert value_loss.item() == pytest.approx(0.5 * 0.8 ** 2)
    assert stats["ppo/clip_fraction"] == 1.0


@given(loss_inputs(), st.sampled_from([None, 3]))
def test_ppo_losses_are_the_clipped_objectives_averaged_over_actions(inputs, extra_actions):
    new_logprobs, entropy, new_values, batch = inputs
    count = None if extra_actions is None else batch["action_mask"].sum().item() + extra_actions
    objective, value_loss, stats = train_ppo.ppo_losses(
        new_logprobs, entropy, new_values, batch, train_ppo.PPOArguments(**LOSS_ARGS),
        None if count is None else torch.tensor(count))
    want_objective, want_value_loss, want_stats = losses_by_hand(
        new_logprobs.tolist(), entropy.tolist(), new_values.tolist(), batch, LOSS_ARGS["clip_range"],
        LOSS_ARGS["value_clip_range"], LOSS_ARGS["entropy_coef"], count)
    assert objective.item() == pytest.approx(want_objective, abs=1e-5)
    assert value_loss.item() == pytest.approx(want_value_loss, abs=1e-5)
    assert stats == pytest.approx(want_stats, abs=1e-5)


# --------------------------------------------------------------------------------------------
# Value metrics
# --------------------------------------------------------------------------------------------

@given(masked_rows(min_actions=2), st.data())
def test_value_metrics_are_the_critics_mean_and_explained_variance_over_actions(rows, data):
    import numpy as np

    mask, values = rows
    returns = [data.draw(st.lists(NUMBERS, min_size=len(row), max_size=len(row))) for row in mask]
    on_actions = np.array(mask, dtype=bool)
    returns_there, values_there = np.array(returns)[on_actions], np.array(values)[on_actions]
    if returns_there.var() < 1e-2:
        return  # returns (nearly) all alike: the ratio is float32 rounding over a clamp
    metrics = train_ppo.value_metrics(tensor(returns), tensor(values), tensor(mask))
    assert metrics["ppo/value_mean"] == pytest.approx(values_there.mean(), abs=1e-5)
    explained = 1 - np.var(returns_there - values_there) / np.var(returns_there)
    assert metrics["ppo/explained_variance"] == pytest.approx(explained, rel=1e-3, abs=1e-4)


def test_explained_variance_of_returns_all_alike_is_a_number_not_nan():
    """Every return the same (a group of equal final emotions, a blank critic): the variance of the returns is 0.
    A critic that matches them explains them all (1); one that misses them is off by the miss over 1e-8."""
    mask = tensor([[0, 1, 1], [1, 1, 0]])
    returns = tensor([[9.0, 0.5, 0.5], [0.5, 0.5, -9.0]])  # the 9s sit off the actions
    assert train_ppo.value_metrics(returns, returns.clone(), mask)["ppo/explained_variance"] == 1.0
    missed = train_ppo.value_metrics(returns, tensor([[0, 0.5, 0.5], [0.5, 0.25, 0]]), mask)
    assert missed["ppo/explained_variance"] == pytest.approx(1 - (0.0625 * 3 / 16) / 1e-8, rel=1e-3)


# --------------------------------------------------------------------------------------------
# Updates on a tiny network: micro-batches, epochs, the options each step reads
# --------------------------------------------------------------------------------------------

VOCAB = 40


def tiny_networks(seed: int = 0) -> train_ppo.PolicyAndCritic:
    """A one-layer Llama policy and critic of width 16, built in memory (no files), the value head random
    so that values differ from position to position."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(seed)
    critic = train_ppo.Critic(LlamaModel(config), config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    return train_ppo.PolicyAndCritic(LlamaForCausalLM(config), critic)


# (prompt, first turn, user turn, second turn) per row: 5, 4, 3 and 8 actions, rows of different widths
ROW_SHAPES = [(3, 2, 2, 3), (2, 4, 0, 0), (4, 1, 3, 2), (2, 3, 1, 5)]


def batch_of(shapes=ROW_SHAPES, seed: int = 0) -> dict:
    """Padded rows of random tokens with their action masks, plus random old log-probs, old values, returns
    and advantages (an update's inputs, whatever produced them)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for prompt, first, user, second in shapes:
        ids = torch.randint(0, VOCAB, (prompt + first + user + second,), generator=generator).tolist()
        rows.append((ids, [0] * prompt + [1] * first + [0] * user + [1] * second))
    batch = train_ppo.pad_batch(rows, pad_id=0, device="cpu")
    batch.update({key: torch.randn(batch["action_mask"].shape, generator=generator) * batch["action_mask"]
                  for key in ("old_logprobs", "old_values", "returns", "advantages")})
    return batch


def scored_by_hand(model: train_ppo.PolicyAndCritic, batch: dict, temperature: float):
    """(log-probs, entropies, values) of every token from the networks' plain outputs: the policy's full logits
    at position t - 1, divided by the temperature, score token t; the critic's output at t - 1 values it."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model.policy(input_ids=ids, attention_mask=attention).logits / temperature, -1)
        critic_outputs = model.critic(ids, attention)
    chosen, entropy, values = (torch.zeros(ids.shape) for _ in range(3))
    chosen[:, 1:] = logprobs[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy[:, 1:] = -(logprobs.exp() * logprobs).sum(-1)[:, :-1]
    values[:, 1:] = critic_outputs[:, :-1]
    return chosen.tolist(), entropy.tolist(), values.tolist()


def stats_by_hand(model, minibatch: dict, args: train_ppo.PPOArguments) -> dict:
    """The stats an update on `minibatch` must report: the losses at the weights before its step."""
    logprobs, entropy, values = scored_by_hand(model, minibatch, args.temperature)
    return losses_by_hand(logprobs, entropy, values, minibatch, args.clip_range, args.value_clip_range,
                          args.entropy_coef)[2]


def test_rows_are_right_padded_with_attention_and_actions_off_on_the_padding():
    batch = train_ppo.pad_batch([([5, 6, 7], [0, 1, 1]), ([8, 9, 10, 11, 12], [0, 1, 0, 0, 1])], pad_id=3, device="cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["action_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 1]]
    assert batch["action_mask"].dtype == torch.float


def test_a_fresh_critic_values_every_state_at_zero():
    """The value head starts at zero (weight and bias): the first advantages are the returns themselves."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    critic = train_ppo.Critic(LlamaModel(config), config.hidden_size)
    batch = batch_of()
    assert torch.equal(critic(batch["input_ids"], batch["attention_mask"]), torch.zeros(batch["input_ids"].shape))


def test_the_reference_scores_the_actions_at_the_sampling_temperature():
    """With the policy itself as the reference, the KL penalty of an unchanged policy must be 0: both scored at
    the temperature the tokens were sampled at."""
    networks, batch = tiny_networks(), batch_of()
    reference = train_ppo.reference_logprobs(networks.policy, batch, 0.6)
    logprobs, _, _ = scored_by_hand(networks, batch, 0.6)
    mask = batch["action_mask"]
    assert torch.allclose(reference * mask, tensor(logprobs) * mask, atol=1e-5)
    assert not reference.requires_grad
    assert train_ppo.reference_logprobs(None, batch, 0.6) is None


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_an_update_in_micro_batches_is_the_update_on_the_whole_minibatch(accelerator, micro_batch_size):
    """Three rows of 5, 4 and 3 actions in a minibatch of up to 4: micro-batches of 1 (three of them) or 2 (2 rows,
    then 1) must accumulate the gradient of the minibatch's token-mean losses and step once. Plain SGD, so that
    the step shows the gradient's scale (Adam's first step is lr x its sign), and no clipping."""
    minibatch = train_ppo.select_rows(batch_of(), [0, 1, 2])
    whole, accumulated = tiny_networks(), tiny_networks()
    expected_stats = stats_by_hand(whole, minibatch, train_ppo.PPOArguments(**LOSS_ARGS, temperature=0.7))
    stats = []
    for networks, micro in ((whole, 4), (accumulated, micro_batch_size)):
        args = train_ppo.PPOArguments(**LOSS_ARGS, temperature=0.7, minibatch_size=4, micro_batch_size=micro,
                                      max_grad_norm=1e9)
        stats.append(train_ppo.ppo_update(accelerator, networks, torch.optim.SGD(networks.parameters(), lr=0.5),
                                          minibatch, args))
    assert stats[0] == pytest.approx(expected_stats, abs=1e-5)
    assert stats[1] == pytest.approx(expected_stats, abs=1e-5)
    before = tiny_networks()
    for (name, parameter), twin, start in zip(whole.named_parameters(), accumulated.parameters(), before.parameters()):
        assert (parameter.grad - twin.grad).abs().max() <= 1e-5 * parameter.grad.abs().max() + 1e-9, name
        assert torch.allclose(parameter, twin, atol=1e-6), name
    assert any(not torch.equal(parameter, start) for parameter, start in zip(whole.parameters(), before.parameters()))


def test_each_network_gets_its_own_learning_rate(accelerator):
    """One AdamW with a parameter group per network. Adam's first step moves each weight by its lr (times the
    sign of its gradient), so the largest change per network is that network's learning rate."""
    networks, before = tiny_networks(), tiny_networks()
    args = train_ppo.PPOArguments(**LOSS_ARGS, learning_rate=3e-3, critic_learning_rate=2e-4, max_grad_norm=1e9)
    optimizer = train_ppo.make_optimizer(networks, args)
    train_ppo.ppo_update(accelerator, networks, optimizer, batch_of(), args)
    for network, start, lr in ((networks.policy, before.policy, 3e-3), (networks.critic, before.critic, 2e-4)):
        moved = max((now - then).abs().max().item() for now, then in zip(network.parameters(), start.parameters()))
        assert moved == pytest.approx(lr, rel=0.05)


def test_gradients_are_clipped_to_max_grad_norm_per_network(accelerator):
    networks = tiny_networks()
    args = train_ppo.PPOArguments(**LOSS_ARGS, max_grad_norm=0.05)
    train_ppo.ppo_update(accelerator, networks, torch.optim.SGD(networks.parameters(), lr=0.0), batch_of(), args)
    for network in (networks.policy, networks.critic):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in network.parameters()]))
        assert norm.item() == pytest.approx(0.05, rel=1e-4)


def test_an_on_policy_update_at_a_temperature_scores_at_that_temperature(accelerator):
    """Old log-probs scored at temperature 0.6: an update at the same temperature sees ratio 1 everywhere (no
    clipping, the policy loss minus the mean advantage) and the entropy of the tempered distribution."""
    networks, batch = tiny_networks(), batch_of()
    args = train_ppo.PPOArguments(**LOSS_ARGS, temperature=0.6, minibatch_size=4, micro_batch_size=2)
    logprobs, entropy, values = scored_by_hand(networks, batch, 0.6)
    batch.update(old_logprobs=tensor(logprobs) * batch["action_mask"], old_values=tensor(values) * batch["action_mask"])
    stats = train_ppo.ppo_update(accelerator, networks, train_ppo.make_optimizer(networks, args), batch, args)
    assert stats["ppo/clip_fraction"] == 0.0
    assert stats["ppo/policy_loss"] == pytest.approx(-mean_by_hand(batch["advantages"].tolist(),
                                                                   batch["action_mask"].tolist()), abs=1e-5)
    assert stats["ppo/entropy"] == pytest.approx(mean_by_hand(entropy, batch["action_mask"].tolist()), abs=1e-5)


def recording_updates(monkeypatch, call_real: bool):
    """Replace ppo_update with one that records (rows of the batch it got, whether it got a first pass, the stats
    expected at the weights before it) and then runs the real one (or returns those stats)."""
    calls, real = [], train_ppo.ppo_update

    def update(accelerator, model, optimizer, minibatch, args, untrained_forward=None):
        expected = stats_by_hand(model, minibatch, args) if call_real else {}
        calls.append(SimpleNamespace(ids=minibatch["input_ids"].tolist(), reused=untrained_forward is not None,
                                     expected=expected))
        return real(accelerator, model, optimizer, minibatch, args, untrained_forward) if call_real else {"n": 1.0}

    monkeypatch.setattr(train_ppo, "ppo_update", update)
    return calls


def rows_in(calls, batch) -> list[list[int]]:
    every = batch["input_ids"].tolist()
    return [[every.index(ids) for ids in call.ids] for call in calls]


def test_a_second_epoch_trains_the_policy_the_first_epoch_updated(accelerator, monkeypatch):
    """ppo_epochs 2, one minibatch per epoch in micro-batches of 2, as main runs them: epoch 1 trains on-policy
    (ratio 1, through the pass that scored the old log-probs), epoch 2 on the updated policy, its rows in its own
    order, its ratios off 1 and clipped. Every update reports the losses of the weights it started from."""
    networks, batch = tiny_networks(), batch_of()
    args = train_ppo.PPOArguments(**LOSS_ARGS, temperature=0.7, ppo_epochs=2, minibatch_size=4, micro_batch_size=2,
                                  learning_rate=0.05, critic_learning_rate=0.01)
    orders = [[2, 0, 3, 1], [1, 3, 0, 2]]
    old_logprobs, old_values, untrained_forward = train_ppo.old_logprobs_and_values(networks, batch, orders[0],
                                                                             args.temperature, args.micro_batch_size)
    batch.update(old_logprobs=old_logprobs, old_values=old_values)
    calls = recording_updates(monkeypatch, call_real=True)
    optimizer = train_ppo.make_optimizer(networks, args)
    stats = [train_ppo.ppo_update(accelerator, networks, optimizer, train_ppo.select_rows(batch, order), args,
                                  untrained_forward if epoch == 0 else None) for epoch, order in enumerate(orders)]
    assert rows_in(calls, batch) == orders
    for got, call in zip(stats, calls):
        assert got == pytest.approx(call.expected, abs=1e-5)
    assert stats[0]["ppo/clip_fraction"] == 0.0
    assert stats[1]["ppo/clip_fraction"] > 0.2  # the first epoch's step moved the policy past the clip


def test_an_epoch_shares_its_rows_out_into_minibatches_larger_first_in_its_order():
    """10 rows in 2 minibatches of micro-batches of 2: 6 rows and 4 (5 micro-batches shared 3 and 2), in the
    epoch's order; a minibatch count of 1 takes the epoch whole."""
    order = [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]
    assert train_ppo.minibatch_rows(order, 2, 2) == [order[:6], order[6:]]
    assert train_ppo.minibatch_rows([4, 3, 2, 1, 0], 1, 3) == [[4, 3, 2, 1, 0]]


def test_three_minibatches_take_their_shares_in_order_larger_first():
    """7 rows in 3 minibatches of micro-batches of 1: 3, 2 and 2 rows. With two minibatches a share counted from
    the end (5 micro-batches: the last 2) is the same as one counted from the start (after the first 3); with
    three it is not. A rank with fewer rows than the ranks' minibatches gets empty ones (ppo_update pads them)."""
    assert train_ppo.minibatch_rows([6, 2, 5, 0, 3, 1, 4], 3, 1) == [[6, 2, 5], [0, 3], [1, 4]]
    assert train_ppo.minibatch_rows([1, 0], 3, 1) == [[1], [0], []]


@pytest.mark.slow
def test_main_trains_every_epoch_on_every_row_in_minibatches_reusing_only_the_very_first_pass(tiny_model_dir,
                                                                                             tmp_path, monkeypatch):
    """4 rows, 2 epochs, minibatches of at most 3 rows: two updates an epoch (the fewest that hold 4 rows), of 2 rows
    each, each epoch on all 4 rows; only the first update of the first epoch gets the forward pass made while
    scoring the old log-probs."""
    calls = recording_updates(monkeypatch, call_real=False)
    train_ppo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"),
                    "--max_steps", "1", "--max_turns", "1", "--max_reply_tokens", "4", "--profiles_per_step", "2",
                    "--dialogues_per_profile", "2", "--ppo_epochs", "2", "--minibatch_size", "3",
                    "--micro_batch_size", "1"])
    assert [len(call.ids) for call in calls] == [2, 2, 2, 2]
    assert [call.reused for call in calls] == [True, False, False, False]
    assert sorted(calls[0].ids + calls[1].ids) == sorted(calls[2].ids + calls[3].ids)


# --------------------------------------------------------------------------------------------
# Options read where they belong
# --------------------------------------------------------------------------------------------

def test_lora_takes_its_rank_and_alpha_from_their_own_options():
    networks = tiny_networks()
    adapted = train_ppo.trainable(networks.policy, train_ppo.PPOArguments(lora_r=4, lora_alpha=12))
    config = adapted.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 12, 0.0)
    plain = tiny_networks().policy
    assert train_ppo.trainable(plain, train_ppo.PPOArguments(use_peft=False)) is plain


def test_the_optimizer_has_the_policys_group_at_its_lr_and_the_critics_at_its_own():
    networks = tiny_networks()
    optimizer = train_ppo.make_optimizer(networks, train_ppo.PPOArguments(learning_rate=3e-3, critic_learning_rate=2e-4))
    groups = [(group["lr"], {id(p) for p in group["params"]}) for group in optimizer.param_groups]
    assert groups == [(3e-3, {id(p) for p in networks.policy.parameters()}),
                      (2e-4, {id(p) for p in networks.critic.parameters()})]


def test_each_step_takes_the_next_profiles_of_shuffled_passes_each_rank_its_own():
    """5 profiles, 2 per step on each of 2 ranks (dialogues_per_profile 3, which must not count): 20 profiles
    over five steps, which make four passes over all profiles, no profile twice within a pass."""
    profiles = ["a", "b", "c", "d", "e"]
    args = train_ppo.PPOArguments(profiles_per_step=2, dialogues_per_profile=3, seed=7)
    ranks = [SimpleNamespace(num_processes=2, process_index=rank) for rank in (0, 1)]
    played = []
    for step in range(5):
        for rank in ranks:
            chosen = train_ppo.step_profiles(profiles, args, step, rank)
            assert len(chosen) == 2
            played += chosen
    assert [sorted(played[start:start + 5]) for start in range(0, 20, 5)] == [profiles] * 4
    assert played[:5] != profiles  # shuffled (seed 7)


def test_the_sampling_temperature_is_the_options(tmp_path):
    """The rollout samples at --temperature, the temperature the log-probs are scored at (a tokenizer stand-in
    with no generation config in its folder)."""
    import rollout

    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=None, name_or_path=str(tmp_path))
    generate = train_ppo.policy_generator(None, tiny_networks().policy, tokenizer,
                                          train_ppo.PPOArguments(temperature=0.65), rollout.DialogueArguments(), 0)
    config = generate.generation_config
    assert (config.temperature, config.do_sample, config.top_k, config.top_p) == (0.65, True, 0, 1.0)
    assert config.pad_token_id == 2  # no pad token: the end token pads


# --------------------------------------------------------------------------------------------
# End to end: a second epoch and the step's dialogue counts
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_plays_dialogues_per_profile_of_each_profile_and_trains_a_second_epoch(tiny_model_dir, tmp_path):
    """One profile per step played three times; two epochs at a high learning rate and a tight clip: the first
    epoch is on-policy (clip fraction 0), so a logged (mean) clip fraction above 0 is the second epoch's."""
    from test_train_ppo import run_ppo

    transcripts, [metrics] = run_ppo(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--profiles_per_step", "1",
                                     "--dialogues_per_profile", "3", "--ppo_epochs", "2", "--minibatch_size", "3",
                                     "--learning_rate", "0.05", "--clip_range", "0.01", "--value_clip_range", "0.5")
    assert len(transcripts) == 3 and len({row["id"] for row in transcripts}) == 1
    assert metrics["ppo/clip_fraction"] > 0


def whole_checkpoint(folder):
    """A PPO checkpoint's members, whole (tiny)."""
    (folder / "policy").mkdir(parents=True)
    (folder / "policy" / "adapter_config.json").write_text("{}")
    for name in ("state.pt", "critic.pt"):
        torch.save({"step": 1}, folder / name)
    return folder


def newest(output_dir):
    said = []
    return guards.newest_whole_checkpoint(output_dir, train_ppo.CHECKPOINT_MEMBERS, said.append), said


def test_the_newest_checkpoint_is_the_highest_step_not_the_last_name(tmp_path):
    assert newest(tmp_path) == (None, [])
    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-2", "checkpoint-11.partial", "checkpoint-x"):
        whole_checkpoint(tmp_path / name)
    assert newest(tmp_path) == (tmp_path / "checkpoint-10", [])


@pytest.mark.parametrize("damage, problem", [
    (lambda folder: (folder / "state.pt").write_bytes((folder / "state.pt").read_bytes()[:-40]),
     "state.pt is cut short or not a torch file"),
    (lambda folder: (folder / "critic.pt").write_bytes(b""), "critic.pt is empty"),
    (lambda folder: shutil.rmtree(folder / "policy"), "no policy"),
    (lambda folder: (folder / "policy" / "adapter_config.json").write_text("{"), "adapter_config.json does not read"),
])
def test_a_broken_newest_checkpoint_is_named_and_passed_over_for_the_one_before(tmp_path, damage, problem):
    whole_checkpoint(tmp_path / "checkpoint-5")
    damage(whole_checkpoint(tmp_path / "checkpoint-10"))
    found, said = newest(tmp_path)
    assert found == tmp_path / "checkpoint-5"
    assert len(said) == 1 and said[0].startswith(f"{tmp_path / 'checkpoint-10'}: ") and problem in said[0]
    damage(tmp_path / "checkpoint-5")
    with pytest.raises(common.InputError, match="no checkpoint of .* can be resumed from .*checkpoint-10: .*"
                                                "checkpoint-5: .*move them aside to start the run over"):
        newest(tmp_path)  # every checkpoint broken: not a restart at step 0 that drops every trained step


def test_ranks_share_python_and_numpy_seeds_but_sample_with_their_own_torch_seed():
    import numpy as np

    draws = []
    for rank in (0, 1, 0):
        train_ppo.seed_everything(7, rank)
        draws.append((random.random(), float(np.random.rand()), torch.rand(1).item()))
    assert draws[0] == draws[2]  # the same seed and rank: the same draws
    assert draws[0][:2] == draws[1][:2] and draws[0][2] != draws[1][2]


@pytest.mark.parametrize("processes, index, transcripts", [(1, 0, "transcripts.jsonl"), (2, 0, "transcripts.rank0.jsonl"),
                                                           (2, 1, "transcripts.rank1.jsonl")])
def test_each_rank_of_several_writes_its_own_transcripts_and_all_share_one_metrics_file(tmp_path, processes, index,
                                                                                       transcripts):
    accelerator = SimpleNamespace(num_processes=processes, process_index=index, is_main_process=index == 0)
    assert train_ppo.run_files(tmp_path, accelerator) == (tmp_path / transcripts, tmp_path / "metrics.jsonl")


def test_per_turn_rows_keep_earlier_replies_but_not_earlier_thoughts(byte_tokenizer):
    """Two think turns: the second row's context is the prompt, the first turn's reply and the user's answer; the
    first thought, and its <think> tags, are not in it; each row's actions are its own turn's sampled tokens."""
    from test_rollout_properties import END, play

    from rollout import DialogueArguments

    args = DialogueArguments(think=True, max_turns=2, max_think_tokens=20, max_reply_tokens=30,
                             max_dialogue_tokens=100_000)
    [dialogue], _ = play(byte_tokenizer, args, {"OPENING": ["she is hurt</think>", "I hear you, Dana hurt you." + END,
                                                            "ask more</think>", "Go on." + END]})
    first, second = train_ppo.per_turn_rows(dialogue)
    assert second[0][:len(dialogue.prompt_ids)] == dialogue.prompt_ids  # the prompt holds the worked examples
    text = byte_tokenizer.decode(second[0][len(dialogue.prompt_ids):])
    assert "I hear you, Dana hurt you." in text and "she is hurt" not in text and text.count("<think>") == 1
    assert byte_tokenizer.decode([t for t, m in zip(second[0], second[1]) if m]) == "ask more</think>Go on.<|im_end|>"
    assert byte_tokenizer.decode([t for t, m in zip(first[0], first[1]) if m]) == \
        "she is hurt</think>I hear you, Dana hurt you.<|im_end|>"


@pytest.mark.parametrize("step, existing, saved", [(0, False, False), (3, False, True), (3, True, False)])
def test_too_many_lost_dialogues_stop_the_run_saving_the_state_before_the_step_once(tmp_path, monkeypatch, step,
                                                                                      existing, saved):
    """Step 0's state is the base model (nothing to save); a later step's is saved unless its folder exists."""
    calls = []
    monkeypatch.setattr(train_ppo, "save_checkpoint", lambda folder, *rest: calls.append(folder))
    if existing:
        (tmp_path / f"checkpoint-{step}").mkdir()
    lost = [SimpleNamespace(failure="HTTP 500"), SimpleNamespace(failure=None)]
    with pytest.raises(SystemExit) as stopped:
        train_ppo.stop_if_simulators_failed(lost, step, SimpleNamespace(max_failed_share=0.25), tmp_path, None, None,
                                            None, SimpleNamespace(num_processes=1))
    assert calls == ([tmp_path / f"checkpoint-{step}"] if saved else [])
    said = "holds the state before it; continue with --resume" if step else "nothing to save yet"
    assert str(stopped.value).startswith(f"stopped at step {step} (") and said in str(stopped.value)
    assert "the simulators of 1 of 2 dialogues failed" in str(stopped.value)


def test_a_share_of_lost_dialogues_within_the_bound_goes_on(tmp_path):
    lost = [SimpleNamespace(failure="HTTP 500")] + [SimpleNamespace(failure=None)] * 3
    train_ppo.stop_if_simulators_failed(lost, 3, SimpleNamespace(max_failed_share=0.25), tmp_path, None, None, None,
                                        SimpleNamespace(num_processes=1))
    assert not (tmp_path / "checkpoint-3").exists()


def test_an_update_descends_both_losses_each_network_its_own(accelerator):
    """Policy and critic share no weights, so a small step down the gradient of policy loss + value loss lowers
    each: a sign lost anywhere on the way to backward (the critic climbing its loss) shows here."""
    networks, batch = tiny_networks(), batch_of()
    args = train_ppo.PPOArguments(**{**LOSS_ARGS, "entropy_coef": 0.0}, temperature=0.7, max_grad_norm=1e9)
    batch["old_logprobs"] = tensor(scored_by_hand(networks, batch, 0.7)[0]) * batch["action_mask"]  # no clipping
    before = stats_by_hand(networks, batch, args)
    train_ppo.ppo_update(accelerator, networks, torch.optim.SGD(networks.parameters(), lr=1e-3), batch, args)
    after = stats_by_hand(networks, batch, args)
    assert after["ppo/policy_loss"] < before["ppo/policy_loss"] - 1e-3
    assert after["ppo/value_loss"] < before["ppo/value_loss"] - 1e-3


def test_a_save_replaces_a_broken_checkpoint_and_a_killed_saves_leftovers(tmp_path, accelerator, byte_tokenizer):
    """Resumed from checkpoint-1 past a broken checkpoint-2 (passed over), the run saves checkpoint-2 again:
    the broken folder and a half-written .partial of an earlier save make way for a whole one."""
    networks = tiny_networks()
    optimizer = torch.optim.SGD(networks.parameters(), lr=0.1)
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "state.pt").write_bytes(b"cut")
    (tmp_path / "checkpoint-2.partial" / "policy").mkdir(parents=True)
    (tmp_path / "checkpoint-2.partial" / "stale.bin").write_bytes(b"x")
    train_ppo.save_checkpoint(tmp_path / "checkpoint-2", 2, networks, optimizer, byte_tokenizer, accelerator)
    assert guards.checkpoint_problem(tmp_path / "checkpoint-2", train_ppo.CHECKPOINT_MEMBERS) is None
    assert not (tmp_path / "checkpoint-2.partial").exists() and not (tmp_path / "checkpoint-2" / "stale.bin").exists()
    assert torch.load(tmp_path / "checkpoint-2" / "state.pt", weights_only=False)["step"] == 2
