"""RL algorithms as specs, and specs as dataflow graphs.

    cfg.algorithm.name ──registry──► builder(cfg) ──► AlgorithmSpec ──adv_estimator, policy_loss,
                                                                      loss_agg_mode overrides──┐
    Graph ◄──validate(placed roles)── graph_from_spec(spec) ◄──check_roles, check_sampling─────┘

A builder states what its algorithm is (estimator, policy loss, the features its paper
switches on); the config says how much. Where the config leaves a knob at its schema default
and the paper needs it, the builder fills the paper's value in and records it in
``spec.filled`` (DAPO's clip_ratio_high=0.28); values the paper uses but that would change a
run's shape (VAPO's 50 value pre-training steps) are only recorded in ``spec.recommended``.
``spec.describe()`` prints both for ``hybridflow plan``. Estimators and losses are named,
never imported: their registries live beside this file and load with torch.

Every node any algorithm uses (``[...]``: only some algorithms):

    data: prompts, answers
      ├─► generate ─► responses ─► reward ─► scores ─► [filter_groups] ─► kept
      └─► [generate_greedy] ─► baseline_responses ─► [baseline_reward] ─► baseline_scores
    responses ─► old_logprob, [ref_logprob], [values] ─► old_logprobs, ref_logprobs, values
    scores ─► token_rewards ─► advantages ─► advantages, returns ─► [update_critic]
    old_logprobs, advantages ─► update_actor ─► actor_metrics ─► sync_weights ─► rollout_weights

The ops. The runtime dispatches on ``op``; each node is named after its op except the second
``reward`` node, ``baseline_reward``. ``[+ x: when]`` is a field read only in that case
(``kept``: with dynamic sampling); ``{...}`` are the node's options. An op reads only what its
node declares (``runtime/step.Inputs`` refuses the rest), so this table is all that passes.

    op               role       reads -> writes
    ───────────────  ─────────  ─────────────────────────────────────────────────────────────
    generate         rollout    prompts -> responses, rollout_logprobs [+ staleness_weights:
                                  async_rl.on_stale=downweight]
    generate_greedy  rollout    prompts -> baseline_responses
    reward           reward     <responses_field>, answers -> <scores_field>
                                  {responses_field, scores_field}
    filter_groups    driver     responses, scores [+ baseline_scores: remax] -> kept  {max_rounds}
    old_logprob      actor      responses [+ kept] -> old_logprobs, entropy [+ routed_experts:
                                  moe.routing_replay r2 / r3]  {routing_replay}
    ref_logprob      reference  responses [+ kept] -> ref_logprobs
    values           critic     responses [+ kept] -> values
    token_rewards    driver     scores, responses [+ kept] [+ ref_logprobs, old_logprobs: KL
                                  in the reward] -> token_rewards
                                  {kl_penalty, overlong_buffer_len}
    advantages       driver     token_rewards, responses [+ kept] [+ values: gae]
                                  [+ baseline_scores: remax] [+ staleness_weights]
                                  -> advantages, returns
                                  {estimator; with a critic: critic_lam, length_adaptive_lam_alpha}
    update_critic    critic     responses, values, returns [+ kept] -> critic_metrics
    update_actor     actor      responses, old_logprobs, advantages [+ kept] [+ ref_logprobs: KL in the
                                  loss] [+ scores: LM loss or PF-PPO] [+ routed_experts: routing
                                  replay] -> actor_metrics
                                  {policy_loss, loss_agg_mode, clip_ratio_high, kl_loss,
                                   lm_loss_coef, pf_ppo, start_step}
    sync_weights     actor      actor_metrics [+ critic_metrics: with a critic] -> rollout_weights

Graph transforms add the frozen models' nodes (``with_reward_model``, ``with_judge``,
``with_distillation``; docs/frozen-models.md):

    rm_score         reward_model  responses -> model_scores (read by reward: the mix)
    rm_request       reward_model  responses -> model_scores_pending (on GPUs of its own,
                                  reward_model.gpus: its ranks score; rm_score then collects,
                                  moved with reward down to just before the reward is read)
    judge_request    judge      responses -> judge_scores_pending (rank 0's engine generates ...)
    judge            judge      responses, judge_scores_pending -> judge_scores (... collected here,
                                  with reward, just before the reward is read: the mix)
    teacher_logprob  teacher    responses [+ kept] -> teacher_logprobs (read by advantages, with
                                  old_logprobs: each token's advantage loses distill_coef x KL)
    teacher_request  teacher    responses [+ kept] -> teacher_logprobs_pending (on GPUs of its own,
                                  distillation.gpus: sent where teacher_logprob was; teacher_logprob
                                  then collects just before advantages)

Conventions the runtime keeps:

- ``kept`` (DAPO dynamic sampling): ``filter_groups`` drops the prompt groups whose scores are
  all equal, and the runtime repeats its ancestors (generate, reward, and ReMax's baseline)
  until the batch is full or ``max_rounds`` rounds have run. From then on the step's batch
  holds only kept rows; the nodes that would otherwise be ready before the filter read
  ``kept`` so that they run after it.
- ``returns`` equal ``advantages`` for estimators without a critic; only ``update_critic``
  reads them.
- PF-PPO is an option of ``update_actor`` (it reweights the actor's samples by ``scores``);
  the critic, if any, trains on every sample.
- ``start_step`` > 0 (VAPO value pre-training): ``update_actor`` and ``sync_weights`` do
  nothing for that many steps while the critic trains.
- ``sync_weights`` reads ``critic_metrics`` only as a barrier: the step, and in colocated
  placement the training memory, is done before the rollout engines generate again. It is
  the step's one sink; its ``rollout_weights`` feed the next step's ``generate``.
- Numbers the options do not carry (clip_ratio_low, gamma, lam, kl coefficients, kl_type,
  entropy_coef, value_clip, ...) the runtime reads from ``cfg.algorithm``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.config import AlgorithmConfig, HybridflowConfig, enabled_roles
from hybridflow.graph import DRIVER, Graph, Node

__all__ = [
    "AlgorithmSpec",
    "DATA_FIELDS",
    "ESTIMATORS",
    "EstimatorNeeds",
    "algorithm_names",
    "algorithm_spec",
    "build_graph",
    "check_roles",
    "check_sampling",
    "graph_from_spec",
    "with_staleness_weights",
    "placed_roles",
    "register_algorithm",
]

logger = logging.getLogger(__name__)

DATA_FIELDS = ("prompts", "answers")
"""Fields the data loader supplies to every graph."""


@dataclass(frozen=True, kw_only=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the graph and from sampling."""

    fields: tuple[str, ...] = ()
    """Fields it reads besides token_rewards."""
    groups: bool = False
    """It compares the responses to one prompt, so it needs rollout.n >= 2."""


