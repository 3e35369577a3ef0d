"""Dataflow graph: edges from fields, stable topological order, every validation error, rendering."""

import dataclasses

import pytest

from hybridflow.graph import ROLES, Edge, Graph, GraphError, Node


def _node(name, inputs=(), outputs=(), role="driver", **options):
    return Node(name=name, role=role, op=name, inputs=inputs, outputs=outputs, options=options)


def _chain() -> Graph:
    """gen -> score -> update, with a second branch (logp) feeding update."""
    return Graph(
        name="chain",
        data_fields=("prompts", "answers"),
        nodes=(
            _node("gen", ("prompts",), ("responses",), role="rollout"),
            _node("score", ("responses", "answers"), ("scores",), role="reward"),
            _node("logp", ("responses",), ("old_logprobs",), role="actor"),
            _node("update", ("scores", "old_logprobs"), ("metrics",), role="actor"),
        ),
    )


def _names(nodes) -> list[str]:
    return [node.name for node in nodes]


@pytest.mark.claim("algorithm-is-a-graph")
def test_edges_are_resolved_from_fields():
    assert _chain().edges() == [
        Edge("gen", "score", "responses"),
        Edge("gen", "logp", "responses"),
        Edge("score", "update", "scores"),
        Edge("logp", "update", "old_logprobs"),
    ]


def test_a_valid_graph_validates_with_and_without_placement():
    graph = _chain()
    graph.validate()
    graph.validate({"rollout", "reward", "actor"})
    assert graph.roles() == ("actor", "rollout", "reward")
    assert _names(graph.sinks()) == ["update"]


def test_topological_order_breaks_ties_by_declaration_order():
    graph = Graph(
        name="g",
        nodes=(
            _node("late", ("x",), ("y",)),  # declared first but waits for x
            _node("first", (), ("x",)),
            _node("other", (), ("z",)),
            _node("last", ("y", "z"), ()),
        ),
    )
    # at each point the earliest-declared ready node runs: late becomes ready before other
    assert _names(graph.topological_order()) == ["first", "late", "other", "last"]
    assert graph.topological_order() == graph.topological_order()


@pytest.mark.claim("graph-checked-before-start")
def test_a_field_written_twice_names_both_writers():
    graph = Graph(name="g", nodes=(_node("a", (), ("x",)), _node("b", (), ("x",))))
    with pytest.raises(GraphError, match="field 'x' is written by both node 'a' and node 'b'"):
        graph.validate()


def test_a_node_writing_a_data_field_is_rejected():
    graph = Graph(name="g", data_fields=("prompts",), nodes=(_node("a", (), ("prompts",)),))
    with pytest.raises(GraphError, match="'prompts' is written by both the data loader and node 'a'"):
        graph.validate()


def test_a_field_nobody_writes_names_the_reader_and_the_available_fields():
    graph = Graph(
        name="g",
        data_fields=("prompts",),
        nodes=(
            _node("gen", ("prompts",), ("responses",)),
            _node("update", ("responses", "advantages"), ()),
        ),
    )
    with pytest.raises(GraphError) as error:
        graph.validate()
    message = str(error.value)
    assert "node 'update' reads field 'advantages'" in message
    assert "available fields: prompts, responses" in message


@pytest.mark.claim("graph-checked-before-start")
def test_a_cycle_names_the_nodes_on_it_in_flow_order():
    graph = Graph(
        name="g",
        nodes=(
            _node("a", ("z",), ("x",)),
            _node("b", ("x",), ("y",)),
            _node("c", ("y",), ("z",)),
            _node("downstream", ("z",), ()),  # blocked by the cycle, but not on it
            _node("free", (), ()),
        ),
    )
    with pytest.raises(GraphError, match=r"graph 'g' has a cycle: a -> b -> c -> a$"):
        graph.validate()
    with pytest.raises(GraphError, match="cycle"):
        graph.topological_order()


