"""GRPO against a simulated user: TRL's GRPOTrainer with a multi-turn `rollout_func`.

Each training prompt is a profile id. TRL's sampler repeats it `num_generations` times; every copy
becomes one dialogue with its own simulator, and all copies share the profile and its opening line
(made once per profile before training). `rollout.py` plays the dialogues at token level and the
reward is the final emotion / 100, read from the rollout's `final_emotion` field (not from the
decoded completion text).

Offline demo (the defaults): the packaged SmolLM2-135M-Instruct with LoRA, against the rule
simulator on our English profiles, about 15 minutes on 2 CPU cores:

    accelerate launch train_grpo.py            # reply only
    accelerate launch train_grpo.py --think    # think, then reply

The paper's runs (GPUs, an LLM simulator on an OpenAI-compatible endpoint):

    accelerate launch --config_file accelerate_configs/zero3.yaml train_grpo.py \\
        --config recipes/grpo_qwen2.5-7b_think.yaml

Every GRPOConfig and ModelConfig flag of TRL works too (`--report_to trackio`, `--push_to_hub`,
`--use_vllm`, `--lora_r`, ...). Where the demo defaults differ from the paper (DESIGN.md section 5),
`DEMO_DEFAULTS` says so; the recipes hold the paper's values.

Logged every step (README "Metrics"): reward; emotion/final_mean, emotion/success_rate (final =
100), emotion/failure_rate (final < 10), emotion/after_turn_k; dialogue/turns_mean,
dialogue/ended_<reason>; format/violation_rate; length/think_tokens_per_turn,
length/reply_tokens_per_turn; simulator/seconds_per_turn. Transcripts of every dialogue go to
`<output_dir>/transcripts.jsonl` (benchmark result format plus step and thoughts).
"""
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer, ModelConfig, TrlParser, get_peft_config

import rollout
import simulator


# The offline demo. Paper values (DESIGN.md section 5) in the comments; recipes/ hold them.
DEMO_DEFAULTS = dict(
    model_name_or_path=simulator.PACKAGED_MODEL,  # paper: Qwen2.5-7B-Instruct
    output_dir="runs/grpo-demo",
    use_peft=True, lora_r=16, lora_alpha=32,  # paper: full fine-tune; on CPU only LoRA learns visibly (DESIGN.md 8)
    learning_rate=1e-3,  # paper: 1e-6 (full fine-tune); LoRA on a 135M model in 30 steps needs far more
    lr_scheduler_type="constant",  # a 30-step run should not spend its last steps at a decayed rate
    num_generations=4,  # paper: 4 dialogues per profile
    per_device_train_batch_size=8,  # 2 profiles x 4 dialogues per step (paper: 32 dialogues per step)
    max_steps=30,  # paper: 1000 steps on 32 GPUs
    temperature=1.0,  # paper: 1.0
    beta=0.0,  # paper: no KL, no reference model
    logging_steps=1, save_strategy="no", report_to="none",
    gradient_checkpointing=False,  # a 135M model fits; checkpointing would only slow the CPU down
    bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
)


def make_emotion_reward(config: rollout.RolloutConfig):
    """The reward function TRL calls: it reads the rollout's per-row fields, never the completion text."""

    def emotion_reward(completions, final_emotion, format_violations, turns, end_reason, think_tokens,
                       reply_tokens, simulator_seconds, emotions, failed, simulator_calls, log_metric=None,
                       **_) -> list[float | None]:
        """Final emotion / 100 (minus the optional format penalty), or None for a dialogue whose simulator
        failed (TRL then leaves it out of its group's baseline and gives it zero advantage); logs the
        step's dialogue metrics."""
        if log_metric is not None:
            for name, value in rollout.dialogue_metrics(final_emotion, turns, end_reason, format_violations,
                                                        think_tokens, reply_tokens, simulator_seconds, emotions,
                                                        failed, simulator_calls, config.max_turns).items():
                log_metric(name, value)
        return [None if lost else rollout.reward(emotion, violations, config.format_penalty)
                for emotion, violations, lost in zip(final_emotion, format_violations, failed)]

    return emotion_reward