ESTIMATORS: dict[str, EstimatorNeeds] = {
    "gae": EstimatorNeeds(fields=("values",)),
    "grpo": EstimatorNeeds(groups=True),
    "rloo": EstimatorNeeds(groups=True),
    "reinforce_plus_plus": EstimatorNeeds(),
    "reinforce_plus_plus_baseline": EstimatorNeeds(groups=True),
    "remax": EstimatorNeeds(fields=("baseline_scores",)),
    "gpg": EstimatorNeeds(groups=True),
    "opo": EstimatorNeeds(groups=True),
    "grpo_passk": EstimatorNeeds(groups=True),
}
"""Advantage estimators by registry name, with what the graph must feed them. A new estimator
registered in ``estimators.py`` needs an entry here before an algorithm can name it."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmSpec:
    """What one RL step does: estimator, loss and switches, resolved from a config."""

    name: str
    """Registered algorithm name (algorithm.name)."""
    description: str
    """One line and the paper it comes from."""
    estimator: str
    """Advantage estimator, a key of ESTIMATORS."""
    policy_loss: str
    """Policy loss, by its registry name (vanilla, gspo, cispo, gpg, reinforce, clip_cov, kl_cov,
    sapo, gmpo, dppo_tv, dppo_kl, ...: ``losses.policy_loss_names()``)."""
    loss_agg_mode: str
    """How token losses are averaged (token-mean, seq-mean-token-sum, ...)."""
    clip_ratio_high: float
    """Upper ratio clip used (clip-higher when above clip_ratio_low)."""
    critic_lam: float
    """GAE lambda of the critic's returns."""
    length_adaptive_lam_alpha: float | None
    """VAPO's length-adaptive actor lambda, 1 - 1 / (alpha * length); None = algorithm.lam."""
    critic_warmup_steps: int
    """Steps in which only the critic trains (VAPO value pre-training)."""
    kl_in_loss: bool
    """The policy loss carries a KL(actor || reference) term (algorithm.kl_loss_coef > 0)."""
    kl_in_reward: bool
    """Token rewards carry a KL penalty (algorithm.kl_reward_coef > 0)."""
    dynamic_sampling: bool
    """Drop prompt groups whose scores are all equal and resample (DAPO)."""
    max_sampling_rounds: int
    """Generation rounds per step of dynamic sampling."""
    overlong_buffer_len: int
    """Overlong shaping over the last this many tokens of the budget; 0 = off (DAPO)."""
    lm_loss_coef: float
    """Weight of the LM loss on correct samples; 0 = off (VAPO)."""
    pf_ppo: str | None
    """PF-PPO reweighting mode; None = off."""
    filled: tuple[tuple[str, Any], ...] = ()
    """(config key, value) the algorithm filled in where the config left the schema default."""
    recommended: tuple[tuple[str, Any], ...] = ()
    """(config key, value) the paper uses where the config left the default; not applied."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"advantage estimator {self.estimator!r} (algorithm {self.name!r}) is not one of: "
                f"{', '.join(ESTIMATORS)}; set algorithm.adv_estimator to one of them (a new "
                "estimator also needs an entry in ESTIMATORS in hybridflow/algorithms/recipes.py)"
            )

    @property
    def needs_critic(self) -> bool:
        """The estimator reads the critic's values."""
        return "values" in ESTIMATORS[self.estimator].fields

    @property
    def greedy_baseline(self) -> bool:
        """The estimator reads the score of a greedy response (ReMax)."""
        return "baseline_scores" in ESTIMATORS[self.estimator].fields

    @property
    def uses_reference(self) -> bool:
        """A KL term, in the loss or in the reward, needs the reference policy."""
        return self.kl_in_loss or self.kl_in_reward

    @property
    def overlong_shaping(self) -> bool:
        """Responses near the length budget are penalised (DAPO)."""
        return self.overlong_buffer_len > 0

    @property
    def lm_loss(self) -> bool:
        """The actor also learns to imitate its correct samples (VAPO)."""
        return self.lm_loss_coef > 0

    def describe(self) -> list[str]:
        """Lines for ``hybridflow plan``: what runs, what is switched on, what was filled in."""
        lines = [
            f"algorithm {self.name}: {self.description}",
            f"  advantages {self.estimator}; policy loss {self.policy_loss} ({self.loss_agg_mode}),"
            f" clip ratio high {self.clip_ratio_high}",
        ]
        features = self._features()
        if features:
            lines.append("  " + "; ".join(features))
        lines += [f"  {k}={_yaml(v)}: {self.name}'s value (the config left the default)" for k, v in self.filled]
        lines += [f"  {k}={_yaml(v)} is what {self.name}'s paper uses; not applied" for k, v in self.recommended]
        return lines

    def _features(self) -> list[str]:
        switched = {
            "critic"
            + (f" ({self.critic_warmup_steps} warm-up steps)" if self.critic_warmup_steps else ""): self.needs_critic,
            "reference (KL in the loss)": self.kl_in_loss,
            "reference (KL in the reward)": self.kl_in_reward,
            f"dynamic sampling, up to {self.max_sampling_rounds} rounds": self.dynamic_sampling,
            f"overlong shaping over the last {self.overlong_buffer_len} tokens": self.overlong_shaping,
            f"LM loss on correct samples x{self.lm_loss_coef}": self.lm_loss,
            f"PF-PPO ({self.pf_ppo})": self.pf_ppo is not None,
            "greedy baseline": self.greedy_baseline,
        }
        return [text for text, on in switched.items() if on]


