"""verl's math data sets scored as verl scores them, math-verify as the lenient choice, and verl's
reward-function signature.

The expected values follow verl's own checks (``verl/utils/reward_score/gsm8k.py`` and
``math.py``): what each accepts and rejects, including the answers the project's ``math``
fallback judges differently (``The answer is 72`` without ``#### 72``; ``3.0`` for ``3``).
"""

from __future__ import annotations

import pytest

from hybridflow.config import RewardConfig
from hybridflow.data import DataConfig, read_rows, write_parquet
from hybridflow.math_scorers import dapo_math, gsm8k_strict, math_boxed, math_verify_score, normalise_math_answer
from hybridflow.rewards import check_reward, describe_routing, get_reward, score_responses

pytestmark = pytest.mark.claim("verl-math-rewards")

THIS_MODULE = __name__


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("She has 72 apples.\n#### 72", "72", 1.0),
        ("She has 72 apples. The answer is 72.", "72", 0.0),  # no "#### ": verl's strict check rejects it
        ("#### 1,000", "1000", 1.0),  # thousands commas dropped
        ("#### 72.0", "72", 0.0),  # compared as text
        ("#### 5 at first, then #### 72", "72", 1.0),  # the last one
        ("#### 72" + " and more" * 40, "72", 0.0),  # beyond the last 300 characters
        ("####72", "72", 0.0),  # the space is part of the format
    ],
)
def test_gsm8k_is_verls_strict_check(response, truth, score):
    assert gsm8k_strict(response, truth) == score


def test_the_math_fallback_and_gsm8k_disagree_where_verl_would():
    loose = "She has 72 apples. The answer is 72."
    assert get_reward("math")(loose, "72") == 1.0 and get_reward("openai/gsm8k")(loose, "72") == 0.0


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("so \\boxed{\\dfrac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac1{72}}", "\\frac{1}{72}", 1.0),
        ("\\boxed{5 \\text{ cm}}", "5", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        ("\\boxed{007}", "7", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{3.0}", "3", 0.0),  # verl's check is a string canonicalisation, not arithmetic
        ("\\fbox{3}", "3", 0.0),  # verl reads \fbox but scores it 0
        ("first \\boxed{2}, finally \\boxed{3}", "3", 1.0),  # the last box
        ("The answer is \\boxed 3$.", "3", 1.0),
        ("\\boxed{3", "3", 0.0),  # unbalanced
        ("3", "3", 0.0),  # no box
    ],
)
def test_math_is_verls_boxed_check(response, truth, score):
    assert math_boxed(response, truth) == score


def test_the_normalisation_falls_back_to_the_raw_strings_where_it_cannot_read_them():
    assert normalise_math_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert math_boxed("\\boxed{a \\text{ b} \\text{ c}}", "a \\text{ b} \\text{ c}") == 1.0  # two units: raw
    assert math_boxed("\\boxed{\\sqrt}", "\\sqrt") == 1.0


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("So the total is 72.\nAnswer: 72", "72", 1.0),
        ("answer: $72$", "72", 1.0),
        ("Answer: 1,000", "1000", 1.0),
        ("Answer: x = 5", "5", 1.0),
        ("Answer: 5 dollars", "5", 1.0),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Answer: 4\nthen Answer: 5", "5", 1.0),  # the last one
        ("The result is 72.", "72", -1.0),  # no "Answer:": DAPO rewards -1
        ("Answer: 72" + " and more" * 40, "72", -1.0),  # beyond the last 300 characters
    ],
)
def test_dapo_math_is_dapos_answer_check(response, truth, score):
    assert dapo_math(response, truth) == score


def test_aime_and_math_dapo_rows_get_dapos_check():
    scores, _ = score_responses(
        ["Answer: 7", "Answer: 7", "Answer: 7"], ["7", "8", "7"], ["math_dapo", "aime2024", "aime_2025"], RewardConfig()
    )
    assert scores == [1.0, -1.0, 1.0]


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("\\boxed{3.0}", "3", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("The answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("\\boxed{4}", "3", 0.0),
    ],
)
def test_math_verify_is_the_lenient_choice(response, truth, score):
    assert math_verify_score(response, truth) == score


