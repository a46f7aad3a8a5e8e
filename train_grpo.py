"""GRPO against a simulated user: TRL's GRPOTrainer with a multi-turn `rollout_func`.

    accelerate launch train_grpo.py            # the offline demo: the packaged SmolLM2 with LoRA vs the rule user
    accelerate launch train_grpo.py --think    # the same, thinking before each reply
    accelerate launch --config_file accelerate_configs/zero3.yaml train_grpo.py \
        --config recipes/grpo_qwen2.5-7b_think.yaml    # the paper's run: GPUs, an LLM simulated user

Each training prompt is a profile id. TRL repeats it `num_generations` times and every copy becomes one
dialogue with its own simulated user (`rollout.py`), all copies opening with the profile's one line. The
reward is the final emotion / 100, read from the rollout's `final_emotion` field. TRL's GRPOConfig and
ModelConfig flags work too; preflight.py refuses, before a model loads, values that cannot work and, with
--turn_credit, the losses whose meaning it would change.

What it simplifies: a dialogue is one training row, the policy keeping its earlier thoughts in view (the
paper trained each turn as its own row); the defaults are a CPU demo (`DEMO_DEFAULTS`), the recipes hold the
paper's values. The details (start-up checks, turn credit, vLLM's importance sampling, the metrics) are in
docs/training.md, docs/gpu.md and docs/usage.md.
"""
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import common
import guards  # before the libraries below: quick, and it quiets a Ctrl-C while they load

if __name__ == "__main__":
    guards.start_script("every checkpoint in --output_dir is whole: continue with --resume_from_checkpoint true "
                          "(from the newest, or from step 0 before the first)")

import torch
from accelerate.utils import broadcast_object_list, gather_object
from datasets import Dataset
from transformers import AutoTokenizer
from transformers.trainer_callback import ProgressCallback
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config

import generation
import preflight
import rollout
import simulator

# The offline demo. The paper's values in the comments; recipes/ hold them, and state
# every key of this dict (tests/test_recipes.py): these are the parser's defaults under --config too.
DEMO_DEFAULTS = dict(
    model_name_or_path=common.PACKAGED_MODEL,  # paper: Qwen2.5-7B-Instruct
    output_dir="runs/grpo-demo",
    use_peft=True, lora_r=16, lora_alpha=32,  # paper: full fine-tune; on CPU only LoRA learns visibly
    learning_rate=1e-3,  # paper: 1e-6 (full fine-tune); LoRA on a 135M model in 30 steps needs far more
    lr_scheduler_type="constant",  # a 30-step run should not spend its last steps at a decayed rate
    num_generations=4,  # paper: 4 dialogues per profile
    per_device_train_batch_size=8,  # 2 profiles x 4 dialogues per step (paper: 32 dialogues per step)
    max_steps=30,  # paper: 1000 steps on 32 GPUs
    temperature=1.0,  # paper: 1.0
    beta=0.0,  # paper: no KL, no reference model
    # paper: none. With --think the packaged model, shown the format, closes a thought in a third of its turns
    # (docs/results.md); paid a penalty graded by the share of violating turns (rollout.reward), it learns to
    # close more of them in 30 steps.
    format_penalty=0.1,
    logging_steps=1, save_strategy="steps", save_steps=10, report_to="none",  # a checkpoint every 10 steps
    gradient_checkpointing=False,  # a 135M model fits; checkpointing would only slow the CPU down
    bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory is for copies to a GPU (torch warns on CPU)
    # With --use_vllm: cap each token's importance ratio instead of TRL's default, which drops a whole
    # dialogue when the product of its tokens' ratios exceeds 3 (module docstring).
    vllm_importance_sampling_mode="token_truncate",
)


