"""PPO against a simulated user: our own loop on Accelerate (TRL >= 1.13 has no PPOTrainer), read top to bottom.

    accelerate launch train_ppo.py            # the offline demo: the packaged SmolLM2 with LoRA vs the rule user
    accelerate launch train_ppo.py --think    # the same, thinking before each reply
    accelerate launch --config_file accelerate_configs/zero2.yaml train_ppo.py \
        --config recipes/ppo_qwen2.5-7b_think.yaml    # the paper's run: GPUs, an LLM simulated user

Read top to bottom: the options, the set-up, then each step's helpers in the order of the step, and `main`
last, the loop over steps. One step, as `main` numbers it:
1. Rollout (`rollout.py`): profiles_per_step x dialogues_per_profile dialogues. A row is one whole dialogue,
   its action mask 1 on the tokens the policy sampled and 0 on everything inserted (user turns, tags).
2. Old log-probs (policy) and values (critic) at every action.
3. Rewards: final emotion / 100 on the dialogue's last action (with --turn_credit, each turn's emotion
   change / 100 on that turn's last action), minus kl_coef x (logp - ref_logp) on every action.
4. GAE over the actions only: a dialogue's actions form one chain across the user turns between them.
   Advantages are whitened over the batch's actions (every rank's).
5. Clipped policy loss, clipped value loss and an entropy bonus, token means over each minibatch's
   actions; one optimizer step per minibatch.

What it simplifies: the critic is a separate network with a zero-initialised linear value head; losses are
token means; one dialogue is one row (the paper trained each turn as its own row: --per_turn_rows); the
defaults are a CPU demo (the dataclass below), the recipes hold the paper's values. The details (several
processes, memory, resume, per-turn rows, why the demo's values) are in docs/training.md and docs/gpu.md.
"""
import random
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import common
import guards  # before the libraries below: quick, and it quiets a Ctrl-C while they load

if __name__ == "__main__":
    guards.start_script("every checkpoint in --output_dir is whole: continue with --resume (from the newest, or "
                          "from step 0 before the first)")

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, extract_model_from_parallel, gather_object
from peft import LoraConfig, get_peft_model
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

import generation
import preflight
import rollout
import simulator


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

