"""RL prompt data: jsonl/parquet round trips, bad rows (skip and fail), tokenising, the sampler."""

import json
import logging
import os

import pytest

from hybridflow.config import DataConfig
from hybridflow.data import (
    DataReport,
    PromptSampler,
    read_rows,
    tokenize_rows,
    write_jsonl,
    write_parquet,
)

GOOD = {
    "prompt": "1+2=",
    "reward_model": {"ground_truth": 3},
    "data_source": "arithmetic",
    "sft_response": "3",
    "level": 1,
}
CHAT = {
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}],
    "reward_model": {"ground_truth": 4},
}


def lines_file(tmp_path, *lines, name="rows.jsonl"):
    """A jsonl file of raw lines (dicts are dumped), so bad JSON can be written too."""
    path = tmp_path / name
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    return str(path)


# --------------------------------------------------------------------------- round trips


def test_jsonl_round_trip(tmp_path):
    path = str(write_jsonl(tmp_path / "a.jsonl", [GOOD, CHAT]))
    report = DataReport()
    first, second = read_rows([path], DataConfig(), sft_key=None, report=report)
    assert first.uid == f"{path}:1" and second.uid == f"{path}:2"
    assert first.prompt == "1+2=" and first.answer == 3 and first.data_source == "arithmetic"
    assert first.sft_response is None and first.extra == {"sft_response": "3", "level": 1}
    assert second.prompt == CHAT["prompt"] and second.answer == 4 and second.data_source is None
    assert report.kept == {path: 2} and report.num_skipped == 0


def test_parquet_round_trip(tmp_path):
    other = dict(GOOD, prompt="5-1=", reward_model={"ground_truth": 4}, sft_response="4")
    path = str(write_parquet(tmp_path / "a.parquet", [GOOD, other]))
    rows = read_rows([path], DataConfig(), sft_key="sft_response")
    assert [r.uid for r in rows] == [f"{path}:0", f"{path}:1"]  # parquet rows count from 0
    assert [(r.prompt, r.answer, r.sft_response) for r in rows] == [("1+2=", 3, "3"), ("5-1=", 4, "4")]
    assert rows[0].extra == {"level": 1}


def test_parquet_chat_prompts_and_struct_answers(tmp_path):
    row = dict(CHAT, reward_model={"ground_truth": {"target": 7, "numbers": [1, 6]}})
    (read,) = read_rows([write_parquet(tmp_path / "c.parquet", [row])], DataConfig())
    assert read.prompt == CHAT["prompt"] and read.answer == {"target": 7, "numbers": [1, 6]}


def test_rows_of_several_files_keep_file_order(tmp_path):
    a = lines_file(tmp_path, GOOD, name="a.jsonl")
    b = str(write_parquet(tmp_path / "b.parquet", [dict(GOOD, prompt="9+9=")]))
    assert [r.prompt for r in read_rows([a, b], DataConfig())] == ["1+2=", "9+9="]


@pytest.mark.parametrize(
    "answer_key, row, expected",
    [
        ("answer", {"prompt": "p", "answer": "x"}, "x"),
        ("reward_model.ground_truth", {"prompt": "p", "reward_model": {"ground_truth": 0}}, 0),
        ("a.b.c", {"prompt": "p", "a": {"b": {"c": [1, 2]}}}, [1, 2]),
    ],
)
def test_answer_key_walks_nested_columns(tmp_path, answer_key, row, expected):
    (read,) = read_rows([lines_file(tmp_path, row)], DataConfig(answer_key=answer_key))
    assert read.answer == expected


def test_blank_lines_are_not_rows(tmp_path):
    path = lines_file(tmp_path, GOOD, "", "   ", GOOD)
    assert [r.uid.rsplit(":", 1)[1] for r in read_rows([path], DataConfig())] == ["1", "4"]


# --------------------------------------------------------------------------- bad rows

