"""RL algorithms: which nodes one step runs, and the registries of their parts.

    recipes.py      algorithm name -> AlgorithmSpec -> dataflow Graph (pure; no torch)
    estimators.py   advantage estimators by name (torch)
    losses.py       policy losses and loss aggregation by name (torch)
    shaping.py      reward shaping: KL penalty, overlong penalty (torch)

Importing this package loads only ``recipes``; the torch modules are imported by name where
the runtime needs them.
"""

from hybridflow.algorithms.recipes import (
    DATA_FIELDS,
    ESTIMATORS,
    AlgorithmSpec,
    EstimatorNeeds,
    algorithm_names,
    algorithm_spec,
    build_graph,
    check_roles,
    check_sampling,
    graph_from_spec,
    placed_roles,
    register_algorithm,
)

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
    "placed_roles",
    "register_algorithm",
]
