"""PPO against a simulated user: our own readable loop on Accelerate (TRL >= 1.13 has no PPOTrainer).

    accelerate launch train_ppo.py            # offline demo, reply only (2 CPU cores)
    accelerate launch train_ppo.py --think    # offline demo, think then reply
    accelerate launch --config_file accelerate_configs/zero2.yaml train_ppo.py --config recipes/ppo_qwen2.5-7b_think.yaml

One step:
1. Rollout. `rollout.py` plays `profiles_per_step x dialogues_per_profile` dialogues (each group
   shares a profile and its opening line). A row is one whole dialogue: prompt + completion, with
   `env_mask` = 1 on the tokens the policy sampled (its actions) and 0 on everything inserted.
2. Old log-probs (policy) and values (critic) at every action, computed once from the batch. The
   value of an action is the critic's estimate at the state just before it was sampled. The first
   minibatch's pass doubles as its training pass (nothing has changed yet), so the demo, with one
   minibatch per batch, makes one forward pass per network per step.
3. Reward: final emotion / 100 (minus the optional format penalty), placed on the last token the
   policy sampled; with kl_coef > 0, minus kl_coef * (logp - ref_logp) on every action (a frozen
   reference is loaded only then; the paper used none).
4. GAE over the policy's actions only: the actions of a dialogue, in order, form one chain.
   Inserted tokens (user turns) are not actions: they get no advantage, and the bootstrap runs from
   the last action of one turn to the first action of the next across them. gamma = lambda = 1.
   Advantages are whitened over the actions of the batch.
5. `ppo_epochs` passes over shuffled minibatches of dialogues: clipped policy loss, entropy bonus,
   clipped value loss, each network with its own optimizer and gradient clipping.

Simplifications, on purpose: losses are means over action tokens of the minibatch (token-mean);
the critic is a separate network (initialised from the policy, or from `critic_model_name_or_path`)
with a zero-initialised linear value head. By default one dialogue is one row (the policy keeps
its earlier thoughts, as in train_grpo.py); `--per_turn_rows` trains the paper's layout instead,
each policy turn a row whose context drops earlier thoughts, all rows sharing the dialogue's
reward. Logged metrics and transcripts are those of train_grpo.py, plus ppo/* losses.
"""
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser

import rollout
import simulator


