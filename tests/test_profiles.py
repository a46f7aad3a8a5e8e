"""Profile loading and validation: our files, the official files, and bad rows."""
import collections
import json
import shutil

import pytest
from conftest import profile_row, write_jsonl

import simulator
from simulator import ProfileError, load_profiles


def test_our_training_profiles_cover_every_intention_and_personality():
    profiles = load_profiles(simulator.DEFAULT_PROFILES)
    assert len(profiles) >= 48
    assert set(collections.Counter(p.intention for p in profiles)) == set(simulator.INTENTIONS)
    assert set(collections.Counter(p.personality for p in profiles)) == set(simulator.PERSONALITIES)
    assert all(p.language == "en" for p in profiles)


def test_our_benchmark_split_is_held_apart_and_opens_with_first_talk():
    benchmark = load_profiles(simulator.DEFAULT_BENCHMARK_PROFILES, require_first_talk=True)
    training = load_profiles(simulator.DEFAULT_PROFILES)
    assert set(p.intention for p in benchmark) == set(simulator.INTENTIONS)
    assert not {p.id for p in benchmark} & {p.id for p in training}
    assert not {p.player for p in benchmark} & {p.player for p in training}


def test_official_files_load_with_the_same_loader(official_profiles):
    train = load_profiles(official_profiles / "train_profile.jsonl")
    test = load_profiles(official_profiles / "test_profile.jsonl", require_first_talk=True)
    assert (len(train), len(test)) == (500, 100)
    assert {p.language for p in train + test} == {"zh"}
    assert set(p.intention for p in test) == set(simulator.INTENTIONS)


def test_corrupted_official_copy_names_file_line_and_field(official_profiles, tmp_path):
    copy = tmp_path / "test_profile.jsonl"
    shutil.copy(official_profiles / "test_profile.jsonl", copy)
    lines = copy.read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[41])
    del row["main_cha"]
    lines[41] = json.dumps(row, ensure_ascii=False)
    copy.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ProfileError, match=rf"{copy}:42: field 'main_cha'"):
        load_profiles(copy)


@pytest.mark.parametrize("change, field", [
    ({"task": "You want a pony"}, "task"),
    ({"main_cha": "cheerful"}, "main_cha"),
    ({"cha_group": ["only", "two"]}, "cha_group"),
    ({"cha_group": "proud, shy, kind"}, "cha_group"),
    ({"player": ""}, "player"),
    ({"scene": None}, "scene"),
    ({"id": 7}, "id"),
    ({"first_talk": ""}, "first_talk"),
])
def test_bad_field_is_named_with_its_line(tmp_path, change, field):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="a"), profile_row(**{"id": "b", **change})])
    with pytest.raises(ProfileError, match=rf"p.jsonl:2: field '{field}'"):
        load_profiles(path)


def test_invalid_json_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="a"), '{"id": "b", "player": '])
    with pytest.raises(ProfileError, match=r"p.jsonl:2: not valid JSON"):
        load_profiles(path)


def test_missing_field_is_named(tmp_path):
    row = profile_row()
    del row["task"]
    with pytest.raises(ProfileError, match=r"p.jsonl:1: field 'task'"):
        load_profiles(write_jsonl(tmp_path / "p.jsonl", [row]))


def test_repeated_id_names_both_lines(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row(id="a"), profile_row(id="a")])
    with pytest.raises(ProfileError, match=r"p.jsonl:2: field 'id' 'a' repeats line 1"):
        load_profiles(path)


def test_benchmark_mode_requires_first_talk(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [profile_row()])
    assert load_profiles(path)[0].first_talk is None
    with pytest.raises(ProfileError, match=r"p.jsonl:1: field 'first_talk' is required"):
        load_profiles(path, require_first_talk=True)


def test_missing_and_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        load_profiles(tmp_path / "nope.jsonl")
    with pytest.raises(ProfileError, match="no profiles"):
        load_profiles(write_jsonl(tmp_path / "empty.jsonl", []))


def test_chinese_task_text_maps_to_the_same_intention_key():
    row = profile_row(task=simulator.INTENTIONS["practical_advice"][1], main_cha="回避型")
    profile = simulator.parse_profile(row)
    assert (profile.intention, profile.personality, profile.language) == ("practical_advice", "avoidant", "zh")


def test_to_row_round_trips_the_official_fields():
    row = profile_row(first_talk="Hi.")
    assert simulator.parse_profile(row).to_row() == row
