"""The trainers' guards (guards.py holds the general ones): what train_grpo.py and train_ppo.py refuse, or warn
about, before a model loads, so that a mistake costs seconds, not a model load and a traceback; the run folder
claimed; resume, checked and prepared; Ctrl-C, which stops after the step in progress with a checkpoint. Kept
apart so that the training scripts read as their algorithm: each calls these from a few visible places, every
call a statement of its own that a copy of the method may delete (docs/copying.md)."""
import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path
from urllib.parse import urlsplit

from accelerate.tracking import get_available_trackers
from accelerate.utils import DistributedType, LoggerType
from transformers import PretrainedConfig, TrainerCallback
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations
from trl import GRPOConfig

import common
import guards


# --------------------------------------------------------------------------------------------
# GRPO (train_grpo.py)
# --------------------------------------------------------------------------------------------

# The options that make a run what it is, which a resume keeps: other values would mix two methods in one run
# (or fail on weights of another shape). Each trainer adds its own; batch sizes and learning rates may change.
KEPT_ON_RESUME = ("think", "start_emotion", "max_turns", "max_think_tokens", "max_reply_tokens",
                  "max_dialogue_tokens", "format_penalty", "policy_prompt", "backend", "variant", "simulator_model",
                  "change_bound", "language", "simulator_prompts", "policy_prompts", "use_peft", "lora_r",
                  "lora_alpha", "dtype", "temperature", "turn_credit", "profiles", "empty_user_message",
                  "analysis_emotion", "simulator_temperature", "simulator_max_tokens")
GRPO_KEPT_ON_RESUME = ("lora_target_modules", "num_generations", "beta", "loss_type", "turn_credit_coef",
                       "turn_credit_baseline", "turn_credit_scale", "turn_groups")
PPO_KEPT_ON_RESUME = ("critic_model_name_or_path", "per_turn_rows", "gamma", "lam", "kl_coef")


def check_grpo_options(dialogue_args, simulator_args, credit_args, training_args: GRPOConfig, model_args) -> None:
    """The option values train_grpo.py refuses while parsing (guards.usage_errors: usage, exit 2)."""
    check_trl_options(training_args, model_args)
    check_turn_credit(dialogue_args, credit_args, training_args)
    if credit_args.turn_groups and simulator_args.backend != "rule":
        raise common.ArgumentError(f"--turn_groups with --backend {simulator_args.backend}: a group's dialogues share "
                                   "their first turns only with a user that answers the same reply the same way; use "
                                   "--backend rule")


def check_grpo_start(argv: list[str], parser, demo_defaults: dict, training_args: GRPOConfig, model_args) -> None:
    """train_grpo.py's first checks, before anything slow: the set-up (check_setup), vLLM, the model by name."""
    check_setup(argv, training_args, parser, demo_defaults)
    guards.check_vllm(training_args.use_vllm)
    guards.check_model(model_args.model_name_or_path, "model_name_or_path")


def check_grpo_run(model_path: str, profiles: dict, dialogue_args, simulator_args, credit_args,
                   training_args: GRPOConfig, model_args) -> None:
    """The rest of what train_grpo.py can check without loading a model (or asking the simulator's endpoint);
    then the run folder claimed as this run's, and the model's folder checked just before it loads."""
    check_master_weights(model_path, training_args, model_args.use_peft)
    check_profile_count(len(profiles), dialogue_args.profiles, training_args)
    check_addresses_on_several_nodes(simulator_args, vllm_server_address(training_args, dialogue_args))
    guards.check_process_count(training_args.distributed_state)
    settings = guards.run_settings(KEPT_ON_RESUME + GRPO_KEPT_ON_RESUME, dialogue_args, simulator_args,
                                   credit_args, model_args, training_args)
    guards.claim_run_folder(training_args.output_dir, "train_grpo.py", model_args.model_name_or_path,
                            bool(training_args.resume_from_checkpoint), "--resume_from_checkpoint", settings,
                            training_args.distributed_state)
    guards.check_model_folder(model_path, "model_name_or_path")


def vllm_server_address(training_args: GRPOConfig, dialogue_args) -> str | None:
    """The vLLM server every rank sends its turns to (server mode, --rollout async), else None."""
    if not (training_args.use_vllm and training_args.vllm_mode == "server" and dialogue_args.rollout == "async"):
        return None
    import vllm_backends

    return vllm_backends.server_url(training_args.vllm_server_base_url, training_args.vllm_server_host,
                                    training_args.vllm_server_port)