def test_auto_routes_verls_data_sources_and_math_equivalence_switches_them_to_math_verify():
    responses, truths = ["#### 3", "\\boxed{3.0}", "\\boxed{3.0}"], ["3", "3", "3"]
    sources = ["openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"]
    assert score_responses(responses, truths, sources, RewardConfig())[0] == [1.0, 0.0, 0.0]
    lenient = RewardConfig(math_equivalence="math_verify")
    assert score_responses(responses, truths, sources, lenient)[0] == [1.0, 1.0, 1.0]
    line, _ = describe_routing(lenient, {"openai/gsm8k": 2, "lighteval/MATH": 1})
    assert line == "reward (auto): 'lighteval/MATH' (1 rows), 'openai/gsm8k' (2 rows) -> math_verify"


SEEN: list[tuple] = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A reward written for verl: its signature, a dict result."""
    SEEN.append((data_source, solution_str, ground_truth, extra_info))
    return {"score": 0.5 if extra_info and extra_info.get("split") == "train" else 0.25, "acc": False}


def by_source(response, answer, data_source=None, extra_info=None):
    return float(data_source == "mine" and extra_info == {"index": 3})


def test_verls_compute_score_is_called_as_verl_calls_it():
    cfg = RewardConfig(function=f"{THIS_MODULE}.compute_score")
    check_reward(cfg)
    SEEN.clear()
    scores, errors = score_responses(["a", "b"], ["1", "2"], ["openai/gsm8k", None], cfg, [{"split": "train"}, None])
    assert (scores, errors) == ([0.5, 0.25], [])
    assert SEEN == [("openai/gsm8k", "a", "1", {"split": "train"}), (None, "b", "2", None)]


def test_a_reward_function_may_take_the_rows_data_source_and_extra_info():
    cfg = RewardConfig(function=f"{THIS_MODULE}.by_source")
    check_reward(cfg)
    assert score_responses(["x", "x"], [0, 0], ["mine", "theirs"], cfg, [{"index": 3}, {"index": 3}])[0] == [1.0, 0.0]


def test_a_verl_format_parquet_reads_as_it_is(tmp_path):
    """verl's preprocessed GSM8K rows: a chat prompt, data_source, ability, reward_model, extra_info."""
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {
                "role": "user",
                "content": "Natalia sold 48 clips... Let's think step by step and output "
                'the final answer after "####".',
            }
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0, "answer": "48 + 24 = 72\n#### 72", "question": "..."},
    }
    (read,) = read_rows([write_parquet(tmp_path / "train.parquet", [row])], DataConfig())
    assert read.prompt == row["prompt"] and read.answer == "72" and read.data_source == "openai/gsm8k"
    assert read.extra["extra_info"]["split"] == "train"
    assert score_responses(
        ["... #### 72"], [read.answer], [read.data_source], RewardConfig(), [read.extra["extra_info"]]
    )[0] == [1.0]


@pytest.mark.claim("verl-math-rewards")
def test_math_500_rows_are_scored_as_verl_scores_them_left_right_tuples_and_intervals_included():
    """HuggingFaceH4/MATH-500 writes tuples and intervals with \\left( ... \\right); verl routes
    the set to its MATH check, whose normalisation drops them. The fallback compared raw text."""
    responses = [r"so \boxed{(3, \frac{\pi}{2})}", r"\boxed{[-2, 7)}", r"\boxed{(3, \frac{\pi}{3})}"]
    truths = [r"\left( 3, \frac{\pi}{2} \right)", r"\left[ -2, 7 \right)", r"\left( 3, \frac{\pi}{2} \right)"]
    scores, errors = score_responses(responses, truths, ["HuggingFaceH4/MATH-500"] * 3, RewardConfig())
    assert scores == [1.0, 1.0, 0.0] and errors == []
