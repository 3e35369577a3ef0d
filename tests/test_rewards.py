"""Reward functions: the registry, dotted paths, each built-in, and error handling when scoring."""

import logging
import math
import threading
import time

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import (
    RewardError,
    check_reward,
    describe_routing,
    extract_final_answer,
    get_reward,
    register_reward,
    reward_names,
    score_responses,
)


def half_reward(response, answer, **kwargs):
    """Loaded by dotted path in the tests below."""
    return 0.5


def raising_reward(response, answer, **kwargs):
    if response == "boom":
        raise KeyError("no such thing")
    return 1.0


def nan_reward(response, answer, **kwargs):
    return math.nan if response == "nan" else 1.0


def text_reward(response, answer, **kwargs):
    return "1.0"


def strict_reward(response, answer):
    """Takes no keyword arguments: any reward.kwargs is a mistake."""
    return 1.0


THIS_MODULE = __name__


# --------------------------------------------------------------------------- registry


def test_builtins_are_registered():
    assert {"exact_match", "math", "arithmetic", "countdown"} <= set(reward_names())


def test_dotted_path_loads_a_function_of_this_module():
    assert get_reward(f"{THIS_MODULE}.half_reward") is half_reward


@pytest.mark.parametrize(
    "name, match",
    [
        ("no_such_reward", "not a registered reward"),
        ("no_such_package.module.fn", "cannot import module 'no_such_package.module'"),
        (f"{THIS_MODULE}.missing_fn", "has nothing named 'missing_fn'"),
        (f"{THIS_MODULE}.THIS_MODULE", "has a str named 'THIS_MODULE'"),
    ],
)
def test_bad_reward_names_say_what_failed(name, match):
    with pytest.raises(ValueError, match=match) as error:
        get_reward(name)
    assert repr(name) in str(error.value)


def test_registering_a_name_twice_is_an_error():
    register_reward("test_rewards_half")(half_reward)
    register_reward("test_rewards_half")(half_reward)  # the same function again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_rewards_half")(nan_reward)


# --------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize(
    "response, answer, score",
    [
        ("  Paris\n", "Paris", 1.0),
        ("paris", "Paris", 0.0),
        ("42", 42, 1.0),
        ("42.0", 42, 0.0),
    ],
)
def test_exact_match(response, answer, score):
    assert get_reward("exact_match")(response, answer) == score


@pytest.mark.parametrize(
    "text, final",
    [
        (r"so \boxed{1} then \boxed{\frac{3}{4}} done", r"\frac{3}{4}"),
        ("work\n#### 72\n", "72"),
        ("The Answer: 1,000 apples\nthanks", "1,000 apples"),
        ("3 apples and 5 pears make 8.", "8"),
        ("no numbers at all", None),
    ],
)
def test_extract_final_answer(text, final):
    assert extract_final_answer(text) == final