def check_trl_options(training_args: GRPOConfig, model_args) -> None:
    """TRL's dataclasses are not ours: check their values here, or inf, nan or a negative temperature would
    fail only after the model loaded (with a traceback), or not at all (save_steps 0 and max_steps -5 train on
    without the checkpoints or the steps asked for)."""
    guards.check_options(training_args, temperature=guards.POSITIVE, learning_rate=guards.NOT_NEGATIVE,
                         per_device_train_batch_size=guards.AT_LEAST_ONE, num_generations=guards.AT_LEAST_ONE,
                         gradient_accumulation_steps=guards.AT_LEAST_ONE, save_steps=guards.POSITIVE,
                         max_steps=(lambda value: value == -1 or value >= 1,
                                    "at least 1 (or -1: as many as --num_train_epochs make)"),
                         beta=guards.NOT_NEGATIVE, seed=guards.SEED,
                         data_seed=(lambda value: value is None or guards.SEED[0](value), guards.SEED[1]))
    guards.check_options(model_args)


def check_turn_credit(dialogue_args, credit_args, training_args: GRPOConfig) -> None:
    """Refuse the GRPOConfig options whose meaning turn credit would silently change. TRL writes them for one
    advantage per dialogue; with turn credit the advantages are (rows, tokens), which TRL's loss takes as they are
    (`DialogueGRPOTrainer`). Unchanged by that, so allowed: the token-level losses (dapo, grpo, bnpo, dr_grpo,
    cispo, sapo, luspo at importance_sampling_level token), every vllm_importance_sampling_mode (its ratio comes
    from the sampled tokens alone, sequence_* modes weigh all a dialogue's tokens alike whatever their advantages),
    top_entropy_quantile, beta and delta (per token), scale_rewards group or batch (both terms in stds)."""
    if not dialogue_args.turn_credit:
        return
    if training_args.importance_sampling_level == "sequence":
        raise common.ArgumentError(
            "--turn_credit with --importance_sampling_level sequence (GSPO): one ratio per dialogue gives each of its "
            "tokens the gradient of the dialogue's mean advantage, so no turn would be credited apart from the others; "
            "use --importance_sampling_level token")
    if training_args.loss_type == "vespo":
        raise common.ArgumentError(
            "--turn_credit with --loss_type vespo: VESPO weighs a whole dialogue by its sequence-level ratio, shaped "
            "by the sign of its advantage, and turn credit gives a dialogue's tokens advantages of both signs; use a "
            "token-level --loss_type (dapo, TRL's default)")
    if training_args.off_policy_mask_threshold is not None:
        raise common.ArgumentError(
            "--turn_credit with --off_policy_mask_threshold: the mask drops an off-policy dialogue with a negative "
            "advantage, and with turn credit TRL would drop only its tokens whose advantage is negative, keeping the "
            "rest; leave --off_policy_mask_threshold unset")
    if training_args.scale_rewards == "none" and credit_args.turn_credit_scale == "std":
        raise common.ArgumentError(
            "--turn_credit with --scale_rewards none and --turn_credit_scale std: the outcome term would stay in "
            "reward units and the turn term in standard deviations, so --turn_credit_coef would no longer weigh one "
            "against the other; pass --turn_credit_scale bound (a fixed scale, as the outcome's), or --scale_rewards "
            "group")


def batch_hint(message: str) -> str:
    """What to change, added to TRL's error when num_generations does not divide the batch."""
    return ("; choose --num_generations dividing it, or change --per_device_train_batch_size"
            if "divisible by num_generations" in message else "")


def demo_defaults_kept(argv: list[str], parser, demo_defaults: dict) -> dict:
    """The demo defaults (train_grpo.DEMO_DEFAULTS, set on `parser`) that a run with --config keeps because
    neither its YAML nor a flag sets them: a paper-scale config must not inherit the CPU demo's LoRA,
    learning rate or save_strategy unnoticed."""
    path = guards.config_file(argv)
    if path is None:
        return {}
    config_keys = set(guards.read_config(path, parser, extra_keys=("env",)))
    flags = {arg[2:].split("=")[0] for arg in argv if arg.startswith("--")}
    return {key: value for key, value in demo_defaults.items() if key not in config_keys | flags}