def _yaml(value: Any) -> str:
    """``value`` as an override would spell it: true, null, 0.28."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


# --------------------------------------------------------------------------- registry

Builder = Callable[[HybridflowConfig], AlgorithmSpec]
_ALGORITHMS: dict[str, Builder] = {}


def register_algorithm(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register ``fn(cfg) -> AlgorithmSpec`` as the algorithm ``name``."""

    def register(builder: Builder) -> Builder:
        if name in _ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        _ALGORITHMS[name] = builder
        return builder

    return register


def algorithm_names() -> tuple[str, ...]:
    """Registered algorithm names, in registration order."""
    return tuple(_ALGORITHMS)


_OVERRIDES = {"adv_estimator": "estimator", "policy_loss": "policy_loss", "loss_agg_mode": "loss_agg_mode"}
"""algorithm.<key> that, when set, replaces the spec field it maps to."""


def algorithm_spec(cfg: HybridflowConfig) -> AlgorithmSpec:
    """The spec of ``cfg.algorithm.name`` with the config's estimator / loss overrides."""
    name = cfg.algorithm.name
    if name not in _ALGORITHMS:
        raise ValueError(
            f"algorithm.name={name!r} is not a registered algorithm; choose one of: {', '.join(_ALGORITHMS)}"
        )
    spec = _ALGORITHMS[name](cfg)
    changes = {
        field: getattr(cfg.algorithm, key)
        for key, field in _OVERRIDES.items()
        if getattr(cfg.algorithm, key) is not None
    }
    return dataclasses.replace(spec, **changes)


# --------------------------------------------------------------------------- building specs

_SCHEMA_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}
OFF = {"dynamic_sampling": False, "overlong_buffer_len": 0, "lm_loss_coef": 0.0, "length_adaptive_lam_alpha": 0.0}
"""What a knob left None means for an algorithm without a value of its own (0: off)."""


def _spec(
    cfg: HybridflowConfig,
    *,
    name: str,
    description: str,
    estimator: str,
    policy_loss: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    paper: Mapping[str, Any] | None = None,
    advice: Mapping[str, Any] | None = None,
) -> AlgorithmSpec:
    """A spec from ``cfg.algorithm``: ``paper`` values are filled in where the config leaves
    the schema default; ``advice`` values are only recorded there."""
    knobs, filled = _fill(cfg.algorithm, paper or {})
    return AlgorithmSpec(
        name=name,
        description=description,
        estimator=estimator,
        policy_loss=policy_loss,
        loss_agg_mode=loss_agg_mode,
        clip_ratio_high=_first_set(knobs["clip_ratio_high"], knobs["clip_ratio_low"]),
        critic_lam=_first_set(knobs["critic_lam"], knobs["lam"]),
        length_adaptive_lam_alpha=knobs["length_adaptive_lam_alpha"],
        critic_warmup_steps=knobs["value_pretrain_steps"],
        kl_in_loss=knobs["kl_loss_coef"] > 0,
        kl_in_reward=knobs["kl_reward_coef"] > 0,
        dynamic_sampling=knobs["dynamic_sampling"],
        max_sampling_rounds=knobs["max_sampling_rounds"],
        overlong_buffer_len=knobs["overlong_buffer_len"],
        lm_loss_coef=knobs["lm_loss_coef"],
        pf_ppo=knobs["pf_ppo"],
        filled=filled,
        recommended=_unfollowed(knobs, advice or {}),
    )