@dataclass
class PPOArguments:
    """PPO settings. Defaults: the offline demo; paper values (the RLVER paper's training settings) in the help."""

    output_dir: str = field(default="runs/ppo-demo", metadata={"help": "checkpoints, transcripts, metrics"})
    model_name_or_path: str = field(default=common.PACKAGED_MODEL, metadata={
        "help": "policy (paper: Qwen2.5-7B-Instruct)"})
    critic_model_name_or_path: str | None = field(default=None, metadata={"help": "critic body; default: the policy's"})
    use_peft: bool = field(default=True, metadata={"help": "LoRA on policy and critic (paper: full fine-tune)"})
    # A full fine-tune needs fp32 master weights: AdamW's steps of ~lr are far below bf16's resolution
    # (1/256 of a weight). DeepSpeed keeps them; plain torch would silently not learn (refused below).
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={
        "help": "weights' dtype; auto: the checkpoint's (demo: float32; Qwen2.5: bfloat16, for DeepSpeed or LoRA)"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in the backward pass: needed for long dialogues on 7B models"})
    lora_r: int = 16
    lora_alpha: int = 32
    learning_rate: float = field(default=1e-3, metadata={"help": "policy lr (paper: 1e-6; LoRA demo: 1e-3)"})
    # The demo's critic lr, profiles per step and minibatch: why these values, in docs/training.md
    # ("Why the PPO demo's defaults"): a faster critic is noise at this scale.
    critic_learning_rate: float = field(default=5e-6, metadata={"help": "critic lr (paper: 5e-6)"})
    profiles_per_step: int = field(default=1, metadata={"help": "profiles per step"})
    dialogues_per_profile: int = field(default=8, metadata={
        "help": "dialogues per profile (1 x 8 = 8 per step; paper: 32 x 1)"})
    max_steps: int = field(default=30, metadata={"help": "PPO steps (paper: 1000)"})
    ppo_epochs: int = field(default=1, metadata={"help": "passes over each batch (paper: 1)"})
    minibatch_size: int = field(default=8, metadata={
        "help": "rows per optimizer step, at most: a batch makes the fewest such steps, its rows shared out evenly "
                "(demo: the whole batch)"})
    micro_batch_size: int | None = field(default=None, metadata={
        "help": "rows per forward and backward pass, gradients accumulated over a minibatch (default: minibatch_size)"})
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
    resume: bool = field(default=False, metadata={
        "help": "continue from the newest checkpoint in output_dir (none yet: from step 0, the rows written dropped)"})
    report_to: str = field(default="none", metadata={
        "help": "none, tensorboard, wandb or trackio (its package installed)"})
    use_vllm: bool = field(default=False, metadata={
        "help": "generate with `trl vllm-serve` on other GPUs, weights pushed every step (one process)"})
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    per_turn_rows: bool = field(default=False, metadata={
        "help": "the paper's layout: each policy turn its own row, earlier thoughts dropped from its context"})

    def __post_init__(self):
        if self.micro_batch_size is None:
            self.micro_batch_size = self.minibatch_size  # no accumulation
        guards.check_options(
            self, lora_r=guards.AT_LEAST_ONE, learning_rate=guards.POSITIVE, critic_learning_rate=guards.POSITIVE,
            profiles_per_step=guards.AT_LEAST_ONE, dialogues_per_profile=guards.AT_LEAST_ONE,
            max_steps=guards.AT_LEAST_ONE, ppo_epochs=guards.AT_LEAST_ONE, minibatch_size=guards.AT_LEAST_ONE,
            # DeepSpeed counts a whole number of micro-batches per optimizer step
            micro_batch_size=(lambda value: value >= 1 and self.minibatch_size % value == 0,
                              f"at least 1 and divide --minibatch_size {self.minibatch_size}"),
            gamma=guards.FRACTION, lam=guards.FRACTION, clip_range=guards.POSITIVE, value_clip_range=guards.POSITIVE,
            entropy_coef=guards.NOT_NEGATIVE, kl_coef=guards.NOT_NEGATIVE, max_grad_norm=guards.POSITIVE,
            temperature=guards.POSITIVE, save_steps=guards.AT_LEAST_ONE, lora_alpha=guards.POSITIVE,
            seed=guards.SEED, vllm_server_port=(lambda value: 1 <= value <= 65535, "within 1-65535"))


def parse_arguments(argv=None):
    """(PPO, dialogue, simulator) arguments: the defaults, then the --config YAML, then flags (TrlParser)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = TrlParser((PPOArguments, rollout.DialogueArguments, simulator.SimulatorArguments))
    with guards.usage_errors(parser, argv):
        return parser.parse_args_and_config(common.split_config_flag(argv))


# --------------------------------------------------------------------------------------------
# Set-up: the models, the optimizer, the seeds
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
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        # A bf16 body feeds an fp32 head (LoRA, or a full fine-tune before DeepSpeed casts both); the
        # values leave in fp32, as the log-probs do, for the advantage and loss arithmetic.
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


class PolicyAndCritic(torch.nn.Module):
    """Both networks as one module: accelerate under DeepSpeed prepares one model per Accelerator, and
    one forward pass through the prepared wrapper (DDP, DeepSpeed engine, autocast) serves both."""

    def __init__(self, policy, critic: Critic):
        super().__init__()
        self.policy, self.critic = policy, critic

    def forward(self, input_ids, attention_mask, action_mask, temperature: float, with_entropy: bool = False):
        """(log-probs, entropy or None, values) at every position; see token_logprobs and state_values."""
        logprobs, entropy = token_logprobs(self.policy, input_ids, attention_mask, action_mask, temperature,
                                           with_entropy)
        return logprobs, entropy, state_values(self.critic, input_ids, attention_mask)


def trainable(model, args: PPOArguments):
    """Gradient checkpointing and LoRA, as the options ask."""
    if args.gradient_checkpointing:  # non-reentrant: needs no input gradients under a frozen LoRA base
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not args.use_peft:
        return model
    return get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0))


def load_models(args: PPOArguments):
    """(policy and critic as one module, frozen reference or None)."""
    policy_path = common.resolve_model(args.model_name_or_path)
    # The policy's LoRA first: its random initialisation draws from the seed before the critic's.
    policy = trainable(AutoModelForCausalLM.from_pretrained(policy_path, dtype=args.dtype), args)
    body = AutoModel.from_pretrained(common.resolve_model(args.critic_model_name_or_path or policy_path),
                                     dtype=args.dtype)
    critic = Critic(trainable(body, args), body.config.hidden_size)
    if args.use_peft:
        critic.value_head.requires_grad_(True)
    reference = None
    if args.kl_coef > 0:
        reference = AutoModelForCausalLM.from_pretrained(policy_path, dtype=args.dtype).eval().requires_grad_(False)
    return PolicyAndCritic(policy, critic), reference


def make_optimizer(model: PolicyAndCritic, args: PPOArguments):
    """One AdamW, a parameter group per network: the same updates as one optimizer per network."""
    return torch.optim.AdamW([
        {"params": [p for p in model.policy.parameters() if p.requires_grad], "lr": args.learning_rate},
        {"params": [p for p in model.critic.parameters() if p.requires_grad], "lr": args.critic_learning_rate}])


def prepare(accelerator, model: PolicyAndCritic, optimizer, args: PPOArguments):
    """accelerator.prepare, after telling DeepSpeed what no dataloader tells it: rows per forward pass,
    micro-batches per optimizer step, and the clipping norm (its engine clips both networks together,
    by default to 1.0)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        deepspeed_config = accelerator.state.deepspeed_plugin.deepspeed_config
        accumulation = args.minibatch_size // args.micro_batch_size
        deepspeed_config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
        deepspeed_config["gradient_accumulation_steps"] = accumulation
        accelerator.gradient_accumulation_steps = accumulation  # else prepare warns of the mismatch and takes it
        deepspeed_config["gradient_clipping"] = args.max_grad_norm
    return accelerator.prepare(model, optimizer)


def seed_everything(seed: int, rank: int) -> None:
    """Python's, NumPy's and torch's RNGs; torch's differs per rank, so ranks sample different dialogues."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + rank)


def set_up_models(args: PPOArguments, accelerator, checkpoint: Path | None, start_step: int):
    """(policy and critic prepared as one module, their optimizer, frozen reference or None), restored
    from `checkpoint` if given."""
    model, reference = load_models(args)
    if (not args.use_peft and model.policy.dtype != torch.float32
            and accelerator.distributed_type != DistributedType.DEEPSPEED):
        raise SystemExit(f"a full fine-tune of {model.policy.dtype} weights needs fp32 master weights: launch with "
                         "--config_file accelerate_configs/zero2.yaml (DeepSpeed), or pass --dtype float32")
    model, optimizer = prepare(accelerator, model, make_optimizer(model, args), args)
    if checkpoint is not None:
        load_checkpoint(checkpoint, model, optimizer, accelerator)
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")
    if reference is not None:
        reference.to(accelerator.device)
    return model, optimizer, reference


# --------------------------------------------------------------------------------------------
# Run files and checkpoints
# --------------------------------------------------------------------------------------------

CHECKPOINT_MEMBERS = ("state.pt", "critic.pt", "policy")  # what save_checkpoint writes on every launch


def run_files(output_dir: Path, accelerator) -> tuple[Path, Path]:
    """(this process's transcripts, the run's metrics): a transcripts file per rank when there are several;
    one metrics file, the steps' metrics over every rank, written by the main process."""
    suffix = "" if accelerator.num_processes == 1 else f".rank{accelerator.process_index}"
    return output_dir / f"transcripts{suffix}.jsonl", output_dir / "metrics.jsonl"


def save_policy(folder: Path, model: PolicyAndCritic, tokenizer) -> None:
    """The policy with its tokenizer, so that the evaluations can load the folder as a model."""
    model.policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_checkpoint(folder: Path, step: int, model, optimizer, tokenizer, accelerator) -> None:
    """Called on every rank: under DeepSpeed each rank holds a shard of the optimizer, which the engine
    saves (with every rank's RNG) into deepspeed/. Elsewhere the optimizer is whole on rank 0."""
    guards.check_run_folder_kept(folder.parent)
    partial = folder.with_name(folder.name + ".partial")
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)  # a save of this run killed midway
    accelerator.wait_for_everyone()
    networks = accelerator.unwrap_model(model)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if deepspeed:
        accelerator.save_state(partial / "deepspeed")
    if accelerator.is_main_process:
        partial.mkdir(parents=True, exist_ok=True)
        save_policy(partial / "policy", networks, tokenizer)  # what the evaluations load
        torch.save(networks.critic.state_dict(), partial / "critic.pt")
        torch.save({"step": step, "optimizer": None if deepspeed else optimizer.state_dict(),
                    "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state()}},
                   partial / "state.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if folder.exists():
            shutil.rmtree(folder)  # a broken checkpoint of this run, passed over when it resumed
        partial.rename(folder)  # a checkpoint folder appears only once complete


def checkpoint_step(folder: Path) -> int:
    """The step a checkpoint's state holds (read without loading the optimizer's tensors)."""
    return torch.load(folder / "state.pt", weights_only=False, mmap=True)["step"]


def load_checkpoint(folder: Path, model, optimizer, accelerator) -> int:
    """Restore a checkpoint into the prepared model and optimizer; returns its step."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = torch.load(folder / "state.pt", weights_only=False)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.load_state(folder / "deepspeed")  # weights, optimizer shards and every rank's RNG
        return state["step"]
    networks = accelerator.unwrap_model(model)
    adapter = folder / "policy" / "adapter_model.safetensors"
    if adapter.is_file():
        set_peft_model_state_dict(networks.policy, load_file(adapter))
    else:
        networks.policy.load_state_dict(AutoModelForCausalLM.from_pretrained(folder / "policy").state_dict())
    networks.critic.load_state_dict(torch.load(folder / "critic.pt"))
    optimizer.load_state_dict(state["optimizer"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]


# --------------------------------------------------------------------------------------------
# 1. Rollout: the step's profiles and generator; the batch of padded rows and their action mask
# --------------------------------------------------------------------------------------------

def step_profiles(profiles: list, args: PPOArguments, step: int, accelerator) -> list:
    """This rank's profiles at `step`: consecutive slices of shuffled passes over all profiles, drawn from
    their own seeded RNG, so a resumed run plays what the uninterrupted run would have."""
    per_step = args.profiles_per_step * accelerator.num_processes  # each rank plays its own profiles
    order, shuffled = random.Random(args.seed), []
    while len(shuffled) < (step + 1) * per_step:
        shuffled += order.sample(profiles, len(profiles))
    offset = step * per_step + accelerator.process_index * args.profiles_per_step
    return shuffled[offset:offset + args.profiles_per_step]


def policy_generator(vllm_server, policy, tokenizer, args: PPOArguments, dialogue_args, step: int):
    """The rollout's `generate`: the vLLM server after the policy's current weights are pushed to it (with
    --rollout async, a request for each turn, seeded by the step), or a fresh transformers generator over the
    policy (a generator serves one set of weights)."""
    if vllm_server is not None:
        vllm_server.push_weights(policy)
        if dialogue_args.rollout == "async":
            return vllm_server.turns(args.seed, step, rank=0)  # one process (preflight.check_launch)
        return vllm_server
    return generation.TransformersGenerator(policy, tokenizer, generation.sampling_config(tokenizer, args.temperature),
                                            dialogue_args.prefix_cache)


def stop_if_simulators_failed(dialogues, step: int, dialogue_args, output_dir: Path, model, optimizer, tokenizer,
                              accelerator) -> None:
    """Exit, after saving the state before this step, when the simulators of more of its dialogues than
    max_failed_share allows failed. Every rank stops here together: check_failures agrees across them."""
    try:
        rollout.check_failures(dialogues, dialogue_args.max_failed_share, accelerator)
    except rollout.TooManySimulatorFailures as error:
        folder = output_dir / f"checkpoint-{step}"
        if step > 0 and not folder.exists():
            save_checkpoint(folder, step, model, optimizer, tokenizer, accelerator)
        saved = f"{folder} holds the state before it; continue with --resume" if step > 0 else "nothing to save yet"
        raise SystemExit(f"stopped at step {step} ({saved}): {error}") from None


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
        reply = dialogue.turn_ids[turn][len(dialogue.thought_ids[turn]):]
        context = context + reply + dialogue.completion_ids[sampled_end:end]  # reply, then the user's next turn
    return rows


def turn_rewards(dialogue, final_reward: float, turn_credit: bool) -> list[float]:
    """What each policy turn of a scored dialogue earns: the final reward on its last turn only (the paper),
    or with `turn_credit` each turn's emotion change / 100, the format penalty (if any) on the last turn."""
    if not turn_credit:
        return [0.0] * (len(dialogue.turn_starts) - 1) + [final_reward]
    rewards = [change / simulator.MAX_EMOTION for change in dialogue.turn_changes]
    rewards[-1] -= dialogue.final_emotion / simulator.MAX_EMOTION - final_reward
    return rewards


def dialogue_rows(dialogue, rewards: list[float], per_turn: bool) -> list[tuple[list[int], list[int], dict]]:
    """The rows of one scored dialogue: (ids, action mask, {position: reward}). One whole-dialogue row gets
    each turn's reward on the last token that turn sampled. Per-turn rows (the paper's layout) end at their
    turn's last sampled token, where each gets its turn's return: its reward and every later turn's (the
    dialogue's reward in every row without turn credit)."""
    if per_turn:
        return [(ids, mask, {len(ids) - 1: sum(rewards[turn:])})
                for turn, (ids, mask) in enumerate(per_turn_rows(dialogue))]
    ids, mask = dialogue_row(dialogue)
    last_token = {turn: len(dialogue.prompt_ids) + position  # the dict keeps each turn's last position
                  for position, turn in enumerate(dialogue.token_turns()) if turn >= 0}
    return [(ids, mask, {last_token[turn]: reward for turn, reward in enumerate(rewards)})]


def pad_batch(rows: list[tuple], pad_id: int, device) -> dict:
    """Right-padded ids, attention mask and float action mask from (ids, action mask, ...) rows, on `device`.
    No rows (a rank where every dialogue's simulator failed) make tensors of 0 rows: the rank still takes
    part in the step's collectives (ppo_update)."""
    width = max((len(row[0]) for row in rows), default=0)
    padding = [width - len(row[0]) for row in rows]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device).reshape(len(rows), width)

    return {"input_ids": tensor([row[0] + [pad_id] * pad for row, pad in zip(rows, padding)], torch.long),
            "attention_mask": tensor([[1] * len(row[0]) + [0] * pad for row, pad in zip(rows, padding)], torch.long),
            "action_mask": tensor([row[1] + [0] * pad for row, pad in zip(rows, padding)], torch.float)}


# --------------------------------------------------------------------------------------------
# 2. Old log-probs (policy and reference) and values (critic) at every action
# --------------------------------------------------------------------------------------------

# Action positions whose logits are computed at once. The output layer's logits are by far the widest
# tensors (vocab 152064 for Qwen2.5: 0.6 GB per 1024 positions in fp32, in a few copies), so
# token_logprobs scores one chunk at a time and recomputes it in the backward pass.
LOGPROB_CHUNK = 1024


def score_positions(output_layer, hidden, input_ids, targets, temperature: float, with_entropy: bool):
    """(log-prob, entropy or None) of the tokens at `targets`, from the hidden states just before them."""
    logits = output_layer(hidden[:, targets - 1])
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logprobs.gather(-1, input_ids[:, targets].unsqueeze(-1)).squeeze(-1)
    return chosen, -(logprobs.exp() * logprobs).sum(-1) if with_entropy else None


def token_logprobs(model, input_ids, attention_mask, action_mask, temperature: float, with_entropy: bool = False):
    """Log-prob of each action token given the tokens before it, 0 elsewhere; with `with_entropy` the
    entropy there too (else None). Logits are computed only where some row has an action (the output
    layer and softmax at prompt and user tokens would be wasted work), LOGPROB_CHUNK positions at a
    time: each chunk is checkpointed, its backward recomputing its logits from the hidden states, so
    that one chunk's logits live at a time in both passes. The body and the output layer are called
    apart (through a PEFT wrapper too: its LoRA layers sit inside them), so the model makes no logits."""
    targets = action_mask.any(dim=0).nonzero().squeeze(-1)  # never position 0: it follows no token
    if len(targets) == 0:  # a placeholder micro-batch (ppo_update): one position scored, so every weight
        targets = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)  # gets its (zero) gradient
    body, output_layer = model.get_decoder(), model.get_output_embeddings()
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    chosen = torch.zeros(input_ids.shape, dtype=torch.float, device=input_ids.device)
    entropy = torch.zeros_like(chosen) if with_entropy else None
    for chunk in targets.split(LOGPROB_CHUNK):
        chunk_logprobs, chunk_entropy = checkpoint(score_positions, output_layer, hidden, input_ids, chunk,
                                                   temperature, with_entropy, use_reentrant=False)
        chosen[:, chunk] = chunk_logprobs
        if with_entropy:
            entropy[:, chunk] = chunk_entropy
    return chosen, entropy


