"""Synthetic tasks: disjoint splits, determinism, reuse, SFT noise, and the verifier's view."""

import json
import logging
import re

import pytest

from hybridflow.config import DataConfig, RewardConfig, TaskConfig
from hybridflow.data import read_rows, tokenize_rows
from hybridflow.rewards import get_reward, score_responses
from hybridflow.tasks import get_task, make_task_files, task_corpus

SMALL = dict(train_size=300, heldout_size=60)


def make(tmp_path, name="arithmetic", seed=0, data_cfg=None, **task):
    cfg = TaskConfig(name=name, **{**SMALL, **task})
    return make_task_files(cfg, data_cfg or DataConfig(), tmp_path, seed=seed)


def rows_of(path, data_cfg=None):
    return read_rows([path], data_cfg or DataConfig(on_bad_row="fail"), sft_key="sft_response")


def scores_of(rows):
    """Scores of the rows' SFT responses; reward.function stays at its default (auto): the
    rows' data_source picks the task's verifier."""
    scores, errors = score_responses(
        [r.sft_response for r in rows], [r.answer for r in rows], [r.data_source for r in rows], RewardConfig()
    )
    assert errors == []
    return scores


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_splits_are_disjoint_and_sized(tmp_path, name):
    train_path, heldout_path = make(tmp_path, name)
    train, heldout = rows_of(train_path), rows_of(heldout_path)
    assert len(train) == SMALL["train_size"] and len(heldout) == SMALL["heldout_size"]
    held_questions = {r.prompt for r in heldout}
    assert len(held_questions) == len(heldout)  # held-out questions are distinct
    assert not held_questions & {r.prompt for r in train}
    assert {r.data_source for r in train + heldout} == {name}


def test_default_arithmetic_sizes_fit_its_question_space(tmp_path):
    train_path, heldout_path = make_task_files(TaskConfig(), DataConfig(), tmp_path, seed=0)
    assert len(rows_of(train_path)) == TaskConfig().train_size


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_files_are_a_function_of_config_and_seed(tmp_path, name):
    first = [p.read_bytes() for p in make(tmp_path / "a", name, seed=1)]
    again = [p.read_bytes() for p in make(tmp_path / "b", name, seed=1)]
    other = [p.read_bytes() for p in make(tmp_path / "c", name, seed=2)]
    assert first == again and first[0] != other[0] and first[1] != other[1]


def test_held_out_split_does_not_depend_on_train_size(tmp_path):
    small = make(tmp_path / "a", train_size=50)[1].read_bytes()
    assert small == make(tmp_path / "b", train_size=400)[1].read_bytes()


def test_files_are_reused_for_the_same_signature_and_rewritten_otherwise(tmp_path, caplog):
    train_path, _ = make(tmp_path)
    stamp = train_path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="hybridflow.tasks"):
        assert make(tmp_path)[0] == train_path
    assert train_path.stat().st_mtime_ns == stamp and "reusing" in caplog.text
    make(tmp_path, sft_noise=0.2)
    meta = json.loads((tmp_path / "arithmetic_meta.json").read_text())
    assert meta["task"]["sft_noise"] == 0.2 and meta["seed"] == 0
    assert train_path.read_bytes() == make(tmp_path / "fresh", sft_noise=0.2)[0].read_bytes()


def test_a_missing_file_or_meta_is_regenerated(tmp_path):
    train_path, heldout_path = make(tmp_path)
    expected = heldout_path.read_bytes()
    heldout_path.unlink()
    assert make(tmp_path)[1].read_bytes() == expected
    (tmp_path / "arithmetic_meta.json").write_text("{not json")
    make(tmp_path)
    assert json.loads((tmp_path / "arithmetic_meta.json").read_text())["version"] == 1


@pytest.mark.parametrize("noise", [0.0, 0.3, 0.5])
def test_arithmetic_sft_noise_is_exact_and_the_verifier_sees_it(tmp_path, noise):
    train_path, heldout_path = make(tmp_path, sft_noise=noise)
    train = rows_of(train_path)
    scores = scores_of(train)
    assert set(scores) <= {0.0, 1.0}
    assert scores.count(0.0) == round(noise * len(train))  # exactly this many noisy demos
    assert all(scores_of(rows_of(heldout_path)))  # held-out demonstrations are all correct
    for row, score in zip(train, scores):
        wrong_by = abs(int(row.sft_response) - row.answer)
        assert wrong_by == 0 if score else 1 <= wrong_by <= 2  # noisy ones are near misses
        assert int(row.sft_response) >= 0