def _fill(algorithm: AlgorithmConfig, paper: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """algorithm's fields with ``paper`` values where the config left them None (a value the
    user wrote always wins, even one equal to the schema's), the rest of the None knobs off,
    and the (config key, value) pairs that were filled."""
    knobs = dataclasses.asdict(algorithm)
    unset = {k: v for k, v in paper.items() if knobs[k] is None}
    knobs.update(unset)
    knobs.update({k: off for k, off in OFF.items() if knobs[k] is None})
    if not knobs["length_adaptive_lam_alpha"]:
        knobs["length_adaptive_lam_alpha"] = None  # 0 = off: the estimator takes None
    return knobs, tuple((f"algorithm.{k}", v) for k, v in unset.items())


def _unfollowed(knobs: Mapping[str, Any], advice: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """(config key, value) of the ``advice`` the config neither follows nor overrides."""
    return tuple((f"algorithm.{k}", v) for k, v in advice.items() if knobs[k] == _SCHEMA_DEFAULTS[k] != v)


def _first_set(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


# --------------------------------------------------------------------------- the algorithms


@register_algorithm("ppo")
def _ppo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="ppo",
        estimator="gae",
        description=(
            "PPO: clipped policy updates with a learned critic and GAE advantages "
            "(Schulman et al., 2017, 'Proximal Policy Optimization Algorithms')"
        ),
    )


@register_algorithm("grpo")
def _grpo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="grpo",
        estimator="grpo",
        description=(
            "GRPO: rewards normalised within each prompt's group of responses, no critic "
            "(Shao et al., 2024, 'DeepSeekMath')"
        ),
    )


@register_algorithm("dapo")
def _dapo(cfg: HybridflowConfig) -> AlgorithmSpec:
    # the paper's overlong buffer is 4096 of a 20480-token budget: a fifth of it
    buffer = max(1, cfg.data.max_response_length // 5)
    return _spec(
        cfg,
        name="dapo",
        estimator="grpo",
        description=(
            "DAPO: GRPO with clip-higher, dynamic sampling, a token-level loss and overlong "
            "shaping (Yu et al., 2025, 'DAPO: An Open-Source LLM Reinforcement Learning System "
            "at Scale')"
        ),
        paper=dict(clip_ratio_high=0.28, dynamic_sampling=True, overlong_buffer_len=buffer),
    )


@register_algorithm("vapo")
def _vapo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="vapo",
        estimator="gae",
        description=(
            "VAPO: value-based PPO with value pre-training, decoupled and length-adaptive GAE, "
            "clip-higher and an LM loss on correct samples (Yue et al., 2025, 'VAPO: Efficient "
            "and Reliable Reinforcement Learning for Advanced Reasoning Tasks')"
        ),
        paper=dict(clip_ratio_high=0.28, critic_lam=1.0, length_adaptive_lam_alpha=0.05, lm_loss_coef=0.1),
        # 50 critic-only steps would stall a short run, so the config decides
        advice=dict(value_pretrain_steps=50),
    )


@register_algorithm("rloo")
def _rloo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="rloo",
        estimator="rloo",
        description=(
            "RLOO: each response's baseline is the mean score of the other responses to its "
            "prompt (Ahmadian et al., 2024, 'Back to Basics: Revisiting REINFORCE Style "
            "Optimization for Learning from Human Feedback in LLMs')"
        ),
    )


@register_algorithm("reinforce_plus_plus")
def _reinforce_plus_plus(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="reinforce_plus_plus",
        estimator="reinforce_plus_plus",
        description=(
            "REINFORCE++: critic-free returns normalised over the whole batch "
            "(Hu, 2025, 'REINFORCE++: A Simple and Efficient Approach for Aligning Large "
            "Language Models')"
        ),
    )


@register_algorithm("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="reinforce_plus_plus_baseline",
        estimator="reinforce_plus_plus_baseline",
        description=(
            "REINFORCE++ with the group's mean score subtracted before the batch "
            "normalisation (Hu, 2025, 'REINFORCE++')"
        ),
    )


@register_algorithm("remax")
def _remax(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="remax",
        estimator="remax",
        description=(
            "ReMax: REINFORCE with the score of a greedy response to the same prompt as baseline "
            "(Li et al., 2023, 'ReMax: A Simple, Effective, and Efficient Reinforcement Learning "
            "Method for Aligning Large Language Models')"
        ),
    )


@register_algorithm("gspo")
def _gspo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="gspo",
        estimator="grpo",
        policy_loss="gspo",
        loss_agg_mode="seq-mean-token-mean",
        description=(
            "GSPO: group-relative advantages with one length-normalised importance "
            "ratio per sequence (Zheng et al., 2025, 'Group Sequence Policy "
            "Optimization')"
        ),
        # sequence ratios sit near 1: the paper clips them in [1 - 3e-4, 1 + 4e-4]
        advice=dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4),
    )


@register_algorithm("gpg")
def _gpg(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="gpg",
        estimator="gpg",
        policy_loss="gpg",
        description=(
            "GPG: a plain policy gradient on group-relative advantages, without clipping "
            "(Chu et al., 2025, 'GPG: A Simple and Strong Reinforcement Learning Baseline for "
            "Model Reasoning')"
        ),
    )


@register_algorithm("cispo")
def _cispo(cfg: HybridflowConfig) -> AlgorithmSpec:
    return _spec(
        cfg,
        name="cispo",
        estimator="grpo",
        policy_loss="cispo",
        description=(
            "CISPO: clips the importance-sampling weight instead of the update, so every token "
            "keeps its gradient (MiniMax, 2025, 'MiniMax-M1')"
        ),
    )


# --------------------------------------------------------------------------- config checks


