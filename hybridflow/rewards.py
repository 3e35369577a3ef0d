"""Reward functions: verifiers that score a response against a reference answer.

```
reward.function  ──┐                      auto (the default): a row's data_source when it names
row data_source  ──┴─ function_name ───►   a registered reward, else math; any other value:
                          │                that function for every row, whatever data_source says
                          │ get_reward: registered name, or dotted path pkg.mod.fn (imported)
                          ▼
fn(response, answer, **reward.kwargs) -> float   ── raises / NaN / not a number:
                          │                          reward.on_error=zero -> 0.0, logged once
                          ▼                          reward.on_error=fail -> RewardError
score_rows -> Scored(scores, errors, no_answer)     score_responses -> (scores, errors)
```

Built-ins register by name: ``exact_match``, ``math``, ``arithmetic``, ``countdown``, and the math
scorers of ``math_scorers`` (``gsm8k``, ``math_boxed``, ``dapo_math``, ``math_verify``), which also
register under the data_source names verl gives them (``openai/gsm8k``, ``lighteval/MATH``,
``math_dapo``; ``aime*`` routes to ``dapo_math``) so that ``auto``
scores such rows as verl does (``reward.math_equivalence=math_verify``: by math-verify instead).
A function may also take the row's ``data_source`` and ``extra_info`` (by those parameter names),
and verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` is called as
verl calls it (a dict result gives its ``score``, and ``"reason": "no_answer"`` when the response
holds no answer in the format it reads). Each built-in knows its format (``finds_answer``), so a
run can tell a model that never writes an answer the scorer reads from one that answers wrongly.
An explicitly written ``reward.function`` wins because a user who names a function expects it
to score their data; ``auto`` keeps the synthetic tasks (whose rows carry their verifier's name
as ``data_source``) and mixed data sets scored by their own verifiers. ``check_reward`` and
``describe_routing`` let preflight fail on a bad name and print which function scores which
data_source before any rank starts; ``score_responses`` logs each new pairing once.
Nothing here calls ``eval``: countdown equations are parsed with ``ast`` and only a whitelist
of nodes is evaluated, with exact fractions.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import logging
import math as _math
import numbers
import queue
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.math_scorers import (
    ANSWER_FINDERS,
    DAPO_SOURCES,
    GSM8K_SOURCES,
    MATH_SOURCES,
    dapo_math,
    gsm8k_strict,
    is_verl_math_source,
    math_boxed,
    math_verify_score,
)

__all__ = [
    "AUTO",
    "RewardError",
    "RewardFn",
    "check_reward",
    "describe_routing",
    "extract_final_answer",
    "function_name",
    "get_reward",
    "register_reward",
    "reward_names",
    "score_responses",
    "score_rows",
]

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
"""``fn(response: str, answer: Any, **kwargs) -> float``."""

_REWARDS: dict[str, RewardFn] = {}
_ANSWER_FINDERS: dict[RewardFn, Callable[[str], bool]] = {}  # scorer -> does the response hold its format
NO_ANSWER = "no_answer"
"""The ``reason`` a scorer returns (``{"score": 0.0, "reason": "no_answer"}``) when the response
holds no answer in the format it reads: the run tells that apart from a wrong answer."""
_SHOWN_CHARS = 120  # response text shown in an error message
AUTO = "auto"
"""``reward.function`` that routes each row by its ``data_source`` (see ``function_name``)."""
AUTO_FALLBACK = "math"
"""What ``auto`` scores a row with when its data_source names no registered reward."""
_LOGGED_ROUTES: set[tuple[str | None, str]] = set()  # (data_source, function) pairs logged once


class RewardError(RuntimeError):
    """A reward function failed on a sample under ``reward.on_error=fail``."""


# --------------------------------------------------------------------------- registry


def register_reward(name: str, *, finds_answer: Callable[[str], bool] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn(response, answer, **kwargs) -> float`` under ``name``;
    ``finds_answer(response)``: whether the response holds an answer in the format ``fn`` reads."""

    def register(fn: RewardFn) -> RewardFn:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered ({_REWARDS[name]!r})")
        _REWARDS[name] = fn
        if finds_answer is not None:
            _ANSWER_FINDERS[fn] = finds_answer
        return fn

    return register


def reward_names() -> tuple[str, ...]:
    """Registered reward names, sorted."""
    return tuple(sorted(_REWARDS))


