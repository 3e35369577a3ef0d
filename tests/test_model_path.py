"""``model.path``: the run's model read from a directory as the hub ships it, and every mistake
about that directory refused in one line before any rank starts.

The directory is ``convert_models.make_hf_dir``'s: transformers' ``save_pretrained`` of a tiny
Qwen3-MoE, two safetensors shards with their index, a BPE tokenizer with a chat template and
special tokens, generation_config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hfschema.hf_config import read_model_config
from hybridflow.config import load_config
from hybridflow.preflight import check_data, check_model_weights
from hybridflow.runtime.model_dir import run_model_dir
from tests.megatron_adapters.convert_models import make_hf_dir

pytestmark = pytest.mark.claim("model-path")

QUICKSTART = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart_cpu.yaml")


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    return make_hf_dir(tmp_path_factory.mktemp("hub"), "qwen3_moe")


@pytest.fixture
def copy_of(hub_dir, tmp_path):
    def copy() -> Path:
        return Path(shutil.copytree(hub_dir, tmp_path / "model"))

    return copy


def test_the_architecture_comes_from_config_json(hub_dir):
    cfg = load_config(None, [f"model.path={hub_dir}"])
    assert cfg.model.architecture == read_model_config(hub_dir)
    assert cfg.model.pretrained and cfg.model.num_layers == 4 and cfg.model.vocab_size == 320


def test_a_key_that_restates_config_json_is_accepted_and_one_that_contradicts_it_is_refused(hub_dir):
    assert load_config(None, [f"model.path={hub_dir}", "model.num_layers=4"]).model.num_layers == 4
    with pytest.raises(ValueError) as error:
        load_config(None, [f"model.path={hub_dir}", "model.hidden_size=128"])
    assert str(error.value) == (
        f"model.hidden_size=128 contradicts {hub_dir}/config.json (64); remove "
        "model.hidden_size: model.path sets the architecture"
    )


def test_the_quickstart_recipe_with_a_path_names_the_first_key_it_contradicts(hub_dir):
    with pytest.raises(ValueError, match=r"^model\.num_layers=2 contradicts .*config\.json \(4\)"):
        load_config(QUICKSTART, [f"model.path={hub_dir}"])


def test_a_missing_path_plans_with_the_config_keys_but_does_not_train(tmp_path):
    missing = tmp_path / "Qwen3-235B-A22B"
    cfg = load_config(QUICKSTART, [f"model.path={missing}"])
    assert cfg.model.num_layers == 2  # the recipe's own keys: hybridflow plan still works
    with pytest.raises(ValueError, match=rf"^model\.path={missing}: no such directory; set model\.path to a "):
        check_model_weights(cfg, on_cluster=False)
    with pytest.raises(ValueError, match="no such directory"):
        load_config(QUICKSTART, [f"model.path={missing}"], model_path_must_exist=True)


def test_an_unmapped_model_type_lists_the_mapped_ones_and_names_the_trainer_that_takes_it(copy_of):
    model = copy_of()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError) as error:
        load_config(None, [f"model.path={model}"])
    assert str(error.value) == (
        f"{model}/config.json: model_type='gpt_neox' is not mapped onto megatron-core (mapped: llama, qwen2, "
        "qwen3, qwen3_moe, mixtral, deepseek_v3); as a policy (model.path) actor.backend=fsdp2 trains it with "
        "transformers' own class"
    )


def test_no_tokenizer_files_are_refused(copy_of):
    model = copy_of()
    (model / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=rf"^{model}: no tokenizer files \(one of tokenizer.json, "):
        load_config(None, [f"model.path={model}"])


def test_a_shard_the_index_lists_but_the_directory_lacks_is_named(copy_of):
    model = copy_of()
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError) as error:
        load_config(None, [f"model.path={model}"])
    assert str(error.value).startswith(
        f"{model}/model.safetensors.index.json lists model-00002-of-00002.safetensors, missing from {model}; download"
    )


def test_a_directory_without_safetensors_is_refused(copy_of):
    model = copy_of()
    for shard in model.glob("*.safetensors*"):
        shard.unlink()
    (model / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"config\.json but no \*\.safetensors weights \(pytorch_model\.bin "
        r"are not read: save the model with safe_serialization=True\)",
    ):
        load_config(None, [f"model.path={model}"])


def test_init_pretrained_without_a_path_is_refused():
    with pytest.raises(ValueError, match=r"^model\.init=pretrained needs model\.path"):
        load_config(None, ["model.init=pretrained"])


def test_a_cluster_run_without_weights_must_say_init_random():
    cfg = load_config(None, [])
    with pytest.raises(ValueError, match=r"^model\.path is not set: this run would post-train a randomly "):
        check_model_weights(cfg, on_cluster=True)
    check_model_weights(load_config(None, ["model.init=random"]), on_cluster=True)
    check_model_weights(cfg, on_cluster=False)  # the CPU quickstart and tests


def test_a_random_model_of_a_family_the_run_cannot_write_is_refused_before_any_rank():
    cfg = load_config(
        Path(QUICKSTART).with_name("grpo_deepseek_v3_671b.yaml").as_posix(), ["model.path=null", "model.init=random"]
    )
    with pytest.raises(
        ValueError,
        match=r"^model\.family=deepseek_v3 without model\.path: .* set model\.path to a "
        r"deepseek_v3 model directory",
    ):
        check_model_weights(cfg, on_cluster=False)


def test_chat_prompts_for_a_model_without_a_chat_template_are_refused(copy_of, tmp_path):
    model = copy_of()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}) + "\n"
    )
    cfg = load_config(None, [f"model.path={model}", f"data.train_files=[{data}]", "run.heldout_prompts=0"])
    with pytest.raises(
        ValueError,
        match=rf"data.train_files\[0\]={data}: line 1 \(1-based\): the prompt is a "
        rf"list of chat messages but the model in {model} has no chat template",
    ):
        check_data(cfg)


def test_the_run_directory_gets_the_models_files_and_no_weights(hub_dir, tmp_path):
    cfg = load_config(None, [f"model.path={hub_dir}"])
    made = run_model_dir(cfg.model, tmp_path / "run" / "model", seed=0)
    names = sorted(p.name for p in made.iterdir())
    assert "config.json" in names and "tokenizer.json" in names and "generation_config.json" in names
    assert not [n for n in names if "safetensors" in n]
    assert (made / "config.json").read_bytes() == (hub_dir / "config.json").read_bytes()
    assert run_model_dir(cfg.model, made, seed=0) == made  # a resumed run keeps it


def test_stop_tokens_include_generation_config_eos(hub_dir):
    from transformers import AutoTokenizer

    from hybridflow.runtime.session import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(hub_dir))
    eos = json.loads((hub_dir / "generation_config.json").read_text())["eos_token_id"]
    assert set(eos) <= set(stop_token_ids(tokenizer, hub_dir))


def test_a_converted_checkpoint_is_a_model_path_too(hub_dir, tmp_path):
    from hfschema.model_source import model_source
    from megatron_adapters.convert import hf_to_mcore

    hf_to_mcore(hub_dir, tmp_path / "mcore")
    source = model_source(tmp_path / "mcore")
    assert (source.kind, source.files) == ("mcore", tmp_path / "mcore" / "hf_files")
    cfg = load_config(None, [f"model.path={tmp_path / 'mcore'}"])
    assert cfg.model.architecture == read_model_config(hub_dir)
    check_model_weights(cfg, on_cluster=True)  # converted at tp=1, the default layout's
    cfg = load_config(None, [f"model.path={tmp_path / 'mcore'}", "actor.parallel.tp=2"])
    with pytest.raises(
        ValueError,
        match=r"holds vocabulary rows padded to 384, but actor\.parallel\.tp=2 pads to "
        r"512; convert it again with `hybridflow convert hf-to-mcore --tp 2`",
    ):
        check_model_weights(cfg, on_cluster=True)


def test_plan_reads_config_json_when_the_path_exists_and_says_so(hub_dir, tmp_path, capsys):
    from hybridflow.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  path: {hub_dir}\n")
    assert main(["plan", str(recipe), "--no-reshard"]) == 0
    assert f"\nweights: {hub_dir} (pretrained); shape from its config.json\n" in capsys.readouterr().out
    assert main(["plan", str(recipe), "--resolved"]) == 0
    out = capsys.readouterr().out
    assert "  num_layers: 4\n" in out and "  family: qwen3_moe\n" in out
    recipe.write_text(f"model:\n  path: {tmp_path / 'not_downloaded'}\n  num_layers: 6\n")
    assert main(["plan", str(recipe), "--no-reshard"]) == 0
    assert "does not exist here: the shape is the config's model.* keys" in capsys.readouterr().out
    assert main(["plan", str(recipe), "--resolved"]) == 0
    assert "  num_layers: 6\n" in capsys.readouterr().out


@pytest.mark.claim("dropped-rows-refused")
def test_a_run_that_would_drop_most_of_its_prompts_as_too_long_is_refused_before_any_rank(hub_dir, tmp_path, capsys):
    """Prompts tokenised before launch as the run will (the model's tokenizer and chat template):
    with the default limits most of a real data set may be too long, which the run would drop."""
    from hybridflow.data import write_jsonl
    from hybridflow.preflight import preflight

    short = {"prompt": "1+2=", "reward_model": {"ground_truth": 3}}
    long = {"prompt": "Natalia sold clips to 48 of her friends. " * 4, "reward_model": {"ground_truth": 72}}
    train = tmp_path / "train.jsonl"
    write_jsonl(train, [short, long, long, short])
    overrides = [f"run.output_dir={tmp_path / 'run'}", f"model.path={hub_dir}", f"data.train_files=[{train}]"]
    cfg = load_config(None, [*overrides, "data.max_prompt_length=64"])
    with pytest.raises(ValueError) as refused:
        preflight(cfg)
    message = str(refused.value)
    assert message.startswith("data.train_files: 2 of 4 training rows (50%) would be dropped (2 too long), ")
    longest = int(message.split("data.max_prompt_length=")[1].split(" ")[0])
    assert longest > 64 and f"the longest has {longest} tokens" in message
    preflight(load_config(None, [*overrides, f"data.max_prompt_length={longest}"]))  # the fix it names works
    assert "too long" not in capsys.readouterr().err


@pytest.mark.claim("context-checked")
def test_lengths_beyond_the_models_context_are_refused_before_any_rank(hub_dir, tmp_path):
    from hybridflow.preflight import preflight

    cfg = load_config(None, [f"run.output_dir={tmp_path}", f"model.path={hub_dir}", "data.max_prompt_length=512"])
    with pytest.raises(ValueError) as refused:
        preflight(cfg)
    assert str(refused.value) == (
        f"data.max_prompt_length=512 + data.max_response_length=16 = 528 exceeds the model's context of 256 "
        f"tokens ({hub_dir}/config.json); lower them to sum to at most 256"
    )


@pytest.mark.claim("lengths-decided")
def test_lengths_left_unset_are_decided_from_the_data_and_the_model(hub_dir, tmp_path, capsys):
    """A run from a model directory and data files does not inherit the synthetic task's 64/16:
    the prompt budget covers the data's longest prompt as the model's chat template makes it, the
    response budget 1.5 x the longest warm-up answer (else 1024), both within the context."""
    from transformers import AutoTokenizer

    from hybridflow.cli import main
    from hybridflow.data import write_jsonl

    question = "Natalia sold clips to 48 of her friends in April, and then half as many in May. "
    answer = "She sold 48 / 2 = 24 clips in May and 48 + 24 = 72 in all. #### 72"
    rows = [{"prompt": question * k, "reward_model": {"ground_truth": 72}, "worked": answer * k} for k in (1, 2)]
    train = tmp_path / "train.jsonl"
    write_jsonl(train, rows)
    tokenizer = AutoTokenizer.from_pretrained(hub_dir)
    chat = [{"role": "user", "content": question * 2}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    longest_prompt = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    longest_answer = len(tokenizer(answer * 2, add_special_tokens=False)["input_ids"])
    base = [f"model.path={hub_dir}", f"data.train_files=[{train}]", "sft.response_key=worked"]

    cfg = load_config(None, [*base, "sft.steps=5"])
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    assert prompt % 64 == 0 and longest_prompt <= prompt < longest_prompt + 64
    assert response == min(-(-int(1.5 * longest_answer) // 64) * 64, 256 - prompt)
    # without warm-up answers: 1024, cut to what the model's context of 256 leaves
    assert load_config(None, base).data.max_response_length == 256 - prompt
    # a value the user sets is kept; plan says where the others come from and prints the numbers
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  max_response_length: 32\n")
    assert main(["plan", str(recipe), *base, "--resolved"]) == 0
    out, err = capsys.readouterr()
    assert f"  max_prompt_length: {prompt}\n  max_response_length: 32\n" in out
    assert err == (
        f"hybridflow plan: decided from the data and the model: data.max_prompt_length={prompt} (the longest of "
        f"the first 2 training prompts has {longest_prompt} tokens); set them to choose\n"
    )
    # a prompt budget set past the context leaves the decided response none: refused, naming both keys
    with pytest.raises(ValueError) as refused:
        load_config(None, [*base, "data.max_prompt_length=512"])
    assert str(refused.value) == (
        "data.max_prompt_length=512 leaves no room for a response in the model's context of 256 tokens; set "
        "data.max_prompt_length and data.max_response_length to sum to at most 256"
    )
    # the data or the model not on this machine (a plan made before the download): said, not guessed
    elsewhere = [f"model.path={tmp_path / 'not_downloaded'}", f"data.train_files=[{train}]"]
    recipe.write_text("run:\n  name: elsewhere\n")
    assert main(["plan", str(recipe), *elsewhere, "--resolved"]) == 0
    assert capsys.readouterr().err == (
        "hybridflow plan: data lengths 64/16 (the synthetic task's where unset): the data or the model's "
        "tokenizer is not on this machine; the run decides them from the data\n"
    )