def placed_roles(cfg: HybridflowConfig) -> frozenset[str]:
    """Roles this config runs: the enabled model roles (a reward model's with
    ``reward_model.path``), and rollout, reward and driver."""
    frozen = {"reward_model"} if cfg.reward_model.path else set()
    frozen |= {"teacher"} if cfg.distillation.teacher_path else set()
    frozen |= {"judge"} if cfg.judge.path else set()
    return frozenset(enabled_roles(cfg)) | frozen | {"rollout", "reward", DRIVER}


def check_roles(cfg: HybridflowConfig, spec: AlgorithmSpec) -> None:
    """ValueError naming the config key when the algorithm needs a role the config turns
    off; a warning when an enabled critic or reference would sit idle."""
    for problem in (_missing_actor, _missing_critic, _missing_reference):
        message = problem(cfg, spec)
        if message:
            raise ValueError(message)
    if cfg.critic.enabled and not spec.needs_critic:
        logger.warning(
            "critic.enabled=true, but %s reads no values: the critic stays idle; "
            "set critic.enabled=false to free its memory",
            _estimator_key(cfg, spec),
        )
    if cfg.reference.enabled and not spec.uses_reference:
        logger.warning(
            "reference.enabled=true, but algorithm.kl_loss_coef and kl_reward_coef "
            "are 0: the reference stays idle; set reference.enabled=false"
        )
    for line in idle_options(cfg, spec):
        logger.warning("%s", line)


def idle_options(cfg: HybridflowConfig, spec: AlgorithmSpec) -> list[str]:
    """One line per ``algorithm.*`` knob the config changed from the schema default that this
    algorithm never reads (a typo'd intention is better said than silently ignored)."""
    algo = cfg.algorithm
    gae = spec.estimator == "gae"
    reads = {
        "value_clip": spec.needs_critic,
        "critic_lam": gae,
        "value_pretrain_steps": spec.needs_critic,
        "length_adaptive_lam_alpha": gae,
        "lam": gae,
        "gamma": spec.estimator in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
        "norm_adv_by_std": spec.estimator == "grpo",
        "max_sampling_rounds": spec.dynamic_sampling,
        "overlong_penalty_factor": spec.overlong_shaping,
        "pf_ppo_weight_pow": spec.pf_ppo == "pow",
        "clip_ratio_c": spec.policy_loss == "vanilla",
        "kl_type": spec.kl_in_loss or spec.kl_in_reward,
        "kl_reward_horizon": algo.kl_reward_target is not None,
        **{
            key: algo.rollout_correction is not None
            for key in ("rollout_correction_level", "rollout_correction_upper", "rollout_correction_lower")
        },
    }
    return [
        f"algorithm.{key}={getattr(algo, key)!r} has no effect: {_estimator_key(cfg, spec)} "
        f"(policy loss {spec.policy_loss}) does not read it"
        for key, used in reads.items()
        if not used and getattr(algo, key) != _SCHEMA_DEFAULTS[key]
    ]


def _estimator_key(cfg: HybridflowConfig, spec: AlgorithmSpec) -> str:
    """The config key that chose the estimator, e.g. ``algorithm.name=ppo (estimator gae)``."""
    if cfg.algorithm.adv_estimator is not None:
        return f"algorithm.adv_estimator={spec.estimator}"
    return f"algorithm.name={spec.name} (advantage estimator {spec.estimator})"


def _missing_actor(cfg: HybridflowConfig, spec: AlgorithmSpec) -> str | None:
    if cfg.actor.enabled:
        return None
    return f"algorithm.name={spec.name} trains the actor: set actor.enabled=true"


def _missing_critic(cfg: HybridflowConfig, spec: AlgorithmSpec) -> str | None:
    if cfg.critic.enabled or not spec.needs_critic:
        return None
    return (
        f"{_estimator_key(cfg, spec)} needs a critic: remove critic.enabled=false (unset, the "
        "critic is built when the algorithm needs one), or choose a critic-free algorithm "
        "such as algorithm.name=grpo"
    )


def _missing_reference(cfg: HybridflowConfig, spec: AlgorithmSpec) -> str | None:
    if cfg.reference.enabled or not spec.uses_reference:
        return None
    coefs = [
        f"algorithm.{key}={getattr(cfg.algorithm, key)}"
        for key in ("kl_loss_coef", "kl_reward_coef")
        if getattr(cfg.algorithm, key) > 0
    ]
    return (
        f"{' and '.join(coefs)} needs the reference policy: set reference.enabled=true "
        "(and reference.parallel to its layout), or set the coefficient to 0"
    )


def check_sampling(cfg: HybridflowConfig, spec: AlgorithmSpec) -> None:
    """ValueError when the sampling settings cannot feed the algorithm: group estimators and
    dynamic sampling need several responses per prompt; the overlong buffer must fit the
    response budget."""
    n = cfg.rollout.n
    if n < 2 and ESTIMATORS[spec.estimator].groups:
        raise ValueError(
            f"{_estimator_key(cfg, spec)} compares the responses to one prompt, but rollout.n={n}: set rollout.n >= 2"
        )
    if n < 2 and spec.dynamic_sampling:
        raise ValueError(
            f"dynamic sampling (algorithm.name={spec.name}) drops groups whose scores are all "
            f"equal, and with rollout.n={n} every group is: set rollout.n >= 2"
        )
    budget = cfg.data.max_response_length
    if spec.overlong_buffer_len >= budget:
        raise ValueError(
            f"algorithm.overlong_buffer_len={spec.overlong_buffer_len} must be smaller than "
            f"data.max_response_length={budget}: the penalty ramps over the budget's last tokens"
        )


