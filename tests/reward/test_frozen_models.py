"""Reward models without a process group: pooling, the Bradley-Terry loss, preference rows in
the layouts users bring, the mix with rule rewards, re-rendering for another tokenizer, the graph
and plan a reward model adds, and the one-line refusals of what is not a reward model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hfschema.hf_config import read_model_config
from hfschema.model_source import architecture, model_source, reward_model_source
from hybridflow.config import load_config
from hybridflow.data import BadRow, write_jsonl, write_parquet
from hybridflow.lowering import lower
from hybridflow.preferences import encode_pair, read_pairs
from hybridflow.preflight import check_frozen_models
from hybridflow.rollout.tiny import make_tiny_model_dir, make_tiny_tokenizer
from hybridflow.rollout.tokens import encode_prompts
from hybridflow.runtime.frozen import RewardModel
from hybridflow.runtime.ops import Rollout, score
from hybridflow.runtime.shares import single_process
from megatron_adapters.reward_model import LAST_KEY, bradley_terry_loss, last_token_mask

QUICKSTART = "configs/quickstart_cpu.yaml"


# ---------------------------------------------------------------- pooling and loss


def test_the_pooled_token_is_the_last_real_one_as_transformers_pools():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 6, 0, 0], [0, 0, 0, 0, 0]])
    mask = last_token_mask(ids, pad_id=0)
    assert mask.argmax(dim=1).tolist() == [2, 2, 4]  # all padding: the last column (transformers' -1)
    # lengths cut a row whatever follows (a concatenated batch pads with zeros that are real ids)
    cut = last_token_mask(torch.tensor([[5, 6, 7, 8, 9]]), pad_id=None, lengths=torch.tensor([3]))
    assert cut.argmax(dim=1).tolist() == [2]


def test_bradley_terry_loss_is_minus_log_sigmoid_of_the_margin():
    values = torch.tensor([[0.0, 2.0], [0.0, 1.0], [0.0, -1.0], [0.0, 0.5]])
    last = torch.tensor([[0.0, 1.0]] * 4)
    loss, pairs, metrics = bradley_terry_loss(values, None, {LAST_KEY: last})
    expected = -math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(1.5)))
    assert int(pairs) == 2 and loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"].item() == 0.5 and metrics["margin"].item() == pytest.approx(-0.25)


# ---------------------------------------------------------------- preference rows


def _data_cfg(tmp_path, **overrides):
    return load_config(QUICKSTART, [f"run.output_dir={tmp_path}", *[f"{k}={v}" for k, v in overrides.items()]]).data


def test_preference_rows_in_the_layouts_users_bring(tmp_path):
    verl = tmp_path / "verl.parquet"  # verl / OpenRLHF: prompt text, chosen and rejected texts
    write_parquet(verl, [{"prompt": "max(3,7)=", "chosen": "7", "rejected": "3", "data_source": "max"}])
    hf = tmp_path / "ultrafeedback.jsonl"  # HF binarized sets: the prompt turns inside each chat
    chat = [{"role": "user", "content": "Say hi"}]
    write_jsonl(
        hf,
        [
            {
                "prompt": "Say hi",
                "chosen": chat + [{"role": "assistant", "content": "Hi!"}],
                "rejected": chat + [{"role": "assistant", "content": "No."}],
            }
        ],
    )
    hh = tmp_path / "hh.jsonl"  # hh-rlhf: whole dialogues as text, no prompt column
    write_jsonl(hh, [{"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"}])
    pairs = read_pairs([str(verl), str(hf), str(hh)], _data_cfg(tmp_path), chosen_key="chosen", rejected_key="rejected")
    assert [(p.prompt, p.chosen, p.rejected, p.data_source) for p in pairs] == [
        ("max(3,7)=", "7", "3", "max"),
        (chat, "Hi!", "No.", None),
        (None, "\n\nHuman: hi\n\nAssistant: hello", "\n\nHuman: hi\n\nAssistant: go", None),
    ]
    tokenizer = make_tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chosen, rejected = encode_pair(pairs[1], tokenizer, _data_cfg(tmp_path), end, use_chat=True)
    (prompt,) = encode_prompts(tokenizer, [chat])
    assert chosen == list(prompt) + tokenizer("Hi!", add_special_tokens=False)["input_ids"] + [end]
    assert rejected[: len(prompt)] == list(prompt) and rejected[-1] == end


def test_bad_preference_rows_name_file_and_row(tmp_path):
    path = tmp_path / "pairs.jsonl"
    write_jsonl(
        path,
        [
            {"prompt": "q", "chosen": "a"},  # no rejected
            {
                "chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}],
            },
            {"prompt": "q", "chosen": "a", "rejected": "b"},
        ],
    )
    cfg = _data_cfg(tmp_path)
    pairs = read_pairs([str(path)], cfg, chosen_key="chosen", rejected_key="rejected")
    assert [p.uid for p in pairs] == [f"{path}:3"]
    strict = _data_cfg(tmp_path, **{"data.on_bad_row": "fail"})
    with pytest.raises(ValueError, match=r"pairs.jsonl line 1 \(1-based\): no column 'rejected'"):
        read_pairs([str(path)], strict, chosen_key="chosen", rejected_key="rejected")
    write_jsonl(path, [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(BadRow, match="more than data.max_prompt_length"):
        encode_pair(
            pairs[0],
            make_tiny_tokenizer(),
            _data_cfg(tmp_path, **{"data.max_prompt_length": 2, "data.max_response_length": 1}),
            1,
            True,
        )


# ---------------------------------------------------------------- the mix and the tokens


def _rollout(texts, sources, answers, batch=None) -> Rollout:
    n = len(texts)
    return Rollout(
        batch=batch or {},
        texts=texts,
        answers=answers,
        prompts=["max(3,7)="] * n,
        sources=sources,
        extra_infos=[None] * n,
        rows=torch.arange(n),
        groups=torch.zeros(n, dtype=torch.long),
        lengths=torch.ones(n, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool),
        seconds=0.0,
    )


@pytest.mark.claim("reward-mix")
def test_rewards_mix_rule_model_and_judge_by_data_source(tmp_path):
    cfg = load_config(
        QUICKSTART,
        [
            f"run.output_dir={tmp_path}",
            "reward_model.path=unused",
            "reward_model.weight=0.5",
            "judge.path=unused",
            "reward.source_weights={max: {model: 0.0, rule: 1.0, judge: 0.0}}",
        ],
    )
    session = SimpleNamespace(run=SimpleNamespace(shard=single_process()), cfg=cfg)
    ro = _rollout(["7", "3", "whatever"], ["max", "max", "chat"], [7, 7, None])
    model, judge = torch.tensor([9.0, 9.0, 4.0]), torch.tensor([0.3, 0.3, 0.25])
    scores, errors, _ = score(session, ro, {"model": model, "judge": judge})
    # max rows: the rule alone (right, wrong); the chat row: 0.5 x model + 1 x judge, and no rule
    # call (the rule's default weight is 0 beside a reward model or a judge): no reward error
    assert scores.tolist() == [1.0, 0.0, 2.25] and errors == 0
    with pytest.raises(ValueError, match=r"reward.source_weights\[max\] has critic; a source weighs rule"):
        load_config(QUICKSTART, ["reward.source_weights={max: {critic: 1.0}}"])


def _groups_rollout(n: int) -> Rollout:
    """``n`` samples in groups of two, with a token each (what ``_concat`` joins)."""
    ro = _rollout(["7"] * n, ["max"] * n, [7] * n, batch={"input_ids": torch.zeros(n, 1, dtype=torch.long)})
    return dataclasses.replace(ro, groups=torch.arange(n) // 2)


@pytest.mark.claim("dynamic-sampling-with-model-scorers")
@pytest.mark.parametrize("drops_weights", [True, False], ids=["engine-drops-weights", "engine-keeps-weights"])
def test_dynamic_sampling_scores_each_extra_round_as_the_step_does(tmp_path, monkeypatch, drops_weights):
    """DAPO's extra rounds with a reward model and a judge: each round is generated, then scored
    by the step's mix (the judge's requests first, the reward model where the plan runs it, in
    train mode); where the switch to train released a colocated engine's weights (a GPU) they are
    pushed again before the next round generates; the GPUs end in the mode they were found in."""
    from hybridflow.runtime import ops, switches

    cfg = load_config(
        QUICKSTART,
        [
            f"run.output_dir={tmp_path}",
            "algorithm.name=dapo",
            "algorithm.max_sampling_rounds=3",
            "run.prompts_per_step=2",
            "rollout.n=2",
            "reward_model.path=unused",
            "reward_model.weight=0.5",
            "judge.path=unused",
        ],
    )
    events = []
    session = SimpleNamespace(
        cfg=cfg,
        mode="train",  # after the step's own rm_score node
        run=SimpleNamespace(shard=single_process()),
        data=SimpleNamespace(prompt_batch=lambda step, offset: [f"round {offset}"], stop_ids=(0,)),
        engines=SimpleNamespace(
            sync=SimpleNamespace(engine_drops_weights=drops_weights, push=lambda: events.append("push"))
        ),
    )

    def enter(s, mode):
        events.append(f"enter {mode}")
        s.mode = mode

    # round 2: only the first group's model scores differ; round 3: only the second's judge scores
    model = {2: torch.tensor([1.0, 3.0, 2.0, 2.0]), 3: torch.tensor([1.0, 1.0, 0.0, 0.0])}
    judge = {2: torch.tensor([0.0, 0.0, 0.0, 0.0]), 3: torch.tensor([0.0, 0.0, 1.0, 2.0])}
    drawn = []
    monkeypatch.setattr(switches, "enter", enter)
    monkeypatch.setattr(
        ops,
        "rollout",
        lambda s, prompts, *a, **k: (
            events.append(f"generate in {s.mode}") or drawn.append(prompts) or _groups_rollout(4),
            {},
        ),
    )
    monkeypatch.setattr(
        ops, "_rm_scores", lambda s, ro: events.append(f"reward model in {s.mode}") or model[len(drawn) + 1]
    )
    monkeypatch.setattr(ops, "_judge_start", lambda s, ro: events.append("judge requests") or len(drawn) + 1)
    monkeypatch.setattr(ops, "_judge_collect", lambda s, ro, round_: (judge[round_], 1))
    node = SimpleNamespace(inputs=("responses", "scores"), option=lambda name: {"max_rounds": 3}[name])
    first = _groups_rollout(4)
    produced = ops.filter_groups_op(
        session, node, {"responses": first, "scores": torch.zeros(4)}, SimpleNamespace(index=5)
    )
    kept, scores = (produced.fields["kept"].fields[name] for name in ("responses", "scores"))
    push = ["enter sync", "push"] if drops_weights else []
    one_round = [
        *push,
        "enter generate",
        "generate in generate",
        "judge requests",
        "enter train",
        "reward model in train",
    ]
    assert events == one_round + one_round + ["enter train"]
    assert drawn == [["round 1"], ["round 2"]]
    # the kept groups, scored 0.5 x model + 1 x judge (the rule's default weight is 0 beside them)
    assert scores.tolist() == [0.5, 1.5, 1.0, 2.0]
    assert kept.total == 4 and produced.metrics["dapo/sampling_rounds"] == 3.0
    assert produced.metrics["dapo/kept_groups"] == 2.0 and produced.metrics["dapo/judge_unparsable"] == 1.0


def test_judging_templates_and_replies():
    from hybridflow.judge import parse_score, render, template_problem

    assert template_problem("Q: {prompt} A: {response} ref {answer}") is None
    with pytest.raises(ValueError, match=r"judge.template has no \{response\} placeholder"):
        load_config(QUICKSTART, ["judge.template=Rate {prompt}"])
    with pytest.raises(ValueError, match=r"judge.template names \{score\}"):
        load_config(QUICKSTART, ['judge.template="Rate {response} as {score}"'])
    with pytest.raises(ValueError, match="judge.pattern=.* has no group"):
        load_config(QUICKSTART, [r"judge.pattern=\d+"])
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"}]
    assert render("{prompt}|{response}|{answer}", prompt=chat, response="4", answer=None) == "2+2?|4|"
    pattern = r"(-?\d+(?:\.\d+)?)"
    assert parse_score("I'd say 7/10.", pattern, 0.1) == pytest.approx(0.7)
    assert parse_score("no idea", pattern, 0.1) is None
    assert (
        parse_score("Score: 3", r"Score: (\w+)", 1.0) == 3.0 and parse_score("Score: x", r"Score: (\w+)", 1.0) is None
    )


def test_a_reward_model_with_its_own_tokenizer_reads_prompt_and_response_in_its_template():
    theirs = make_tiny_tokenizer(300)
    rm = RewardModel(model=None, pad_id=0, tokenizer=theirs, end_id=theirs.convert_tokens_to_ids("<|im_end|>"))
    ids, lengths = rm.tokens(_rollout(["7", "10"], ["max", "max"], [7, 7]))
    (prompt,) = encode_prompts(theirs, [[{"role": "user", "content": "max(3,7)="}]])
    first = list(prompt) + theirs("7", add_special_tokens=False)["input_ids"] + [rm.end_id]
    assert ids[0, : lengths[0]].tolist() == first and int(lengths[1]) > int(lengths[0])
    assert (ids[0, lengths[0] :] == 0).all()  # right-padded with its pad id


# ---------------------------------------------------------------- directories and the plan


def _reward_dir(tmp_path: Path) -> Path:
    from tests.reward.rm_models import make_rm_dir

    return make_rm_dir(tmp_path, "qwen3")


@pytest.mark.claim("reward-model-errors")
def test_what_is_not_a_reward_model_is_refused_in_one_line(tmp_path):
    causal = make_tiny_model_dir(tmp_path / "causal", "qwen3")
    with pytest.raises(ValueError, match=r"names Qwen3ForCausalLM, a model without a score head") as e:
        reward_model_source(causal)
    assert "\n" not in str(e.value)
    rm = _reward_dir(tmp_path)
    config = json.loads((rm / "config.json").read_text())
    two = tmp_path / "two_labels"
    two.mkdir()
    for f in rm.iterdir():
        (two / f.name).write_bytes(f.read_bytes())
    (two / "config.json").write_text(json.dumps({**config, "id2label": {"0": "a", "1": "b"}, "num_labels": 2}))
    with pytest.raises(ValueError, match="with 2 labels; a reward model has one score"):
        reward_model_source(two)
    headless = tmp_path / "headless"  # a seq-cls config.json over a causal LM's weights
    headless.mkdir()
    for f in causal.iterdir():
        (headless / f.name).write_bytes(f.read_bytes())
    (headless / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="score.weight is missing in the safetensors files"):
        reward_model_source(headless)
    with pytest.raises(ValueError, match="not a causal LM a policy samples from; .* reward_model.path"):
        architecture(model_source(rm), {})
    assert read_model_config(rm).head == "score"


@pytest.mark.claim("frozen-models-in-plan")
def test_plan_prints_the_reward_model_node_its_placement_and_memory(tmp_path):
    rm = _reward_dir(tmp_path)
    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"reward_model.path={rm}"])
    text = "\n".join(lower(cfg, with_reshard=False).describe())
    assert "rm_score [reward_model] rm_score: responses -> model_scores" in text
    assert "reward [reward] reward: responses, answers, model_scores -> scores" in text
    assert "reward_model: qwen3 (score head" in text and f"from {rm}" in text and "resident" in text
    memory = lower(cfg, with_reshard=False).memory[0]
    assert memory.phases["training"]["reward_model params"] > 0
    assert memory.phases["generation"]["reward_model params"] > 0
    off = load_config(
        QUICKSTART, [f"run.output_dir={tmp_path}", f"reward_model.path={rm}", "reward_model.offload=true"]
    )
    plan = lower(off, with_reshard=False)
    assert "reward_model params" not in plan.memory[0].phases["generation"]
    assert "on the host between uses" in "\n".join(plan.describe())


@pytest.mark.claim("frozen-model-own-layout")
def test_a_frozen_model_of_its_own_layout_is_planned_under_it(tmp_path):
    """The plan's stage and memory follow reward_model.parallel / distillation.parallel; a layout
    that does not fill the actor's ranks, or cannot split the model, is refused in one line."""
    rm, teacher = _reward_dir(tmp_path), make_tiny_model_dir(tmp_path / "teacher", "qwen3_moe")
    base = [f"run.output_dir={tmp_path}", f"reward_model.path={rm}", f"distillation.teacher_path={teacher}"]
    shared = lower(load_config(QUICKSTART, base), with_reshard=False)
    own = lower(load_config(QUICKSTART, [*base, "reward_model.parallel.tp=2", "distillation.parallel.pp=2"]))
    text = own.describe()
    rm_stage, teacher_stage = [line for line in text if " rm_score [reward_model] rm_score on " in line] + [
        line for line in text if " teacher_logprob [teacher] teacher_logprob on " in line
    ]
    assert "megatron tp=2 pp=1 " in rm_stage and "(its own: reward_model.parallel)" in rm_stage
    assert "megatron tp=1 pp=2 " in teacher_stage and "(its own: distillation.parallel)" in teacher_stage
    (listed,) = [line for line in text if line.strip().startswith("teacher: ")]  # the frozen models' list
    assert "megatron tp=1 pp=2 " in listed and "(its own: distillation.parallel)" in listed
    assert "its own" not in "\n".join(shared.describe())
    # the actor's layout gives each rank every layer of both (EP=2 splits the teacher's experts);
    # TP=2 halves the reward model's layers, PP=2 gives each rank half of the teacher's layers
    was, now = shared.memory[0].phases["training"], own.memory[0].phases["training"]
    assert now["reward_model params"] < was["reward_model params"]
    assert now["teacher params"] != was["teacher params"]
    with pytest.raises(
        ValueError,
        match=r"^distillation.parallel: .* = 1 ranks, but a frozen model runs on the actor's 2 ranks "
        r".*; set distillation.parallel.dp=2$",
    ):
        load_config(QUICKSTART, [*base, "distillation.parallel.tp=1"])
    # the dense reward model cannot take the MoE actor's EP=2; the refusal says where its own goes
    with pytest.raises(
        ValueError, match=r"^actor.parallel \(reward_model.path's layout\).ep=2 .*\(reward_model.parallel\)$"
    ):
        check_frozen_models(load_config(QUICKSTART, base))
    check_frozen_models(load_config(QUICKSTART, [*base, "reward_model.parallel.dp=2"]))  # EP=1: served
    own_ep = load_config(QUICKSTART, [*base, "reward_model.parallel.tp=2", "reward_model.parallel.ep=2"])
    with pytest.raises(ValueError, match=r"^reward_model.parallel.ep=2 and reward_model.parallel.etp=1 need an MoE"):
        check_frozen_models(own_ep)


