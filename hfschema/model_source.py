"""Where a run's starting model comes from (``model.path``), checked without torch.

```
model.path = DIR
  DIR/config.json + *.safetensors (+ index)  ─► kind "hf":    a Hugging Face model directory
  DIR/hybridflow.json + DIR/hf_files/         ─► kind "mcore": ``hybridflow convert hf-to-mcore``
  DIR/hybridflow.json in <run>/checkpoints/   ─► kind "mcore": a run's checkpoint (<run>/model)
        │
        └─► ModelSource(kind, weights=DIR, files=the folder with config.json + tokenizer)
```

Everything a user can get wrong about the directory is found here, on the launching process,
before any rank starts: a path that does not exist, a directory with no weights, a shard the
index lists but the directory lacks, no tokenizer files. ``read_model_config`` (``hf_config``)
then refuses a ``model_type`` the project does not map.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfschema.hf_config import SCORE_SUFFIX, SIDE_FILE_DIR, WEIGHT_INDEX, read_hf_config, read_model_config
from hfschema.model import ModelConfig

__all__ = [
    "CHECKPOINT_META",
    "ModelSource",
    "architecture",
    "check_padded_vocab",
    "has_chat_template",
    "model_source",
    "reward_model_source",
    "stored_shapes",
    "teacher_source",
    "judge_source",
]

CHECKPOINT_META = "hybridflow.json"
"""The metadata file of every megatron checkpoint the project writes (``checkpoint.META_FILE``)."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""Any one of these makes a loadable tokenizer (fast JSON, SentencePiece, or BPE vocab + merges)."""
_FIX = (
    "set model.path to a Hugging Face model directory (config.json, *.safetensors, tokenizer "
    "files) or to a checkpoint written by `hybridflow convert hf-to-mcore`"
)


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """The starting weights of a run and the files that describe them."""

    kind: str
    """``hf`` (safetensors read slice by slice onto each rank) or ``mcore`` (a dist checkpoint)."""
    weights: Path
    """The directory holding the weights."""
    files: Path
    """The directory holding config.json, the tokenizer and the chat template."""


def model_source(path: str | Path, *, key: str = "model.path") -> ModelSource:
    """The source at ``path`` (the config key ``key`` names it); ValueError naming the file and
    the fix for anything missing."""
    directory = Path(path).expanduser()
    fix = _FIX.replace("model.path", key)
    if not directory.is_dir():
        raise ValueError(f"{key}={path}: no such directory; {fix}")
    if (directory / CHECKPOINT_META).is_file():
        source = ModelSource(kind="mcore", weights=directory, files=_checkpoint_files(directory, key))
    elif (directory / "config.json").is_file():
        _check_weights(directory, key, fix)
        source = ModelSource(kind="hf", weights=directory, files=directory)
    else:
        raise ValueError(f"{key}={path}: neither config.json nor {CHECKPOINT_META} is there; {fix}")
    _check_tokenizer(source.files)
    return source


def _checkpoint_files(directory: Path, key: str) -> Path:
    """hf-to-mcore keeps the HF side files in ``hf_files``; a run's checkpoint has ``<run>/model``."""
    beside = directory / SIDE_FILE_DIR
    if (beside / "config.json").is_file():
        return beside
    run_model = directory.resolve().parent.parent.parent / "model"
    if directory.resolve().parent.parent.name == "checkpoints" and (run_model / "config.json").is_file():
        return run_model
    raise ValueError(
        f"{key}={directory}: a megatron checkpoint without {SIDE_FILE_DIR}/config.json "
        "and not inside a run directory; convert the model with `hybridflow convert "
        "hf-to-mcore`, which keeps its config and tokenizer beside the weights"
    )


def _check_weights(directory: Path, key: str, fix: str) -> None:
    index = directory / WEIGHT_INDEX
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, AttributeError) as error:
            raise ValueError(f"{index}: not a safetensors index ({error!r}); download the model again") from None
        missing = sorted(f for f in files if not (directory / f).is_file())
        if missing:
            raise ValueError(
                f"{index} lists {', '.join(missing)}, missing from {directory}; download "
                "the whole model again (an interrupted download leaves shards out)"
            )
    elif not any(directory.glob("*.safetensors")):
        other = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" ({', '.join(other[:3])} are not read: save the model with safe_serialization=True)" if other else ""
        raise ValueError(f"{key}={directory}: config.json but no *.safetensors weights{hint}; {fix}")