# --------------------------------------------------------------------------- building graphs


def build_graph(cfg: HybridflowConfig) -> Graph:
    """The validated dataflow graph of one RL step of ``cfg``'s algorithm."""
    spec = algorithm_spec(cfg)
    check_roles(cfg, spec)
    check_sampling(cfg, spec)
    graph = with_routing_replay(graph_from_spec(spec), cfg.moe.routing_replay)
    graph = with_staleness_weights(
        graph, downweights=cfg.async_rl.mode != "sync" and cfg.async_rl.on_stale == "downweight"
    )
    graph = with_reward_model(graph, scored=bool(cfg.reward_model.path), remote=cfg.reward_model.gpus > 0)
    graph = with_judge(graph, judged=bool(cfg.judge.path))
    graph = with_distillation(
        graph, coef=cfg.distillation.coef if cfg.distillation.teacher_path else None, remote=cfg.distillation.gpus > 0
    )
    graph.validate(placed_roles(cfg))
    return graph


def with_distillation(graph: Graph, *, coef: float | None, remote: bool = False) -> Graph:
    """``distillation.teacher_path`` set: a ``teacher_logprob`` node (the frozen teacher, on the
    actor's layout) scores the responses the actor scores, and ``advantages`` subtracts ``coef``
    x (old log-prob - teacher log-prob) from each response token's advantage. ``remote``
    (``distillation.gpus``): a ``teacher_request`` node sends the responses to the teacher's own
    GPUs there, and ``teacher_logprob`` collects the log-probs just before ``advantages``, so the
    actor's log-prob stages run while the teacher computes."""
    if coef is None:
        return graph
    nodes: list[Node] = []
    pending = "teacher_logprobs_pending"
    for node in graph.nodes:
        if node.op == "old_logprob":
            inputs = tuple(f for f in node.inputs if f in ("responses", "kept"))
            if remote:
                nodes.append(
                    Node(
                        name="teacher_request",
                        role="teacher",
                        op="teacher_request",
                        inputs=inputs,
                        outputs=(pending,),
                        options={"pending_field": pending},
                        doc="each response's tokens, sent to the teacher's own GPUs",
                    )
                )
            else:
                nodes.append(_teacher_logprob(inputs))
        if node.op == "advantages":
            if remote:
                nodes.append(_teacher_logprob(inputs + (pending,), pending_field=pending))
            reads = tuple(f for f in ("old_logprobs", "teacher_logprobs") if f not in node.inputs)
            node = dataclasses.replace(
                node, inputs=(*node.inputs, *reads), options=(*node.options, ("distill_coef", coef))
            )
        nodes.append(node)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _teacher_logprob(inputs: tuple[str, ...], **options) -> Node:
    return Node(
        name="teacher_logprob",
        role="teacher",
        op="teacher_logprob",
        inputs=inputs,
        outputs=("teacher_logprobs",),
        options=options,
        doc="log-probs of the responses under the frozen teacher",
    )


def with_reward_model(graph: Graph, *, scored: bool, remote: bool = False) -> Graph:
    """``reward_model.path`` set: before each ``reward`` node an ``rm_score`` node (the frozen
    reward model, on its layout) scores the same responses, and the reward node mixes
    its scores with the rule's (``config.reward_weights``). ``remote`` (``reward_model.gpus``):
    an ``rm_request`` node sends the responses to the model's own GPUs and ``rm_score`` collects
    the scores later, as the judge's nodes do (``with_judge``)."""
    if not scored:
        return graph
    graph = _scored_by(graph, role="reward_model", op="rm_score", prefix="model", doc="the reward model's score")
    if not remote:
        return graph
    return _requested_early(
        graph, "rm_score", "rm_request", doc="each response's tokens, sent to the reward model's own GPUs"
    )


def with_judge(graph: Graph, *, judged: bool) -> Graph:
    """``judge.path`` set: for each ``reward`` node, a ``judge_request`` node where the reward node
    was (rank 0 hands the judging requests to the judge's engine and goes on), and the ``judge``
    node that collects and parses the replies, moved with the reward node, which mixes the scores
    in, down to just before the first node that reads the reward: the log-prob and value stages
    between them run while the judge generates."""
    if not judged:
        return graph
    graph = _scored_by(graph, role="judge", op="judge", prefix="judge", doc="the generative judge's parsed score")
    return _requested_early(
        graph, "judge", "judge_request", doc="the judging requests of each response, handed to the judge's engine"
    )