@pytest.mark.claim("frozen-model-offload")
def test_every_frozen_model_may_live_on_the_host_between_uses(tmp_path):
    """``reference.offload``, ``reward_model.offload``, ``distillation.offload``: the plan lists each
    as on the host between uses and leaves its parameters out of the generation phase (they come
    to the GPUs for their node, in the training phase)."""
    rm, teacher = _reward_dir(tmp_path), make_tiny_model_dir(tmp_path / "teacher", "qwen3_moe")
    base = [
        f"run.output_dir={tmp_path}",
        f"reward_model.path={rm}",
        "reward_model.parallel.dp=2",
        f"distillation.teacher_path={teacher}",
        "reference.enabled=true",
        "algorithm.kl_loss_coef=0.01",
    ]
    roles = ("reference", "reward_model", "teacher")
    resident = lower(load_config(QUICKSTART, base), with_reshard=False)
    offloaded = lower(
        load_config(
            QUICKSTART, [*base, "reference.offload=true", "reward_model.offload=true", "distillation.offload=true"]
        ),
        with_reshard=False,
    )
    for role in roles:
        assert f"{role} params" in resident.memory[0].phases["generation"]
        assert f"{role} params" not in offloaded.memory[0].phases["generation"]
        assert offloaded.memory[0].phases["training"][f"{role} params"] > 0
    listed = {m.role: m.describe() for m in offloaded.frozen}
    assert all(listed[role].endswith("; on the host between uses") for role in roles), listed
    with pytest.raises(ValueError, match=r"^distillation.offload=true with distillation.gpus=1: its own GPUs hold"):
        load_config(QUICKSTART, [*base, "distillation.gpus=1", "distillation.offload=true"])


