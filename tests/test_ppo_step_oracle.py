"""train_ppo.main's step, checked against a second computation written from the paper's equations.

The unit tests check each helper (GAE, the losses, reward placement) on its own; this checks the wiring of
main, where a wrong option read or two arguments swapped pass every helper's test: a whole run with every
option that main hands on given a distinct value, the batch that reaches the PPO epochs recomputed by hand
from the models and the dialogues of that step.
"""
import json
import math

import pytest
import torch

import train_ppo

OPTIONS = dict(gamma=0.9, lam=0.7, kl_coef=0.05, temperature=0.8, format_penalty=0.3, ppo_epochs=2, minibatch_size=2,
               micro_batch_size=1, critic_learning_rate=0.05, learning_rate=0.01, max_steps=3, save_steps=2)


def logprobs_by_hand(model, input_ids, attention_mask, temperature):
    """log softmax(logits / T) of each token, read at the position before it (0 at position 0)."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    taken = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(taken[:, :1]), taken], dim=1)


def gae_by_hand(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list, list]:
    """GAE over one row's actions in order (the value after the last is 0): (advantages, returns)."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.slow
def test_the_batch_each_step_trains_on_is_the_papers_computation_from_its_dialogues(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    played, checked, value_sizes, batches, orders = [], [], [], [], []
    stop_if_failed, pad, split, train = (train_ppo.stop_if_simulators_failed, train_ppo.pad_batch,
                                         train_ppo.minibatch_rows, train_ppo.ppo_update)

    def keep_dialogues(dialogues, *rest):
        played.append(dialogues)
        return stop_if_failed(dialogues, *rest)

    def keep_batch(*given):  # the step's batch, which the step fills in (old log-probs, ..., advantages)
        batches.append(pad(*given))
        return batches[-1]

    def keep_order(order, *rest):
        orders.append(order)
        return split(order, *rest)

    def check_then_train(accelerator, model, optimizer, minibatch, args, untrained_forward=None):
        if untrained_forward is None:  # not the step's first update: checked already
            return train(accelerator, model, optimizer, minibatch, args, untrained_forward)
        dialogues, batch = played[-1], batches[-1]
        networks = accelerator.unwrap_model(model)
        ids, attention, actions = batch["input_ids"], batch["attention_mask"], batch["action_mask"]
        for row, dialogue in enumerate(dialogues):  # one row a dialogue, in order, right-padded
            length = len(dialogue.prompt_ids) + len(dialogue.completion_ids)
            assert ids[row, :length].tolist() == dialogue.prompt_ids + dialogue.completion_ids
            assert attention[row].tolist() == [1] * length + [0] * (ids.shape[1] - length)
            assert actions[row, :length].tolist() == [0] * len(dialogue.prompt_ids) + dialogue.env_mask
        with torch.no_grad():
            policy = logprobs_by_hand(networks.policy, ids, attention, OPTIONS["temperature"])
            base = logprobs_by_hand(reference, ids, attention, OPTIONS["temperature"])
            critic = networks.critic(ids, attention)
        value_sizes.append(batch["old_values"].abs().max().item())
        for row, dialogue in enumerate(dialogues):
            positions = actions[row].nonzero()[:, 0].tolist()
            logp = [policy[row, p].item() for p in positions]
            values = [critic[row, p - 1].item() for p in positions]  # the state before the action
            assert batch["old_logprobs"][row, positions].tolist() == pytest.approx(logp, abs=1e-4)
            assert batch["old_values"][row, positions].tolist() == pytest.approx(values, abs=1e-4)
            final = (dialogue.final_emotion / 100
                     - OPTIONS["format_penalty"] * dialogue.format_violations / len(dialogue.reply_texts))
            rewards = [-OPTIONS["kl_coef"] * (lp - base[row, p].item()) for lp, p in zip(logp, positions)]
            rewards[-1] += final
            advantages, returns = gae_by_hand(rewards, values, OPTIONS["gamma"], OPTIONS["lam"])
            assert batch["returns"][row, positions].tolist() == pytest.approx(returns, abs=1e-4)
            checked.append(advantages)
        pooled = [a for advantages in checked[-len(dialogues):] for a in advantages]
        mean = sum(pooled) / len(pooled)
        std = math.sqrt(sum((a - mean) ** 2 for a in pooled) / len(pooled))
        whitened = [(a - mean) / (std + 1e-8) for a in pooled]
        assert batch["advantages"][actions > 0].tolist() == pytest.approx(whitened, abs=1e-3)
        assert batch["advantages"][actions == 0].abs().sum() == 0
        return train(accelerator, model, optimizer, minibatch, args, untrained_forward)

    monkeypatch.setattr(train_ppo, "stop_if_simulators_failed", keep_dialogues)
    monkeypatch.setattr(train_ppo, "pad_batch", keep_batch)
    monkeypatch.setattr(train_ppo, "minibatch_rows", keep_order)
    monkeypatch.setattr(train_ppo, "ppo_update", check_then_train)
    flags = [part for name, value in OPTIONS.items() for part in (f"--{name}", str(value))]
    train_ppo.main(["--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"), "--think",
                    "--max_turns", "2", "--max_think_tokens", "4", "--max_reply_tokens", "6",
                    "--profiles_per_step", "2", "--dialogues_per_profile", "2", *flags])

    assert len(played) == OPTIONS["max_steps"] and len(checked) == 4 * OPTIONS["max_steps"]
    assert len(orders) == OPTIONS["ppo_epochs"] * OPTIONS["max_steps"]  # each epoch in an order of its own
    assert all(sorted(order) == list(range(4)) for order in orders)
    # A blank critic values every state at 0 (step 0); at 0.05 it learned, so that gamma and lambda, which a
    # blank critic only shows as their product, each showed in the later steps.
    assert value_sizes[0] == 0 and min(value_sizes[1:]) > 0.01
    assert sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    violations = sum(d.format_violations for step in played for d in step)
    assert violations > 0  # so that the format penalty showed in the rewards
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for step, (row, dialogues) in enumerate(zip(metrics, played, strict=True)):
        finals = [d.final_emotion / 100 - OPTIONS["format_penalty"] * d.format_violations / len(d.reply_texts)
                  for d in dialogues]
        assert row["step"] == step and row["reward"] == pytest.approx(sum(finals) / len(finals))
