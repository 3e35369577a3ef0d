"""The features a user switches on beside an algorithm, as one registry.

Each feature is what a user types to switch it on (``switch``: overrides of the CPU quickstart,
``{reward_model}`` / ``{judge}`` / ``{teacher}`` standing for a model directory of that kind),
how to tell that a config has it on (``on``), and the parts of a step it changes (``touches``).
``hybridflow plan`` names the features a config has on; the combination matrix
(``tests/combinations``, docs/testing.md) runs every algorithm with every feature, and every pair
of features that touch a common part of the step, from this registry and the algorithms' one.

Features with several modes expand from the registry of those modes (async modes, rollout
corrections, PF-PPO weightings, routing replays, LoRA pushes): a mode added there joins the
matrix without an edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hfschema.lora import LORA_PUSHES
from hfschema.train import ROUTING_REPLAY_MODES
from hybridflow.config import ASYNC_MODES, CORRECTION_MODES, PF_PPO_MODES, HybridflowConfig

__all__ = ["FEATURES", "MODEL_DIRS", "PARTS", "Feature", "active_features", "feature"]

MODEL_DIRS = ("reward_model", "judge", "teacher")
"""The model directories a feature's switch can name, as ``{reward_model}`` and so on."""

PARTS = ("rows", "sequences", "weights", "scores", "logprobs", "placement")
"""The parts of a step a feature can change: which rows train (``rows``), how a sample's tokens
are laid out (``sequences``), what the engines hold and when (``weights``), what a response
scores (``scores``), which log-probs the loss compares (``logprobs``), where the ranks run
(``placement``). Two features interact when they touch a common part."""


@dataclass(frozen=True)
class Feature:
    name: str
    switch: tuple[str, ...]
    on: Callable[[HybridflowConfig], bool]
    touches: frozenset[str]

    @property
    def needs(self) -> tuple[str, ...]:
        """The model directories its switch names (of ``MODEL_DIRS``)."""
        return tuple(name for name in MODEL_DIRS if any(f"{{{name}}}" in part for part in self.switch))

    def overrides(self, dirs: dict[str, str]) -> tuple[str, ...]:
        """Its switch with the model directories it needs filled in from ``dirs``."""
        filled = []
        for part in self.switch:
            for name in self.needs:
                part = part.replace(f"{{{name}}}", dirs[name])
            filled.append(part)
        return tuple(filled)


def _feature(name: str, switch: tuple[str, ...], on: Callable[[HybridflowConfig], bool], *touches: str) -> Feature:
    unknown = set(touches) - set(PARTS)
    if unknown:
        raise ValueError(f"feature {name}: unknown parts {sorted(unknown)}; parts are {', '.join(PARTS)}")
    return Feature(name, switch, on, frozenset(touches))


SEPARATE = ("rollout.placement=separate", "rollout.tp=1")
"""The quickstart's engine on a rank of its own (asynchronous RL overlaps nothing colocated)."""


def _modes(prefix: str, key: str, modes, *touches: str) -> list[Feature]:
    """One feature per mode of ``key`` (``<prefix>_<mode>``), on when the key holds that mode."""

    def value(cfg: HybridflowConfig):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    return [_feature(f"{prefix}_{m}", (f"{key}={m}",), lambda c, m=m: value(c) == m, *touches) for m in modes]


JUDGE_SWITCH = (
    "judge.path={judge}",
    "judge.dtype=float32",
    "judge.template=max({response},{answer})=",
    "judge.pattern=^([0-4])$",
    "judge.scale=1.0",
    "judge.max_tokens=4",
)
"""A generative judge that answers the quickstart's question again: its reply, a digit, is the
score (the quickstart's own warm-up model can be that judge)."""

