"""The paper recipes as the scripts read them, and the GPU-run settings train_grpo.py checks at start-up.

Each recipe is parsed exactly as its script parses it: train_grpo.parse_arguments (TrlParser, the demo's
defaults, then the YAML) and train_ppo.parse_arguments. GRPO recipes get `--bf16 false` on top, only
because TrainingArguments refuses bf16 on a machine without a GPU; the YAML's own value is checked apart."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import preflight
import train_grpo
import train_ppo

GRPO_DEMO = (train_grpo.make_parser(), train_grpo.DEMO_DEFAULTS)  # what preflight checks --config against

REPO = Path(__file__).resolve().parent.parent
GRPO_RECIPES = sorted((REPO / "recipes").glob("grpo_*.yaml"))
PPO_RECIPES = sorted((REPO / "recipes").glob("ppo_*.yaml"))
DIALOGUES_PER_STEP = 32  # the paper's batch (the RLVER paper's training settings)


def processes(accelerate_config: str) -> int:
    return yaml.safe_load((REPO / "accelerate_configs" / accelerate_config).read_text())["num_processes"]


def grpo_arguments(recipe: Path):
    """(dialogue, simulator, turn credit, training, model) arguments of `accelerate launch train_grpo.py --config recipe`."""
    return train_grpo.parse_arguments(["--config", str(recipe), "--bf16", "false"])


def test_there_are_two_grpo_and_two_ppo_recipes():
    assert [r.name for r in GRPO_RECIPES] == ["grpo_qwen2.5-7b.yaml", "grpo_qwen2.5-7b_think.yaml"]
    assert [r.name for r in PPO_RECIPES] == ["ppo_qwen2.5-7b.yaml", "ppo_qwen2.5-7b_think.yaml"]


# --------------------------------------------------------------------------------------------
# GRPO recipes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_states_every_demo_default_so_none_leaks_in(recipe):
    assert preflight.demo_defaults_kept(["--config", str(recipe)], *GRPO_DEMO) == {}
    assert set(train_grpo.DEMO_DEFAULTS) <= set(yaml.safe_load(recipe.read_text()))


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_saves_a_checkpoint_every_100_steps(recipe):
    _, _, _, training_args, _ = grpo_arguments(recipe)
    assert (training_args.save_strategy, training_args.save_steps) == ("steps", 100)
    assert training_args.output_dir.startswith("runs/grpo-qwen2.5-7b")


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_holds_the_papers_values(recipe):
    dialogue_args, simulator_args, _, training_args, model_args = grpo_arguments(recipe)
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct" and model_args.dtype == "bfloat16"
    assert model_args.use_peft is False  # a full fine-tune, not the demo's LoRA
    assert training_args.learning_rate == 1e-6
    # verl's constant schedule after a 2% warm-up, not the demo's plain constant nor TRL's linear decay
    assert (training_args.lr_scheduler_type, training_args.warmup_steps) == ("constant_with_warmup", 20)
    assert (training_args.beta, training_args.epsilon, training_args.num_iterations) == (0.0, 0.2, 1)
    assert (training_args.num_generations, training_args.temperature, training_args.max_steps) == (4, 1.0, 1000)
    assert dialogue_args.max_turns == 8 and dialogue_args.max_reply_tokens == 1024
    assert dialogue_args.think == ("think" in recipe.name)
    assert not dialogue_args.think or dialogue_args.max_think_tokens == 4096
    assert simulator_args.backend == "llm" and simulator_args.variant == "vanilla"
    assert training_args.gradient_checkpointing is True and training_args.logging_steps == 1
    assert training_args.dataloader_pin_memory is True  # the demo pins only where CUDA is; a GPU run pins
    assert yaml.safe_load(recipe.read_text())["bf16"] is True  # overridden above only for this CPU machine
    assert training_args.report_to == ["trackio"]


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_trains_one_dialogue_at_a_time_and_32_per_optimizer_step_from_one_rollout(recipe):
    _, _, _, training_args, _ = grpo_arguments(recipe)
    assert training_args.per_device_train_batch_size == 1  # activations of one dialogue (recipe header)
    per_step = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
    assert per_step * processes("zero3.yaml") == DIALOGUES_PER_STEP
    assert training_args.steps_per_generation == training_args.gradient_accumulation_steps  # one rollout a step
    assert DIALOGUES_PER_STEP % training_args.num_generations == 0


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_colocates_vllm_sized_to_its_dialogues_without_sleep_mode(recipe):
    dialogue_args, _, _, training_args, _ = grpo_arguments(recipe)
    assert training_args.use_vllm and training_args.vllm_mode == "colocate"
    assert training_args.vllm_max_model_length == dialogue_args.max_dialogue_tokens == 16384
    assert training_args.vllm_enable_sleep_mode is False


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_plays_its_rollout_async(recipe):
    """Colocated vLLM with tensor parallelism 1 and no sleep mode: nothing makes generate a collective, so
    --rollout async (the default) is what runs, not a fallback to lockstep."""
    from types import SimpleNamespace

    import vllm_backends

    dialogue_args, _, _, training_args, _ = grpo_arguments(recipe)
    assert dialogue_args.rollout == "async"
    assert vllm_backends.vllm_lockstep_reason(SimpleNamespace(
        mode=training_args.vllm_mode, tensor_parallel_size=training_args.vllm_tensor_parallel_size,
        enable_sleep_mode=training_args.vllm_enable_sleep_mode)) is None


@pytest.mark.parametrize("recipe", GRPO_RECIPES, ids=lambda r: r.name)
def test_a_grpo_recipe_caps_importance_ratios_per_token_instead_of_dropping_dialogues(recipe):
    _, _, _, training_args, _ = grpo_arguments(recipe)
    assert training_args.vllm_importance_sampling_correction is True
    assert training_args.vllm_importance_sampling_mode == "token_truncate"
    assert training_args.vllm_importance_sampling_clip_max == 3.0


def test_without_a_config_the_cli_demo_keeps_its_defaults():
    dialogue_args, simulator_args, _, training_args, model_args = train_grpo.parse_arguments([])
    assert model_args.use_peft is True and (model_args.lora_r, model_args.lora_alpha) == (16, 32)
    assert training_args.learning_rate == 1e-3 and training_args.lr_scheduler_type == "constant"
    assert (training_args.save_strategy, training_args.save_steps) == ("steps", 10)  # for Ctrl-C and resume
    assert training_args.gradient_checkpointing is False
    assert training_args.per_device_train_batch_size == 8 and training_args.max_steps == 30
    assert training_args.vllm_importance_sampling_mode == "token_truncate"  # also for --use_vllm on the CLI
    assert simulator_args.backend == "rule" and training_args.report_to == []
    assert preflight.demo_defaults_kept([], *GRPO_DEMO) == {}


def test_a_config_that_leaves_out_demo_keys_is_warned_about_by_name(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nlearning_rate: 1.0e-6\n")
    argv = ["--config", str(config), "--save_strategy", "steps"]
    kept = preflight.demo_defaults_kept(argv, *GRPO_DEMO)
    assert "learning_rate" not in kept and "save_strategy" not in kept  # set by the YAML, by a flag
    assert kept["use_peft"] is True and kept["lr_scheduler_type"] == "constant"
    _, _, _, training_args, _ = train_grpo.parse_arguments(argv)
    with pytest.warns(UserWarning, match=r"mine.yaml leaves the offline demo's values in force: .*use_peft=True"):
        preflight.check_setup(argv, training_args, *GRPO_DEMO)


# --------------------------------------------------------------------------------------------
# Start-up checks for GPU runs
# --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tracker_whose_package_is_missing_is_refused_before_any_model_loads(tmp_path):
    if preflight.missing_trackers(["trackio"]) == []:
        pytest.skip("trackio is installed here")
    finished = subprocess.run([sys.executable, str(REPO / "train_grpo.py"), "--report_to", "trackio",
                               "--model_name_or_path", str(tmp_path / "no-such-model"), "--output_dir",
                               str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1 and "Traceback" not in finished.stderr
    message = finished.stderr.strip().splitlines()[-1]
    assert message.startswith("--report_to trackio: trackio not installed") and "requirements-gpu.txt" in message
    assert not (tmp_path / "run").exists()  # nothing started


def test_only_known_trackers_that_are_not_installed_count_as_missing():
    assert preflight.missing_trackers([]) == []
    assert preflight.missing_trackers(["no_such_tracker"]) == []  # left to transformers' own error


def test_vllm_sleep_mode_is_warned_about_because_every_turn_would_resync_all_weights():
    argv = ["--use_vllm", "true", "--vllm_enable_sleep_mode", "true", "--bf16", "false"]
    _, _, _, training_args, _ = train_grpo.parse_arguments(argv)
    with pytest.warns(UserWarning, match="full weight sync"):
        preflight.check_setup(argv, training_args, *GRPO_DEMO)


def importance_args(mode: str, clip_max: float | None = 3.0, clip_min: float | None = None):
    _, _, _, training_args, _ = train_grpo.parse_arguments(["--vllm_importance_sampling_mode", mode])
    training_args.vllm_importance_sampling_clip_max = clip_max
    training_args.vllm_importance_sampling_clip_min = clip_min
    return training_args


def test_clipped_share_counts_trained_tokens_whose_ratio_sits_on_a_truncation_bound():
    ratio = torch.tensor([[3.0, 1.2, 3.0, 3.0], [0.5, 3.0, 0.1, 1.0]])  # TRL's ratios after clamping to <= 3
    trained = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # 0: a simulator token or padding
    cut, total = train_grpo.importance_ratios_cut(ratio, trained, importance_args("token_truncate"))
    assert (cut.item(), total.item()) == (3, 7)
    cut, _ = train_grpo.importance_ratios_cut(ratio, trained, importance_args("token_truncate", clip_min=0.1))
    assert cut.item() == 4


def test_clipped_share_in_sequence_mask_mode_counts_every_trained_token_of_a_zeroed_dialogue():
    ratio = torch.tensor([[0.0], [1.7]])  # one ratio per dialogue; the first one masked out
    trained = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    cut, total = train_grpo.importance_ratios_cut(ratio, trained, importance_args("sequence_mask"))
    assert (cut.item(), total.item()) == (3, 7)


def test_with_vllm_the_share_of_clipped_importance_ratios_is_logged(tiny_model_dir, tmp_path):
    """A real TRL run on the fake vLLM (tests/fake_vllm), whose log-probs are random: with the cap set inside
    the range of the ratios they give, some tokens are clipped, and the logged share says how many."""
    command = [sys.executable, str(REPO / "tests" / "fake_vllm" / "run.py"), "train_grpo.py",
               "--model_name_or_path", str(tiny_model_dir), "--output_dir", str(tmp_path / "run"), "--use_vllm",
               "--use_cpu", "true", "--vllm_mode", "colocate", "--max_steps", "1", "--max_turns", "2",
               "--max_reply_tokens", "8", "--max_dialogue_tokens", "400", "--num_generations", "2",
               "--per_device_train_batch_size", "4", "--vllm_importance_sampling_clip_max", "1e-4"]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert finished.returncode == 0, finished.stderr[-3000:]
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    step = next(entry for entry in history if "sampling/importance_sampling_ratio/clipped_share" in entry)
    assert 0 < step["sampling/importance_sampling_ratio/clipped_share"] < 1
    assert step["sampling/importance_sampling_ratio/max"] == pytest.approx(1e-4)  # TRL's own: capped there


# --------------------------------------------------------------------------------------------
# PPO recipes
# --------------------------------------------------------------------------------------------

# PPOArguments whose defaults are the CPU demo's, not the paper's: each recipe must state them.
PPO_DEMO_DEFAULTS = ["model_name_or_path", "output_dir", "use_peft", "dtype", "gradient_checkpointing",
                     "learning_rate", "profiles_per_step", "dialogues_per_profile", "minibatch_size", "micro_batch_size",
                     "max_steps", "save_steps", "report_to"]


@pytest.mark.parametrize("recipe", PPO_RECIPES, ids=lambda r: r.name)
def test_a_ppo_recipe_states_every_option_whose_default_is_the_demos(recipe):
    stated = set(yaml.safe_load(recipe.read_text()))
    assert [name for name in PPO_DEMO_DEFAULTS if name not in stated] == []


@pytest.mark.parametrize("recipe", PPO_RECIPES, ids=lambda r: r.name)
def test_a_ppo_recipe_plays_its_rollout_async_under_zero2(recipe):
    """ZeRO-2 keeps each rank's weights whole, so generate is no collective (only ZeRO-3 and FSDP step in
    lockstep): --rollout async (the default) runs as is."""
    args, dialogue_args, _ = train_ppo.parse_arguments(["--config", str(recipe)])
    assert dialogue_args.rollout == "async" and not args.use_vllm
    launch = next(line for line in recipe.read_text().splitlines() if "accelerate launch" in line)
    assert "zero2.yaml" in launch and "zero3" not in launch


@pytest.mark.parametrize("recipe", PPO_RECIPES, ids=lambda r: r.name)
def test_a_ppo_recipe_holds_the_papers_values(recipe):
    args, dialogue_args, simulator_args = train_ppo.parse_arguments(["--config", str(recipe)])
    assert args.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct" and args.use_peft is False
    assert args.dtype == "bfloat16" and args.gradient_checkpointing is True
    assert (args.learning_rate, args.critic_learning_rate) == (1e-6, 5e-6)
    assert (args.ppo_epochs, args.gamma, args.lam, args.clip_range) == (1, 1.0, 1.0, 0.2)
    assert (args.entropy_coef, args.kl_coef, args.temperature, args.max_steps) == (0.001, 0.0, 1.0, 1000)
    per_process = args.profiles_per_step * args.dialogues_per_profile
    assert per_process * processes("zero2.yaml") == DIALOGUES_PER_STEP and args.dialogues_per_profile == 1
    assert args.minibatch_size == per_process  # one update per step on all 32 dialogues, as the paper
    assert args.micro_batch_size == 1  # one dialogue per forward and backward pass: the memory in its header
    assert args.save_steps == 50 and args.report_to == "trackio"
    assert dialogue_args.max_turns == 8 and dialogue_args.max_dialogue_tokens == 16384
    assert dialogue_args.think == ("think" in recipe.name) and simulator_args.backend == "llm"


@pytest.mark.parametrize("recipe", GRPO_RECIPES + PPO_RECIPES, ids=lambda r: r.name)
def test_a_recipe_leaves_turn_credit_off_and_its_commented_block_turns_it_on(recipe, tmp_path):
    """Off as written (the paper's reward); the commented lines, uncommented, parse and switch it on."""
    lines = recipe.read_text().splitlines()
    block = [line for line in lines if line.startswith("# turn_credit")]
    assert block, "the recipe carries the commented turn_credit option"
    uncommented = tmp_path / recipe.name
    uncommented.write_text("\n".join(line[2:] if line in block else line for line in lines) + "\n")
    if recipe in GRPO_RECIPES:
        credit = grpo_arguments(uncommented)[2]
        assert (credit.turn_credit_coef, credit.turn_credit_baseline, credit.turn_credit_scale) == (0.5, "turn", "std")
        written, tried = (grpo_arguments(path)[0] for path in (recipe, uncommented))
    else:
        written, tried = (train_ppo.parse_arguments(["--config", str(path)])[1] for path in (recipe, uncommented))
    assert written.turn_credit is False and tried.turn_credit is True


OFFICIAL_REPO = Path(os.environ.get("RLVER_OFFICIAL_REPO", "/nonexistent"))


@pytest.mark.skipif(not (OFFICIAL_REPO / "SAGE").is_dir(), reason="set RLVER_OFFICIAL_REPO to a digitalhuman checkout")
@pytest.mark.parametrize("recipe", GRPO_RECIPES + PPO_RECIPES, ids=lambda r: r.name)
def test_a_recipes_commented_official_prompts_block_turns_rlvers_prompts_on(recipe, tmp_path):
    """Our prompts as written; the commented lines, uncommented with a real checkout, give RLVER's."""
    lines = recipe.read_text().splitlines()
    block = [line for line in lines if line.startswith(("# simulator_prompts", "# policy_prompts", "# official_repo"))]
    assert len(block) == 3, "the recipe carries the commented official-prompts options"
    uncommented = tmp_path / recipe.name
    uncommented.write_text("\n".join(line[2:].replace("/path/to/digitalhuman", str(OFFICIAL_REPO))
                                     if line in block else line for line in lines) + "\n")
    parse = (lambda path: grpo_arguments(path)[1]) if recipe in GRPO_RECIPES else (
        lambda path: train_ppo.parse_arguments(["--config", str(path)])[2])
    written, tried = parse(recipe), parse(uncommented)
    assert (written.simulator_prompts, written.policy_prompts) == ("ours", "ours")
    assert (tried.simulator_prompts, tried.policy_prompts) == ("rlver", "rlver")
    # What each simulator request sends: ours, 0.7 and 512 tokens; RLVER's, nothing its call_api does not.
    assert (written.simulator_temperature, written.simulator_max_tokens) == (0.7, 512)
    assert (tried.simulator_temperature, tried.simulator_max_tokens) == (None, None)
    assert (tried.empty_user_message, tried.analysis_emotion) == ("keep", "current")
    assert tried.released_prompts("simulator_prompts").source == "rlver"