def _check_tokenizer(files: Path) -> None:
    if not any((files / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{files}: no tokenizer files (one of {', '.join(_TOKENIZER_FILES)}); copy the "
            "model's tokenizer files into it (the run tokenises prompts with them)"
        )


def check_padded_vocab(source: ModelSource, padded_vocab: int, tp: int) -> None:
    """A converted checkpoint's vocabulary rows were padded for one TP size and load only under a
    layout that pads the same (megatron-core refuses the shape): say so before any rank starts."""
    if source.kind != "mcore":
        return
    meta = json.loads((source.weights / CHECKPOINT_META).read_text())
    stored = meta.get("padded_vocab_size")
    if stored is not None and stored != padded_vocab:
        raise ValueError(
            f"model.path={source.weights} holds vocabulary rows padded to {stored}, but "
            f"actor.parallel.tp={tp} pads to {padded_vocab}; convert it again with "
            f"`hybridflow convert hf-to-mcore --tp {tp}` or start from the Hugging Face directory"
        )


def has_chat_template(files: str | Path) -> bool:
    """Whether the tokenizer in ``files`` has a chat template (transformers 5 writes it to
    ``chat_template.jinja``; older tokenizers keep it in ``tokenizer_config.json``)."""
    files = Path(files)
    if (files / "chat_template.jinja").is_file() or (files / "chat_template.json").is_file():
        return True
    config = files / "tokenizer_config.json"
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except json.JSONDecodeError:
        return False


def architecture(source: ModelSource, explicit: Mapping[str, Any], *, unmapped: bool = False) -> dict[str, Any]:
    """Every ``ModelConfig`` field of the model at ``source`` (its config.json), after checking
    that the ``model.*`` keys a user set (``explicit``) agree with it: a recipe may restate the
    shape it expects, never a different one. ``unmapped``: a model_type no family maps reads as the
    ``transformers`` family (an FSDP2 actor trains transformers' own class)."""
    model = read_model_config(source.files, unmapped=unmapped)
    where = source.files / "config.json"
    if model.head != "lm":  # a reward model given as the policy: the class of config.json says so
        raise ValueError(
            f"model.path={source.weights}: {where} describes a sequence-classification model (a "
            "score head, a reward model), not a causal LM a policy samples from; set model.path to "
            "a *ForCausalLM directory and the reward model as reward_model.path"
        )
    values = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)}
    for key, value in explicit.items():
        if key not in values:
            continue
        theirs = values[key]
        if key == "rope_scaling" and theirs is not None:
            theirs = dataclasses.asdict(theirs)
        if value != theirs:
            raise ValueError(
                f"model.{key}={value!r} contradicts {where} ({theirs!r}); remove model.{key}: "
                "model.path sets the architecture"
            )
    return values


def reward_model_source(path: str | Path, key: str = "reward_model.path") -> tuple[ModelSource, ModelConfig]:
    """The reward model at ``path`` and its architecture (a ``ScoreModelConfig``), checked
    without torch: a directory whose config.json is not a one-label sequence-classification
    model, or whose weights lack the ``score.weight`` head, is refused in one line naming ``key``."""
    source = model_source(path, key=key)
    where = source.files / "config.json"
    model = read_model_config(source.files)
    if model.head != "score":
        classes = ", ".join(read_hf_config(source.files).get("architectures") or ["none"])
        raise ValueError(
            f"{key}={path}: {where} names {classes}, a model without a score head; a reward model "
            f"is a *{SCORE_SUFFIX} directory with num_labels=1 (or the export of "
            "`hybridflow train run.mode=rm`)"
        )
    if source.kind == "hf":
        shape = stored_shapes(source.weights).get("score.weight")
        if shape != [1, model.hidden_size]:
            found = "is missing" if shape is None else f"has shape {shape}"
            raise ValueError(
                f"{key}={path}: the score head's tensor score.weight {found} in the safetensors files "
                f"(a reward model's is [1, {model.hidden_size}]); they are not the weights of the "
                f"sequence-classification model {where} describes"
            )
    return source, model


def stored_shapes(directory: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors files' headers (nothing else is read)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({name: entry["shape"] for name, entry in header.items() if name != "__metadata__"})
    return shapes


def teacher_source(
    path: str | Path, vocab_size: int, key: str = "distillation.teacher_path"
) -> tuple[ModelSource, ModelConfig]:
    """The distillation teacher at ``path`` and its architecture, checked without torch: a model
    without an LM head, or with another vocabulary than the student's ``vocab_size`` (the
    log-probs are compared token by token), is refused in one line naming ``key``."""
    source = model_source(path, key=key)
    model = read_model_config(source.files)
    if model.head != "lm":
        raise ValueError(
            f"{key}={path}: {source.files / 'config.json'} describes a sequence-classification model; "
            "a teacher is a causal LM whose log-probs the student matches"
        )
    if model.vocab_size != vocab_size:
        raise ValueError(
            f"{key}={path}: the teacher's vocabulary has {model.vocab_size} tokens, the student's "
            f"{vocab_size}; on-policy distillation compares their log-probs token by token, so the "
            "teacher must share the student's tokenizer"
        )
    return source, model


def judge_source(path: str | Path, tp: int, key: str = "judge.path") -> tuple[ModelSource, ModelConfig]:
    """The generative judge at ``path`` and its architecture: a causal LM (a Hugging Face
    directory its engine reads) whose attention heads split over ``tp``; one line naming ``key``
    otherwise."""
    source = model_source(path, key=key)
    model = read_model_config(source.files)
    if source.kind != "hf":
        raise ValueError(f"{key}={path}: a judge's engine reads a Hugging Face directory; convert it with mcore-to-hf")
    if model.head != "lm":
        raise ValueError(
            f"{key}={path}: a sequence-classification model cannot answer a judging prompt; set reward_model.path"
        )
    if model.num_attention_heads % tp:
        raise ValueError(f"{key}={path}: judge.tp={tp} does not divide its {model.num_attention_heads} attention heads")
    return source, model
