"""An architecture no family maps (``model.family=transformers``), read from a model directory.

OLMo2 is the example: transformers and SGLang build it, no hybridflow family describes it (its
norms follow attention and the MLP, its q/k norms span all heads). Read for an FSDP2 actor, its
shape comes from config.json and its tensors from the weight files' headers, as transformers' own
class names its parameters; every combination the runtime cannot run is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfschema.hf_config import read_model_config
from hybridflow.config import load_config
from hybridflow.rollout.tiny import make_tiny_model_dir
from reshard.families import canonical_tensors

CONFIG = "configs/quickstart_cpu_day0.yaml"


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hub") / "olmo2"
    make_tiny_model_dir(path, "olmo2", max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) >= 2  # as the hub ships it: shards and their index
    return path


def _load(model_dir: Path, *overrides: str):
    return load_config(CONFIG, [f"model.path={model_dir}", *overrides], model_path_must_exist=True)


def test_an_unmapped_model_type_reads_as_transformers_own_class_for_an_fsdp2_actor(olmo2: Path) -> None:
    cfg = _load(olmo2)
    assert cfg.model.family == "transformers"
    config = json.loads((olmo2 / "config.json").read_text())
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.vocab_size) == (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_key_value_heads"],
        config["vocab_size"],
    )
    assert cfg.model.described.startswith("olmo2 ")


def test_its_tensors_are_transformers_parameters_by_name_and_shape(olmo2: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(olmo2)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    tensors = canonical_tensors(_load(olmo2).model, dtype="float32")
    assert {t.name: t.shape for t in tensors} == expected
    assert any(".post_feedforward_layernorm." in t.name for t in tensors)  # what no family has


def test_a_tied_head_stored_beside_the_embedding_is_not_pushed_twice(tmp_path: Path) -> None:
    path = make_tiny_model_dir(tmp_path / "tied", "olmo2", tie_word_embeddings=True)
    names = {t.name for t in canonical_tensors(_load(path).model)}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("actor.backend=megatron",), "model_type='olmo2' is not mapped onto megatron-core"),
        (("rollout.sync_route=sliced",), "set rollout.sync_route=full"),
    ],
)
def test_what_the_runtime_cannot_run_is_refused_in_one_line(olmo2: Path, overrides, says: str) -> None:
    with pytest.raises(ValueError, match=says) as error:
        _load(olmo2, *overrides)
    assert "\n" not in str(error.value)


def test_the_family_typed_without_a_directory_is_refused() -> None:
    with pytest.raises(ValueError, match="set model.path to its Hugging Face directory"):
        load_config(CONFIG, ["model.path=null", "model.init=null", "model.family=transformers", "model.num_experts=0"])


def test_routed_experts_of_an_unmapped_model_type_are_refused_by_key(tmp_path: Path) -> None:
    make_tiny_model_dir(tmp_path, "olmo2", weights=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "newmoe", "num_local_experts": 8}))
    with pytest.raises(ValueError, match="num_local_experts=8: routed experts train only in a mapped MoE family"):
        read_model_config(tmp_path, unmapped=True)


def test_an_architecture_sglang_does_not_serve_names_the_engine_and_the_alternative(tmp_path: Path) -> None:
    from hybridflow.preflight import check_engine_serves

    path = make_tiny_model_dir(tmp_path / "helium", "helium")  # transformers has it, SGLang 0.5 not
    cfg = _load(path)
    with pytest.raises(ValueError, match=r"no model class for HeliumForCausalLM.*set rollout\.engine=hf"):
        check_engine_serves(cfg)
    check_engine_serves(_load(path, "rollout.engine=hf", "rollout.tp=1"))


def test_plan_counts_the_weight_files_tensors(olmo2: Path) -> None:
    from hybridflow.model_size import count_parameters

    cfg = _load(olmo2)
    stored = sum(1 for _ in canonical_tensors(cfg.model))
    assert stored == 2 * 11 + 3  # per layer: q,k,v,o, q/k norms, 3 MLP, 2 norms; embed, norm, head
    import math

    assert count_parameters(cfg.model)["total"] == sum(math.prod(t.shape) for t in canonical_tensors(cfg.model))


def test_a_stored_tensor_the_trainer_does_not_hold_is_named_before_the_first_push(olmo2: Path) -> None:
    """The sync reads each rank's parameters by the weight files' names: a name transformers'
    class has no parameter of (or of another shape) fails in one line naming it."""
    import torch

    from hybridflow.runtime.sync import check_source_params
    from reshard.fsdp import fsdp_layout

    cfg = _load(olmo2)
    layout = fsdp_layout(cfg.model, cfg.actor.parallel, dtype="float32")
    held = {name: torch.zeros(shape) for name, shape in layout.param_shapes(1).items()}
    check_source_params(layout, held, rank=1)
    del held["model.norm.weight"]
    with pytest.raises(ValueError, match=r"reads model\.norm\.weight \[32\] on actor rank 1, but the trainer holds no"):
        check_source_params(layout, held, rank=1)


def test_a_rotary_buffer_older_checkpoints_store_is_not_one_of_its_tensors(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    path = make_tiny_model_dir(tmp_path / "old", "olmo2")
    weights = path / "model.safetensors"
    save_file({**load_file(weights), "model.rotary_emb.inv_freq": torch.ones(8)}, weights, metadata={"format": "pt"})
    names = {t.name for t in canonical_tensors(_load(path).model)}
    assert "model.rotary_emb.inv_freq" not in names and "model.norm.weight" in names
