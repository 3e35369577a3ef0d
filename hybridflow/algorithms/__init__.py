"""RL algorithms: which nodes one step runs, and the registries of their parts.

    recipes.py      algorithm name -> AlgorithmSpec -> dataflow Graph (pure; no torch)
    estimators.py   advantage estimators by name (torch)
    losses.py       policy losses and loss aggregation by name (torch)
    shaping.py      reward shaping: KL penalty, overlong penalty (torch)

Importing this package loads only ``recipes``; the torch modules are imported by name where
the runtime needs them.
"""

from hybridflow.algorithms import recipes
from hybridflow.algorithms.recipes import *  # noqa: F403 (the public names are recipes.__all__)

__all__ = list(recipes.__all__)