FEATURES: tuple[Feature, ...] = (
    _feature(
        "dynamic_sampling",
        ("algorithm.dynamic_sampling=true",),
        lambda c: bool(c.algorithm.dynamic_sampling),
        "rows",
        "scores",
    ),
    _feature(
        "overlong_shaping",
        ("algorithm.overlong_buffer_len=2",),
        lambda c: bool(c.algorithm.overlong_buffer_len),
        "scores",
    ),
    _feature("packing", ("packing.enabled=true",), lambda c: c.packing.enabled, "sequences"),
    _feature(
        "token_budget",
        ("packing.enabled=true", "packing.max_tokens_per_micro_batch=96"),
        lambda c: c.packing.max_tokens_per_micro_batch is not None,
        "sequences",
        "rows",
    ),
    *(
        _feature(
            f"lora_{push}",
            ("lora.enabled=true", f"lora.push={push}", "lora.target_modules=[linear_qkv,linear_proj]"),
            lambda c, push=push: c.lora.enabled and c.lora.push == push,
            "weights",
            "sequences",
        )
        for push in LORA_PUSHES
    ),
    *(
        _feature(
            f"async_{mode}",
            (*SEPARATE, f"async_rl.mode={mode}"),
            lambda c, mode=mode: c.async_rl.mode == mode,
            "rows",
            "weights",
            "placement",
        )
        for mode in ASYNC_MODES
        if mode != "sync"
    ),
    _feature(
        "partial_rollout",
        (
            *SEPARATE,
            "async_rl.mode=async",
            "async_rl.max_staleness=2",
            "async_rl.partial_rollout=true",
            "async_rl.segment_tokens=2",
        ),
        lambda c: c.async_rl.partial_rollout,
        "rows",
        "weights",
        "logprobs",
    ),
    _feature(
        "replicas",
        ("rollout.num_replicas=2", "rollout.tp=1"),
        lambda c: c.rollout.num_replicas > 1,
        "weights",
        "rows",
    ),
    _feature(
        "separate_placement",
        SEPARATE,
        lambda c: c.rollout.placement == "separate",
        "placement",
        "weights",
    ),
    _feature(
        "reward_model",
        ("reward_model.path={reward_model}", "reward_model.parallel.dp=2", "reward.rule_weight=1"),
        lambda c: c.reward_model.path is not None,
        "scores",
    ),
    _feature("judge", JUDGE_SWITCH, lambda c: c.judge.path is not None, "scores"),
    _feature(
        "distillation",
        ("distillation.teacher_path={teacher}",),
        lambda c: c.distillation.teacher_path is not None,
        "logprobs",
        "scores",
    ),
    _feature(
        "multi_turn",
        (
            "agentic.enabled=true",
            "agentic.tools=[calculator]",
            "agentic.environments={max: tests.agentic.envs:AskAgain}",
            "agentic.max_turns=2",
            "agentic.turn_tokens=8",
            "data.max_response_length=24",
        ),
        lambda c: c.agentic.enabled,
        "sequences",
        "rows",
    ),
    *_modes("rollout_correction", "algorithm.rollout_correction", CORRECTION_MODES, "logprobs"),
    *_modes("pf_ppo", "algorithm.pf_ppo", PF_PPO_MODES, "rows"),
    *_modes("routing_replay", "moe.routing_replay", [m for m in ROUTING_REPLAY_MODES if m != "off"], "logprobs"),
    _feature(
        "kl_loss",
        ("reference.enabled=true", "algorithm.kl_loss_coef=0.01"),
        lambda c: c.algorithm.kl_loss_coef > 0,
        "logprobs",
    ),
    _feature(
        "kl_reward",
        ("reference.enabled=true", "algorithm.kl_reward_coef=0.01"),
        lambda c: c.algorithm.kl_reward_coef > 0,
        "scores",
        "logprobs",
    ),
    _feature(
        "critic_own_layout",
        ("critic.parallel.tp=2", "critic.parallel.ep=1", "critic.parallel.dp=1"),
        lambda c: bool(c.critic.enabled) and c.critic.parallel != c.actor.parallel,
        "placement",
    ),
)
"""Every feature, in the order ``hybridflow plan`` names them."""


def feature(name: str) -> Feature:
    """The feature registered as ``name``; KeyError lists them."""
    for f in FEATURES:
        if f.name == name:
            return f
    raise KeyError(f"unknown feature {name!r}; features: {', '.join(f.name for f in FEATURES)}")


def active_features(cfg: HybridflowConfig) -> list[str]:
    """The features ``cfg`` has on, by registry name."""
    return [f.name for f in FEATURES if f.on(cfg)]
