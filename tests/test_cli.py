"""`python -m cbcore generate`: input parsing, the output file, the summary line and exit codes.

Runs the real engine on a tiny random Llama saved to a temporary folder; prompts are token ids unless a test needs
a tokenizer, in which case a tiny byte-level tokenizer with a ChatML template is built offline.
"""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cbcore import cli

VOCAB = 272
EOS = 2
ENGINE = ["--page-size", "16", "--num-blocks", "64", "--no-progress"]
SUMMARY = re.compile(
    r"^summary: (\d+) requests, (\d+) prompt tokens, (\d+) generated tokens, "
    r"([\d.]+) s, ([\d.]+) generated tok/s, (\d+) failed$",
    re.MULTILINE,
)


def _save_tiny_llama(folder: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


def _save_tiny_tokenizer(folder: Path) -> None:
    """Byte-level BPE with no merges (one token per byte) plus three ChatML special tokens (ids 0-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with no tokenizer: prompts must be token ids."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    _save_tiny_llama(folder)
    return folder


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """The same tiny Llama with a byte-level tokenizer and a ChatML chat template."""
    folder = tmp_path_factory.mktemp("tiny_llama_chat")
    _save_tiny_llama(folder)
    _save_tiny_tokenizer(folder)
    return folder


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["generate", *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------------ input files


def test_jsonl_accepts_prompt_input_ids_and_messages_and_skips_blank_lines(tmp_path) -> None:
    path = write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"prompt": "hello"},
            "",
            {"input_ids": [5, 6, 7], "tag": "extra keys are ignored"},
            {"messages": [{"role": "user", "content": "hi"}]},
        ],
    )
    prompts = cli.read_jsonl(path)
    assert [(p.text, p.input_ids, p.messages) for p in prompts] == [
        ("hello", None, None),
        (None, [5, 6, 7], None),
        (None, None, [{"role": "user", "content": "hi"}]),
    ]
    assert prompts[1].source == f"{path}:3"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "unterminated', "not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        ('{"promt": "typo"}', 'needs exactly one of "prompt", "input_ids" or "messages" (found keys: promt)'),
        ('{"prompt": "a", "input_ids": [1]}', "needs exactly one of"),
        ('{"prompt": 42}', '"prompt" must be a string'),
        ('{"input_ids": [1, "2"]}', '"input_ids" must be a list of non-negative integers'),
        ('{"input_ids": [1, -3]}', '"input_ids" must be a list of non-negative integers'),
        ('{"input_ids": []}', '"input_ids" is empty'),
        ('{"messages": [{"role": "user"}]}', '"messages" must be a non-empty list'),
    ],
)
def test_bad_jsonl_line_is_a_usage_error_naming_file_and_line(tmp_path, model_dir, bad_line, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [5, 6]}, "", bad_line, {"input_ids": [7]}])
    code, out, err = run(["--model", str(model_dir), "--input", str(path), *ENGINE])
    assert code == cli.EXIT_USAGE
    assert f"error: {path}:3: " in err
    assert message in err
    assert out == ""


def test_missing_input_file_is_a_usage_error(tmp_path, model_dir) -> None:
    code, _, err = run(["--model", str(model_dir), "--input", str(tmp_path / "nope.jsonl")])
    assert code == cli.EXIT_USAGE
    assert "cannot read --input" in err and "nope.jsonl" in err


# ------------------------------------------------------------------------------------------- output, summary, exit


def test_output_file_has_one_line_per_request_in_input_order(tmp_path, model_dir) -> None:
    prompts = [[5, 6, 7, 8], [9] * 20, [10, 11]]
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": ids} for ids in prompts])
    output = tmp_path / "out.jsonl"
    code, _, _ = run(
        ["--model", str(model_dir), "--input", str(path), "--output", str(output), "--max-new-tokens", "6", *ENGINE]
    )
    assert code == cli.EXIT_OK
    records = read_output(output)
    assert [r["request_id"] for r in records] == ["req_0", "req_1", "req_2"]
    for record, ids in zip(records, prompts, strict=True):
        assert set(record) == {"request_id", "prompt", "input_tokens", "generated_tokens", "text", "status", "error"}
        assert record["prompt"] is None and record["text"] is None  # token-id prompts, model without tokenizer
        assert record["input_tokens"] == len(ids)
        assert 1 <= len(record["generated_tokens"]) <= 6
        assert all(0 <= t < VOCAB for t in record["generated_tokens"])
        assert record["status"] == "FINISHED" and record["error"] is None


def test_summary_line_counts_requests_and_tokens(tmp_path, model_dir) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    output = tmp_path / "out.jsonl"
    code, out, _ = run(["--model", str(model_dir), "--input", str(path), "--output", str(output), *ENGINE])
    assert code == cli.EXIT_OK
    match = SUMMARY.search(out)
    assert match, out
    requests, prompt_tokens, generated, wall, rate, failed = match.groups()
    records = read_output(output)
    assert (int(requests), int(prompt_tokens), int(failed)) == (2, 5, 0)
    assert int(generated) == sum(len(r["generated_tokens"]) for r in records)
    assert float(wall) > 0 and float(rate) > 0


def test_texts_are_printed_unless_quiet(tmp_path, model_dir) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6, 7]}])
    _, loud, _ = run(["--model", str(model_dir), "--input", str(path), "--max-new-tokens", "3", *ENGINE])
    _, quiet, _ = run(["--model", str(model_dir), "--input", str(path), "--max-new-tokens", "3", "--quiet", *ENGINE])
    assert "=== req_0 (3 prompt tokens" in loud
    assert SUMMARY.search(loud)
    assert quiet.splitlines() == [SUMMARY.search(quiet).group(0)]


def test_a_failed_request_fails_alone_and_makes_the_exit_status_nonzero(tmp_path, model_dir) -> None:
    out_of_vocabulary = VOCAB + 100
    path = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [5, 6]}, {"input_ids": [7, out_of_vocabulary]}])
    output = tmp_path / "out.jsonl"
    code, out, _ = run(["--model", str(model_dir), "--input", str(path), "--output", str(output), *ENGINE])
    assert code == cli.EXIT_FAILED_REQUESTS
    ok, bad = read_output(output)
    assert ok["status"] == "FINISHED" and ok["error"] is None
    assert bad["status"] == "FAILED" and bad["error"]
    assert SUMMARY.search(out).group(6) == "1"
    assert "error: " in out  # the failed request's error is printed in place of its text


def test_text_prompts_without_a_tokenizer_are_a_usage_error(model_dir) -> None:
    code, out, err = run(["--model", str(model_dir), "--prompt", "hello", *ENGINE])
    assert code == cli.EXIT_USAGE
    assert "no tokenizer" in err and "input_ids" in err
    assert out == ""


def test_bad_engine_settings_are_a_usage_error(model_dir) -> None:
    code, _, err = run(["--model", str(model_dir), "--page-size", "2", "--prompt", "x"])
    assert code == cli.EXIT_USAGE
    assert "page_size" in err


def test_missing_model_folder_is_a_usage_error(tmp_path) -> None:
    code, _, err = run(["--model", str(tmp_path / "no-such-model"), "--prompt", "x"])
    assert code == cli.EXIT_USAGE
    assert "cannot load the model" in err and "no such file or folder" in err


# ------------------------------------------------------------------------------------------------ chat templates


def test_chat_template_is_applied_to_text_prompts_by_default(tmp_path, chat_model_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    want_chat = len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    want_plain = len(tokenizer("hi")["input_ids"])
    assert want_chat > want_plain

    results = {}
    for flag in ([], ["--no-chat"]):
        output = tmp_path / f"out{len(flag)}.jsonl"
        argv = ["--model", str(chat_model_dir), "--prompt", "hi", "--output", str(output), "--max-new-tokens", "4"]
        code, out, _ = run([*argv, *flag, *ENGINE])
        assert code == cli.EXIT_OK
        (record,) = read_output(output)
        results[bool(flag)] = record
        assert record["prompt"] == "hi"
        assert isinstance(record["text"], str)
        assert ">>> hi" in out
    assert results[False]["input_tokens"] == want_chat
    assert results[True]["input_tokens"] == want_plain


def test_messages_lines_use_the_chat_template(tmp_path, chat_model_dir) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    path = write_jsonl(tmp_path / "in.jsonl", [{"messages": messages}])
    output = tmp_path / "out.jsonl"
    code, _, _ = run(["--model", str(chat_model_dir), "--input", str(path), "--output", str(output), *ENGINE])
    assert code == cli.EXIT_OK
    (record,) = read_output(output)
    assert record["messages"] == messages and record["prompt"] is None
    # "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n": the
    # five special tokens are one token each, every other character one byte-level token.
    assert record["input_tokens"] == 5 + len("system\nbe brief\nuser\nhello\nassistant\n")


def test_chat_flag_without_a_chat_template_is_a_usage_error(tmp_path, chat_model_dir) -> None:
    no_template = tmp_path / "no_template"
    _save_tiny_llama(no_template)
    _save_tiny_tokenizer(no_template)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    code, _, err = run(["--model", str(no_template), "--prompt", "hi", "--chat", *ENGINE])
    assert code == cli.EXIT_USAGE
    assert "no chat template" in err


# ------------------------------------------------------------------------------------------ generation settings


def _args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["generate", *argv])


def test_generation_config_copies_the_models_and_never_mutates_it(model_dir) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir)
    before = model.generation_config.to_dict()
    config = cli.build_generation_config(
        model, _args("--max-new-tokens", "7", "--do-sample", "--temperature", "0.5", "--top-k", "5", "--top-p", "0.9")
    )
    assert config is not model.generation_config
    assert config.eos_token_id == EOS and config.pad_token_id == EOS
    assert (config.max_new_tokens, config.do_sample, config.temperature, config.top_k, config.top_p) == (
        7,
        True,
        0.5,
        5,
        0.9,
    )
    assert model.generation_config.to_dict() == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "0.7"], "--temperature only affect sampling; add --do-sample"),
        (["--top-p", "0.9", "--top-k", "3"], "--top-p, --top-k only affect sampling"),
        (["--do-sample", "--temperature", "0"], "--temperature must be > 0"),
        (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ],
)
def test_bad_sampling_settings_are_rejected(model_dir, argv, message) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir)
    with pytest.raises(cli.UsageError, match=re.escape(message)):
        cli.build_generation_config(model, _args(*argv))


# ------------------------------------------------------------------------------------------------- command line


def test_no_command_prints_usage_and_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    assert "generate" in capsys.readouterr().err


def test_serve_is_offered_with_its_options(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    for option in ("--model", "--host", "--port", "--dtype", "--max-queue-size", "--api-key", "--page-size",
                   "--num-blocks", "--max-batch-tokens", "--scheduler", "--no-prefix-sharing", "--seed"):
        assert option in usage