@pytest.mark.claim("frozen-model-own-gpus")
def test_frozen_models_on_gpus_of_their_own_are_placed_counted_and_launched(tmp_path):
    """``reward_model.gpus`` / ``distillation.gpus``: a pool each after the actor's (and the
    separate engines'), the scoring split in a request before the actor's log-probs and a
    collection after them, no colocation switch for them, memory per pool, the processes a
    launch starts; a layout that does not fill them and an offload there are refused."""
    from hybridflow.preflight import process_count

    rm, teacher = _reward_dir(tmp_path), make_tiny_model_dir(tmp_path / "teacher", "qwen3_moe")
    base = [f"run.output_dir={tmp_path}", f"reward_model.path={rm}", f"distillation.teacher_path={teacher}"]
    cfg = load_config(QUICKSTART, [*base, "reward_model.gpus=2", "distillation.gpus=1", "distillation.parallel.ep=1"])
    plan = lower(cfg, with_reshard=False)
    assert [(p.name, p.ranks, p.roles) for p in plan.placement.pools] == [
        ("colocated", range(2), ("actor", "rollout", "reward", "driver")),
        ("reward_model", range(2, 4), ("reward_model",)),
        ("teacher", range(4, 5), ("teacher",)),
    ]
    assert cfg.reward_model.parallel.dp == 2 and process_count(cfg) == 5  # dp defaults to the GPUs
    order = [(st.node.name, st.pool, st.switch is not None) for st in plan.stages]
    names = [name for name, _, _ in order]
    assert names.index("rm_request") < names.index("old_logprob") < names.index("rm_score") < names.index("reward")
    assert names.index("teacher_request") < names.index("old_logprob") < names.index("teacher_logprob")
    assert names.index("teacher_logprob") == names.index("advantages") - 1
    assert {pool for name, pool, _ in order if name in ("rm_request", "rm_score")} == {"reward_model"}
    own = ("rm_request", "rm_score", "teacher_request", "teacher_logprob")
    assert not any(switched for name, _, switched in order if name in own)
    assert [m.pool for m in plan.memory] == ["colocated", "reward_model", "teacher"]
    assert list(plan.memory_of("reward_model").phases) == ["scoring"]
    assert "reward_model params" not in plan.memory_of("colocated").phases["training"]
    text = "\n".join(plan.describe())
    assert "(its own GPUs: reward_model.gpus)" in text and "reward_model: 2 GPUs on 1 node, ranks 2-3" in text
    separate = load_config(QUICKSTART, [*base, "reward_model.gpus=1", "rollout.placement=separate"])
    assert lower(separate, with_reshard=False).placement.ranks_of("reward_model") == range(4, 5)  # after 2 engines
    with pytest.raises(
        ValueError, match=r"^reward_model.parallel: .* = 2 ranks, but a frozen model runs on its own 1 GPUs"
    ):
        load_config(QUICKSTART, [*base, "reward_model.gpus=1", "reward_model.parallel.dp=2"])
    with pytest.raises(ValueError, match=r"^reward_model.offload=true with reward_model.gpus=1: its own GPUs hold"):
        load_config(QUICKSTART, [*base, "reward_model.gpus=1", "reward_model.offload=true"])