@pytest.mark.parametrize(
    "response, answer, score",
    [
        (r"It is \boxed{42}.", "42", 1.0),
        (r"It is \boxed{41}.", "42", 0.0),
        (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
        (r"\boxed{3/4}", "\\frac{3}{4}", 1.0),
        ("#### 1,234", 1234, 1.0),
        ("steps 5, 7 and finally 12", 12, 1.0),
        ("steps 5, 7 and finally 12", 7, 0.0),
        ("answer: 2.50", "5/2", 1.0),
        ("answer: x + 1", "x+1", 1.0),  # not numbers: compared as normalised text
        ("answer: x + 2", "x+1", 0.0),
        ("I do not know", 3, 0.0),
        (r"\boxed{1/0}", 1, 0.0),
    ],
)
def test_math(response, answer, score):
    assert get_reward("math")(response, answer) == score


@pytest.mark.parametrize(
    "response, answer, score",
    [
        ("19", 19, 1.0),
        ("19 is it", "19", 1.0),
        (" 19\n", 19, 1.0),
        ("-3", -3, 1.0),
        ("18", 19, 0.0),
        ("18 19", 19, 0.0),  # only the first integer counts
        ("", 19, 0.0),
        ("nineteen", 19, 0.0),
    ],
)
def test_arithmetic(response, answer, score):
    assert get_reward("arithmetic")(response, answer) == score


def test_arithmetic_rejects_a_non_integer_answer():
    with pytest.raises(ValueError):
        get_reward("arithmetic")("3", "three")


COUNTDOWN = {"target": 24, "numbers": [2, 3, 4, 6]}


@pytest.mark.parametrize(
    "response, score",
    [
        ("(2+4)*4", 0.1),  # reuses 4
        ("6*4", 1.0),  # a subset of the numbers, each once
        ("(6-2)*(3+...)", 0.0),  # malformed
        ("6*4*1", 0.1),  # uses a number not given
        ("<answer>(2*3)*4</answer>", 1.0),
        ("I think <answer>6+4</answer>", 0.1),  # well formed, wrong value
        ("6*4 = 24", 1.0),
        ("24 = 6*4", 1.0),
        ("so the equation = 6*4", 1.0),
        ("6*4 = 25", 1.0),  # a wrong claim next to the equation is not what is checked
        ("6/(3-2)*4", 1.0),  # division, exact
        ("(6/4)*(3+2)*2", 0.1),  # 2 used twice
        ("3*(4+6)/(2-2)", 0.1),  # division by zero: well formed, invalid
        ("6**2-3*4", 0.0),  # power is not allowed
        ("-2+6*4+2", 0.0),  # no unary minus
        ("24", 0.1),  # a bare number, but not a given one
        ("6", 0.1),  # a given number, the wrong value
        ("", 0.0),
        ("no equation here", 0.0),
        ("__import__('os').system('true')", 0.0),  # never evaluated
        ("(lambda: 24)()", 0.0),
        ("(" * 60 + "6*4" + ")" * 60, 0.0),  # too long to parse
    ],
)
def test_countdown(response, score):
    assert get_reward("countdown")(response, COUNTDOWN) == pytest.approx(score)


def test_countdown_format_score_is_a_kwarg_and_numbers_may_repeat():
    countdown = get_reward("countdown")
    assert countdown("(2+4)*4", COUNTDOWN, format_score=0.0) == 0.0
    assert countdown("4*4+4", {"target": 20, "numbers": [4, 4, 4]}) == 1.0


def test_countdown_rejects_a_malformed_answer():
    with pytest.raises(ValueError, match="countdown answer"):
        get_reward("countdown")("1+2", {"target": "3", "numbers": [1, 2]})


# --------------------------------------------------------------------------- scoring


def test_score_responses_uses_the_function_and_its_kwargs():
    cfg = RewardConfig(function="countdown", kwargs={"format_score": 0.25})
    scores, errors = score_responses(["6*4", "6+4"], [COUNTDOWN] * 2, [None, None], cfg)
    assert scores == [1.0, 0.25] and errors == []


def test_under_auto_a_registered_data_source_picks_the_reward():
    cfg = RewardConfig()  # function=auto
    scores, _ = score_responses(["19 then 3", "19 then 3"], [19, 19], ["arithmetic", "my/math_set"], cfg)
    assert scores == [1.0, 0.0]  # arithmetic reads the first integer; the unknown source gets math (the last)


def test_an_explicit_reward_function_scores_every_row_whatever_its_data_source():
    cfg = RewardConfig(function="exact_match")
    scores, _ = score_responses(["19 ok", "19"], [19, 19], ["arithmetic", "my/math_set"], cfg)
    assert scores == [0.0, 1.0]  # exact_match on both: the arithmetic verifier is not called


@pytest.mark.claim("reward-routing-line")
def test_routing_is_described_in_one_line_and_a_bypassed_verifier_is_warned_about():
    sources = {"arithmetic": 90, "my/math_set": 10, None: 2}
    line, warnings = describe_routing(RewardConfig(), sources)
    assert line == (
        "reward (auto): 'arithmetic' (90 rows) -> arithmetic; 'my/math_set' (10 rows), no data_source (2 rows) -> math"
    )
    assert warnings == []
    line, warnings = describe_routing(RewardConfig(function=f"{THIS_MODULE}.half_reward"), sources)
    assert line.endswith(f"no data_source (2 rows) -> {THIS_MODULE}.half_reward") and "\n" not in line
    assert warnings == [
        f"reward.function='{THIS_MODULE}.half_reward' scores the rows whose data_source is "
        "'arithmetic', not the registered 'arithmetic' verifier; set reward.function=auto to "
        "score each row by its data_source"
    ]


@pytest.mark.parametrize(
    "cfg, match",
    [
        (RewardConfig(function="maths"), r"reward.function='maths' is not a registered reward .*did you mean 'math'\?"),
        (
            RewardConfig(function="no_such_pkg.fn"),
            r"reward.function='no_such_pkg.fn': cannot import module 'no_such_pkg'",
        ),
        (RewardConfig(function=f"{THIS_MODULE}.nope"), r"has nothing named 'nope'"),
        (
            RewardConfig(function=f"{THIS_MODULE}.strict_reward", kwargs={"scale": 2}),
            r"cannot be called as fn\(response, answer, \*\*reward.kwargs\) with reward.kwargs=\{'scale': 2\}",
        ),
    ],
)
def test_check_reward_names_the_key_and_the_fix(cfg, match):
    with pytest.raises(ValueError, match=match):
        check_reward(cfg)


def test_check_reward_accepts_auto_names_and_paths():
    for function in ("auto", "countdown", f"{THIS_MODULE}.strict_reward"):
        check_reward(RewardConfig(function=function))
    check_reward(RewardConfig(function="countdown", kwargs={"format_score": 0.2}))


@pytest.mark.claim("bad-rows-and-reward-errors")
def test_a_raising_function_scores_zero_and_is_logged_once(caplog):
    cfg = RewardConfig(function=f"{THIS_MODULE}.raising_reward", on_error="zero")
    responses = ["ok", "boom", "ok", "boom"]
    with caplog.at_level(logging.WARNING, logger="hybridflow.rewards"):
        scores, errors = score_responses(responses, ["a"] * 4, [None] * 4, cfg)
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert len(errors) == 2 and "sample 1" in errors[0] and "sample 3" in errors[1]
    assert len(caplog.records) == 1
    logged = caplog.records[0].getMessage()
    assert "sample 1" in logged and "'boom'" in logged and "KeyError" in logged and "'a'" in logged


@pytest.mark.claim("bad-rows-and-reward-errors")
def test_a_raising_function_fails_under_fail():
    cfg = RewardConfig(function=f"{THIS_MODULE}.raising_reward", on_error="fail")
    with pytest.raises(RewardError, match="sample 1.*KeyError.*reward.on_error=zero") as error:
        score_responses(["ok", "boom"], ["a", "a"], [None, None], cfg)
    assert isinstance(error.value.__cause__, KeyError)


@pytest.mark.parametrize("function, match", [("nan_reward", "non-finite"), ("text_reward", "not a number")])
def test_non_finite_or_non_numeric_scores_are_errors(function, match):
    cfg = RewardConfig(function=f"{THIS_MODULE}.{function}")
    scores, errors = score_responses(["nan", "x"], [0, 0], [None, None], cfg)
    if function == "nan_reward":
        assert scores == [0.0, 1.0] and len(errors) == 1
    else:
        assert scores == [0.0, 0.0] and len(errors) == 2
    assert match in errors[0]
    with pytest.raises(RewardError, match=match):
        score_responses(["nan"], [0], [None], RewardConfig(function=cfg.function, on_error="fail"))


def test_long_responses_are_truncated_in_messages():
    cfg = RewardConfig(function=f"{THIS_MODULE}.text_reward")
    _, (message,) = score_responses(["x" * 1000], [0], [None], cfg)
    assert "x" * 120 + "..." in message and "x" * 121 not in message


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="pair up"):
        score_responses(["a"], [1, 2], [None], RewardConfig())