def state_values(critic, input_ids, attention_mask):
    """The value of the action at position t is the critic's output at t - 1 (the state before it)."""
    values = critic(input_ids, attention_mask)[:, :-1]
    return torch.cat([torch.zeros_like(values[:, :1]), values], dim=1)


def select_rows(batch: dict, indices: list[int]) -> dict:
    return {key: value[indices] for key, value in batch.items()}


def forward(model, batch: dict, temperature: float, with_entropy: bool = True):
    """(log-probs, entropy, values) at the actions of `batch`, through the prepared PolicyAndCritic. Rows
    taken from a longer batch keep its width: the columns after their own longest row (padding only)
    are not fed, and come back as zeros."""
    width = int(batch["attention_mask"].sum(dim=1).max())
    padding = batch["attention_mask"].shape[1] - width
    outputs = model(batch["input_ids"][:, :width], batch["attention_mask"][:, :width],
                    batch["action_mask"][:, :width], temperature, with_entropy)
    if padding == 0:
        return outputs
    return tuple(None if output is None else torch.nn.functional.pad(output, (0, padding)) for output in outputs)


def old_logprobs_and_values(model, batch: dict, order: list[int], temperature: float, micro_batch_size: int):
    """Log-probs and values of every row before the update, and the forward pass of the first
    micro-batch of the first epoch's `order` (of placeholder_rows when there are no rows). That micro-batch is
    trained before any weight changes, so its old log-probs and values are its new ones, detached: its pass is
    made once, with graphs, and serves both (with one micro-batch per batch, as in the demo, no separate
    no-grad pass is made at all). The other micro-batches are scored without graphs, grouped as the first
    epoch trains them, by the networks outside their DDP or DeepSpeed wrapper: scoring trains nothing, and
    DDP's forward pass after a training pass broadcasts the buffers (a collective), which ranks scoring
    different numbers of micro-batches would pair with the wrong collectives of the others."""
    micro_batches = [order[start:start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]
    old_logprobs, old_values = torch.zeros_like(batch["action_mask"]), torch.zeros_like(batch["action_mask"])
    if not micro_batches:  # a rank without rows: its first pass, like every rank's, is a collective under DDP
        return old_logprobs, old_values, forward(model, placeholder_rows(batch), temperature)
    untrained_forward = forward(model, select_rows(batch, micro_batches[0]), temperature)
    old_logprobs[micro_batches[0]], old_values[micro_batches[0]] = (untrained_forward[0].detach(),
                                                                    untrained_forward[2].detach())
    scorer = extract_model_from_parallel(model)  # keeps accelerate's autocast, if any
    with torch.no_grad():
        for indices in micro_batches[1:]:
            old_logprobs[indices], _, old_values[indices] = forward(scorer, select_rows(batch, indices), temperature,
                                                                    with_entropy=False)
    return old_logprobs, old_values * batch["action_mask"], untrained_forward


def reference_logprobs(reference, batch: dict, temperature: float):
    """The frozen reference's log-probs at the actions (None without a reference: kl_coef 0)."""
    if reference is None:
        return None
    with torch.no_grad():
        return token_logprobs(reference, batch["input_ids"], batch["attention_mask"], batch["action_mask"],
                              temperature)[0]


# --------------------------------------------------------------------------------------------
# 3. Rewards and 4. GAE, over every rank's actions
# --------------------------------------------------------------------------------------------

def place_rewards(action_mask, rewards_at: list[dict], logprobs=None, ref_logprobs=None, kl_coef: float = 0.0):
    """Each row's rewards at their positions ({position: reward}, from dialogue_rows); minus
    kl_coef * (logp - ref_logp) on every action."""
    index = lambda values: torch.tensor(values, dtype=torch.long, device=action_mask.device)  # noqa: E731
    rewards = torch.zeros_like(action_mask)
    rewards[index([row for row, placed in enumerate(rewards_at) for _ in placed]),
            index([position for placed in rewards_at for position in placed])] = torch.tensor(
        [reward for placed in rewards_at for reward in placed.values()], dtype=rewards.dtype, device=rewards.device)
    if kl_coef > 0:
        rewards -= kl_coef * (logprobs - ref_logprobs) * action_mask
    return rewards


def masked_gae(rewards, values, action_mask, gamma: float, gae_lambda: float):
    """GAE over the actions only: a non-action position is skipped, neither receiving an advantage
    nor cutting the chain; the value after a row's last action is 0 (the dialogue is over)."""
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.size(1))):
        is_action = action_mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * gae_lambda * running
        running = torch.where(is_action, advantage, running)
        next_value = torch.where(is_action, values[:, t], next_value)
        advantages[:, t] = torch.where(is_action, advantage, torch.zeros_like(advantage))
    returns = (advantages + values) * action_mask
    return advantages, returns