# ---------------------------------------------------------------- the distillation teacher


@pytest.mark.claim("teacher-errors")
def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tmp_path):
    from hfschema.model_source import teacher_source

    other = make_tiny_model_dir(tmp_path / "other", "qwen3", vocab_size=300)
    with pytest.raises(
        ValueError, match=r"the teacher's vocabulary has 300 tokens, the student's 320; .*tokenizer"
    ) as e:
        teacher_source(other, 320)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="describes a sequence-classification model; a teacher is a causal LM"):
        teacher_source(_reward_dir(tmp_path), 320)
    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"distillation.teacher_path={other}"])
    with pytest.raises(ValueError, match="distillation.teacher_path=.* the teacher's vocabulary has 300 tokens"):
        lower(cfg, with_reshard=False)


@pytest.mark.claim("frozen-models-in-plan")
def test_plan_prints_the_teacher_node_and_the_advantages_it_feeds(tmp_path):
    teacher = make_tiny_model_dir(tmp_path / "teacher", "qwen3_moe")
    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"distillation.teacher_path={teacher}"])
    plan = lower(cfg, with_reshard=False)
    text = "\n".join(plan.describe())
    assert "teacher_logprob [teacher] teacher_logprob: responses -> teacher_logprobs" in text
    assert "advantages: token_rewards, responses, old_logprobs, teacher_logprobs -> advantages" in text
    assert "distill_coef=1.0" in text and "teacher: qwen3_moe (LM head" in text
    assert plan.memory[0].phases["training"]["teacher params"] > 0