def _import_reward(path: str) -> RewardFn:
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import failure is the user's path or module
        raise ValueError(
            f"reward.function={path!r}: cannot import module {module_name!r} ({type(error).__name__}: {error})"
        ) from error
    fn = getattr(module, attribute, None)
    if not callable(fn):
        found = "nothing" if fn is None else f"a {type(fn).__name__}"
        raise ValueError(
            f"reward.function={path!r}: module {module_name!r} has {found} named "
            f"{attribute!r}; expected a function fn(response, answer, **kwargs)"
        )
    return fn


def get_reward(name: str) -> RewardFn:
    """The registered reward ``name``, or the function at dotted path ``pkg.module.fn``."""
    if name in _REWARDS:
        return _REWARDS[name]
    if "." in name.strip("."):
        return _import_reward(name)
    close = difflib.get_close_matches(name, reward_names(), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"reward.function={name!r} is not a registered reward ({', '.join(reward_names())}), "
        f"{AUTO!r} nor a dotted path package.module.function; {hint}set reward.function to one of them"
    )


_VERL_PARAMETERS = frozenset({"solution_str", "ground_truth"})
_ROW_PARAMETERS = ("data_source", "extra_info")


def _parameters(fn: RewardFn) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return frozenset()


def _arguments(
    fn: RewardFn, response: str, answer: Any, data_source: str | None, extra_info: Any, kwargs: Mapping[str, Any]
) -> tuple[tuple, dict]:
    """How ``fn`` is called: verl's ``compute_score`` by its parameter names, any other function as
    fn(response, answer, **kwargs), with ``data_source`` / ``extra_info`` when it names them."""
    names = _parameters(fn)
    if _VERL_PARAMETERS <= names:
        row = (
            {"data_source": data_source, "extra_info": extra_info}
            if "extra_info" in names
            else {"data_source": data_source}
        )
        return (), {**row, "solution_str": response, "ground_truth": answer, **kwargs}
    row = {k: v for k, v in (("data_source", data_source), ("extra_info", extra_info)) if k in names}
    return (response, answer), {**row, **kwargs}


def check_reward(cfg: RewardConfig) -> None:
    """``reward.function`` resolves (``auto``: always) and takes ``(response, answer, **reward.kwargs)``
    (or verl's ``compute_score`` arguments); ValueError naming the key and the fix otherwise.
    Imports a dotted path's module."""
    names = [AUTO_FALLBACK] if cfg.function == AUTO else [cfg.function]
    for name in names:
        fn = get_reward(name)
        args, kwargs = _arguments(fn, "response", "answer", "data_source", {}, cfg.kwargs)
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as error:
            raise ValueError(
                f"reward.function={name!r} cannot be called as fn(response, answer, "
                f"**reward.kwargs) with reward.kwargs={dict(cfg.kwargs)} ({error}); fix "
                "reward.kwargs or the function's parameters (verl's compute_score(data_source, "
                "solution_str, ground_truth, extra_info) is called as verl calls it)"
            ) from None
        except ValueError:  # no signature to read (a builtin): it is checked when called
            pass


def function_name(data_source: str | None, cfg: RewardConfig) -> str:
    """The reward that scores a row: ``reward.function``, or under ``auto`` the row's data_source
    when that names a registered reward, else ``AUTO_FALLBACK``."""
    if cfg.function != AUTO:
        return cfg.function
    if is_verl_math_source(data_source):
        if cfg.math_equivalence == "math_verify":
            return "math_verify"
        if data_source.startswith("aime"):  # verl scores every aime* data set with DAPO's check
            return "dapo_math"
    return data_source if data_source in _REWARDS else AUTO_FALLBACK


def describe_routing(cfg: RewardConfig, sources: Mapping[str | None, int]) -> tuple[str, list[str]]:
    """One line saying which function scores the rows of each data_source (``sources``: rows per
    data_source, None for rows without one), and a warning for each registered data_source that
    an explicit ``reward.function`` bypasses."""
    routes: dict[str, list[str]] = {}
    for source in sorted(sources, key=lambda s: (s is None, str(s))):
        shown = "no data_source" if source is None else f"{source!r}"
        routes.setdefault(function_name(source, cfg), []).append(f"{shown} ({sources[source]} rows)")
    line = "; ".join(f"{', '.join(shown)} -> {name}" for name, shown in routes.items())
    bypassed = sorted(s for s in sources if s in _REWARDS and s != function_name(s, cfg))
    warnings = [
        f"reward.function={cfg.function!r} scores the rows whose data_source is {s!r}, not the "
        f"registered {s!r} verifier; set reward.function={AUTO} to score each row by its data_source"
        for s in bypassed
    ]
    return f"reward ({cfg.function}): {line or 'no rows'}", warnings