def _requested_early(graph: Graph, collect_op: str, request_op: str, *, doc: str) -> Graph:
    """Each ``collect_op`` node split in two: a ``request_op`` node (the work is started elsewhere:
    another engine, other GPUs), moved up to just after the node that makes its responses, and
    the collecting node, moved with the reward node after it down to just before the first node
    that reads the reward, so that the nodes between run while the work is done (with a reward
    model and a judge both asked early, both work at once)."""
    nodes = list(graph.nodes)
    for collect in [n for n in graph.nodes if n.op == collect_op]:
        responses, pending = collect.option("responses_field"), f"{collect.option('scores_field')}_pending"
        request = Node(
            name=collect.name.replace(_scored_name(collect_op), request_op),
            role=collect.role,
            op=request_op,
            inputs=(responses,),
            outputs=(pending,),
            options={"responses_field": responses, "pending_field": pending},
            doc=doc,
        )
        index = nodes.index(collect)
        collected = dataclasses.replace(
            collect, inputs=(*collect.inputs, pending), options=(*collect.options, ("pending_field", pending))
        )
        nodes[index : index + 1] = [request, collected]
        nodes = _later(nodes, [collected, nodes[index + 2]])  # the collecting node and its reward node
        nodes = _earlier(nodes, request)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _earlier(nodes: list[Node], node: Node) -> list[Node]:
    """``nodes`` with ``node`` moved up to just after the last node before it that writes one of
    its inputs (the start if none): its inputs are still made before it reads them."""
    at = nodes.index(node)
    rest = nodes[:at] + nodes[at + 1 :]
    writers = [i for i in range(at) if set(rest[i].outputs) & set(node.inputs)]
    start = writers[-1] + 1 if writers else 0
    return rest[:start] + [node] + rest[start:]


def _later(nodes: list[Node], block: list[Node]) -> list[Node]:
    """``nodes`` with ``block`` (consecutive, in order) moved down to just before the first later
    node that reads one of its outputs (the end if none): what it produces is still produced
    before it is read, and the nodes it passes run before it."""
    start = nodes.index(block[0])
    rest = nodes[:start] + nodes[start + len(block) :]
    made = {field for node in block for field in node.outputs}
    at = next((i for i in range(start, len(rest)) if made & set(rest[i].inputs)), len(rest))
    return rest[:at] + block + rest[at:]


def _scored_name(op: str) -> str:
    """What a scoring node is called in place of ``reward`` in its reward node's name."""
    return "judge_score" if op == "judge" else op


def _scored_by(graph: Graph, *, role: str, op: str, prefix: str, doc: str) -> Graph:
    """A ``role``/``op`` node before each reward node, scoring its responses into
    ``<prefix>_<scores field>``, which the reward node reads (option ``<prefix>_scores_field``)."""
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.op == "reward":
            responses, scores = node.option("responses_field"), node.option("scores_field")
            field = f"{prefix}_{scores}"
            nodes.append(
                Node(
                    name=node.name.replace("reward", _scored_name(op)),
                    role=role,
                    op=op,
                    inputs=(responses,),
                    outputs=(field,),
                    options={"responses_field": responses, "scores_field": field},
                    doc=f"{doc} of each response",
                )
            )
            option = (f"{prefix}_scores_field", field)
            node = dataclasses.replace(node, inputs=(*node.inputs, field), options=(*node.options, option))
        nodes.append(node)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def with_staleness_weights(graph: Graph, *, downweights: bool) -> Graph:
    """Asynchronous RL with ``async_rl.on_stale=downweight``: ``generate`` hands ``advantages``
    each admitted sample's loss weight (below 1 past ``max_staleness``), which scales its
    advantages."""
    if not downweights:
        return graph

    def add_weights(node: Node) -> Node:
        if node.op == "generate":
            return dataclasses.replace(node, outputs=node.outputs + ("staleness_weights",))
        if node.op == "advantages":
            return dataclasses.replace(node, inputs=node.inputs + ("staleness_weights",))
        return node

    return dataclasses.replace(graph, nodes=tuple(add_weights(n) for n in graph.nodes))


def with_routing_replay(graph: Graph, mode: str) -> Graph:
    """MoE routing replay (r2 / r3): ``old_logprob`` hands ``update_actor`` the routes to replay
    (r2: the ones it recorded; r3: the rollout engine's, which it replayed itself)."""
    if mode == "off":
        return graph

    def add_routes(node: Node) -> Node:
        if node.op == "old_logprob":
            return dataclasses.replace(
                node, outputs=node.outputs + ("routed_experts",), options={**dict(node.options), "routing_replay": mode}
            )
        if node.op == "update_actor":
            return dataclasses.replace(node, inputs=node.inputs + ("routed_experts",))
        return node

    return dataclasses.replace(graph, nodes=tuple(add_routes(n) for n in graph.nodes))


def graph_from_spec(spec: AlgorithmSpec) -> Graph:
    """The nodes ``spec`` needs, in the order the step runs them (not validated)."""
    nodes = (make(spec) for make in _NODE_BUILDERS)
    return Graph(name=spec.name, nodes=tuple(n for n in nodes if n is not None), data_fields=DATA_FIELDS)


def _when(flag: bool, *fields: str) -> tuple[str, ...]:
    return fields if flag else ()


def _after_filter(spec: AlgorithmSpec) -> tuple[str, ...]:
    """``kept`` where dynamic sampling filters the batch, so the reader runs on kept rows."""
    return _when(spec.dynamic_sampling, "kept")


def _generate(spec: AlgorithmSpec) -> Node:
    return Node(
        name="generate",
        role="rollout",
        op="generate",
        inputs=("prompts",),
        outputs=("responses", "rollout_logprobs"),
        doc="sample rollout.n responses per prompt with the actor's latest weights",
    )


def _generate_greedy(spec: AlgorithmSpec) -> Node | None:
    if not spec.greedy_baseline:
        return None
    return Node(
        name="generate_greedy",
        role="rollout",
        op="generate_greedy",
        inputs=("prompts",),
        outputs=("baseline_responses",),
        doc="one greedy response per prompt, the ReMax baseline",
    )


