"""train_grpo.py against oracles written apart from it: which flag lands in which field of the effective
configuration, how the reward function reads the rollout's columns, and turn credit (terms, their placement on
tokens, the rows of each rank) against plain loops over the documented rules. Options that could be mixed up
hold different values here (group size and batch size, baseline and scale, the two importance-ratio bounds)."""
import math
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import preflight
import common
import rollout
import train_grpo

GRPO_DEMO = (train_grpo.make_parser(), train_grpo.DEMO_DEFAULTS)  # what preflight checks --config against

# --------------------------------------------------------------------------------------------
# The effective configuration
# --------------------------------------------------------------------------------------------

def parse(*argv: str):
    return train_grpo.parse_arguments([*argv, "--bf16", "false"])


def test_each_flag_lands_in_its_own_field():
    dialogue_args, simulator_args, credit_args, training_args, model_args = parse(
        "--num_generations", "3", "--per_device_train_batch_size", "6", "--steps_per_generation", "2",
        "--learning_rate", "2e-4", "--max_steps", "7", "--save_strategy", "steps", "--save_steps", "5",
        "--temperature", "0.7", "--beta", "0.02", "--lora_r", "4", "--lora_alpha", "12", "--max_turns", "5",
        "--format_penalty", "0.3", "--start_emotion", "40", "--change_bound", "8", "--turn_credit",
        "--turn_credit_coef", "0.25", "--turn_credit_baseline", "group", "--turn_credit_scale", "bound")
    assert (training_args.num_generations, training_args.per_device_train_batch_size) == (3, 6)
    assert training_args.generation_batch_size == 12  # 6 per device x 1 process x 2 steps per generation
    assert (training_args.learning_rate, training_args.max_steps, training_args.save_steps) == (2e-4, 7, 5)
    assert (training_args.temperature, training_args.beta) == (0.7, 0.02)
    assert (model_args.lora_r, model_args.lora_alpha, model_args.use_peft) == (4, 12, True)
    assert (dialogue_args.max_turns, dialogue_args.format_penalty, dialogue_args.start_emotion) == (5, 0.3, 40)
    assert simulator_args.change_bound == 8
    assert dialogue_args.turn_credit and credit_args == train_grpo.TurnCreditArguments(
        turn_credit_coef=0.25, turn_credit_baseline="group", turn_credit_scale="bound")


def test_without_flags_every_demo_default_is_in_force():
    *_, training_args, model_args = parsed = train_grpo.parse_arguments([])
    for key, value in train_grpo.DEMO_DEFAULTS.items():
        [held] = [getattr(arguments, key) for arguments in parsed if hasattr(arguments, key)]  # in one dataclass
        assert held == ([] if key == "report_to" and value == "none" else value), key  # TRL lists the trackers