def main() -> None:
    rollout.use_all_cpu_cores()
    parser = TrlParser((rollout.DialogueArguments, simulator.SimulatorArguments, GRPOConfig, ModelConfig))
    parser.set_defaults(**DEMO_DEFAULTS)
    try:
        dialogue_args, simulator_args, training_args, model_args = parser.parse_args_and_config()
    except simulator.ArgumentError as error:  # a value that cannot work: usage and what to fix, exit 2
        parser.error(str(error))

    if dialogue_args.think and training_args.output_dir == DEMO_DEFAULTS["output_dir"]:
        training_args.output_dir += "-think"  # the two demo runs side by side
    transcripts = Path(training_args.output_dir) / "transcripts.jsonl"
    if transcripts.exists() and not training_args.resume_from_checkpoint:
        raise SystemExit(f"{training_args.output_dir} already holds a run ({transcripts.name}); choose another "
                         "--output_dir, delete that folder, or pass --resume_from_checkpoint to continue it")
    if training_args.resume_from_checkpoint:  # the checkpoint's steps will be played again: drop their rows
        state = Path(training_args.resume_from_checkpoint) / "trainer_state.json"
        if not state.is_file():
            raise SystemExit(f"--resume_from_checkpoint {training_args.resume_from_checkpoint}: no trainer_state.json "
                             f"there; give a checkpoint folder such as {training_args.output_dir}/checkpoint-10")
        for path in [transcripts, *transcripts.parent.glob("transcripts.rank*.jsonl")]:
            rollout.keep_rows_before(path, json.loads(state.read_text())["global_step"])
    training_args.model_init_kwargs = {"dtype": model_args.dtype, **(training_args.model_init_kwargs or {})}
    profiles = {p.id: p for p in simulator.load_profiles(dialogue_args.profiles)}
    model_path = simulator.resolve_model(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chat = simulator.make_chat(simulator_args)
    config = rollout.rollout_config(dialogue_args, simulator_args)
    runner = rollout.DialogueRunner(tokenizer, config, chat)
    if chat is not None:
        runner.loop.run_until_complete(chat.check())  # fail now, not after loading the model
    openings = runner.openings(list(profiles.values()))

    def rollout_func(prompts: list[str], trainer) -> dict:
        starts = [(profiles[profile_id], openings[profile_id]) for profile_id in prompts]
        with rollout.trainer_generator(trainer) as generate:
            dialogues = runner.run(starts, generate)
        rollout.check_failures(dialogues, dialogue_args.max_failed_share)  # before writing: a resume replays the step
        rank = trainer.accelerator.process_index
        path = transcripts if trainer.accelerator.num_processes == 1 else transcripts.with_suffix(f".rank{rank}.jsonl")
        rollout.write_transcripts(path, dialogues, step=trainer.state.global_step)
        return rollout.rollout_output(dialogues, with_logprobs=training_args.use_vllm)

    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=make_emotion_reward(config),
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": list(profiles)}),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        rollout_func=rollout_func,
    )
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except rollout.TooManySimulatorFailures as error:
        trainer._save_checkpoint(trainer.model, trial=None)  # Trainer's own full checkpoint: weights, optimizer, RNG
        folder = Path(training_args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        raise SystemExit(f"stopped at step {trainer.state.global_step} ({folder} holds the state before it; "
                         f"continue with --resume_from_checkpoint {folder}): {error}") from None
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    runner.close()
    if trainer.accelerator.is_main_process:
        print(f"read the dialogues: python report.py {training_args.output_dir}")


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
    try:
        main()
    except (simulator.SimulatorError, simulator.ProfileError) as error:  # bad endpoint or profiles: say what, no traceback
        raise SystemExit(f"error: {error}") from None