def test_arithmetic_questions_are_short_sums_and_differences(tmp_path):
    for row in rows_of(make(tmp_path, max_operand=9)[0]):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", row.prompt).groups()
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert row.answer == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_countdown_targets_are_reachable_and_noise_is_exact(tmp_path):
    train_path, heldout_path = make(tmp_path, "countdown", sft_noise=0.25)
    heldout, train = rows_of(heldout_path), rows_of(train_path)
    assert all(score == 1.0 for score in scores_of(heldout))
    scores = scores_of(train)
    assert sum(score < 1.0 for score in scores) == round(0.25 * len(train))
    assert all(score == pytest.approx(0.1) for score in scores if score < 1.0)  # still equations
    for row in heldout:
        numbers = row.answer["numbers"]
        assert len(numbers) == 3 and numbers == sorted(numbers) and row.answer["target"] > 0
        assert row.prompt == f"Make {row.answer['target']} with {' '.join(map(str, numbers))}"


def test_rows_follow_the_configured_columns(tmp_path):
    data_cfg = DataConfig(prompt_key="question", answer_key="solution.value")
    train_path, _ = make(tmp_path, data_cfg=data_cfg)
    (row, *_) = rows_of(train_path, data_cfg)
    assert json.loads(train_path.read_text().splitlines()[0]).keys() == {
        "question",
        "solution",
        "data_source",
        "sft_response",
    }
    assert get_reward("arithmetic")(str(row.answer), row.answer) == 1.0


@pytest.mark.parametrize(
    "heldout_size, match",
    [
        (10, "found only 7 distinct questions"),
        (7, "held-out split takes"),
    ],
)
def test_a_too_small_question_space_is_an_error(tmp_path, heldout_size, match):
    with pytest.raises(ValueError, match=match):
        make(tmp_path, max_operand=1, heldout_size=heldout_size, train_size=5)


def test_unknown_task_is_an_error():
    with pytest.raises(ValueError, match="task.name='nope'"):
        get_task("nope")


def test_prompts_and_responses_fit_the_default_lengths(tmp_path):
    from hybridflow.rollout.tiny import make_tiny_tokenizer

    tokenizer, cfg = make_tiny_tokenizer(), DataConfig(on_bad_row="fail")
    for name in ("arithmetic", "countdown"):
        rows = rows_of(make(tmp_path, name)[0])
        _, skipped = tokenize_rows(rows, tokenizer, cfg)  # fails on a prompt over 64 tokens
        longest = max(len(tokenizer(r.sft_response)["input_ids"]) for r in rows)
        assert skipped == 0 and longest + 1 <= cfg.max_response_length  # + the end of turn


def test_task_corpus_covers_the_task_text():
    corpus = task_corpus(TaskConfig(name="countdown"))
    assert corpus == task_corpus(TaskConfig(name="countdown"))
    text = " ".join(corpus)
    assert all(c in text for c in "0123456789+-*()") and "Make" in text and "assistant" in text
    assert "=" in " ".join(task_corpus(TaskConfig()))


def test_the_multiply_task_demonstrates_the_calculator_and_its_noise_guesses(tmp_path) -> None:
    import json as _json

    from hybridflow.config import DataConfig
    from hybridflow.rewards import get_reward

    cfg = TaskConfig(name="multiply", max_operand=999, train_size=200, heldout_size=20, sft_noise=0.5)
    train, _ = make_task_files(cfg, DataConfig(), tmp_path, seed=0, sft_key="sft_response")
    rows = [_json.loads(line) for line in train.read_text().splitlines()]
    calls = [r for r in rows if len(r["sft_response"]) == 3]
    guesses = [r for r in rows if len(r["sft_response"]) == 1]
    assert len(calls) == len(guesses) == 100
    a, b = (int(x) for x in calls[0]["prompt"][:-1].split("*"))
    call = _json.loads(calls[0]["sft_response"][0]["content"].split("\n")[1])
    assert call == {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    assert calls[0]["sft_response"][1:] == [
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]
    reward = get_reward("multiply")
    for r in guesses:  # near the product, never it
        assert reward(r["sft_response"][0]["content"], r["reward_model"]["ground_truth"]) == 0.0