def _reward_node(name: str, responses: str, scores: str, doc: str) -> Node:
    return Node(
        name=name,
        role="reward",
        op="reward",
        inputs=(responses, "answers"),
        outputs=(scores,),
        options={"responses_field": responses, "scores_field": scores},
        doc=doc,
    )


def _reward(spec: AlgorithmSpec) -> Node:
    return _reward_node("reward", "responses", "scores", "score each response against its answer")


def _baseline_reward(spec: AlgorithmSpec) -> Node | None:
    if not spec.greedy_baseline:
        return None
    return _reward_node(
        "baseline_reward", "baseline_responses", "baseline_scores", "score the greedy baseline responses"
    )


def _filter_groups(spec: AlgorithmSpec) -> Node | None:
    if not spec.dynamic_sampling:
        return None
    return Node(
        name="filter_groups",
        role=DRIVER,
        op="filter_groups",
        inputs=("responses", "scores") + _when(spec.greedy_baseline, "baseline_scores"),
        outputs=("kept",),
        options={"max_rounds": spec.max_sampling_rounds},
        doc="drop groups with equal scores; resample until the batch is full",
    )


def _old_logprob(spec: AlgorithmSpec) -> Node:
    return Node(
        name="old_logprob",
        role="actor",
        op="old_logprob",
        inputs=("responses",) + _after_filter(spec),
        outputs=("old_logprobs", "entropy"),
        options={"routing_replay": "off"},
        doc="log-probs of the responses under the actor before the update",
    )


def _ref_logprob(spec: AlgorithmSpec) -> Node | None:
    if not spec.uses_reference:
        return None
    return Node(
        name="ref_logprob",
        role="reference",
        op="ref_logprob",
        inputs=("responses",) + _after_filter(spec),
        outputs=("ref_logprobs",),
        doc="log-probs of the responses under the frozen reference policy",
    )


def _values(spec: AlgorithmSpec) -> Node | None:
    if not spec.needs_critic:
        return None
    return Node(
        name="values",
        role="critic",
        op="values",
        inputs=("responses",) + _after_filter(spec),
        outputs=("values",),
        doc="the critic's value of every response token",
    )


def _token_rewards(spec: AlgorithmSpec) -> Node:
    inputs = ("scores", "responses") + _after_filter(spec) + _when(spec.kl_in_reward, "ref_logprobs", "old_logprobs")
    return Node(
        name="token_rewards",
        role=DRIVER,
        op="token_rewards",
        inputs=inputs,
        outputs=("token_rewards",),
        options={"kl_penalty": spec.kl_in_reward, "overlong_buffer_len": spec.overlong_buffer_len},
        doc="the score on the last token, minus KL and overlong penalties",
    )


def _advantages(spec: AlgorithmSpec) -> Node:
    options: dict[str, Any] = {"estimator": spec.estimator}
    if spec.needs_critic:
        options |= {"critic_lam": spec.critic_lam, "length_adaptive_lam_alpha": spec.length_adaptive_lam_alpha}
    return Node(
        name="advantages",
        role=DRIVER,
        op="advantages",
        inputs=("token_rewards", "responses") + _after_filter(spec) + ESTIMATORS[spec.estimator].fields,
        outputs=("advantages", "returns"),
        options=options,
        doc=f"{spec.estimator} advantages (and the critic's returns)",
    )


def _update_critic(spec: AlgorithmSpec) -> Node | None:
    if not spec.needs_critic:
        return None
    return Node(
        name="update_critic",
        role="critic",
        op="update_critic",
        inputs=("responses", "values", "returns") + _after_filter(spec),
        outputs=("critic_metrics",),
        doc="regress the critic's values on the returns (clipped)",
    )


def _update_actor(spec: AlgorithmSpec) -> Node:
    inputs = (
        ("responses", "old_logprobs", "advantages")
        + _after_filter(spec)
        + _when(spec.kl_in_loss, "ref_logprobs")
        + _when(spec.lm_loss or spec.pf_ppo is not None, "scores")
    )
    return Node(
        name="update_actor",
        role="actor",
        op="update_actor",
        inputs=inputs,
        outputs=("actor_metrics",),
        options={
            "policy_loss": spec.policy_loss,
            "loss_agg_mode": spec.loss_agg_mode,
            "clip_ratio_high": spec.clip_ratio_high,
            "kl_loss": spec.kl_in_loss,
            "lm_loss_coef": spec.lm_loss_coef,
            "pf_ppo": spec.pf_ppo,
            "start_step": spec.critic_warmup_steps,
        },
        doc=f"{spec.policy_loss} policy loss over algorithm.ppo_epochs x mini_batches",
    )


def _sync_weights(spec: AlgorithmSpec) -> Node:
    return Node(
        name="sync_weights",
        role="actor",
        op="sync_weights",
        inputs=("actor_metrics",) + _when(spec.needs_critic, "critic_metrics"),
        outputs=("rollout_weights",),
        doc="push the updated actor to the rollout engines through the reshard plan",
    )


_NODE_BUILDERS: tuple[Callable[[AlgorithmSpec], Node | None], ...] = (
    _generate,
    _generate_greedy,
    _reward,
    _baseline_reward,
    _filter_groups,
    _old_logprob,
    _ref_logprob,
    _values,
    _token_rewards,
    _advantages,
    _update_critic,
    _update_actor,
    _sync_weights,
)
"""Every node an algorithm may use, in step order; a builder returns None when the spec
does not need its node."""