def missing_trackers(report_to: list[str]) -> list[str]:
    """The trackers of `report_to` whose package is not installed. The Trainer would find out only after
    loading the model; names transformers does not know are left to its own error."""
    installed = get_available_reporting_integrations()
    # That list leaves out flyte (no check), azure_ml when mlflow is there, kubeflow without its variable.
    checked = set(INTEGRATION_TO_CALLBACK) - {"flyte", "azure_ml", "kubeflow"}
    return [name for name in report_to if name in checked and name not in installed]


def check_setup(argv: list[str], training_args: GRPOConfig, parser, demo_defaults: dict) -> None:
    """Refuse what would fail after the model loaded, and warn about what would silently mislead."""
    missing = missing_trackers(training_args.report_to)
    if missing:
        where = " (trackio is in requirements-gpu.txt)" if "trackio" in missing else ""
        raise SystemExit(f"--report_to {','.join(missing)}: {' and '.join(missing)} not installed. Install it with "
                         f"pip install {' '.join(missing)}{where}, or pass --report_to none")
    guards.check_output_folder(training_args.output_dir, "output_dir")  # not found at the first save
    kept = demo_defaults_kept(argv, parser, demo_defaults)
    if kept:
        values = ", ".join(f"{key}={value!r}" for key, value in kept.items())
        warnings.warn(f"{guards.config_file(argv)} leaves the offline demo's values in force: {values}; "
                      "state these keys in the config")
    if training_args.use_vllm and training_args.vllm_enable_sleep_mode:
        warnings.warn("--vllm_enable_sleep_mode: TRL discards vLLM's weights and KV cache after every generate call "
                      "and pushes all the policy's weights again before the next; the rollout calls generate once "
                      "per turn (twice with --think, more where token budgets differ), so each call pays a full "
                      "weight sync and a prefill of the whole dialogue. Leave it off unless memory forces it (lower "
                      "vllm_gpu_memory_utilization or max_dialogue_tokens first)")


def check_master_weights(model_path: str, training_args: GRPOConfig, use_peft: bool) -> None:
    """Refuse a full fine-tune of 16-bit weights without DeepSpeed, before they load. AdamW's steps of ~lr (1e-6 in
    the recipes) are far below bf16's resolution (1/256 of a weight); DeepSpeed keeps fp32 master weights (the
    recipes launch under accelerate_configs/zero3.yaml), but TRL and the Trainer train the weights in the dtype
    they were loaded in (--bf16 only autocasts), so the run would silently not learn. The dtype is
    model_init_kwargs' (--dtype); "auto" is the checkpoint's, read from its config."""
    if use_peft or training_args.deepspeed_plugin is not None:
        return
    dtype = str(training_args.model_init_kwargs.get("dtype", "float32")).removeprefix("torch.")
    source = f"--dtype {dtype}"
    if dtype == "auto":
        try:
            config = PretrainedConfig.get_config_dict(model_path)[0]
        except OSError:  # no config to read: loading the model will say what is wrong
            return
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
        source = f"--dtype auto ({model_path} is {dtype})"
    if dtype in ("bfloat16", "float16"):
        raise common.InputError(
            f"a full fine-tune (--use_peft false) of {source} weights without DeepSpeed trains them in {dtype}, where "
            "AdamW's steps of ~lr are below the weights' resolution and the model silently does not learn; launch with "
            "accelerate launch --config_file accelerate_configs/zero3.yaml (or zero2.yaml), which keeps fp32 master "
            "weights, or pass --dtype float32, or train LoRA (--use_peft true)")


def check_profile_count(profile_count: int, path: str, training_args: GRPOConfig) -> None:
    """TRL's sampler takes generation_batch_size / num_generations distinct prompts (profiles) per generation
    batch, over all processes, and drops a remainder smaller than that: with fewer profiles it yields no
    batch at all, and the run "finishes" at once with an untrained adapter."""
    needed = training_args.generation_batch_size // training_args.num_generations
    if profile_count < needed:
        raise common.InputError(
            f"{path}: {profile_count} profile(s), but a generation batch of {training_args.generation_batch_size} "
            f"dialogues (--per_device_train_batch_size {training_args.per_device_train_batch_size} x "
            f"{training_args.world_size} process(es) x {training_args.steps_per_generation} steps_per_generation), "
            f"{training_args.num_generations} per profile, needs {needed} distinct profiles; add profiles, or lower "
            "--per_device_train_batch_size")