@dataclass
class PPOArguments:
    """PPO settings. Defaults: the offline demo; paper values (DESIGN.md section 5) in the help."""

    config: str | None = field(default=None, metadata={"help": "YAML file of these options (CLI flags override it)"})
    output_dir: str = field(default="runs/ppo-demo", metadata={"help": "checkpoints, transcripts, metrics"})
    model_name_or_path: str = field(default=simulator.PACKAGED_MODEL, metadata={"help": "policy (paper: Qwen2.5-7B-Instruct)"})
    critic_model_name_or_path: str | None = field(default=None, metadata={"help": "critic body; default: the policy's"})
    use_peft: bool = field(default=True, metadata={"help": "LoRA on policy and critic (paper: full fine-tune)"})
    lora_r: int = 16
    lora_alpha: int = 32
    learning_rate: float = field(default=1e-3, metadata={"help": "policy lr (paper: 1e-6; LoRA demo: 1e-3)"})
    # The paper's critic lr, also in the demo: a faster critic is noise there. Its value head on 576
    # hidden units moved values by ~0.3 per step at 1e-3 and ~0.015 at 3e-5, varying from token to
    # token by more than the rewards of one profile's dialogues differ (explained variance -0.6 to
    # -2.6), and the advantages carried that noise. In 30 steps it cannot learn which profile is easy.
    critic_learning_rate: float = field(default=5e-6, metadata={"help": "critic lr (paper: 5e-6)"})
    # One profile per step: in 30 steps the critic cannot learn which profiles are easy, so the batch
    # whitening is the baseline, and with one profile it compares dialogues of the same user, as GRPO does.
    profiles_per_step: int = field(default=1, metadata={"help": "profiles per step"})
    dialogues_per_profile: int = field(default=8, metadata={"help": "dialogues per profile (1 x 8 = 8 per step; paper: 32 x 1)"})
    max_steps: int = field(default=30, metadata={"help": "PPO steps (paper: 1000)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each batch (paper: 1)"})
    # Demo: one update per batch, as the GRPO demo makes. Two updates on halves (4 rows each) stayed
    # flat (35.2 +- 0.6 -> 34.2 +- 1.4 over 30 steps); one update gave +1.1 +- 1.3, and +5.0 +- 1.1
    # with --seed 1 (README).
    minibatch_size: int = field(default=8, metadata={"help": "rows per optimizer step (demo: the whole batch)"})
    gamma: float = field(default=1.0, metadata={"help": "discount (paper: 1)"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda (paper: 1)"})
    clip_range: float = field(default=0.2, metadata={"help": "policy ratio clip (paper: 0.2)"})
    value_clip_range: float = field(default=0.2, metadata={"help": "value clip"})
    entropy_coef: float = field(default=0.001, metadata={"help": "entropy bonus (paper: 0.001)"})
    kl_coef: float = field(default=0.0, metadata={"help": "per-token KL to a frozen reference (paper: 0, none loaded)"})
    max_grad_norm: float = 1.0
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (paper: 1.0)"})
    seed: int = 42
    save_steps: int = field(default=10, metadata={"help": "checkpoint every N steps"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in output_dir"})
    report_to: str = field(default="none", metadata={"help": "none, tensorboard, wandb or trackio"})
    use_vllm: bool = field(default=False, metadata={
        "help": "generate with `trl vllm-serve` on other GPUs (untested here), weights pushed every step"})
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    per_turn_rows: bool = field(default=False, metadata={
        "help": "the paper's layout: each policy turn its own row, earlier thoughts dropped from its context"})

    def __post_init__(self):
        positive, at_least_one, fraction = simulator.POSITIVE, simulator.AT_LEAST_ONE, simulator.FRACTION
        simulator.check_options(
            self, lora_r=at_least_one, learning_rate=positive, critic_learning_rate=positive,
            profiles_per_step=at_least_one, dialogues_per_profile=at_least_one, max_steps=at_least_one,
            ppo_epochs=at_least_one, minibatch_size=at_least_one, gamma=fraction, lam=fraction, clip_range=positive,
            value_clip_range=positive, entropy_coef=simulator.NOT_NEGATIVE, kl_coef=simulator.NOT_NEGATIVE,
            max_grad_norm=positive, temperature=positive, save_steps=at_least_one)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

class Critic(torch.nn.Module):
    """A transformer body with a scalar value head: one value per position."""

    def __init__(self, body, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def lora(model, args: PPOArguments):
    if not args.use_peft:
        return model
    return get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0))


def load_models(args: PPOArguments):
    policy_path = simulator.resolve_model(args.model_name_or_path)
    policy = lora(AutoModelForCausalLM.from_pretrained(policy_path), args)
    body = AutoModel.from_pretrained(simulator.resolve_model(args.critic_model_name_or_path or policy_path))
    critic = Critic(lora(body, args), body.config.hidden_size)
    if args.use_peft:
        critic.value_head.requires_grad_(True)
    reference = None
    if args.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(policy_path).eval().requires_grad_(False)
    return policy, critic, reference


# --------------------------------------------------------------------------------------------
# The batch: padded rows, action mask, log-probs, values
# --------------------------------------------------------------------------------------------

def dialogue_row(dialogue) -> tuple[list[int], list[int]]:
    """One dialogue as one row: (token ids, action mask), the mask 1 on tokens the policy sampled."""
    return dialogue.prompt_ids + dialogue.completion_ids, [0] * len(dialogue.prompt_ids) + dialogue.env_mask


def per_turn_rows(dialogue) -> list[tuple[list[int], list[int]]]:
    """The paper's layout: each policy turn its own row, whose context keeps only the replies of
    earlier turns (their thoughts dropped); only that turn's sampled tokens are actions. The turn was
    sampled with its earlier thoughts in view, so these rows are slightly off-policy for the first
    PPO update; old log-probs are computed on the rows themselves."""
    rows, context = [], list(dialogue.prompt_ids)
    ends = dialogue.turn_starts[1:] + [len(dialogue.completion_ids)]
    for turn, (start, end) in enumerate(zip(dialogue.turn_starts, ends)):
        mask = dialogue.env_mask[start:end]
        sampled_end = start + max(i for i, keep in enumerate(mask) if keep) + 1  # after this turn's reply
        turn_ids, turn_mask = dialogue.completion_ids[start:sampled_end], dialogue.env_mask[start:sampled_end]
        rows.append((context + turn_ids, [0] * len(context) + turn_mask))
        reply = dialogue.sampled_turns[turn][len(dialogue.thought_ids[turn]):]
        context = context + reply + dialogue.completion_ids[sampled_end:end]  # reply, then the user's next turn
    return rows


def pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Right-padded ids, attention mask and float action mask from (ids, action mask) rows."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    action_mask = torch.zeros((len(rows), width), dtype=torch.float)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attention_mask[i, :len(ids)] = 1
        action_mask[i, :len(ids)] = torch.tensor(mask, dtype=torch.float)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask}


def token_logprobs(model, input_ids, attention_mask, action_mask, temperature: float, with_entropy: bool = False):
    """Log-prob of each action token given the tokens before it, 0 elsewhere; with `with_entropy` the
    entropy there too (else None). Logits are computed only where some row has an action: the
    49k-wide output layer and softmax at prompt and user tokens would be wasted work."""
    targets = action_mask.any(dim=0).nonzero().squeeze(-1)  # never position 0: it follows no token
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=targets - 1).logits
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = torch.zeros(input_ids.shape, dtype=logprobs.dtype, device=logprobs.device)
    chosen[:, targets] = logprobs.gather(-1, input_ids[:, targets].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    entropy = torch.zeros_like(chosen)
    entropy[:, targets] = -(logprobs.exp() * logprobs).sum(-1)
    return chosen, entropy


def state_values(critic, input_ids, attention_mask):
    """The value of the action at position t is the critic's output at t - 1 (the state before it)."""
    values = critic(input_ids, attention_mask)[:, :-1]
    return torch.cat([torch.zeros_like(values[:, :1]), values], dim=1)


def select_rows(batch: dict, rows: list[int]) -> dict:
    return {key: value[rows] for key, value in batch.items()}


def forward(policy, critic, batch: dict, temperature: float):
    """(log-probs, entropy, values) at the actions of `batch`, with their graphs."""
    logprobs, entropy = token_logprobs(policy, batch["input_ids"], batch["attention_mask"], batch["action_mask"],
                                       temperature, with_entropy=True)
    return logprobs, entropy, state_values(critic, batch["input_ids"], batch["attention_mask"])


def old_logprobs_and_values(policy, critic, batch: dict, first_minibatch: list[int], temperature: float):
    """Log-probs and values of every row before the update, and the first minibatch's forward pass.
    That minibatch is trained before any weight changes, so its old log-probs and values are its new
    ones, detached: its pass is made once, with graphs, and serves both (with one minibatch per batch,
    as in the demo, no separate no-grad pass is made at all)."""
    first = forward(policy, critic, select_rows(batch, first_minibatch), temperature)
    old_logprobs, old_values = torch.zeros_like(batch["action_mask"]), torch.zeros_like(batch["action_mask"])
    old_logprobs[first_minibatch], old_values[first_minibatch] = first[0].detach(), first[2].detach()
    rest = [row for row in range(len(old_logprobs)) if row not in first_minibatch]
    if rest:
        with torch.no_grad():
            others = select_rows(batch, rest)
            old_logprobs[rest], _ = token_logprobs(policy, others["input_ids"], others["attention_mask"],
                                                   others["action_mask"], temperature)
            old_values[rest] = state_values(critic, others["input_ids"], others["attention_mask"])
    return old_logprobs, old_values * batch["action_mask"], first


def place_rewards(action_mask, final_rewards, logprobs=None, ref_logprobs=None, kl_coef: float = 0.0):
    """Final reward on the last action of each row; minus kl_coef * (logp - ref_logp) on every action."""
    rewards = torch.zeros_like(action_mask)
    positions = torch.arange(action_mask.size(1)).expand_as(action_mask)
    last_action = (positions * action_mask).argmax(dim=1)
    rewards[torch.arange(len(rewards)), last_action] = torch.as_tensor(final_rewards, dtype=rewards.dtype)
    if kl_coef > 0:
        rewards -= kl_coef * (logprobs - ref_logprobs) * action_mask
    return rewards


def masked_gae(rewards, values, action_mask, gamma: float, lam: float):
    """GAE over the actions only: a non-action position is skipped, neither receiving an advantage
    nor cutting the chain; the value after a row's last action is 0 (the dialogue is over)."""
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(rewards.size(0))
    running = torch.zeros(rewards.size(0))
    for t in reversed(range(rewards.size(1))):
        is_action = action_mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * running
        running = torch.where(is_action, advantage, running)
        next_value = torch.where(is_action, values[:, t], next_value)
        advantages[:, t] = torch.where(is_action, advantage, torch.zeros_like(advantage))
    returns = (advantages + values) * action_mask
    return advantages, returns


def masked_mean(values, mask):
    # where, not multiply: an inf or nan at a masked position must not leak in as 0 * inf = nan
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def whiten(values, mask):
    mean = masked_mean(values, mask)
    std = masked_mean((values - mean) ** 2, mask).sqrt()
    return torch.where(mask > 0, (values - mean) / (std + 1e-8), torch.zeros_like(values))


def ppo_losses(new_logprobs, entropy, new_values, batch, args: PPOArguments):
    """Clipped policy loss with entropy bonus, and clipped value loss, as means over actions."""
    mask = batch["action_mask"]
    ratio = torch.exp(new_logprobs - batch["old_logprobs"])
    advantages = batch["advantages"]
    policy_loss = masked_mean(torch.max(-advantages * ratio,
                                        -advantages * ratio.clamp(1 - args.clip_range, 1 + args.clip_range)), mask)
    entropy_mean = masked_mean(entropy, mask)
    clipped_values = batch["old_values"] + (new_values - batch["old_values"]).clamp(-args.value_clip_range,
                                                                                    args.value_clip_range)
    value_loss = 0.5 * masked_mean(torch.max((new_values - batch["returns"]) ** 2,
                                             (clipped_values - batch["returns"]) ** 2), mask)
    stats = {"ppo/policy_loss": policy_loss.item(), "ppo/value_loss": value_loss.item(),
             "ppo/entropy": entropy_mean.item(),
             "ppo/clip_fraction": masked_mean(((ratio - 1).abs() > args.clip_range).float(), mask).item()}
    return policy_loss - args.entropy_coef * entropy_mean, value_loss, stats


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

def save_checkpoint(folder: Path, step: int, policy, critic, policy_optimizer, critic_optimizer, accelerator):
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    accelerator.unwrap_model(policy).save_pretrained(partial / "policy")
    torch.save(accelerator.unwrap_model(critic).state_dict(), partial / "critic.pt")
    torch.save({"step": step, "policy_optimizer": policy_optimizer.state_dict(),
                "critic_optimizer": critic_optimizer.state_dict(),
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}},
               partial / "state.pt")
    partial.rename(folder)  # a checkpoint folder appears only once complete


def load_checkpoint(folder: Path, policy, critic, policy_optimizer, critic_optimizer) -> int:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = folder / "policy" / "adapter_model.safetensors"
    if adapter.is_file():
        set_peft_model_state_dict(policy, load_file(adapter))
    else:
        policy.load_state_dict(AutoModelForCausalLM.from_pretrained(folder / "policy").state_dict())
    critic.load_state_dict(torch.load(folder / "critic.pt"))
    state = torch.load(folder / "state.pt", weights_only=False)
    policy_optimizer.load_state_dict(state["policy_optimizer"])
    critic_optimizer.load_state_dict(state["critic_optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]


def newest_checkpoint(output_dir: Path) -> Path | None:
    checkpoints = sorted(output_dir.glob("checkpoint-*[0-9]"), key=lambda p: int(p.name.split("-")[1]))
    return checkpoints[-1] if checkpoints else None


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def parse_arguments(argv=None):
    parser = HfArgumentParser((PPOArguments, rollout.DialogueArguments, simulator.SimulatorArguments))
    try:
        args = parser.parse_args_into_dataclasses(argv)
        if args[0].config:  # YAML first, then the command line on top of it
            import yaml

            with open(args[0].config, encoding="utf-8") as handle:
                parser.set_defaults(**yaml.safe_load(handle))
            args = parser.parse_args_into_dataclasses(argv)
    except simulator.ArgumentError as error:  # a value that cannot work: usage and what to fix, exit 2
        parser.error(str(error))
    return args


def main(argv=None) -> None:
    args, dialogue_args, simulator_args = parse_arguments(argv)
    if dialogue_args.think and args.output_dir == "runs/ppo-demo":
        args.output_dir += "-think"  # the two demo runs side by side
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(log_with=None if args.report_to == "none" else args.report_to, project_dir=str(output_dir))
    suffix = "" if accelerator.num_processes == 1 else f".rank{accelerator.process_index}"  # one file per rank
    transcripts, metrics_file = output_dir / f"transcripts{suffix}.jsonl", output_dir / f"metrics{suffix}.jsonl"
    if transcripts.exists() and not args.resume:
        raise SystemExit(f"{output_dir} already holds a run; choose another --output_dir, delete it, or pass --resume")
    rollout.use_all_cpu_cores()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed + accelerator.process_index)

    profiles = simulator.load_profiles(dialogue_args.profiles)
    tokenizer = AutoTokenizer.from_pretrained(simulator.resolve_model(args.model_name_or_path))
    chat = simulator.make_chat(simulator_args)
    config = rollout.rollout_config(dialogue_args, simulator_args)
    runner = rollout.DialogueRunner(tokenizer, config, chat)
    if chat is not None:  # a wrong URL, key or model name fails now, before any model loads
        runner.loop.run_until_complete(chat.check())  # on the loop that will use its connections
    policy, critic, reference = load_models(args)
    policy_optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=args.learning_rate)
    critic_optimizer = torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad], lr=args.critic_learning_rate)
    start_step = 0
    checkpoint = newest_checkpoint(output_dir) if args.resume else None
    if checkpoint is not None:
        start_step = load_checkpoint(checkpoint, policy, critic, policy_optimizer, critic_optimizer)
        for path in (transcripts, metrics_file):
            rollout.keep_rows_before(path, start_step)
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")
    policy, critic, policy_optimizer, critic_optimizer = accelerator.prepare(policy, critic, policy_optimizer,
                                                                             critic_optimizer)
    if accelerator.is_main_process and args.report_to != "none":
        accelerator.init_trackers("rlver-ppo", config={**vars(args), **vars(dialogue_args)})

    openings = runner.openings(profiles)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generation_config = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id)
    if args.use_vllm and accelerator.num_processes > 1:
        raise SystemExit("--use_vllm in train_ppo.py supports a single training process")
    vllm_generator = None
    if args.use_vllm:
        vllm_generator = rollout.VLLMServerGenerator(args.vllm_server_host, args.vllm_server_port, args.temperature)
    order = random.Random(args.seed)
    profile_order = []

    per_step_dialogues = args.profiles_per_step * args.dialogues_per_profile  # this rank's
    with rollout.DialogueProgress(args.max_steps * per_step_dialogues, start_step * per_step_dialogues,
                                  "PPO dialogues", show=accelerator.is_main_process) as bar:
        for step in range(start_step, args.max_steps):
            started = time.perf_counter()
            per_step = args.profiles_per_step * accelerator.num_processes  # each rank plays its own profiles
            while len(profile_order) < (step + 1) * per_step:  # the same order after a resume
                profile_order += order.sample(profiles, len(profiles))
            first = step * per_step + accelerator.process_index * args.profiles_per_step
            chosen = profile_order[first:first + args.profiles_per_step]
            starts = [(p, openings[p.id]) for p in chosen for _ in range(args.dialogues_per_profile)]

            # 1. Rollout with the current policy.
            policy.eval()
            if vllm_generator is not None:
                vllm_generator.push_weights(accelerator.unwrap_model(policy))
                generator = vllm_generator
            else:
                generator = rollout.TransformersGenerator(accelerator.unwrap_model(policy), tokenizer, generation_config)
            dialogues = runner.run(starts, generator)
            policy.train()
            rollout_time = time.perf_counter() - started
            try:
                rollout.check_failures(dialogues, dialogue_args.max_failed_share)
            except rollout.TooManySimulatorFailures as error:
                folder = output_dir / f"checkpoint-{step}"
                if step > 0 and not folder.exists() and accelerator.is_main_process:
                    save_checkpoint(folder, step, policy, critic, policy_optimizer, critic_optimizer, accelerator)
                saved = f"{folder} holds the state before it; continue with --resume" if step > 0 else "nothing to save yet"
                raise SystemExit(f"stopped at step {step} ({saved}): {error}") from None

            # 2-4. Old log-probs and values, rewards on the last action, GAE over actions.
            scored = [d for d in dialogues if d.failure is None]  # a failed simulator left no score: no rows
            rewards_by_dialogue = [rollout.reward(d.final_emotion, d.format_violations, config.format_penalty)
                                   for d in scored]
            rows, final_rewards = [], []
            for dialogue, dialogue_reward in zip(scored, rewards_by_dialogue):
                dialogue_rows = per_turn_rows(dialogue) if args.per_turn_rows else [dialogue_row(dialogue)]
                rows += dialogue_rows
                final_rewards += [dialogue_reward] * len(dialogue_rows)  # the rows of a dialogue share its reward
            batch = pad_batch(rows, pad_id)
            orders = [torch.randperm(len(rows)).tolist() for _ in range(args.ppo_epochs)]
            old_logprobs, old_values, first_forward = old_logprobs_and_values(
                policy, critic, batch, orders[0][:args.minibatch_size], args.temperature)
            ref_logprobs = None
            if reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = token_logprobs(reference, batch["input_ids"], batch["attention_mask"],
                                                     batch["action_mask"], args.temperature)
            rewards = place_rewards(batch["action_mask"], final_rewards, old_logprobs, ref_logprobs, args.kl_coef)
            advantages, returns = masked_gae(rewards, old_values, batch["action_mask"], args.gamma, args.lam)
            batch.update(old_logprobs=old_logprobs, old_values=old_values, returns=returns,
                         advantages=whiten(advantages, batch["action_mask"]))

            # 5. PPO epochs over minibatches of dialogues.
            stats = []
            for epoch, indices in enumerate(orders):
                for first in range(0, len(indices), args.minibatch_size):
                    minibatch = select_rows(batch, indices[first:first + args.minibatch_size])
                    outputs = first_forward if epoch == first == 0 else forward(policy, critic, minibatch, args.temperature)
                    policy_loss, value_loss, minibatch_stats = ppo_losses(*outputs, minibatch, args)
                    for loss, model, optimizer in ((policy_loss, policy, policy_optimizer), (value_loss, critic, critic_optimizer)):
                        optimizer.zero_grad()
                        accelerator.backward(loss)
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                        optimizer.step()
                    stats.append(minibatch_stats)

            # Logging, transcripts, checkpoints.
            metrics = rollout.dialogues_metrics(dialogues, config.max_turns)
            metrics.update({key: sum(s[key] for s in stats) / len(stats) for key in stats[0]})
            mask = batch["action_mask"]
            unexplained = masked_mean((returns - old_values - masked_mean(returns - old_values, mask)) ** 2, mask)
            spread = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
            metrics.update({"ppo/value_mean": masked_mean(old_values, mask).item(),
                            "ppo/explained_variance": (1 - unexplained / spread.clamp(min=1e-8)).item()})
            metrics.update({"reward": sum(rewards_by_dialogue) / len(rewards_by_dialogue), "step": step,
                            "step_time": time.perf_counter() - started, "rollout_time": rollout_time})
            rollout.write_transcripts(transcripts, dialogues, step=step)
            with metrics_file.open("a", encoding="utf-8") as out:
                out.write(json.dumps(metrics) + "\n")
            if accelerator.is_main_process:
                accelerator.print({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()
                                   if not k.startswith("emotion/after")})
            if args.report_to != "none":
                accelerator.log(metrics, step=step)
            bar.advance(len(dialogues), metrics.get("emotion/final_mean", float("nan")))
            if (step + 1) % args.save_steps == 0 and accelerator.is_main_process:
                save_checkpoint(output_dir / f"checkpoint-{step + 1}", step + 1, policy, critic, policy_optimizer,
                                critic_optimizer, accelerator)

    if accelerator.is_main_process:
        accelerator.unwrap_model(policy).save_pretrained(output_dir)
        torch.save(accelerator.unwrap_model(critic).state_dict(), output_dir / "critic.pt")
    accelerator.end_training()
    runner.close()
    accelerator.print(f"read the dialogues: python report.py {output_dir}")


if __name__ == "__main__":
    try:
        main()
    except (simulator.SimulatorError, simulator.ProfileError) as error:  # bad endpoint or profiles: say what, no traceback
        raise SystemExit(f"error: {error}") from None