def test_a_flag_beats_the_config_file_which_beats_the_demo_defaults(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 5.0e-5\nnum_generations: 2\nmax_turns: 6\n")
    dialogue_args, _, _, training_args, _ = parse("--config", str(config), "--learning_rate", "1e-4")
    assert training_args.learning_rate == 1e-4  # the flag
    assert training_args.num_generations == 2 and dialogue_args.max_turns == 6  # the file
    assert training_args.lr_scheduler_type == "constant"  # the demo's, neither stated


def options_for_profile_count(batch_size: int, num_generations: int, steps_per_generation: int):
    return parse("--per_device_train_batch_size", str(batch_size), "--num_generations", str(num_generations),
                 "--steps_per_generation", str(steps_per_generation))[3]


def test_a_generation_batch_needs_as_many_profiles_as_it_has_groups():
    """6 dialogues a device x 2 steps per generation = 12, in groups of 3: 4 distinct profiles."""
    training_args = options_for_profile_count(6, 3, 2)
    preflight.check_profile_count(4, "profiles.jsonl", training_args)
    with pytest.raises(common.InputError, match=r"profiles.jsonl: 3 profile\(s\), but a generation batch of 12 "
                                                r"dialogues .* 3 per profile, needs 4 distinct profiles"):
        preflight.check_profile_count(3, "profiles.jsonl", training_args)


# --------------------------------------------------------------------------------------------
# The reward function: which column goes where
# --------------------------------------------------------------------------------------------

def columns(**overrides) -> dict:
    """The per-row fields of three dialogues (rollout.dialogue_record), the second one's simulator lost."""
    rows = dict(final_emotion=[70, 55, 40], format_violations=[1, 0, 2], turns=[4, 3, 5],
                end_reason=["turn_limit", "simulator_failed", "turn_limit"], think_tokens=[8, 0, 6],
                reply_tokens=[20, 10, 30], simulator_seconds=[0.5, 0.1, 0.5], emotions=[[35, 50, 60, 70], [30], [45, 40]],
                failed=[False, True, False], simulator_calls=[{}] * 3)
    rows.update(overrides)
    return rows


def test_the_reward_function_hands_each_row_its_emotion_violations_turns_and_the_format_penalty(monkeypatch):
    called = []
    monkeypatch.setattr(rollout, "reward", lambda *given: called.append(given) or len(called))
    reward = train_grpo.make_emotion_reward(rollout.DialogueArguments(max_turns=6, format_penalty=0.3))
    assert reward(completions=["a", "b", "c"], **columns()) == [1, None, 2]  # no reward for a lost simulator
    assert called == [(70, 1, 4, 0.3), (40, 2, 5, 0.3)]


def test_the_reward_is_the_final_emotion_less_the_penalty_for_the_share_of_violating_turns():
    reward = train_grpo.make_emotion_reward(rollout.DialogueArguments(max_turns=6, format_penalty=0.3))
    assert reward(completions=["a", "b", "c"], **columns()) == [pytest.approx(0.7 - 0.3 * 1 / 4), None,
                                                                 pytest.approx(0.4 - 0.3 * 2 / 5)]


def test_the_logged_emotion_trajectory_runs_to_max_turns_not_to_the_turns_played():
    logged = {}
    reward = train_grpo.make_emotion_reward(rollout.DialogueArguments(max_turns=6))
    reward(completions=["a", "b", "c"], log_metric=logged.__setitem__, **columns())
    trajectory = sorted(key for key in logged if key.startswith("emotion/after_turn_"))
    assert trajectory == [f"emotion/after_turn_{turn}" for turn in range(1, 7)]
    assert logged["emotion/after_turn_6"] == (70 + 40) / 2  # ended dialogues keep their final emotion
    assert logged["emotion/final_mean"] == 55 and logged["dialogue/ended_simulator_failed"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------------------------
# Turn credit: the terms, and where they land
# --------------------------------------------------------------------------------------------

def turn_terms_by_hand(changes, failed, group_size, baseline, scale, change_bound):
    """Within each group of group_size consecutive rows, the scored rows' changes are pooled by turn index
    ("turn") or all together ("group"); a pooled change becomes (change - pool mean) / (the pool's sample std +
    1e-4) for "std", / change_bound for "bound"; a pool of fewer than 2 gives 0, as does a failed row."""
    terms = [[0.0] * len(row) for row in changes]
    for first in range(0, len(changes), group_size):
        group = [row for row in range(first, first + group_size) if not failed[row]]
        pools = defaultdict(list)
        for row in group:
            for turn, change in enumerate(changes[row]):
                pools[turn if baseline == "turn" else "all"].append((row, turn, change))
        for pool in pools.values():
            if len(pool) < 2:
                continue
            pooled = [change for _, _, change in pool]
            spread = statistics.stdev(pooled) + 1e-4 if scale == "std" else change_bound
            for row, turn, change in pool:
                terms[row][turn] = (change - statistics.mean(pooled)) / spread
    return terms


@st.composite
def groups_of_dialogues(draw):
    """(turn changes per row, failed per row, group size): 1 to 3 groups of 2 to 4 dialogues of 1 to 4 turns."""
    group_size, groups = draw(st.integers(2, 4)), draw(st.integers(1, 3))
    rows = group_size * groups
    changes = [draw(st.lists(st.integers(-10, 10), min_size=1, max_size=4)) for _ in range(rows)]
    failed = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    return changes, failed, group_size


@pytest.mark.parametrize("baseline, scale", [("turn", "std"), ("group", "std"), ("turn", "bound"), ("group", "bound")])
@given(dialogues=groups_of_dialogues())
def test_turn_terms_centre_each_change_on_its_pool_within_its_group(dialogues, baseline, scale):
    changes, failed, group_size = dialogues
    terms = train_grpo.turn_terms(changes, failed, group_size, baseline, scale, change_bound=8)
    expected = turn_terms_by_hand(changes, failed, group_size, baseline, scale, change_bound=8)
    assert terms == [pytest.approx(row, abs=1e-9) for row in expected]


@given(st.data())
def test_token_advantages_are_the_outcome_plus_coef_times_the_turn_term_of_each_sampled_token(data):
    rows, width = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 12))
    outcome = [data.draw(st.floats(-2, 2, width=32)) for _ in range(rows)]
    token_turns, terms = [], []
    for _ in range(rows):
        turns = data.draw(st.integers(1, 3))
        terms.append([data.draw(st.floats(-2, 2)) for _ in range(turns)])
        token_turns.append(data.draw(st.lists(st.integers(-1, turns - 1), max_size=width)))  # then padding
    advantages = train_grpo.token_advantages(torch.tensor(outcome), terms, token_turns, width, coef=0.3)
    expected = [[outcome[row] + (0.3 * terms[row][turn_of[t]] if t < len(turn_of) and turn_of[t] >= 0 else 0.0)
                 for t in range(width)] for row, turn_of in enumerate(token_turns)]
    assert advantages.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