@pytest.mark.claim("frozen-models-in-plan", "judge-overlaps-the-step")
def test_plan_prints_the_judge_engine(tmp_path):
    judge = make_tiny_model_dir(tmp_path / "judge", "qwen3")
    cfg = load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"judge.path={judge}"])
    plan = lower(cfg, with_reshard=False)
    text = "\n".join(plan.describe())
    assert "judge_request [judge] judge_request: responses -> judge_scores_pending" in text
    assert "judge_score [judge] judge: responses, judge_scores_pending -> judge_scores" in text
    # the judge generates while the actor's log-probs are computed: the reward waits until it is read
    order = [stage.node.name for stage in plan.stages]
    assert order[:6] == ["generate", "judge_request", "old_logprob", "judge_score", "reward", "token_rewards"]
    assert "judge: qwen3 (LM head" in text and "sglang engine, tp=1, bfloat16" in text
    assert plan.memory[0].phases["generation"]["judge weights"] > 0
    with pytest.raises(ValueError, match="judge.path=.* a sequence-classification model cannot answer"):
        lower(load_config(QUICKSTART, [f"run.output_dir={tmp_path}", f"judge.path={_reward_dir(tmp_path)}"]))


@pytest.mark.claim("frozen-model-own-gpus")
def test_a_judge_on_gpus_of_its_own_is_placed_counted_split_and_refused_where_it_does_not_fit(tmp_path):
    """``judge.gpus``: ``gpus / tp`` replicas after the actor's ranks (and the separate engines'),
    a pool with its engine's memory alone (the actor's pool no longer holds it), the processes a
    launch starts, consecutive shares of each request; a count that is not whole replicas, and a
    replica across two nodes, are refused in one line."""
    from hybridflow.preflight import check_separate_nodes, process_count
    from hybridflow.runtime.frozen_ranks import share

    judge = make_tiny_model_dir(tmp_path / "judge", "qwen3")
    base = [f"run.output_dir={tmp_path}", f"judge.path={judge}"]
    cfg = load_config(QUICKSTART, [*base, "judge.gpus=2"])
    plan = lower(cfg, with_reshard=False)
    assert [(p.name, p.ranks) for p in plan.placement.pools] == [("colocated", range(2)), ("judge", range(2, 4))]
    assert process_count(cfg) == 4
    assert {st.pool for st in plan.stages if st.node.role == "judge"} == {"judge"}
    text = "\n".join(plan.describe())
    assert "sglang engine, tp=1, bfloat16 x2 replica(s) (its own GPUs: judge.gpus)" in text
    assert "judge weights" in plan.memory_of("judge").phases["scoring"]
    assert "judge weights" not in plan.memory_of("colocated").phases["generation"]
    separate = load_config(QUICKSTART, [*base, "judge.gpus=2", "judge.tp=2", "rollout.placement=separate"])
    assert lower(separate, with_reshard=False).placement.ranks_of("judge") == range(4, 6)  # after 2 engine ranks
    check_separate_nodes(separate, 2)
    with pytest.raises(ValueError, match=r"^judge.gpus: judge replica 0 \(ranks 4..5\) would span two nodes of 5"):
        check_separate_nodes(separate, 5)
    with pytest.raises(ValueError, match=r"^judge.gpus=3 is not a multiple of judge.tp=2: .* set judge.gpus=2$"):
        load_config(QUICKSTART, [*base, "judge.gpus=3", "judge.tp=2"])
    rm = [f"reward_model.path={_reward_dir(tmp_path)}"]
    for own_rm in ([], ["reward_model.gpus=1"]):  # a reward model beside: both start before the log-probs
        names = [st.node.name for st in lower(load_config(QUICKSTART, [*base, *rm, *own_rm, "judge.gpus=1"])).stages]
        scoring = "rm_request" if own_rm else "rm_score"
        assert names[:3] == ["generate", "judge_request", scoring] and names[3] == "old_logprob", names
    items = list(range(7))
    shares = [share(items, replica, 3) for replica in range(3)]
    assert shares == [[0, 1], [2, 3], [4, 5, 6]] and [x for s in shares for x in s] == items