BAD_ROWS = {
    "invalid JSON": ('{"prompt": "1+2=", ', "invalid JSON"),
    "not an object": ("[1, 2]", "object of columns"),
    "no prompt": ({"reward_model": {"ground_truth": 3}}, "no prompt column 'prompt'"),
    "no answer": ({"prompt": "1+2="}, "no value under 'reward_model'"),
    "no nested answer": ({"prompt": "1+2=", "reward_model": {"style": "rule"}}, "'reward_model.ground_truth'"),
    "prompt of wrong type": ({"prompt": 12, "reward_model": {"ground_truth": 3}}, "is of type int"),
    "empty prompt": ({"prompt": "  ", "reward_model": {"ground_truth": 3}}, "empty prompt"),
    "bad chat message": ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": 3}}, "messages"),
    "data_source of wrong type": (dict(GOOD, data_source=5), "'data_source' is of type int"),
}


@pytest.mark.claim("bad-rows-and-reward-errors")
@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_jsonl_row_is_skipped_with_file_and_line(tmp_path, caplog, kind):
    bad, reason = BAD_ROWS[kind]
    path = lines_file(tmp_path, GOOD, bad, GOOD)
    report = DataReport()
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        rows = read_rows([path], DataConfig(on_bad_row="skip"), report=report)
    assert [r.uid for r in rows] == [f"{path}:1", f"{path}:3"]
    assert report.skipped == {path: 1}
    warning = caplog.records[0].getMessage()
    assert f"{path} line 2 (1-based)" in warning and reason in warning


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_jsonl_row_fails_naming_file_line_and_fix(tmp_path, kind):
    bad, reason = BAD_ROWS[kind]
    path = lines_file(tmp_path, GOOD, bad)
    with pytest.raises(ValueError) as error:
        read_rows([path], DataConfig(on_bad_row="fail"))
    message = str(error.value)
    assert f"{path} line 2 (1-based)" in message and reason in message
    assert "data.on_bad_row=skip" in message


def test_bad_parquet_row_names_the_0_based_row(tmp_path, caplog):
    path = str(write_parquet(tmp_path / "p.parquet", [GOOD, dict(GOOD, prompt="")]))
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        assert len(read_rows([path], DataConfig())) == 1
    assert f"{path} row 1 (0-based)" in caplog.text and "empty prompt" in caplog.text
    with pytest.raises(ValueError, match=r"row 1 \(0-based\): empty prompt"):
        read_rows([path], DataConfig(on_bad_row="fail"))


def test_missing_sft_response_is_a_bad_row_when_asked_for(tmp_path):
    path = lines_file(tmp_path, GOOD, dict(GOOD, sft_response=None))
    report = DataReport()
    (row,) = read_rows([path], DataConfig(), sft_key="sft_response", report=report)
    assert row.sft_response == "3" and report.num_skipped == 1
    with pytest.raises(ValueError, match="line 2.*sft.response_key"):
        read_rows([path], DataConfig(on_bad_row="fail"), sft_key="sft_response")


def test_a_dotted_sft_response_key_reads_verls_worked_gsm8k_answer(tmp_path):
    """verl's GSM8K parquet keeps the worked solution in ``extra_info.answer``; reading it for SFT
    leaves ``extra_info`` whole for the reward function."""
    verl = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0, "answer": "2 and 2 make 4\n#### 4"},
    }
    path = str(write_parquet(tmp_path / "g.parquet", [verl, dict(verl, extra_info={"index": 1})]))
    numeric = str(write_parquet(tmp_path / "n.parquet", [dict(verl, extra_info={"index": 2, "answer": 4})]))
    report = DataReport()
    (row,) = read_rows([path], DataConfig(), sft_key="extra_info.answer", report=report)
    assert row.sft_response.endswith("#### 4") and row.extra["extra_info"]["index"] == 0
    assert report.num_skipped == 1
    with pytest.raises(ValueError, match=r"row 1 \(0-based\): no SFT response in 'extra_info.answer'"):
        read_rows([path], DataConfig(on_bad_row="fail"), sft_key="extra_info.answer")
    with pytest.raises(ValueError, match=r"row 0 \(0-based\): 'extra_info.answer' is of type int"):
        read_rows([numeric], DataConfig(on_bad_row="fail"), sft_key="extra_info.answer")