# Two ranks of three rows each, groups of two: rows 2 and 3 form a group that spans the ranks.
RANK_ROWS = [
    dict(turn_changes=[5, 10], failed=False, token_turns=[0, 0, -1, 1]),
    dict(turn_changes=[-5], failed=False, token_turns=[0, 0, 0]),
    dict(turn_changes=[10, 0, 5], failed=False, token_turns=[0, -1, 1, -1, 2]),  # rank 0 ends here
    dict(turn_changes=[0, 10], failed=False, token_turns=[0, 0, -1, -1, 1, 1]),
    dict(turn_changes=[3], failed=True, token_turns=[0, 0]),
    dict(turn_changes=[-10, 5], failed=False, token_turns=[0, -1, 1]),
]


def trainer_on_rank_one(credit: train_grpo.TurnCreditArguments | None, monkeypatch, parent_batch: dict):
    """A DialogueGRPOTrainer on the second of two ranks, without TRL's set-up: TRL's own batch is `parent_batch`,
    and the rows gathered from every rank are RANK_ROWS."""
    monkeypatch.setattr(train_grpo.GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: parent_batch)
    monkeypatch.setattr(train_grpo, "gather_object", lambda mine: [(row["turn_changes"], row["failed"])
                                                                   for row in RANK_ROWS[:3]] + mine)
    trainer = object.__new__(train_grpo.DialogueGRPOTrainer)
    trainer.credit, trainer.change_bound, trainer.num_generations = credit, 8, 2
    trainer.accelerator = SimpleNamespace(process_index=1, gather=lambda counts: counts)
    trainer.model = SimpleNamespace(training=True)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    return trainer


@pytest.mark.parametrize("baseline, scale", [("group", "std"), ("turn", "bound")])
def test_a_ranks_rows_get_their_own_turn_terms_computed_over_every_ranks_groups(monkeypatch, baseline, scale):
    credit = train_grpo.TurnCreditArguments(turn_credit_coef=0.3, turn_credit_baseline=baseline,
                                            turn_credit_scale=scale)
    outcome = torch.tensor([0.5, -1.0, 0.25])
    trainer = trainer_on_rank_one(credit, monkeypatch, {"advantages": outcome, "completion_ids": torch.zeros(3, 7)})
    batch = trainer._generate_and_score_completions(RANK_ROWS[3:])
    terms = turn_terms_by_hand([row["turn_changes"] for row in RANK_ROWS], [row["failed"] for row in RANK_ROWS],
                               2, baseline, scale, 8)
    expected = [[outcome[index].item() + (0.3 * terms[3 + index][turn] if t < len(row["token_turns"]) and
                                          (turn := row["token_turns"][t]) >= 0 else 0.0) for t in range(7)]
                for index, row in enumerate(RANK_ROWS[3:])]
    assert batch["advantages"].tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    weighted = [0.3 * abs(term) for row in terms for term in row]
    assert trainer._metrics["train"]["turn_credit/mean_abs_term"] == [pytest.approx(sum(weighted) / len(weighted))]


