"""Mistakes in the ``agentic`` section are refused in one line naming the key, before any rank
starts; the loss mask and turn counts of a trajectory travel to the ranks that train on it."""

from __future__ import annotations

import pytest

from hybridflow.agentic.engine import configured_tools
from hybridflow.agentic.tools import TOOLS, Tool, check_parameters_schema, tool
from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.rollout.base import RolloutSample
from hybridflow.runtime.exchange import meta_of, pack, unpack

QUICKSTART = "configs/quickstart_cpu.yaml"


@pytest.mark.claim("agentic-bad-input")
@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["agentic.tools=[calculator,nope]"], "agentic.tools[1]: unknown tool 'nope': registered tools are calculator"),
        (["agentic.tools=[no_such_module:fn]"], "agentic.tools[0]: tool 'no_such_module:fn' does not import"),
        (["agentic.environment=no_such_module:Env"], "agentic.environment='no_such_module:Env' does not import"),
        (
            ["agentic.environment=tests.agentic.envs:Missing"],
            "agentic.environment='tests.agentic.envs:Missing' does not",
        ),
        (
            ["agentic.environments={search: tests.agentic.envs:Gone}"],
            "agentic.environments.search='tests.agentic.envs:Gone' does not import",
        ),
        (["agentic.tool_parser=xml"], "agentic.tool_parser='xml' is not one of: hermes, qwen"),
        (["agentic.schedule=eager"], "agentic.schedule='eager' is not one of: independent, turn_synchronous"),
        (["agentic.sandbox=remote"], "agentic.sandbox=remote needs agentic.sandbox_url"),
        (
            ["agentic.sandbox_disk_mb=512"],
            "agentic.sandbox_disk_mb=512 must be below agentic.sandbox_memory_mb=512: the files share the memory",
        ),
        (
            ["agentic.tool_output_special_tokens=drop"],
            "agentic.tool_output_special_tokens='drop' is not one of: escape, refuse",
        ),
        (
            [
                "async_rl.partial_rollout=true",
                "rollout.placement=separate",
                "async_rl.mode=async",
                "async_rl.max_staleness=2",
                "async_rl.segment_tokens=1",
            ],
            "cannot be saved with a checkpoint; set async_rl.resume=drop",
        ),
    ],
)
def test_a_mistake_in_the_agentic_section_is_one_line_before_any_rank(capsys, tmp_path, overrides, said) -> None:
    code = main(["train", QUICKSTART, f"run.output_dir={tmp_path}", "agentic.enabled=true", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and said in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()


def test_an_invalid_tool_schema_is_refused_where_the_tool_is_declared() -> None:
    with pytest.raises(
        ValueError, match=r"tool 'f': a tool's parameters must be a JSON schema with \"type\": \"object\""
    ):
        tool("f", parameters={"type": "string"})(lambda: None)
    with pytest.raises(ValueError, match="tool 'g': not a valid JSON schema: 'integr' is not valid"):
        check_parameters_schema({"type": "object", "properties": {"a": {"type": "integr"}}}, "tool 'g'")
    assert (
        Tool("h", "does h", {"type": "object"}, lambda: None).argument_errors([1])
        == "the arguments: [1] is not of type 'object'"
    )


@pytest.mark.claim("tool-schemas-checked")
def test_a_tool_the_model_could_not_choose_or_call_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^tool 'f': no description; the model picks its tools by"):
        tool("f", parameters={"type": "object"})(lambda: None)  # no description=, no docstring
    with pytest.raises(ValueError, match=r"^tool 'add numbers': a tool's name must be 1-64 letters"):
        Tool("add numbers", "adds", {"type": "object"}, lambda: None)
    with pytest.raises(ValueError, match=r"^tool 'add': required \['b'\] not among the schema's properties"):
        Tool("add", "adds", {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, lambda: None)

    def documented(a):
        """Add one to a.

        More lines the template need not show."""

    tool("documented_tool", parameters={"type": "object"})(documented)
    assert TOOLS["documented_tool"].description == "Add one to a."
    cfg = load_config(None, ["agentic.enabled=true", "agentic.tools=[calculator, calculator]"])
    with pytest.raises(ValueError, match=r"^agentic.tools\[1\]: a second tool named 'calculator'"):
        configured_tools(cfg.agentic)


def test_a_trajectorys_loss_mask_and_counts_travel_with_its_tokens() -> None:
    single = RolloutSample(
        prompt_index=0, sample_index=0, prompt_ids=(1, 2), response_ids=(3,), logprobs=(-0.5,), finish_reason="stop"
    )
    trajectory = RolloutSample(
        prompt_index=1,
        sample_index=1,
        prompt_ids=(4,),
        response_ids=(5, 6, 7, 8),
        logprobs=(-0.1, 0.0, 0.0, -0.2),
        finish_reason="stop",
        loss_mask=(1, 0, 0, 1),
        turn_stats=(2, 1, 0, 0, 0, 2, 0),
        routed_experts=[[[1]], [[0]], [[1]], [[0]]],
    )
    ints, floats = pack([single, trajectory])
    back = unpack([meta_of(single), meta_of(trajectory)], ints, floats)
    assert back[0] == single
    assert (back[1].loss_mask, back[1].turn_stats, back[1].response_ids) == (
        (1, 0, 0, 1),
        (2, 1, 0, 0, 0, 2, 0),
        (5, 6, 7, 8),
    )
    assert back[1].routed_experts.tolist() == trajectory.routed_experts
