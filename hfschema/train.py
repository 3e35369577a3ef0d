"""Training settings of the trained roles: the optimizer and batches, and MoE RL stability.

Sections of the run config (``train:`` and ``moe:`` in ``hybridflow.config``) that
``megatron_adapters`` consumes; each checks itself at construction and raises ``ConfigError``
with keys relative to itself.
"""

from dataclasses import dataclass, replace
from typing import Optional

from hfschema.checks import check_choice, check_non_negative, check_positive
from hfschema.layout import ConfigError

__all__ = ["MoEConfig", "ROUTING_REPLAY_MODES", "TrainConfig"]


@dataclass(kw_only=True)
class TrainConfig:
    """Optimizer, learning-rate schedule and batch sizes of the trained roles."""

    optimizer: str = "adam"
    """Optimizer: adam or sgd."""
    lr: float = 1e-4
    """Peak learning rate."""
    critic_lr: Optional[float] = None
    """Peak learning rate of the critic (its schedule's shape is the actor's); None = lr. PPO
    critics usually learn faster than the policy (verl's examples: 1e-5 against 1e-6)."""
    min_lr: float = 0.0
    """Floor of the decaying schedules (linear, cosine)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam first-moment decay."""
    adam_beta2: float = 0.999
    """Adam second-moment decay."""
    adam_eps: float = 1e-8
    """Adam denominator epsilon."""
    lr_schedule: str = "constant"
    """Learning-rate decay after warmup: constant, linear or cosine."""
    lr_warmup_steps: int = 0
    """Steps of linear warmup from 0 to lr."""
    lr_decay_steps: int = 1000
    """Optimizer steps over which the linear or cosine schedule decays lr to min_lr."""
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 = off."""
    micro_batch_size: int = 2
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step across all data-parallel ranks."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (megatron distributed optimizer)."""

    def __post_init__(self) -> None:
        check_choice("optimizer", self.optimizer, ("adam", "sgd"))
        check_choice("lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        check_positive(self, ("lr", "adam_eps", "micro_batch_size", "global_batch_size", "lr_decay_steps"))
        check_non_negative(self, ("min_lr", "weight_decay", "lr_warmup_steps", "clip_grad"))
        if self.min_lr > self.lr:
            raise ConfigError("{p}min_lr={m} must be <= {p}lr={lr}", m=self.min_lr, lr=self.lr)
        if self.critic_lr is not None and (self.critic_lr <= 0 or self.critic_lr < self.min_lr):
            raise ConfigError(
                "{p}critic_lr={c} must be > 0 and >= {p}min_lr={m} (null: {p}lr)", c=self.critic_lr, m=self.min_lr
            )
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError("{p}{key}={v} must be in [0, 1)", key=key, v=getattr(self, key))
        if self.optimizer == "sgd" and self.use_distributed_optimizer:
            raise ConfigError(
                "{p}optimizer=sgd needs {p}use_distributed_optimizer=false "
                "(megatron-core's distributed optimizer checkpoints Adam state only)"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                "{p}global_batch_size={g} is not a multiple of {p}micro_batch_size={m}",
                g=self.global_batch_size,
                m=self.micro_batch_size,
            )

    def for_critic(self) -> "TrainConfig":
        """These settings as the critic trains under them: ``critic_lr`` as its peak rate."""
        return self if self.critic_lr is None else replace(self, lr=self.critic_lr, critic_lr=None)


ROUTING_REPLAY_MODES = ("off", "r2", "r3")


@dataclass(kw_only=True)
class MoEConfig:
    """MoE reinforcement-learning stability: routing replay, router statistics, router control."""

    routing_replay: str = "off"
    """off; r2: replay in training the experts the actor's own old-log-prob forward chose; r3:
    replay the experts the rollout engine chose (SGLang returns them on a GPU only)."""
    freeze_router: bool = False
    """Keep the router weights and expert bias fixed during RL (no gradient, bias update rate 0)."""
    expert_bias_update_rate: float = 1e-3
    """Aux-loss-free expert-bias step per optimizer step (model.router_expert_bias routers only;
    0 under lora.enabled: the bias is part of the frozen base)."""
    aux_loss_coef: float = 0.0
    """Load-balancing auxiliary loss coefficient during RL; 0 = off."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (keeps router logits small) during RL; 0 = off."""
    router_stats: bool = True
    """Log router statistics per step (moe/... metrics) and summarise them in summary.json."""

    def __post_init__(self) -> None:
        check_choice("routing_replay", self.routing_replay, ROUTING_REPLAY_MODES)
        check_non_negative(self, ("expert_bias_update_rate", "aux_loss_coef", "z_loss_coef"))

    @property
    def bias_update_rate(self) -> float:
        """The expert-bias update rate in effect: 0 while the router is frozen."""
        return 0.0 if self.freeze_router else self.expert_bias_update_rate