def trainer_state_step(checkpoint) -> int:
    """The step a GRPO checkpoint holds, as the Trainer reads it."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"]


def resume_checkpoint(training_args: GRPOConfig) -> Path | None:
    """The checkpoint --resume_from_checkpoint names, checked whole and holding the step its name says; `true`
    (or `latest`): the newest such one in output_dir, passing over broken ones with a note, or None where the
    run stopped before its first checkpoint."""
    given, output_dir = training_args.resume_from_checkpoint, training_args.output_dir
    if given.lower() in ("true", "latest"):
        return guards.newest_whole_checkpoint(output_dir, ("trainer_state.json",),
                                              lambda note: print(note, file=sys.stderr), trainer_state_step)
    if not Path(given).exists():
        raise common.InputError(f"--resume_from_checkpoint {given}: no such folder; give its path, such as "
                                f"{Path(output_dir) / Path(given).name}, or true for the newest checkpoint")
    if guards.real_path(given).parent != guards.real_path(output_dir):
        # Its run's settings and rows are in that folder: a resume here would check against, and add to, neither.
        raise common.InputError(f"--resume_from_checkpoint {given}: not a checkpoint of --output_dir "
                                f"{output_dir}; continue its run with --output_dir "
                                f"{Path(given).parent}, or start a new run from a saved model with "
                                "--model_name_or_path")
    problem = guards.checkpoint_problem(given, ("trainer_state.json",), trainer_state_step)
    if problem:
        try:
            newest = guards.newest_whole_checkpoint(output_dir, ("trainer_state.json",), lambda note: None,
                                                    trainer_state_step)
        except common.InputError:
            newest = None
        instead = f"; the newest whole one is {newest}" if newest else ""
        raise common.InputError(f"--resume_from_checkpoint {given}: {problem}; give a checkpoint folder such as "
                                f"{output_dir}/checkpoint-10{instead}, or true for the newest")
    return Path(given)


def prepare_resume(training_args: GRPOConfig, transcripts: Path) -> None:
    """--resume_from_checkpoint: the checkpoint resolved and checked, and the transcript rows of its later steps
    dropped (those steps are played again). A run stopped before its first checkpoint starts over at step 0, as
    a resume starts over after its checkpoint; one that finished without checkpoints is refused (starting over
    would overwrite the model it saved)."""
    checkpoint = resume_checkpoint(training_args)
    output_dir = Path(training_args.output_dir)
    if checkpoint is None:
        if (output_dir / "trainer_state.json").is_file():
            raise common.InputError(f"--resume_from_checkpoint: {output_dir} holds a finished run without "
                                    "checkpoints, so there is nothing to continue; choose another --output_dir")
        training_args.resume_from_checkpoint = None
        trained = 0
    else:
        training_args.resume_from_checkpoint = str(checkpoint)
        trained = trainer_state_step(checkpoint)
        guards.check_steps_left("--resume_from_checkpoint", checkpoint, trained, training_args.max_steps)
    files = [transcripts, *transcripts.parent.glob("transcripts.rank*.jsonl")]
    guards.check_rows_up_to(files, trained)
    dropped = sum(guards.drop_rows_from(path, trained) for path in files)
    if checkpoint is None:
        print(f"--resume_from_checkpoint: no checkpoint in {output_dir} yet (the run stopped before its first save, "
              f"every --save_steps {training_args.save_steps}): starting again at step 0; dropped the {dropped} "
              "transcript rows it wrote, as those steps are played again", file=sys.stderr)


def check_grpo_vllm_length(trainer, training_args: GRPOConfig, dialogue_args) -> None:
    """With --use_vllm, TRL's vLLM (colocated or a server) is long enough for the dialogues (check_vllm_length)."""
    if training_args.use_vllm:
        import vllm_backends

        check_vllm_length(vllm_backends.trainer_max_model_len(trainer), dialogue_args.max_dialogue_tokens)


class StopOnCtrlC(TrainerCallback):
    """Ctrl-C (guards.StopRequest, set as `request` while training): once the step in progress is done, the
    Trainer saves a full checkpoint and stops; `stopped` says it did."""

    def __init__(self):
        self.request, self.stopped = None, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.request is not None and self.request.stop_agreed() and state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = self.stopped = True


