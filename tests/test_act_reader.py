"""What a reply does, read as a person reads it (rule_user.SentenceReader): acts in any wording, checked against
sentences labelled by a writer who never saw the rules or the read-out's examples (tests/data/act_sentences.jsonl),
and the misreadings blind players met (issue 48)."""
import importlib.util
import json
from pathlib import Path

import pytest

import rule_user

EXAMPLES = {json.loads(line)["sentence"] for line in rule_user.ACT_EXAMPLES.open(encoding="utf-8")}
# The labelled set, less the three short sentences that a writer of the examples happened to write word for word
# ("How are you doing, really?"): what is tested is never what was fitted.
LABELLED = [row for row in map(json.loads, (Path(__file__).parent / "data" / "act_sentences.jsonl").open(encoding="utf-8"))
            if row["sentence"] not in EXAMPLES]
SINGLE = [row for row in LABELLED if row["act"] != "mixed"]


def accuracy(predict) -> float:
    """Share of labelled sentences read right: the labelled act among those found, or none for a sentence of none."""
    right = 0
    for row in SINGLE:
        found = predict(row["sentence"])
        right += (row["act"] in found) if row["act"] != rule_user.NO_ACT else not found
    return right / len(SINGLE)


def test_the_labelled_set_is_held_out_of_the_read_outs_examples():
    assert len(SINGLE) == 264 and not EXAMPLES & {row["sentence"] for row in LABELLED}


@pytest.mark.slow
def test_the_kept_read_out_is_the_fit_of_the_examples_bit_for_bit():
    kept = json.loads(rule_user.ACT_READOUT.read_text(encoding="utf-8"))
    assert rule_user.SentenceReader(read_out=False).fit() == kept


@pytest.mark.slow  # a measurement over many dialogues or sentences, or a process of its own
def test_acts_in_other_words_are_read_far_better_than_by_the_listed_phrases():
    assert accuracy(rule_user.acts_of) >= 0.78  # 0.82 when written
    assert accuracy(rule_user.phrase_acts) <= 0.5  # 0.43: the phrase lists alone miss most wordings


def test_both_acts_of_a_two_act_reply_are_mostly_found():
    mixed = [row for row in LABELLED if row["act"] == "mixed"]
    assert sum(set(row["acts"]) <= rule_user.acts_of(row["sentence"]) for row in mixed) >= 7  # of 12


@pytest.mark.parametrize("sentence, act", [
    ("Right now: don't run tomorrow, ice the shin tonight, and call a sports physio in the morning for the earliest "
     "appointment you can get.", "concrete"),
    ("On that, you weren't wrong.", "clears"),
    ("That's not luck, that's foresight, and it sounds like nobody's connected the dots and said so.", "praises"),
    ("No, you're not crazy: the plumber's report says the leak is in the shared riser, so it was never yours to pay.",
     "clears"),
])
def test_what_blind_players_wrote_is_read_as_they_meant_it(sentence, act):
    assert act in rule_user.acts_of(sentence)


def test_a_sentence_reads_the_same_every_time():
    sentence = "You kept everyone calm in the dark, and that took nerve."
    assert rule_user.reader() is rule_user.reader()
    assert rule_user.act_probabilities(sentence) == rule_user.act_probabilities(sentence)
    assert all(p == round(p, 3) for p in rule_user.act_probabilities(sentence).values())


def test_a_missing_encoder_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(rule_user.MissingEncoder, match="requirements-nodeps.txt"):
        rule_user.SentenceReader()


def test_the_readers_sentence_cache_is_bounded_and_a_sentence_made_again_is_the_same(monkeypatch):
    reader = rule_user.reader()
    first = reader.embed("The lift stopped between floors at midnight.").clone()
    monkeypatch.setattr(rule_user, "EMBEDDINGS_KEPT", len(reader._embeddings) + 1)
    for sentence in ("One new sentence here.", "Another new sentence there.", "And a third one to overflow."):
        reader.embed(sentence)
        assert len(reader._embeddings) <= rule_user.EMBEDDINGS_KEPT
    assert (reader.embed("The lift stopped between floors at midnight.") == first).all()
    kept = reader.act_probabilities("The lift stopped between floors at midnight.")
    monkeypatch.setattr(rule_user, "EMBEDDINGS_KEPT", len(reader._probabilities) + 1)
    for sentence in ("One new sentence here.", "Another new sentence there.", "And a third one to overflow."):
        reader.act_probabilities(sentence)
        assert len(reader._probabilities) <= rule_user.EMBEDDINGS_KEPT
    kept["reflects"] = 2.0  # what a caller does to its copy does not reach the kept one
    assert reader.act_probabilities("The lift stopped between floors at midnight.")["reflects"] <= 1.0


LONG = ("You planned the whole trip, paid the deposits and still got the blame when the hotel fell through, and nobody "
        "there stood up for you, not even your sister, which must have hurt more than the money.")


@pytest.mark.parametrize("sentence", ["Oh.", "That sounds hard.", LONG])
def test_the_traced_encoder_gives_bertmodels_own_token_states_bit_for_bit_at_any_length(sentence):
    # The oracle is transformers' BertModel forward; the lengths differ from the trace's example sentence.
    reader = rule_user.reader()
    torch = reader.torch
    ids = torch.tensor([reader.tokenizer.encode(sentence).ids])
    with torch.inference_mode():
        expected = reader.model(input_ids=ids).last_hidden_state
        assert torch.equal(rule_user.token_states(reader.model, ids), expected)
        assert torch.equal(reader._encoder(ids), expected)