def test_a_byte_that_is_not_utf8_is_a_bad_row_named_by_its_line(tmp_path, caplog):
    """Anywhere in the file (past what preflight previews too): skipped or fatal as data.on_bad_row
    says, naming the file and line, never a decoding error from inside a read buffer."""
    good = (json.dumps(GOOD) + "\n").encode()
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        good * 3000 + json.dumps(dict(GOOD, prompt="caf\u00e9")).encode().replace(b"\\u00e9", b"\xe9") + b"\n" + good
    )
    report = DataReport()
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        assert len(read_rows([str(path)], DataConfig(), report=report)) == 3001
    assert report.num_skipped == 1 and f"{path} line 3001 (1-based): not UTF-8 text (byte 0xe9" in caplog.text
    with pytest.raises(ValueError, match=r"line 3001 \(1-based\): not UTF-8 text .*re-encode the file as UTF-8"):
        read_rows([str(path)], DataConfig(on_bad_row="fail"))


def test_many_bad_rows_log_a_bounded_number_of_warnings(tmp_path, caplog):
    path = lines_file(tmp_path, GOOD, *["{oops"] * 30)
    report = DataReport()
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        read_rows([path], DataConfig(), report=report)
    assert report.num_skipped == 30 and len(caplog.records) < 15
    assert "skipped 30 bad rows" in caplog.text


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("none.jsonl", None, "data file not found"),
        ("rows.csv", "prompt,answer\n", "unsupported data file extension '.csv'"),
        ("bad.jsonl", "{oops\n", "no usable rows"),
        ("empty.jsonl", "", "no usable rows"),
        ("broken.parquet", "not parquet", "not a readable parquet file"),
    ],
)
def test_file_errors_name_the_file(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        read_rows([str(path)], DataConfig())
    assert str(path) in str(error.value)


def test_no_files_is_an_error():
    with pytest.raises(ValueError, match="data.train_files"):
        read_rows([], DataConfig())


# --------------------------------------------------------------------------- tokenising


@pytest.fixture(scope="module")
def tokenizer():
    from hybridflow.rollout.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def test_tokenize_applies_the_chat_template(tmp_path, tokenizer):
    rows = read_rows([lines_file(tmp_path, GOOD, CHAT)], DataConfig())
    (text, chat), skipped = tokenize_rows(rows, tokenizer, DataConfig())
    as_chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert skipped == 0 and text.row is rows[0] and list(text.prompt_ids) == list(as_chat)
    assert tokenizer.decode(chat.prompt_ids).startswith("<|im_start|>system\nBe brief.")


@pytest.mark.claim("verl-math-rewards")
def test_chat_format_rows_read_their_messages_as_the_prompt_and_the_last_assistant_turn_as_the_target(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    path = lines_file(tmp_path, {"messages": chat, "answer": "4"}, {"messages": chat[:2], "answer": "4"})
    cfg = DataConfig(answer_key="answer")
    first, second = read_rows([path], cfg, sft_key="sft_response")[:1] + read_rows([path], cfg)[1:]
    assert first.prompt == chat[:2] and first.sft_response == "4" and first.answer == "4"
    assert second.prompt == chat[:2] and "messages" not in second.extra
    (rl,) = read_rows([lines_file(tmp_path, {"messages": chat, "answer": "4"}, name="rl.jsonl")], cfg)
    assert rl.prompt == chat[:2] and rl.sft_response is None  # RL never sees the reference answer turn


@pytest.mark.claim("verl-math-rewards")
def test_a_system_prompt_goes_before_every_chat_without_one(tmp_path, tokenizer):
    cfg = DataConfig(system_prompt="Put the answer after ####.")
    rows = read_rows([lines_file(tmp_path, GOOD, CHAT)], cfg)
    (text, chat), _ = tokenize_rows(rows, tokenizer, cfg)
    assert tokenizer.decode(text.prompt_ids).startswith(
        "<|im_start|>system\nPut the answer after ####.<|im_end|>\n<|im_start|>user\n1+2="
    )
    assert tokenizer.decode(chat.prompt_ids).startswith("<|im_start|>system\nBe brief.")  # its own system turn


def test_tokenize_raw_text_without_the_template(tmp_path, tokenizer):
    cfg = DataConfig(apply_chat_template=False)
    rows = read_rows([lines_file(tmp_path, GOOD, CHAT)], cfg)
    (text,), skipped = tokenize_rows(rows, tokenizer, cfg)  # a chat cannot go in as raw text
    assert skipped == 1 and tokenizer.decode(text.prompt_ids) == "1+2="


def test_too_long_prompts_are_bad_rows(tmp_path, tokenizer, caplog):
    path = lines_file(tmp_path, GOOD, dict(GOOD, prompt="1+2=" * 40))
    cfg = DataConfig(max_prompt_length=32)
    report = DataReport()
    with caplog.at_level(logging.WARNING, logger="hybridflow.data"):
        kept, skipped = tokenize_rows(read_rows([path], cfg), tokenizer, cfg, report=report)
    assert len(kept) == 1 and skipped == 1 and report.too_long == [173]
    assert f"{path} line 2 (1-based)" in caplog.text and "data.max_prompt_length=32" in caplog.text
    fail = DataConfig(max_prompt_length=32, on_bad_row="fail")
    with pytest.raises(ValueError, match=r"line 2 \(1-based\).*more than data.max_prompt_length=32"):
        tokenize_rows(read_rows([path], fail), tokenizer, fail)


# --------------------------------------------------------------------------- sampler


def test_sampler_is_a_function_of_seed_and_step():
    original = PromptSampler(n_rows=10, batch_size=4, seed=3, shuffle=True)
    drawn = [original.batch(step) for step in range(8)]
    for step in (0, 5, 7, 2):  # a resumed run asks for any step first
        assert PromptSampler(10, 4, 3, True).batch(step) == drawn[step]
    assert PromptSampler(10, 4, seed=4).batch(0) != drawn[0]


def test_sampler_covers_every_row_once_per_epoch():
    sampler = PromptSampler(12, 4, seed=0)
    epochs = [sum((sampler.batch(3 * e + s) for s in range(3)), []) for e in range(3)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    assert [sampler.epoch(s) for s in (0, 2, 3, 8)] == [0, 0, 1, 2]


def test_sampler_batches_run_across_epochs_and_can_keep_order():
    sampler = PromptSampler(5, 3, seed=0, shuffle=False)
    assert [sampler.batch(s) for s in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]
    assert sorted(PromptSampler(5, 7, seed=1).batch(0)[:5]) == list(range(5))


@pytest.mark.parametrize("args, match", [((0, 1, 0), "n_rows=0"), ((3, 0, 0), "batch_size=0")])
def test_sampler_rejects_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        PromptSampler(*args)


# --------------------------------------------------------------------------- writers


def test_writers_replace_atomically_and_leave_nothing_on_failure(tmp_path):
    path = write_jsonl(tmp_path / "out" / "rows.jsonl", [GOOD])
    with pytest.raises(TypeError):
        write_jsonl(path, [GOOD, {"prompt": object()}])  # fails half-way through
    assert path.read_text() == json.dumps(GOOD) + "\n"  # the old file is intact
    assert os.listdir(path.parent) == ["rows.jsonl"]  # and no temporary is left


@pytest.mark.claim("chat-prompt-ending-in-assistant")
def test_a_chat_prompt_ending_with_an_assistant_turn_is_a_bad_row_but_a_messages_target_is_not(tmp_path):
    chat = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]
    path = lines_file(tmp_path, {"prompt": chat, "answer": "4"}, {"messages": chat, "answer": "4"})
    with pytest.raises(ValueError, match=r"line 1 \(1-based\): the chat prompt in 'prompt' ends with an assistant "):
        read_rows([path], DataConfig(answer_key="answer", on_bad_row="fail"))
    (row,) = read_rows([path], DataConfig(answer_key="answer"))  # the first skipped and counted
    assert row.prompt == chat[:1]  # a messages row's last assistant turn is its SFT target, not its prompt