def test_without_turn_credit_trls_batch_is_left_as_it_is(monkeypatch):
    batch = {"advantages": torch.tensor([0.5, -1.0, 0.25]), "completion_ids": torch.zeros(3, 7)}
    trainer = trainer_on_rank_one(None, monkeypatch, dict(batch))  # no --turn_credit
    got = trainer._generate_and_score_completions(RANK_ROWS[3:])
    assert got["advantages"] is batch["advantages"] and not trainer._metrics["train"]


def test_the_clipped_share_counts_only_the_policys_trained_tokens(monkeypatch):
    """TRL's completion mask covers the simulator's tokens too; the rollout's env_mask (TRL's tool_mask) leaves
    them out. Ratios capped to [0.5, 2]: 2 of the 4 trained tokens sit on a bound."""
    batch = {"advantages": torch.zeros(2), "completion_ids": torch.zeros(2, 3),
             "importance_sampling_ratio": torch.tensor([[2.0, 0.5, 1.0], [2.0, 1.2, 0.5]]),
             "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
             "tool_mask": torch.tensor([[1, 0, 1], [1, 1, 1]])}
    trainer = trainer_on_rank_one(None, monkeypatch, batch)
    trainer.args = SimpleNamespace(vllm_importance_sampling_mode="token_truncate",
                                   vllm_importance_sampling_clip_max=2.0, vllm_importance_sampling_clip_min=0.5)
    trainer._generate_and_score_completions(RANK_ROWS[3:5])
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/clipped_share"] == [0.5]


@given(st.data())
def test_the_ratios_counted_as_cut_are_those_on_either_bound_among_trained_tokens(data):
    rows, width = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    ratio = [[data.draw(st.sampled_from([0.25, 0.5, 0.9, 1.0, 1.7, 3.0])) for _ in range(width)] for _ in range(rows)]
    trained = [[data.draw(st.integers(0, 1)) for _ in range(width)] for _ in range(rows)]
    args = SimpleNamespace(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0,
                           vllm_importance_sampling_clip_min=0.5)
    cut, total = train_grpo.importance_ratios_cut(torch.tensor(ratio), torch.tensor(trained), args)
    pairs = [(r, keep) for ratio_row, trained_row in zip(ratio, trained) for r, keep in zip(ratio_row, trained_row)]
    assert (cut.item(), total.item()) == (sum(keep and (r >= 3.0 or r <= 0.5) for r, keep in pairs),
                                          sum(keep for _, keep in pairs))
    assert not math.isnan(cut.item())


@pytest.mark.parametrize("flag", [["--learning_rate", "3e-6"], ["--learning_rate=3e-6"]])
def test_a_flag_set_either_way_is_not_a_demo_default_kept(tmp_path, flag):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\n")
    kept = preflight.demo_defaults_kept(["--config", str(config), *flag], *GRPO_DEMO)
    assert "learning_rate" not in kept and "max_steps" not in kept
    assert "learning_rate" in preflight.demo_defaults_kept(["--config", str(config)], *GRPO_DEMO)


@pytest.mark.parametrize("use_vllm, sleep, warned", [(True, True, True), (False, True, False), (True, False, False)])
def test_the_sleep_mode_warning_needs_vllm_and_sleep_mode_both(monkeypatch, use_vllm, sleep, warned):
    import warnings

    monkeypatch.setattr(preflight, "missing_trackers", lambda report_to: [])
    monkeypatch.setattr(preflight.guards, "check_output_folder", lambda *args: None)
    args = SimpleNamespace(report_to=[], output_dir="unused", use_vllm=use_vllm, vllm_enable_sleep_mode=sleep)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preflight.check_setup([], args, *GRPO_DEMO)
    assert any("vllm_enable_sleep_mode" in str(w.message) for w in caught) == warned