@dataclass
class TurnCreditArguments:
    """How `--turn_credit` (rollout.DialogueArguments; off by default, as in the paper) adds each policy turn's
    centred emotion change to the advantage of that turn's tokens (`turn_terms`)."""

    # Half: the final emotion (the paper's reward, what the benchmark scores) stays the larger part.
    turn_credit_coef: float = field(default=0.5, metadata={"help": "weight of the turn term (the outcome term has 1)"})
    # The first reply meets a fresh opening, later ones a user already moved: compare like with like.
    turn_credit_baseline: Literal["turn", "group"] = field(default="turn", metadata={
        "help": "turn: centre on the group's changes at the same turn; group: on all the group's turns"})
    # std: unitless, as TRL's scale_rewards="group" makes the outcome term; bound: a fixed scale, which does
    # not inflate a group whose changes barely differ.
    turn_credit_scale: Literal["std", "bound"] = field(default="std", metadata={
        "help": "std: divide by the std of the changes compared; bound: by the simulator's change bound"})

    # GiGPO's anchor-state groups for dialogues: a group's replies compared from one context at every turn,
    # not only at the first, where all of a profile's dialogues start alike.
    turn_groups: bool = field(default=False, metadata={
        "help": "each group of one profile's dialogues plays its first dialogue's replies up to a turn (the next "
                "group the next turn, and so on from step to step) and parts there: the group's replies at that "
                "turn answer one context and only they and the later turns are trained (the rule user only)"})

    def __post_init__(self):
        guards.check_options(self, turn_credit_coef=guards.NOT_NEGATIVE)


def make_parser() -> TrlParser:
    parser = TrlParser((rollout.DialogueArguments, simulator.SimulatorArguments, TurnCreditArguments, GRPOConfig,
                        ModelConfig))
    parser.set_defaults(**DEMO_DEFAULTS)
    return parser


def parse_arguments(argv: list[str] | None = None):
    """(dialogue, simulator, turn credit, training, model) arguments: DEMO_DEFAULTS, then the --config YAML,
    then flags."""
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    with guards.usage_errors(parser, argv, hint=preflight.batch_hint):
        dialogue_args, simulator_args, credit_args, training_args, model_args = parser.parse_args_and_config(
            common.split_config_flag(argv))
        preflight.check_grpo_options(dialogue_args, simulator_args, credit_args, training_args, model_args)
    if str(training_args.resume_from_checkpoint).lower() in ("false", "none"):  # a path to transformers
        training_args.resume_from_checkpoint = None
    return dialogue_args, simulator_args, credit_args, training_args, model_args


def shared_openings(runner: rollout.DialogueRunner, profiles: list, training_args: GRPOConfig) -> dict[str, str]:
    """Each profile's opening line, made on the main process and sent to the others. An LLM simulator samples
    openings, and a group of dialogues may span ranks: openings made on every rank would start one group's
    dialogues from different user messages. An error there is raised on every rank, not only the main one."""
    made = [None]
    if training_args.distributed_state.is_main_process:
        try:
            made = [runner.openings(profiles)]
        except Exception as error:  # the others wait in the broadcast: send them the error to raise
            made = [error]
    broadcast_object_list(made)
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def make_emotion_reward(dialogue_args: rollout.DialogueArguments):
    """The reward function TRL calls: it reads the rollout's per-row fields (rollout.dialogue_record), never
    the completion text."""

    def emotion_reward(completions, log_metric=None, **columns) -> list[float | None]:
        """Final emotion / 100 (minus the optional format penalty), or None for a dialogue whose simulator
        failed (TRL then leaves it out of its group's baseline and gives it zero advantage); logs the
        step's dialogue metrics."""
        if log_metric is not None:
            for name, value in rollout.dialogue_metrics(columns, dialogue_args.max_turns).items():
                log_metric(name, value)
        return [None if failed else rollout.reward(emotion, violations, turns, dialogue_args.format_penalty)
                for emotion, violations, turns, failed in zip(columns["final_emotion"], columns["format_violations"],
                                                            columns["turns"], columns["failed"])]

    return emotion_reward