def all_ranks(tensor, op=None):
    """`tensor` summed (or reduced with `op`, a torch.distributed.ReduceOp) over every process; itself
    when there is one. Every process must call it, the same number of times."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor
    tensor = tensor.clone()
    torch.distributed.all_reduce(tensor, op=op or torch.distributed.ReduceOp.SUM)
    return tensor


def most_over_ranks(count: int, device) -> int:
    """The largest of every process's `count`."""
    return int(all_ranks(torch.tensor(count, device=device), torch.distributed.ReduceOp.MAX))


def masked_mean(values, mask, count=None):
    """Mean over the positions where mask is 1; with `count`, the sum there over `count` instead (a
    micro-batch's share of its minibatch's mean, `count` being the minibatch's number of actions)."""
    # where, not multiply: an inf or nan at a masked position must not leak in as 0 * inf = nan
    total = torch.where(mask > 0, values, torch.zeros_like(values)).sum()
    return total / (mask.sum().clamp(min=1) if count is None else count)


def step_mean(values, mask):
    """The mean over the actions of every process's rows: the step's batch is all ranks' dialogues."""
    total, count = all_ranks(torch.stack([torch.where(mask > 0, values, torch.zeros_like(values)).sum(), mask.sum()]))
    return total / count.clamp(min=1)


