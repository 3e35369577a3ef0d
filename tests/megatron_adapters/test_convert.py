"""HF <-> megatron-core checkpoint converters in one process: exactness, format, bad input, CLI.

Tiny models of all five families (``convert_models``) go Hugging Face -> megatron ``torch_dist``
-> Hugging Face with small buffers, so every tensor is split over several stored chunks. The
megatron side is checked against the independent test oracle (``tests/reshard/oracle.py``,
written from megatron-core's code, not from ``reshard``): each stored parameter equals the
oracle's TP=1 parameter. Loading the converted checkpoints into real megatron-core policies is
in ``test_convert_distributed.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hfschema.hf_config import SIDE_FILE_DIR, read_model_config
from hfschema.layout import ParallelLayout
from hfschema.model import ModelConfig
from hybridflow.cli import main
from megatron_adapters import convert as convert_module
from megatron_adapters.checkpoint import read_meta
from megatron_adapters.convert import hf_to_mcore, mcore_to_hf
from megatron_adapters.convert_plan import plan_checkpoint, plan_slabs
from megatron_adapters.dist_io import DistReader
from reshard.families import canonical_tensors
from tests.megatron_adapters.convert_models import FAMILIES, MOE_FAMILIES, hf_tensors, make_hf_dir
from tests.reshard.oracle import megatron_params

BUFFER = 64 << 10
"""Small enough that embeddings and fused parameters span several stored chunks."""
LAYOUTS = {"tp2ep2": {"tp": 2, "ep": 2}, "pp2": {"pp": 2}}
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _layout(family: str, name: str) -> dict:
    spec = dict(LAYOUTS[name])
    if family not in MOE_FAMILIES:
        spec.pop("ep", None)
    return spec


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_dir(root, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[tuple[str, str], tuple[Path, object]]:
    root = tmp_path_factory.mktemp("mcore")
    out = {}
    for family, path in hf_dirs.items():
        for name in LAYOUTS:
            target = root / f"{family}_{name}"
            report = hf_to_mcore(path, target, **_layout(family, name), checksums=True, buffer_bytes=BUFFER)
            out[family, name] = target, report
    return out


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


# ------------------------------------------------------------------------------ exactness


@pytest.mark.claim("convert-round-trip")
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bitwise_identical(family, name, hf_dirs, converted, tmp_path):
    mcore, report = converted[family, name]
    back = tmp_path / "back"
    result = mcore_to_hf(mcore, back, checksums=True, buffer_bytes=BUFFER // 2)
    _assert_same_tensors(hf_tensors(hf_dirs[family]), hf_tensors(back))
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / side).read_bytes() == (hf_dirs[family] / side).read_bytes()
    assert any("read back through the checkpoint" in c for c in report.checks)
    assert any("equal the original HF checkpoint" in c for c in result.checks)
    assert result.tensors == report.tensors and result.nbytes == report.nbytes


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_parameters_equal_the_oracle(family, hf_dirs, converted):
    """Every stored megatron parameter (fused qkv, [gate; up], stacked experts / layers) is the
    one megatron-core holds at TP=1, as the independent oracle slices it."""
    mcore, _ = converted[family, "pp2"]
    model = read_model_config(hf_dirs[family])
    hf = {k: v.numpy() for k, v in hf_tensors(hf_dirs[family]).items()}
    expected = megatron_params(model, ParallelLayout(), hf, rank=0)
    reader = DistReader(mcore)
    padded = reader.tensors()["embedding.word_embeddings.weight"].size[0]
    renames = convert_module._local_spec_renames(model)
    slabs = plan_slabs(model, renames, padded)
    assert sorted(s.param for s in slabs) == sorted(expected)
    boxes = [
        (
            (s.key, s.prefix + (0,) * len(s.shape), (1,) * len(s.prefix) + s.shape),
            torch.empty((1,) * len(s.prefix) + s.shape),
        )
        for s in slabs
    ]
    reader.read(boxes)
    for slab, (_, got) in zip(slabs, boxes):
        got, want = got.reshape(slab.shape).numpy(), expected[slab.param]
        if slab.param in VOCAB_PARAMS:  # padding rows: zeros here, a sentinel in the oracle
            assert not got[model.vocab_size :].any()
            got, want = got[: model.vocab_size], want[: model.vocab_size]
        np.testing.assert_array_equal(got, want, err_msg=slab.param)


def test_vocab_padding_and_metadata_follow_the_layout(hf_dirs, converted):
    tp2, _ = converted["qwen3_moe", "tp2ep2"]
    tp1, _ = converted["qwen3_moe", "pp2"]
    # megatron pads 320 to a multiple of 128 * tp, and loads only that global shape
    assert DistReader(tp2).tensors()["embedding.word_embeddings.weight"].size[0] == 512
    assert DistReader(tp1).tensors()["embedding.word_embeddings.weight"].size[0] == 384
    meta = read_meta(tp2)
    assert meta["layout"]["tp"] == 2 and meta["layout"]["ep"] == 2 and meta["with_optimizer"] is False
    assert json.loads((tp2 / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (tp2 / "common.pt").is_file() and (tp2 / SIDE_FILE_DIR / "config.json").is_file()
    assert sorted(meta["hf_checksums_crc32"]) == sorted(hf_tensors(hf_dirs["qwen3_moe"]))


@pytest.mark.claim("convert-streams")
def test_stored_chunks_respect_the_buffer(converted):
    mcore, _ = converted["llama", "pp2"]
    sizes = [np.prod(c.sizes) * 4 for md in DistReader(mcore).tensors().values() for c in md.chunks]
    assert max(sizes) <= BUFFER // 4
    assert len(sizes) > 9  # the 9 keys of a dense 4-layer model are split into many chunks


@pytest.mark.claim("convert-streams")
def test_plans_deepseek_v3_671b_without_weights():
    """The plan is pure: 671B parameters, 45k HF tensors, bounded chunks, in seconds."""
    model = ModelConfig(  # deepseek-ai/DeepSeek-V3 config.json
        family="deepseek_v3",
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_kv_heads=128,
        ffn_hidden_size=18432,
        vocab_size=129280,
        num_experts=256,
        moe_top_k=8,
        moe_ffn_hidden_size=2048,
        num_shared_experts=1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        router_topk_scaling_factor=2.5,
        router_num_groups=8,
        router_group_topk=4,
        first_k_dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    )
    chunk_bytes = 256 << 20
    plan = plan_checkpoint(
        model,
        renames={},
        padded_vocab=ParallelLayout(tp=8).padded_vocab_size(model),
        itemsize=lambda slab: 2,
        chunk_bytes=chunk_bytes,
    )
    assert set(plan.tensors) == {t.name for t in canonical_tensors(model)} and len(plan.tensors) == 45395
    assert plan.keys["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"] == (256, 4096, 7168)
    assert max(np.prod(c.sizes) * 2 for c in plan.chunks) <= chunk_bytes


def test_dtype_conversion_keeps_pinned_float32_tensors(hf_dirs, tmp_path):
    source = hf_dirs["deepseek_v3"]
    hf_to_mcore(source, tmp_path / "mcore", dtype="bfloat16", buffer_bytes=BUFFER, checksums=True)
    report = mcore_to_hf(tmp_path / "mcore", tmp_path / "back", checksums=True)
    original, back = hf_tensors(source), hf_tensors(tmp_path / "back")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert back[bias].dtype == torch.float32 and torch.equal(back[bias], original[bias])
    expected = {k: v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16) for k, v in original.items()}
    _assert_same_tensors(expected, back)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"
    assert any("equal the original" in c for c in report.checks)  # checksums of what was stored


# ------------------------------------------------------------------------------ bad input


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "hf_copy"
    shutil.copytree(source, target)
    return target


def _shard(path: Path, holding: str | None = None) -> Path:
    """The safetensors file of ``path`` holding tensor ``holding`` (None: the first file)."""
    files = sorted(path.glob("*.safetensors"))
    if holding is None:
        return files[0]
    return next(f for f in files if holding in load_file(str(f)))


def _edit_weights(path: Path, edit, holding: str | None = None) -> Path:
    file = _shard(path, holding)
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return file


def _missing(path):
    name = "model.layers.2.self_attn.k_proj.weight"
    return _edit_weights(path, lambda t: t.pop(name), holding=name), name


def _unexpected(path):
    return _edit_weights(
        path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)})
    ), "model.layers.0.mlp.extra.weight"


def _shape(path):
    name = "model.norm.weight"
    return _edit_weights(path, lambda t: t.update({name: torch.zeros(65)}), holding=name), name


def _truncated(path):
    file = _shard(path)
    with file.open("r+b") as f:
        f.truncate(file.stat().st_size - 100)
    return file, "truncated: tensor 'model."  # the first tensor past the new end is named


def _architecture(path):
    config = path / "config.json"
    values = json.loads(config.read_text())
    values["model_type"] = "gpt2"
    config.write_text(json.dumps(values))
    return config, "gpt2"


@pytest.mark.parametrize(
    "breaker",
    [_missing, _unexpected, _shape, _truncated, _architecture],
    ids=["missing", "unexpected", "shape", "truncated", "architecture"],
)
@pytest.mark.claim("convert-bad-input")
def test_bad_hf_input_names_file_and_tensor_and_writes_nothing(breaker, hf_dirs, tmp_path):
    source = _copy(hf_dirs["qwen3_moe"], tmp_path)
    file, tensor = breaker(source)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as error:
        hf_to_mcore(source, out)
    message = str(error.value)
    assert tensor in message
    assert str(file) in message or str(source) in message
    assert not out.exists() and not out.with_name("out.tmp").exists()


@pytest.mark.claim("convert-bad-input")
def test_failure_while_writing_leaves_no_directory(hf_dirs, tmp_path, monkeypatch):
    calls = []

    def failing_fill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return original(*args, **kwargs)

    original = convert_module._fill
    monkeypatch.setattr(convert_module, "_fill", failing_fill)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"):
        hf_to_mcore(hf_dirs["llama"], out, buffer_bytes=BUFFER)
    assert not out.exists() and not out.with_name("out.tmp").exists()


def test_existing_output_needs_overwrite(hf_dirs, converted, tmp_path):
    mcore, _ = converted["llama", "pp2"]
    with pytest.raises(ValueError, match="exists; pass overwrite=True"):
        hf_to_mcore(hf_dirs["llama"], mcore)
    out = tmp_path / "back"
    out.mkdir()
    mcore_to_hf(mcore, out, overwrite=True)
    assert (out / "model.safetensors.index.json").is_file()


@pytest.mark.claim("convert-never-replaces-its-input")
def test_an_output_that_would_replace_or_hold_its_input_is_refused_even_with_overwrite(
    hf_dirs, converted, tmp_path, capsys
):
    """`convert hf-to-mcore --hf M --out M --overwrite` replaced the user's model; every way of
    naming the same directory, or one inside the other, is refused before anything is written."""
    model = _copy(hf_dirs["llama"], tmp_path)
    before = sorted(p.name for p in model.iterdir())
    link = tmp_path / "link"
    link.symlink_to(model)
    for out in (model, link, tmp_path, model / "mcore"):
        code = main(["convert", "hf-to-mcore", "--hf", str(model), "--out", str(out), "--overwrite"])
        assert code == 2, out
        err = capsys.readouterr().err
        assert f"the input {model.resolve()}" in err and "choose an output directory outside it" in err
    assert sorted(p.name for p in model.iterdir()) == before
    mcore, _ = converted["llama", "pp2"]
    with pytest.raises(ValueError, match=r"is the input .*hf_llama"):  # the side files' directory
        mcore_to_hf(mcore, hf_dirs["llama"], hf_config=hf_dirs["llama"], overwrite=True)
    with pytest.raises(ValueError, match=r"llama_pp2 is the input .*llama_pp2: writing it would replace"):
        mcore_to_hf(mcore, mcore, overwrite=True)


@pytest.mark.claim("convert-bad-input")
def test_bad_megatron_input(hf_dirs, converted, tmp_path):
    mcore, _ = converted["deepseek_v3", "pp2"]
    with pytest.raises(ValueError, match="hybridflow.json is missing"):
        mcore_to_hf(mcore / SIDE_FILE_DIR, tmp_path / "a")
    # a config that does not describe the checkpoint: the first key it lacks is named
    with pytest.raises(ValueError, match=r"\.metadata: checkpoint key .* is missing"):
        mcore_to_hf(mcore, tmp_path / "b", hf_config=hf_dirs["qwen3_moe"])
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tmp").exists()
    # a shard file deleted (or cut short) after the save: named before anything is read or written
    damaged = tmp_path / "damaged"
    shutil.copytree(mcore, damaged)
    shard = sorted(damaged.glob("*.distcp"))[-1]
    shard.unlink()
    with pytest.raises(
        ValueError,
        match=rf"checkpoint {damaged} is damaged: {shard} is missing \(listed in "
        r"\.metadata\); restore the file",
    ):
        mcore_to_hf(damaged, tmp_path / "c")
    assert not (tmp_path / "c").exists() and not (tmp_path / "c.tmp").exists()


# ------------------------------------------------------------------------------------- CLI


def test_cli_round_trip_and_error(hf_dirs, tmp_path, capsys):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert (
        main(
            [
                "convert",
                "hf-to-mcore",
                "--hf",
                str(hf_dirs["mixtral"]),
                "--out",
                str(mcore),
                "--tp",
                "2",
                "--ep",
                "2",
                "--buffer-bytes",
                "64K",
                "--checksums",
            ]
        )
        == 0
    )
    assert main(["convert", "mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--checksums"]) == 0
    printed = capsys.readouterr().out
    assert "hf-to-mcore: mixtral" in printed and "mcore-to-hf: mixtral" in printed
    assert "verified: CRC32 of all" in printed
    _assert_same_tensors(hf_tensors(hf_dirs["mixtral"]), hf_tensors(back))
    assert (
        main(["convert", "hf-to-mcore", "--hf", str(hf_dirs["mixtral"]), "--out", str(tmp_path / "x"), "--tp", "3"])
        == 2
    )
    assert "convert.tp=3 does not divide" in capsys.readouterr().err


def test_a_convert_error_is_the_only_line_on_stderr(tmp_path):
    """In a fresh process (megatron imported there first): no "Apex is not installed" or CUDA
    runtime warnings above the error on a machine without a GPU (``cpu_compat``)."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridflow.cli",
            "convert",
            "hf-to-mcore",
            "--hf",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"hybridflow convert: error: {tmp_path}/config.json not found: a Hugging Face model directory needs config.json"
    ], done.stderr


@pytest.mark.parametrize(
    "family,key,value",
    [
        ("qwen2", "use_sliding_window", True),
        ("llama", "rope_parameters", {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
        ("deepseek_v3", "norm_topk_prob", False),
        ("mixtral", "hidden_act", "gelu"),
        # SGLang would hold tensors (o_proj bias, dense MLPs, no gate bias) ModelConfig cannot describe
        ("llama", "attention_bias", True),
        ("qwen3_moe", "attention_bias", True),
        ("deepseek_v3", "moe_layer_freq", 2),
        ("deepseek_v3", "topk_method", "greedy"),
        ("deepseek_v3", "scoring_func", "softmax"),
        ("deepseek_v3", "attention_bias", True),
    ],
)
def test_config_settings_megatron_builds_differently_are_refused(family, key, value, hf_dirs, tmp_path):
    source = _copy(hf_dirs[family], tmp_path)
    config = json.loads((source / "config.json").read_text())
    config[key] = value
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json: {key}="):
        read_model_config(source)