@contextlib.contextmanager
def grpo_stops_on_ctrl_c(trainer, training_args: GRPOConfig, runner):
    """Around trainer.train(): a Ctrl-C stops the run once the step in progress is done, the Trainer saving its
    checkpoint (StopOnCtrlC); then the run is marked as interrupted (guards.note_interruption) and exits 130."""
    stop_on_ctrl_c = StopOnCtrlC()
    trainer.add_callback(stop_on_ctrl_c)
    with guards.StopRequest(show=trainer.accelerator.is_main_process) as stop_on_ctrl_c.request:
        yield
    if stop_on_ctrl_c.stopped:  # the Trainer saved the checkpoint of the step it stopped after
        folder = Path(training_args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        runner.close()
        if trainer.accelerator.is_main_process:
            guards.note_interruption(training_args.output_dir, trainer.state.global_step - 1, folder,
                                     guards.resume_command("--resume_from_checkpoint", str(folder)))
        raise SystemExit(130)


# --------------------------------------------------------------------------------------------
# PPO (train_ppo.py)
# --------------------------------------------------------------------------------------------

THIS_MACHINE = re.compile(r"localhost|127\.[0-9.]+|0\.0\.0\.0|::1")  # recipes/slurm_multinode.sh refuses the same


def names_this_machine(address: str) -> bool:
    """Whether a URL or host name means whichever machine reads it."""
    host = urlsplit(address).hostname if "://" in address else address.strip("[]")
    return bool(host) and THIS_MACHINE.fullmatch(host) is not None


def check_addresses_on_several_nodes(simulator_args, vllm_server: str | None = None) -> None:
    """On several nodes every rank calls the simulator's endpoint itself, and with --rollout async in vLLM server
    mode (`vllm_server`: its address then) it sends its own turns to the server: an address naming the machine
    itself names another machine on each node, and the first rollout would fail there."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world <= int(os.environ.get("LOCAL_WORLD_SIZE", world)):  # one node (torchrun sets both)
        return
    base_url = simulator_args.base_url or os.environ.get("OPENAI_BASE_URL") or ""
    if simulator_args.backend == "llm" and names_this_machine(base_url):
        raise common.InputError(f"--base_url {base_url} names each node itself, and every rank calls the simulator; "
                                "give a host every node reaches, e.g. http://SIMULATOR_HOST:8001/v1")
    if vllm_server is not None and names_this_machine(vllm_server):
        raise common.InputError(f"the vLLM server at {vllm_server} is named as each node itself, and with --rollout "
                                "async every rank sends its turns there; give --vllm_server_base_url (or "
                                "--vllm_server_host) with a host every node reaches, or --rollout lockstep (only the "
                                "main process talks to the server then)")


def check_vllm_length(max_model_len: int, max_dialogue_tokens: int) -> None:
    """Refuse a vLLM engine or server shorter than the dialogues: a turn's request keeps context + budget within
    --max_dialogue_tokens, which vLLM serves only within its max_model_len; past it a request fails (HTTP 400,
    or a refused prompt) the first time a dialogue grows that long, possibly hours into the run."""
    if max_model_len < max_dialogue_tokens:
        raise common.InputError(
            f"vLLM's max_model_len is {max_model_len}, below --max_dialogue_tokens {max_dialogue_tokens}: a dialogue "
            "growing past it would fail mid-run; lower --max_dialogue_tokens, or raise vLLM's length "
            "(--vllm_max_model_length colocated, the server's --max-model-len)")


def check_tracker(report_to: str) -> None:
    """accelerate drops a tracker whose package is missing without a word: the run would log nothing; it
    refuses an unknown name only once the models loaded, with a traceback."""
    available = [tracker.value for tracker in get_available_trackers()]
    trackers = [tracker.value for tracker in LoggerType if tracker.value != "all"]
    if report_to not in ("none", "all", *trackers):
        raise SystemExit(f"--report_to {report_to}: not a tracker accelerate knows; give one of none, all, "
                         f"{', '.join(trackers)}")
    if report_to == "all" and not available:
        raise SystemExit("--report_to all: no tracker's package is installed (pip install tensorboard, say), or "
                         "pass --report_to none")
    if report_to not in ("none", "all", *available):
        raise SystemExit(f"--report_to {report_to}: its package is not installed; pip install {report_to} "
                         "(or pass --report_to none)")


def check_launch(args, accelerator) -> None:
    """Refuse the launches this loop cannot run, before any model loads; said by the main process only (every
    rank refuses alike: eight ranks would say it eight times)."""
    guards.check_process_count(accelerator)
    problem = None
    if args.use_vllm and accelerator.num_processes > 1:
        problem = ("--use_vllm in train_ppo.py supports a single training process (the weights are pushed from one); "
                   "with several, generate with transformers (the default)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        problem = ("train_ppo.py does not support DeepSpeed ZeRO-3: its rollout generates with the policy's weights "
                   "partitioned across ranks (it would hang) and its saves would hold empty tensors; launch with "
                   "accelerate_configs/zero2.yaml")
    if problem:
        raise SystemExit(problem if accelerator.is_main_process else 1)


def check_ppo_start(args, simulator_args) -> None:
    """train_ppo.py's first checks, before anything slow: the tracker, vLLM, the output folder (else found at the
    first step's writes, the step lost), the models by name, the endpoints' addresses."""
    check_tracker(args.report_to)
    guards.check_vllm(args.use_vllm)
    guards.check_output_folder(args.output_dir, "output_dir")
    guards.check_model(args.model_name_or_path, "model_name_or_path")
    if args.critic_model_name_or_path:
        guards.check_model_source(args.critic_model_name_or_path, "critic_model_name_or_path")
    check_addresses_on_several_nodes(simulator_args)  # --use_vllm takes one process


def check_ppo_launch(args, dialogue_args, simulator_args, accelerator) -> None:
    """The launch (check_launch), then the run folder claimed as this run's."""
    check_launch(args, accelerator)
    settings = guards.run_settings(KEPT_ON_RESUME + PPO_KEPT_ON_RESUME, args, dialogue_args, simulator_args)
    guards.claim_run_folder(args.output_dir, "train_ppo.py", args.model_name_or_path, args.resume, "--resume",
                            settings, accelerator)


def check_ppo_models(args, policy_path: str) -> None:
    """The models' folders, just before they load (after a resume's files, whose faults show first)."""
    guards.check_model_folder(policy_path, "model_name_or_path")
    if args.critic_model_name_or_path:
        guards.check_model_folder(args.critic_model_name_or_path, "critic_model_name_or_path", tokenizer=False)


def resume_point(output_dir: Path, transcripts: Path, metrics_file: Path, save_steps: int, max_steps: int,
                 accelerator, members: tuple[str, ...], step_of):
    """(newest checkpoint or None, the step to start at), after dropping the rows of the steps that will be
    played again. Without a checkpoint a run resumes at step 0, as a run resumes at its last checkpoint:
    the rows written since were of steps that are played again, so they go, with a note. (Refusing instead
    would leave the user to delete the same rows by hand.) A finished run without checkpoints is refused:
    starting it over would overwrite the policy it saved, and so is a resume with no steps left to train.
    `members`: what a PPO checkpoint holds; `step_of(folder)`: the step its state holds."""
    output_dir = Path(output_dir)
    checkpoint = guards.newest_whole_checkpoint(output_dir, members, accelerator.print, step_of)
    if checkpoint is None and transcripts.exists() and (output_dir / "critic.pt").is_file():
        raise common.InputError(f"--resume: {output_dir} holds a finished run without checkpoints (none every "
                                f"--save_steps {save_steps}), so there is nothing to continue; choose another "
                                "--output_dir for a new run")
    step = 0 if checkpoint is None else int(checkpoint.name.split("-")[1])
    guards.check_steps_left("--resume", checkpoint, step, max_steps)
    guards.check_rows_up_to([transcripts], step)
    if accelerator.is_main_process:
        guards.check_rows_up_to([metrics_file], step, "metrics file")
    dropped = (guards.drop_rows_from(transcripts, step),
               guards.drop_rows_from(metrics_file, step, "metrics file") if accelerator.is_main_process else 0)
    if checkpoint is None and any(dropped):
        accelerator.print(f"--resume: no checkpoint in {output_dir} yet (the run stopped before its first save, at "
                          f"step {save_steps}): starting again at step 0; dropped the {dropped[0]} transcript rows "
                          f"and {dropped[1]} metrics rows it wrote, as those steps are played again")
    return checkpoint, step


def stop_if_asked(stop, step: int, max_steps: int, saved: bool, output_dir: Path, accelerator, save) -> None:
    """Ctrl-C (guards.StopRequest) in a PPO run, decided alike on every rank after each step (stop_agreed): unless
    `step` is the last, save the state before `step` with `save(folder)` unless this step `saved` it, mark the run,
    exit 130. Not decided by the folder's presence: a broken checkpoint passed over at resume may hold the name."""
    if not (stop.stop_agreed() and step < max_steps):
        return
    folder = Path(output_dir) / f"checkpoint-{step}"
    if not saved:
        save(folder)
    if accelerator.is_main_process:
        guards.note_interruption(output_dir, step - 1, folder, guards.resume_command("--resume"))
    raise SystemExit(130)