def turn_group_plan(profile_ids: list[str], group_size: int, max_turns: int, first_group: int) -> list[tuple[int, int]]:
    """--turn_groups: for each row, (its group's first row, the turns it shares with that row). Group k (counted
    over all ranks and steps from `first_group`) parts at turn k mod max_turns, so a step covers every turn when
    it has as many groups as turns. Refused when this rank's rows do not hold whole groups."""
    plan = []
    for first in range(0, len(profile_ids), group_size):
        group = profile_ids[first:first + group_size]
        if len(group) != group_size or len(set(group)) != 1:
            raise common.InputError(
                f"--turn_groups: this rank's {len(profile_ids)} rows do not come in whole groups of "
                f"{group_size} dialogues of one profile; make --per_device_train_batch_size a multiple of "
                f"--num_generations")
        turns = (first_group + first // group_size) % max_turns
        plan += [(first, turns)] * group_size
    return plan


def importance_ratios_cut(ratio: torch.Tensor, trained: torch.Tensor, args: GRPOConfig):
    """(tokens whose vLLM importance ratio TRL clipped or zeroed, tokens trained), counted over `trained`
    (1 = a policy token in the loss, 0 = padding or a simulator token). `ratio` is TRL's, after its cut:
    (rows, tokens) in the token modes, (rows, 1) in the sequence modes, where a cut row counts all its tokens.
    In the mask modes a ratio that underflowed to 0 counts too: its weight in the loss is zero all the same."""
    ratio, trained = ratio.expand_as(trained), trained.bool()
    if args.vllm_importance_sampling_mode.endswith("_mask"):
        cut = ratio == 0
    else:  # *_truncate: clamped exactly onto a bound
        cut = torch.zeros_like(trained)
        if args.vllm_importance_sampling_clip_max is not None:
            cut |= ratio >= args.vllm_importance_sampling_clip_max
        if args.vllm_importance_sampling_clip_min is not None:
            cut |= ratio <= args.vllm_importance_sampling_clip_min
    return (cut & trained).sum(), trained.sum()


def ranks_clipped_share(ratio: torch.Tensor, trained: torch.Tensor, args: GRPOConfig, accelerator) -> float:
    """The share of every rank's trained tokens whose importance ratio TRL cut (importance_ratios_cut)."""
    counts = torch.stack(importance_ratios_cut(ratio, trained, args))
    cut, total = accelerator.gather(counts.float().unsqueeze(0)).sum(0).tolist()
    return cut / max(total, 1)


def turn_terms(turn_changes: list[list[int]], failed: list[bool], group_size: int, baseline: str, scale: str,
               change_bound: int) -> list[list[float]]:
    """The turn-level term of each policy turn of each row, before its coefficient. Rows come in groups of
    `group_size` dialogues of one profile, as TRL's sampler lays them out (and normalises their outcomes).
    A turn's emotion change is centred on the group's changes at the same turn (baseline "turn") or on all
    the group's turns ("group"), and divided by the sample standard deviation of those changes (scale
    "std", as TRL scales outcomes) or by the change bound ("bound"). A dialogue whose simulator failed gets
    no term and is left out of its group's statistics; a change compared with nothing else (the only
    dialogue of its group to reach that turn) gets 0."""
    terms = [[0.0] * len(changes) for changes in turn_changes]
    for first in range(0, len(turn_changes), group_size):
        scored = [row for row in range(first, first + group_size) if not failed[row]]
        if baseline == "group":
            pools = [[(row, turn) for row in scored for turn in range(len(turn_changes[row]))]]
        else:
            longest = max((len(turn_changes[row]) for row in scored), default=0)
            pools = [[(row, turn) for row in scored if turn < len(turn_changes[row])] for turn in range(longest)]
        for pool in pools:
            if len(pool) < 2:
                continue
            changes = torch.tensor([float(turn_changes[row][turn]) for row, turn in pool], dtype=torch.float64)
            spread = changes.std() + 1e-4 if scale == "std" else float(change_bound)  # 1e-4: TRL's, for equal changes
            for (row, turn), term in zip(pool, ((changes - changes.mean()) / spread).tolist()):
                terms[row][turn] = term
    return terms


def ranks_turn_terms(rows: list[dict], rank: int, group_size: int, credit, change_bound: int) -> tuple[list, list]:
    """(this rank's rows' turn terms, every rank's): groups may span ranks, as for the outcome, so the terms are
    computed over every rank's rows (gathered in rank order, each rank holding as many) and this rank's are taken."""
    every = gather_object([(row["turn_changes"], row["failed"]) for row in rows])
    terms = turn_terms([changes for changes, _ in every], [failed for _, failed in every], group_size,
                       credit.turn_credit_baseline, credit.turn_credit_scale, change_bound)
    first = rank * len(rows)
    return terms[first:first + len(rows)], terms


def token_advantages(outcome: torch.Tensor, terms: list[list[float]], token_turns: list[list[int]], width: int,
                     coef: float) -> torch.Tensor:
    """(rows, width) advantages: each row's outcome advantage on every token, plus coef x its turn's term on
    the tokens that turn sampled (`token_turns`: a token's turn, -1 where inserted; the loss masks those and
    the padding anyway, but they get no turn term)."""
    per_token = torch.zeros(len(terms), width, dtype=torch.float64)
    for row, (row_terms, turn_of) in enumerate(zip(terms, token_turns)):
        lookup = torch.tensor(row_terms + [0.0], dtype=torch.float64)  # index -1: inserted tokens
        per_token[row, :len(turn_of)] = lookup[torch.tensor(turn_of, dtype=torch.long)]
    return outcome.unsqueeze(1) + (coef * per_token).to(outcome.dtype).to(outcome.device)


class StepLines(ProgressCallback):
    """The Trainer's progress bar with one short line per step (rollout.step_line) in place of its dictionary of
    every metric, which trainer_state.json and the tracker keep."""

    def __init__(self, think: bool):
        super().__init__()
        self.think = think

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and "emotion/final_mean" in (logs or {}):
            self.training_bar.write(rollout.step_line(state.global_step, state.max_steps, logs, self.think))


class DialogueGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer plus, with --turn_credit, token-level advantages (the dialogue's outcome advantage, TRL's,
    plus turn_credit_coef x the turn term on each turn's sampled tokens; TRL's loss takes (rows, tokens) as they
    are), and `sampling/importance_sampling_ratio/clipped_share`, the share of trained tokens whose vLLM
    importance ratio was cut (TRL logs only the ratio's min, mean and max)."""

    def __init__(self, *args, credit: TurnCreditArguments | None, change_bound: int, **kwargs):
        """`credit`: how turn credit is given, or None without --turn_credit."""
        super().__init__(*args, **kwargs)
        self.credit, self.change_bound = credit, change_bound
        if self.use_vllm and hasattr(self.model, "peft_config"):
            import vllm_backends

            vllm_backends.merge_lora_out_of_place(self.vllm_generation)

    def _save_checkpoint(self, model, trial):
        guards.check_run_folder_kept(self.args.output_dir)  # not into another run's folder moved into its place
        return super()._save_checkpoint(model, trial)

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.credit is not None:
            # TRL has merged the rollout's per-row fields into `inputs`.
            own, terms = ranks_turn_terms(inputs, self.accelerator.process_index, self.num_generations, self.credit,
                                          self.change_bound)
            batch["advantages"] = token_advantages(batch["advantages"], own, [row["token_turns"] for row in inputs],
                                                   batch["completion_ids"].shape[1], self.credit.turn_credit_coef)
            weighted = [self.credit.turn_credit_coef * abs(term) for row_terms in terms for term in row_terms]
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["turn_credit/mean_abs_term"].append(sum(weighted) / max(len(weighted), 1))
        if "importance_sampling_ratio" in batch:  # use_vllm with the correction on
            trained = batch["completion_mask"] * batch.get("tool_mask", 1)  # tool_mask: the rollout's env_mask
            share = ranks_clipped_share(batch["importance_sampling_ratio"], trained, self.args, self.accelerator)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["sampling/importance_sampling_ratio/clipped_share"].append(share)
        return batch


def train_and_save(trainer: DialogueGRPOTrainer, training_args: GRPOConfig, runner) -> None:
    """Train; save after a step where too many simulators failed, or after Ctrl-C; save the model at the end."""
    with preflight.grpo_stops_on_ctrl_c(trainer, training_args, runner):
        try:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        except rollout.TooManySimulatorFailures as error:
            trainer._save_checkpoint(trainer.model, trial=None)  # Trainer's own checkpoint: weights, optimizer, RNG
            folder = Path(training_args.output_dir) / f"checkpoint-{trainer.state.global_step}"
            raise SystemExit(f"stopped at step {trainer.state.global_step} ({folder} holds the state before it; "
                             f"continue with --resume_from_checkpoint {folder}): {error}") from None
    guards.check_run_folder_kept(training_args.output_dir)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    runner.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    common.quiet_libraries()
    common.use_all_cpu_cores()
    dialogue_args, simulator_args, credit_args, training_args, model_args = parse_arguments(argv)
    if dialogue_args.think and training_args.output_dir == DEMO_DEFAULTS["output_dir"]:
        training_args.output_dir += "-think"  # the two demo runs side by side
    # Every input that can be checked without a model is, before one loads (or the simulator's endpoint is asked);
    # the run folder is claimed as this run's.
    preflight.check_grpo_start(argv, make_parser(), DEMO_DEFAULTS, training_args, model_args)
    model_path = common.resolve_model(model_args.model_name_or_path)
    training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    profiles = {p.id: p for p in simulator.load_playable_profiles(dialogue_args.profiles, simulator_args,
                                                                   dialogue_args.think)}
    preflight.check_grpo_run(model_path, profiles, dialogue_args, simulator_args, credit_args, training_args,
                             model_args)
    if training_args.distributed_state.is_main_process:
        print(rollout.run_line("GRPO", model_args.model_name_or_path, model_args.use_peft, simulator_args.backend,
                               dialogue_args.think, training_args.max_steps, training_args.output_dir), flush=True)
    transcripts = Path(training_args.output_dir) / "transcripts.jsonl"
    if training_args.resume_from_checkpoint:
        preflight.prepare_resume(training_args, transcripts)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    runner = rollout.DialogueRunner(tokenizer, dialogue_args, simulator_args, rollout.make_chat(simulator_args))
    runner.check_chat()  # fail now, not after loading the model
    openings = shared_openings(runner, list(profiles.values()), training_args)
    runner.check_room([(profile, openings[profile.id]) for profile in profiles.values()])

    def rollout_func(prompts: list[str], trainer) -> dict:
        starts = [(profiles[profile_id], openings[profile_id]) for profile_id in prompts]
        shared = None
        if credit_args.turn_groups:
            groups = len(prompts) // training_args.num_generations
            first_group = (trainer.state.global_step * trainer.accelerator.num_processes
                           + trainer.accelerator.process_index) * groups
            shared = turn_group_plan(prompts, training_args.num_generations, dialogue_args.max_turns, first_group)
        with generation.trainer_generator(trainer, dialogue_args.prefix_cache, dialogue_args.rollout) as generate:
            dialogues = runner.run(starts, generate, shared)
        # Before writing: a resumed run plays the step again.
        rollout.check_failures(dialogues, dialogue_args.max_failed_share, trainer.accelerator)
        rank = trainer.accelerator.process_index
        path = transcripts if trainer.accelerator.num_processes == 1 else transcripts.with_suffix(f".rank{rank}.jsonl")
        guards.check_run_folder_kept(path.parent)
        rollout.write_transcripts(path, dialogues, step=trainer.state.global_step)
        return rollout.rollout_output(dialogues, with_logprobs=training_args.use_vllm)

    trainer = DialogueGRPOTrainer(
        model=model_path,
        reward_funcs=make_emotion_reward(dialogue_args),
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": list(profiles)}),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        rollout_func=rollout_func,
        credit=credit_args if dialogue_args.turn_credit else None,
        change_bound=simulator_args.change_bound,
    )
    if not training_args.disable_tqdm:
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(StepLines(dialogue_args.think))
    preflight.check_grpo_vllm_length(trainer, training_args, dialogue_args)
    train_and_save(trainer, training_args, runner)
    if trainer.accelerator.is_main_process:
        print(f"read the dialogues: {common.script_command('report.py')} {shlex.quote(training_args.output_dir)}")


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
    with guards.one_line_exits("--resume_from_checkpoint true"):
        main()