def whiten(values, mask):
    """(values - mean) / std, both over the step's actions on every rank (a rank's own 4 dialogues would
    make their own baseline: a rank whose dialogues all went well would push its worse ones down)."""
    mean = step_mean(values, mask)
    std = step_mean((values - mean) ** 2, mask).sqrt()
    return torch.where(mask > 0, (values - mean) / (std + 1e-8), torch.zeros_like(values))


# --------------------------------------------------------------------------------------------
# 5. The update: losses, one optimizer step per minibatch, the epochs
# --------------------------------------------------------------------------------------------

def ppo_losses(new_logprobs, entropy, new_values, batch, args: PPOArguments, action_count=None):
    """Clipped policy loss with entropy bonus, and clipped value loss, as means over actions; over
    `action_count` actions when given (see masked_mean), so that micro-batches' losses and stats add up
    to their minibatch's."""
    mask = batch["action_mask"]
    ratio = torch.exp(new_logprobs - batch["old_logprobs"])
    advantages = batch["advantages"]
    policy_loss = masked_mean(torch.max(-advantages * ratio,
                                        -advantages * ratio.clamp(1 - args.clip_range, 1 + args.clip_range)),
                              mask, action_count)
    entropy_mean = masked_mean(entropy, mask, action_count)
    clipped_values = batch["old_values"] + (new_values - batch["old_values"]).clamp(-args.value_clip_range,
                                                                                    args.value_clip_range)
    value_loss = 0.5 * masked_mean(torch.max((new_values - batch["returns"]) ** 2,
                                             (clipped_values - batch["returns"]) ** 2), mask, action_count)
    stats = {"ppo/policy_loss": policy_loss.item(), "ppo/value_loss": value_loss.item(),
             "ppo/entropy": entropy_mean.item(),
             "ppo/clip_fraction": masked_mean(((ratio - 1).abs() > args.clip_range).float(), mask,
                                              action_count).item()}
    return policy_loss - args.entropy_coef * entropy_mean, value_loss, stats