# --------------------------------------------------------------------------- numbers in text

_NUMBER = r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?"
_FRAC = re.compile(r"\\[dt]?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")


def _to_number(text: str) -> Fraction | None:
    """``text`` as an exact number ("3", "-2.5", "1,000", "3/4", "\\frac{3}{4}"), or None."""
    cleaned = _FRAC.sub(r"\1/\2", text).replace("$", "").replace("\\!", "").strip().rstrip(".")
    cleaned = re.sub(r"(?<=\d),(?=\d{3}\b)", "", cleaned).replace(" ", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+|\$", "", text).rstrip(".").lower()


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth < 0:
            return text[begin:index]
    return None  # unbalanced: no usable answer


def extract_final_answer(text: str) -> str | None:
    """The final answer of a math response: the last ``\\boxed{}``, else what follows the last
    "answer:" or "####" (to the end of its line), else the last number; None if nothing."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marked = re.findall(r"(?:answer\s*:|####)\s*([^\n]*)", text, flags=re.IGNORECASE)
    if marked and marked[-1].strip():
        return marked[-1].strip()
    numbers_found = re.findall(_NUMBER, text)
    return numbers_found[-1] if numbers_found else None


def _same_number(a: Fraction, b: Fraction) -> bool:
    # Exact first; the tolerance only absorbs float noise in answers stored as floats.
    return a == b or _math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)


# --------------------------------------------------------------------------- built-ins


@register_reward("exact_match")
def exact_match(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when the response equals ``str(answer)`` up to surrounding whitespace."""
    return float(response.strip() == str(answer).strip())


@register_reward("math", finds_answer=lambda response: extract_final_answer(response) is not None)
def math_reward(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when the response's final answer (see ``extract_final_answer``) matches ``answer``:
    numerically when both read as numbers (fractions and decimals are exact), else as text
    without spaces, ``$`` or case."""
    final = extract_final_answer(response)
    if final is None:
        return 0.0
    got, expected = _to_number(final), _to_number(str(answer))
    if got is not None and expected is not None:
        return float(_same_number(got, expected))
    return float(_normalise(final) == _normalise(str(answer)))


def _has_integer(response: str) -> bool:
    return re.search(r"-?\d+", response) is not None


@register_reward("multiply", finds_answer=_has_integer)
@register_reward("max", finds_answer=_has_integer)
@register_reward("arithmetic", finds_answer=_has_integer)
def arithmetic(response: str, answer: Any, **kwargs: Any) -> float:
    """1.0 when the first integer in the response equals the integer ``answer``.

    The synthetic arithmetic task trains the tiny model to answer with the number first (its
    demonstrations are just the number), so the first integer is its answer and whatever it
    generates after it is ignored; taking the first (not the last, or any) also stops a
    policy from collecting reward by listing several candidates.
    """
    expected = int(str(answer).strip())  # a non-integer answer is bad data: raise
    found = re.search(r"-?\d+", response)
    return float(found is not None and int(found.group()) == expected)


register_reward("gsm8k")(gsm8k_strict)
register_reward("math_boxed")(math_boxed)
register_reward("math_verify")(math_verify_score)
register_reward("dapo_math")(dapo_math)
for _source in DAPO_SOURCES:
    register_reward(_source)(dapo_math)
for _source in GSM8K_SOURCES:
    register_reward(_source)(gsm8k_strict)
for _source in MATH_SOURCES:
    register_reward(_source)(math_boxed)
_ANSWER_FINDERS.update(ANSWER_FINDERS)


# --------------------------------------------------------------------------- countdown

_EQUATION_CHARS = re.compile(r"[0-9 +\-*/()]+")
_MAX_EQUATION_CHARS = 100  # bounds the parser's work on whatever a policy generates
_OPERATIONS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _parse_equation(text: str) -> ast.expr | None:
    """The expression tree of ``text`` if it uses only integers, + - * / and parentheses."""
    text = text.strip()
    if not text or len(text) > _MAX_EQUATION_CHARS or not _EQUATION_CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    return tree if _whitelisted(tree) else None


def _whitelisted(node: ast.expr) -> bool:
    if isinstance(node, ast.BinOp):
        return type(node.op) in _OPERATIONS and _whitelisted(node.left) and _whitelisted(node.right)
    return isinstance(node, ast.Constant) and type(node.value) is int


def _evaluate(node: ast.expr) -> Fraction:
    """Value of a whitelisted tree, exactly; ZeroDivisionError on a division by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    return _OPERATIONS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


def _numbers_used(node: ast.expr) -> Counter[int]:
    return Counter(n.value for n in ast.walk(node) if isinstance(n, ast.Constant))


def _equation_text(response: str) -> str | None:
    """The equation of a response: inside the last <answer></answer> if any, else the response;
    of its "="-separated sides, the last that parses and has an operator (else the last that
    parses: a bare number)."""
    tagged = re.findall(r"<answer>(.*?)</answer>", response, flags=re.DOTALL)
    sides = [s for s in (tagged[-1] if tagged else response).split("=") if s.strip()]
    parsed = [(side, _parse_equation(side)) for side in sides]
    parsed = [(side, tree) for side, tree in parsed if tree is not None]
    with_operator = [side for side, tree in parsed if isinstance(tree, ast.BinOp)]
    candidates = with_operator or [side for side, _ in parsed]
    return candidates[-1] if candidates else None


def _countdown_answer(answer: Any) -> tuple[int, Counter[int]]:
    ok = (
        isinstance(answer, Mapping)
        and isinstance(answer.get("target"), int)
        and isinstance(answer.get("numbers"), (list, tuple))
        and all(type(n) is int for n in answer["numbers"])
    )
    if not ok:
        raise ValueError(f"countdown answer {answer!r} must be {{'target': int, 'numbers': [int, ...]}}")
    return answer["target"], Counter(answer["numbers"])


@register_reward("countdown", finds_answer=lambda response: _equation_text(response) is not None)
def countdown(response: str, answer: Any, *, format_score: float = 0.1, **kwargs: Any) -> float:
    """1.0 when the response's equation uses each of ``answer["numbers"]`` at most once, only
    + - * / and parentheses, and equals ``answer["target"]``; ``format_score`` when it parses but
    is wrong (value, numbers, division by zero); 0.0 when there is no equation.

    The equation sits inside ``<answer></answer>`` or is one side of an "=" (see
    ``_equation_text``): ``(3+5)*2``, ``(3+5)*2 = 16`` and ``16 = (3+5)*2`` all read as
    ``(3+5)*2``; a claimed result next to it is not checked, the expression is. Integers
    only, no unary minus: the given numbers are used as they are.
    """
    target, allowed = _countdown_answer(answer)
    text = _equation_text(response)
    if text is None:
        return 0.0
    tree = _parse_equation(text)
    if _numbers_used(tree) - allowed:  # a number not given, or used more often than given
        return format_score
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        return format_score
    return 1.0 if value == target else format_score


# --------------------------------------------------------------------------- scoring


def _log_new_routes(data_sources: Sequence[str | None], names: Sequence[str]) -> None:
    for route in set(zip(data_sources, names)) - _LOGGED_ROUTES:
        _LOGGED_ROUTES.add(route)
        logger.info("reward: rows with data_source %r are scored by %s", *route)


def _check_score(value: Any) -> tuple[float, str | None]:
    """(the score, the reason the scorer gave for it, if any)."""
    reason = None
    if isinstance(value, Mapping) and "score" in value:  # verl's scorers may return {"score": ..., ...}
        value, reason = value["score"], value.get("reason")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"returned a {type(value).__name__} ({value!r:.40}), not a number")
    score = float(value)
    if not _math.isfinite(score):
        raise ValueError(f"returned a non-finite score {score}")
    return score, None if reason is None else str(reason)


def _describe(index: int, name: str, response: str, answer: Any, error: Exception) -> str:
    shown = response if len(response) <= _SHOWN_CHARS else response[:_SHOWN_CHARS] + "..."
    return (
        f"reward {name!r} failed on sample {index} (response {shown!r}, answer {answer!r}): "
        f"{type(error).__name__}: {error}"
    )


class _ErrorLog:
    """Errors of one scoring call: each distinct error logged once, every sample listed."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.policy, self.messages, self.seen = cfg.on_error, [], Counter()

    def add(self, index: int, name: str, response: str, answer: Any, error: Exception) -> None:
        message = _describe(index, name, response, answer, error)
        if self.policy == "fail":
            raise RewardError(f"{message}; fix the function or set reward.on_error=zero") from error
        key = (name, type(error).__name__, str(error))
        if not self.seen[key]:
            logger.warning("%s; scored 0.0 (logged once per distinct error)", message)
        self.seen[key] += 1
        self.messages.append(message)


class RewardTimeout(TimeoutError):
    """A reward call that ran past ``reward.timeout_s``."""


def call_each(call: Callable[[int], Any], count: int, timeout_s: float) -> list[tuple[Exception | None, Any]]:
    """``call(0) .. call(count - 1)`` in order, each within ``timeout_s`` (0: no limit): (None,
    value) or (the exception, None) per call. The calls run on a worker thread; one that runs
    past its time is abandoned (a thread cannot be stopped) and a new worker takes the next, so a
    function that never returns costs its rows a timeout each, never the run."""
    results: list[tuple[Exception | None, Any]] = []
    while len(results) < count:
        start, done, abandoned = len(results), queue.SimpleQueue(), threading.Event()

        def work(first: int = start, out=done, stop=abandoned) -> None:
            for index in range(first, count):
                if stop.is_set():
                    return
                try:
                    out.put((None, call(index)))
                except Exception as error:  # the caller reports it with its row
                    out.put((error, None))

        threading.Thread(target=work, name=f"reward-{start}", daemon=True).start()
        for _ in range(start, count):
            try:
                results.append(done.get(timeout=timeout_s or None))
            except queue.Empty:
                abandoned.set()
                results.append((RewardTimeout(f"no result within reward.timeout_s={timeout_s:g} s"), None))
                break
    return results


@dataclass(frozen=True)
class Scored:
    """What scoring a batch found, row by row."""

    scores: list[float]
    errors: list[str]
    """One message per reward call that raised (its row scored 0.0)."""
    no_answer: list[bool]
    """The row's response holds no answer in the format its scorer reads (the scorer said
    ``reason: no_answer``, or its registered answer finder found none): a zero that no better
    answer would have changed, which a warm-up on the format fixes."""


def score_responses(
    responses: Sequence[str],
    answers: Sequence[Any],
    data_sources: Sequence[str | None],
    cfg: RewardConfig,
    extra_infos: Sequence[Any] | None = None,
) -> tuple[list[float], list[str]]:
    """The scores and error messages of ``score_rows``."""
    scored = score_rows(responses, answers, data_sources, cfg, extra_infos)
    return scored.scores, scored.errors


def score_rows(
    responses: Sequence[str],
    answers: Sequence[Any],
    data_sources: Sequence[str | None],
    cfg: RewardConfig,
    extra_infos: Sequence[Any] | None = None,
) -> Scored:
    """Score each response against its answer.

    The function is ``function_name(row's data_source, cfg)``: ``cfg.function``, or under
    ``auto`` the row's registered data_source (the synthetic tasks write theirs), else
    ``AUTO_FALLBACK``; it is called with ``cfg.kwargs``. A
    function that raises or returns a non-number or a non-finite number gives 0.0 and an
    error message (each distinct error logged once) under ``cfg.on_error=zero``, and raises a
    RewardError naming the sample under ``fail``.
    """
    if not len(responses) == len(answers) == len(data_sources):
        raise ValueError(
            f"score_responses got {len(responses)} responses, {len(answers)} answers "
            f"and {len(data_sources)} data sources; they must pair up"
        )
    names = [function_name(source, cfg) for source in data_sources]
    functions = {name: get_reward(name) for name in names}
    _log_new_routes(data_sources, names)
    extra_infos = [None] * len(responses) if extra_infos is None else extra_infos
    errors, scores, no_answer = _ErrorLog(cfg), [], []

    def call(index: int) -> Any:
        fn = functions[names[index]]
        args, kwargs = _arguments(
            fn, responses[index], answers[index], data_sources[index], extra_infos[index], cfg.kwargs
        )
        return fn(*args, **kwargs)

    for index, (outcome, value) in enumerate(call_each(call, len(responses), cfg.timeout_s)):
        fn, reason, response = functions[names[index]], None, responses[index]
        try:
            if outcome is not None:
                raise outcome
            score, reason = _check_score(value)
        except Exception as error:  # any failure of user code is reported per sample
            errors.add(index, names[index], response, answers[index], error)
            score = 0.0
        scores.append(score)
        finder = _ANSWER_FINDERS.get(fn)
        no_answer.append(reason == NO_ANSWER or (reason is None and finder is not None and not finder(response)))
    return Scored(scores, errors.messages, no_answer)