def test_a_node_reading_its_own_output_is_a_cycle():
    graph = Graph(name="g", nodes=(_node("a", ("x",), ("x",)),))
    with pytest.raises(GraphError, match="has a cycle: a -> a"):
        graph.validate()


def test_duplicate_node_names_are_rejected():
    graph = Graph(name="g", nodes=(_node("a", (), ("x",)), _node("a", (), ("y",))))
    with pytest.raises(GraphError, match="two nodes are called 'a'"):
        graph.validate()


def test_node_names_must_be_identifiers():
    graph = Graph(name="g", nodes=(_node("old logprob"),))
    with pytest.raises(GraphError, match="'old logprob' must be an identifier"):
        graph.validate()


def test_an_unknown_role_lists_the_roles():
    graph = Graph(name="g", nodes=(_node("a", role="oracle"),))
    with pytest.raises(GraphError) as error:
        graph.validate()
    assert "node 'a' has unknown role 'oracle'" in str(error.value)
    assert ", ".join(ROLES) in str(error.value)


@pytest.mark.parametrize(
    "role, switch",
    [
        ("critic", "critic.enabled=true"),
        ("reference", "reference.enabled=true"),
        ("actor", "actor.enabled=true"),
    ],
)
@pytest.mark.claim("graph-checked-before-start")
def test_an_unplaced_role_says_which_config_key_places_it(role, switch):
    graph = Graph(name="g", nodes=(_node("a", role=role),))
    graph.validate()  # without placement only the structure is checked
    with pytest.raises(GraphError) as error:
        graph.validate({"rollout", "reward", "driver"})
    assert f"node 'a' runs on the {role} role" in str(error.value)
    assert switch in str(error.value)


def test_to_text_is_one_line_per_node_in_topological_order():
    lines = _chain().to_text().splitlines()
    assert lines[0] == "gen [rollout] gen: prompts -> responses"
    assert lines[-1] == "update [actor] update: scores, old_logprobs -> metrics"
    assert [line.split()[0] for line in lines] == ["gen", "score", "logp", "update"]


def test_to_text_shows_options_and_empty_field_lists():
    graph = Graph(name="g", nodes=(_node("a", estimator="gae"),))
    assert graph.to_text() == "a [driver] a: - -> -  (estimator=gae)"


def test_to_mermaid_has_every_node_and_labelled_edges():
    text = _chain().to_mermaid()
    assert text.startswith("flowchart TD\n")
    for name in ("gen", "score", "logp", "update"):
        assert f'node_{name}["{name}<br/>' in text
    assert '    data_fields -->|"prompts"| node_gen' in text
    assert '    data_fields -->|"answers"| node_score' in text
    assert '    node_gen -->|"responses"| node_score' in text
    assert '    node_score -->|"scores"| node_update' in text


def test_mermaid_joins_the_fields_of_one_producer_consumer_pair():
    graph = Graph(name="g", nodes=(_node("a", (), ("x", "y")), _node("b", ("x", "y"), ())))
    assert '    node_a -->|"x, y"| node_b' in graph.to_mermaid()


def test_nodes_are_frozen_values_with_options_from_a_mapping():
    node = Node(name="adv", role="driver", op="advantages", inputs=["r"], outputs=["a"], options={"estimator": "grpo"})
    assert node.inputs == ("r",) and node.options == (("estimator", "grpo"),)
    assert node.option("estimator") == "grpo"
    assert hash(node) == hash(dataclasses.replace(node))
    with pytest.raises(KeyError, match="has no option 'lam'; it has: estimator"):
        node.option("lam")
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.name = "other"


def test_a_bare_string_of_fields_is_caught():
    with pytest.raises(TypeError, match="inputs must be a tuple of field names"):
        Node(name="gen", role="rollout", op="generate", inputs="prompts")


def test_node_lookup_names_the_nodes():
    graph = _chain()
    assert graph.node("logp").role == "actor"
    with pytest.raises(KeyError, match="nodes: gen, score, logp, update"):
        graph.node("values")