def test_a_bad_reward_function_fails_even_when_data_sources_pick_the_rewards():
    with pytest.raises(ValueError, match="no_such_reward"):
        score_responses(["1"], [1], ["arithmetic"], RewardConfig(function="no_such_reward"))


def hangs_on_seven(response, answer):
    if response == "7":
        threading.Event().wait()  # never returns
    return float(response == str(answer))


@pytest.mark.claim("reward-timeout")
def test_a_reward_that_never_returns_costs_its_row_a_timeout_not_the_run():
    cfg = RewardConfig(function=f"{__name__}.hangs_on_seven", timeout_s=0.3)
    started = time.perf_counter()
    scores, errors = score_responses(["3", "7", "4", "7", "5"], [3, 7, 4, 7, 9], [None] * 5, cfg)
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert len(errors) == 2 and all("RewardTimeout: no result within reward.timeout_s=0.3 s" in e for e in errors)
    assert "sample 1" in errors[0] and "sample 3" in errors[1]
    assert time.perf_counter() - started < 3
    with pytest.raises(RewardError, match=r"sample 1 .*RewardTimeout.*set reward.on_error=zero"):
        score_responses(
            ["3", "7"], [3, 7], [None] * 2, RewardConfig(function=cfg.function, timeout_s=0.3, on_error="fail")
        )