def placeholder_rows(minibatch: dict) -> dict:
    """One row of two tokens without actions, in `minibatch`'s dtypes and device: its forward and backward
    pass make a rank's collectives without changing any gradient (ppo_update)."""
    placeholder = {key: torch.zeros((1, 2), dtype=value.dtype, device=value.device) for key, value in minibatch.items()}
    placeholder["attention_mask"] += 1
    return placeholder


def ppo_update(accelerator, model, optimizer, minibatch: dict, args: PPOArguments, untrained_forward=None) -> dict:
    """One optimizer step for both networks on a minibatch, its rows in micro-batches of micro_batch_size
    (gradient accumulation); returns the minibatch's stats, every rank's actions counted. Each micro-batch's
    losses are sums over its actions divided by the minibatch's action count (all ranks' / the number of
    processes, as DDP and DeepSpeed average gradients), so the accumulated gradient is that of the token-mean
    losses over every rank's rows. `untrained_forward`: the first micro-batch's forward pass, if made already.

    Every backward pass reduces gradients across ranks, so every rank makes as many as the rank with the most
    micro-batches; a rank that has run out (its dialogues' simulators failed, fewer per-turn rows) passes a row
    without actions (placeholder_rows), which adds nothing. Each network is clipped on its own. Under DeepSpeed
    the engine clips (both networks together) and steps inside accelerator.backward, after the micro-batch
    marked `sync_gradients` (so a short last minibatch still steps), with its own loss scaling turned off."""
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    networks = accelerator.unwrap_model(model)
    row_count, processes = len(minibatch["action_mask"]), accelerator.num_processes
    micro_batches = most_over_ranks(-(-row_count // args.micro_batch_size), minibatch["action_mask"].device)
    action_count = all_ranks(minibatch["action_mask"].sum()).clamp(min=1) / processes
    stats = {}
    optimizer.zero_grad()
    for index in range(micro_batches):
        start = index * args.micro_batch_size
        micro_batch = {key: value[start:start + args.micro_batch_size] for key, value in minibatch.items()}
        if start >= row_count:
            micro_batch = placeholder_rows(minibatch)
        outputs = untrained_forward if start == 0 and untrained_forward is not None \
            else forward(model, micro_batch, args.temperature)
        policy_loss, value_loss, micro_stats = ppo_losses(*outputs, micro_batch, args, action_count)
        accelerator.sync_gradients = index == micro_batches - 1
        accelerator.backward(policy_loss + value_loss, **({"scale_wrt_gas": False} if deepspeed else {}))
        stats = {key: stats.get(key, 0.0) + value for key, value in micro_stats.items()}
    for network in (networks.policy, networks.critic):
        accelerator.clip_grad_norm_(network.parameters(), args.max_grad_norm)
    optimizer.step()
    names = sorted(stats)  # each rank's share of the step's means: their mean over the ranks is the step's
    shares = all_ranks(torch.tensor([stats[name] for name in names], device=minibatch["action_mask"].device))
    return dict(zip(names, (shares / processes).tolist()))


def minibatch_rows(order: list[int], minibatches: int, micro_batch_size: int) -> list[list[int]]:
    """An epoch's rows, in its `order`, shared out over `minibatches` optimizer steps in whole micro-batches of
    micro_batch_size rows, as evenly as they allow and the larger shares first, so that each step takes a like
    share of every rank's rows (10 rows, 2 minibatches, micro-batches of 2: 6 rows and 4)."""
    micro_batches = [order[start:start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]
    return [[row for micro_batch in micro_batches[-(-len(micro_batches) * index // minibatches):
                                                  -(-len(micro_batches) * (index + 1) // minibatches)]
             for row in micro_batch] for index in range(minibatches)]


# --------------------------------------------------------------------------------------------
# Logging and stopping
# --------------------------------------------------------------------------------------------

def value_metrics(returns, old_values, action_mask) -> dict[str, float]:
    """The critic's mean value and explained variance (1 - Var(returns - values) / Var(returns)) over the
    step's actions (every rank's)."""
    errors = returns - old_values
    unexplained = step_mean((errors - step_mean(errors, action_mask)) ** 2, action_mask)
    spread = step_mean((returns - step_mean(returns, action_mask)) ** 2, action_mask)
    return {"ppo/value_mean": step_mean(old_values, action_mask).item(),
            "ppo/explained_variance": (1 - unexplained / spread.clamp(min=1e-8)).item()}


def step_dialogues(dialogues, final_rewards: list[float], accelerator) -> tuple[dict, list[float]]:
    """(dialogue columns, final rewards of the scored dialogues) of every rank's dialogues of the step."""
    columns, rewards = rollout.dialogue_columns(dialogues), list(final_rewards)
    if accelerator.num_processes > 1:
        every = gather_object([(columns, rewards)])
        columns = {key: [value for rank_columns, _ in every for value in rank_columns[key]] for key in columns}
        rewards = [reward for _, rank_rewards in every for reward in rank_rewards]
    return columns, rewards


def log_step(metrics: dict, dialogues, step: int, transcripts: Path, metrics_file: Path, args: PPOArguments,
             think: bool, accelerator) -> None:
    """This rank's transcripts; the step's metrics row (every rank's: main process), console line and tracker."""
    guards.check_run_folder_kept(transcripts.parent)
    rollout.write_transcripts(transcripts, dialogues, step=step)
    if accelerator.is_main_process:
        with guards.own_output(metrics_file):
            common.append_json_lines(metrics_file, [metrics])
        accelerator.print(rollout.step_line(step + 1, args.max_steps, metrics, think))
    if args.report_to != "none":
        accelerator.log(metrics, step=step)


# --------------------------------------------------------------------------------------------
# Training: main, in the order of the module docstring's steps; its helpers are above
# --------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    # 0. Set-up. Every input that can be checked without a model is, before one loads (or the simulator's
    #    endpoint is asked); a resumed run drops the rows of the steps it will play again.
    common.quiet_libraries()
    args, dialogue_args, simulator_args = parse_arguments(argv)
    if dialogue_args.think and args.output_dir == "runs/ppo-demo":
        args.output_dir += "-think"  # the two demo runs side by side
    output_dir = Path(args.output_dir)
    preflight.check_ppo_start(args, simulator_args)
    policy_path = common.resolve_model(args.model_name_or_path)
    profiles = simulator.load_playable_profiles(dialogue_args.profiles, simulator_args, dialogue_args.think)
    accelerator = Accelerator(log_with=None if args.report_to == "none" else args.report_to,
                              project_dir=str(output_dir))
    preflight.check_ppo_launch(args, dialogue_args, simulator_args, accelerator)
    transcripts, metrics_file = run_files(output_dir, accelerator)
    accelerator.print(rollout.run_line("PPO", args.model_name_or_path, args.use_peft, simulator_args.backend,
                                       dialogue_args.think, args.max_steps, output_dir))
    checkpoint, start_step = None, 0
    if args.resume:  # the files' faults (a line cut short by a kill, ...) show now, not after the models load
        checkpoint, start_step = preflight.resume_point(output_dir, transcripts, metrics_file, args.save_steps,
                                                        args.max_steps, accelerator, CHECKPOINT_MEMBERS,
                                                        checkpoint_step)
    common.use_all_cpu_cores()
    seed_everything(args.seed, accelerator.process_index)
    preflight.check_ppo_models(args, policy_path)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args, rollout.make_chat(simulator_args))
    runner.check_chat()  # a wrong URL, key or model name fails now, before any model loads
    openings = runner.openings(profiles)
    runner.check_room([(profile, openings[profile.id]) for profile in profiles])
    model, optimizer, reference = set_up_models(args, accelerator, checkpoint, start_step)
    networks = accelerator.unwrap_model(model)  # .policy and .critic, for generation and saving
    if accelerator.is_main_process and args.report_to != "none":
        accelerator.init_trackers("rlver-ppo", config={**vars(args), **vars(dialogue_args)})
    vllm_server = None
    if args.use_vllm:
        import vllm_backends

        vllm_server = vllm_backends.VLLMServerGenerator(args.vllm_server_host, args.vllm_server_port, args.temperature)
        preflight.check_vllm_length(vllm_server.max_model_len(), dialogue_args.max_dialogue_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    dialogues_per_step = args.profiles_per_step * args.dialogues_per_profile  # this rank's
    with rollout.DialogueProgress(args.max_steps * dialogues_per_step, start_step * dialogues_per_step,
                                  "PPO dialogues", show=accelerator.is_main_process) as bar, \
            guards.StopRequest(show=accelerator.is_main_process) as stop:
        for step in range(start_step, args.max_steps):
            started = time.perf_counter()

            # 1. Rollout: this rank's profiles of the step, each played dialogues_per_profile times with the
            #    current policy; a step where too many simulators failed stops the run, after saving.
            chosen = step_profiles(profiles, args, step, accelerator)
            starts = [(profile, openings[profile.id]) for profile in chosen for _ in range(args.dialogues_per_profile)]
            model.eval()
            generate = policy_generator(vllm_server, networks.policy, tokenizer, args, dialogue_args, step)
            dialogues = runner.run(starts, generate)
            del generate  # it holds the last call's key and value cache (GBs in the recipe): not kept while training
            model.train()
            rollout_time = time.perf_counter() - started
            stop_if_simulators_failed(dialogues, step, dialogue_args, output_dir, model, optimizer, tokenizer,
                                      accelerator)
            scored = [d for d in dialogues if d.failure is None]  # a failed simulator left no score: no rows
            final_rewards = [rollout.reward(d.final_emotion, d.format_violations, len(d.reply_texts),
                                            dialogue_args.format_penalty)
                             for d in scored]
            rows = [row for dialogue, final_reward in zip(scored, final_rewards)
                    for row in dialogue_rows(dialogue, turn_rewards(dialogue, final_reward, dialogue_args.turn_credit),
                                             args.per_turn_rows)]
            batch = pad_batch(rows, pad_id, accelerator.device)

            # 2. Old log-probs (policy) and values (critic) at every action. Each epoch's shuffle of the rows
            #    is drawn first: the first micro-batch of the first epoch is scored with graphs and trained on
            #    as it is (nothing has changed yet), so its forward pass is made once (untrained_forward).
            epoch_orders = [torch.randperm(len(rows)).tolist() for _ in range(args.ppo_epochs)]
            old_logprobs, old_values, untrained_forward = old_logprobs_and_values(
                model, batch, epoch_orders[0], args.temperature, args.micro_batch_size)
            ref_logprobs = reference_logprobs(reference, batch, args.temperature)

            # 3. Rewards: the dialogue's on its last action (each turn's on that turn's last action, with turn
            #    credit), minus kl_coef x (logp - ref_logp) on every action.
            rewards = place_rewards(batch["action_mask"], [row[2] for row in rows], old_logprobs, ref_logprobs,
                                    args.kl_coef)

            # 4. GAE over the policy's actions only, advantages whitened over the batch's actions.
            advantages, returns = masked_gae(rewards, old_values, batch["action_mask"], args.gamma, args.lam)
            batch.update(old_logprobs=old_logprobs, old_values=old_values, returns=returns,
                         advantages=whiten(advantages, batch["action_mask"]))

            # 5. PPO epochs over shuffled minibatches of rows, one optimizer step (ppo_update) per minibatch. Every
            #    rank makes as many steps as the rank with the most rows needs (minibatches of at most
            #    minibatch_size rows); the very first micro-batch reuses the pass that scored the old log-probs.
            minibatches = max(1, most_over_ranks(-(-len(rows) // args.minibatch_size), accelerator.device))
            stats = []
            for epoch, order in enumerate(epoch_orders):
                for index, minibatch in enumerate(minibatch_rows(order, minibatches, args.micro_batch_size)):
                    stats.append(ppo_update(accelerator, model, optimizer, select_rows(batch, minibatch), args,
                                            untrained_forward if epoch == index == 0 else None))

            # Logging, transcripts, checkpoints. The metrics are the step's: every rank's dialogues.
            columns, every_reward = step_dialogues(dialogues, final_rewards, accelerator)
            metrics = {**rollout.dialogue_metrics(columns, dialogue_args.max_turns),
                       **{key: sum(s[key] for s in stats) / len(stats) for key in stats[0]},
                       **value_metrics(returns, old_values, batch["action_mask"]),
                       "reward": sum(every_reward) / max(len(every_reward), 1), "step": step,
                       "step_time": time.perf_counter() - started, "rollout_time": rollout_time}
            log_step(metrics, dialogues, step, transcripts, metrics_file, args, dialogue_args.think, accelerator)
            bar.advance(len(dialogues), metrics.get("emotion/final_mean", float("nan")))
            saved = (step + 1) % args.save_steps == 0
            if saved:
                save_checkpoint(output_dir / f"checkpoint-{step + 1}", step + 1, model, optimizer, tokenizer,
                                accelerator)
            preflight.stop_if_asked(stop, step + 1, args.max_steps, saved, output_dir, accelerator,
                                    save=lambda folder: save_checkpoint(folder, step + 1, model, optimizer, tokenizer,
                                                                        accelerator))

    if accelerator.is_main_process:
        guards.check_run_folder_kept(output_dir)
        save_policy(output_dir, networks, tokenizer)
        torch.save(networks.critic.state_dict(), output_dir / "critic.pt")
    accelerator.end_training()
    runner.close()
    accelerator.print(f"read the dialogues: {common.script_command('report.py')} {shlex.quote(str(output_dir))}")


if __name__ == "__main__":
    with guards.one_line_exits("--resume"):
        main()
