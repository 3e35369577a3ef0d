"""hybridflow: RL post-training for mixture-of-experts LLMs on megatron-core.

The package is split so that configuration, layouts and planners are plain Python
(importable and testable on a CPU without torch); only ``megatron_adapters`` talks to
megatron-core.
"""

__version__ = "0.1.0"
