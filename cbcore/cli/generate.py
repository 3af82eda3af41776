"""`python -m cbcore generate`: prompts in, generated texts out through `model.generate_batch`, with a progress bar
and a one-line summary (and, with --output, one JSON line per request)."""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any, TextIO

from .options import (
    EXIT_FAILED_REQUESTS,
    EXIT_OK,
    UsageError,
    add_engine_arguments,
    add_model_arguments,
    build_cb_config,
    positive_int,
)
from .prompts import Prompt, collect_prompts, encode_prompts


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `generate` and its options under `commands`."""
    p = commands.add_parser(
        "generate",
        help="generate for a batch of prompts and print the texts and a summary",
        description="Generate for a batch of prompts with cbcore's continuous batching. With no --prompt and no "
        "--input, a built-in list of short chat prompts is used.",
    )
    add_model_arguments(p)
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    inp.add_argument(
        "--input",
        type=Path,
        help='a JSONL file; each line one of {"prompt": "text"}, {"input_ids": [1, 2, ...]}, '
        '{"messages": [{"role": "user", "content": "..."}]}',
    )
    inp.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to text prompts (default: on when the tokenizer has one)",
    )

    gen = p.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=positive_int, default=128)
    gen.add_argument(
        "--do-sample",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sample instead of greedy decoding (default: the model's generation config; greedy for most models)",
    )
    gen.add_argument("--temperature", type=float, help="sampling temperature (needs --do-sample)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling threshold (needs --do-sample)")
    gen.add_argument("--top-k", type=int, help="sample among the k most likely tokens (needs --do-sample)")
    gen.add_argument("--seed", type=int, help="random seed, for reproducible sampling")

    add_engine_arguments(p)

    out = p.add_argument_group("output")
    out.add_argument(
        "--output",
        type=Path,
        help="write one JSON line per request: request_id, prompt, input_tokens, generated_tokens, text, status, error",
    )
    out.add_argument("--quiet", action="store_true", help="do not print the generated texts (the summary still is)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_generate)


def build_generation_config(model: Any, args: argparse.Namespace):
    """A copy of the model's own generation config (EOS, pad, ...) with the command line's settings on top.

    The model's `generation_config` itself is never modified."""
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    given = [name for name, value in sampling.items() if value is not None]
    config = copy.deepcopy(model.generation_config)
    if args.do_sample is not None:
        config.do_sample = args.do_sample
    if given and not config.do_sample:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{flags} only affect sampling; add --do-sample (decoding is greedy otherwise)")
    if args.temperature is not None and args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature} (for greedy decoding, drop --do-sample)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 turns it off), got {args.top_k}")
    for name, value in sampling.items():
        if value is not None:
            setattr(config, name, value)
    config.max_new_tokens = args.max_new_tokens
    config.max_length = None  # max_new_tokens alone bounds the output
    try:
        config.validate()
    except (ValueError, TypeError) as error:
        raise UsageError(f"bad generation settings: {error}") from error
    return config


def run_generate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """`python -m cbcore generate`: serve the prompts, print texts and the summary; the exit status."""
    import torch
    from transformers.utils import logging as hf_logging

    import cbcore
    from cbcore.compiled_step import compile_seconds
    from cbcore.default_model import ModelLoadError, load_model_and_tokenizer
    from cbcore.distributed.launch import is_driver_process, tensor_parallel_load_kwargs, torchrun_world_size

    prompts = collect_prompts(args)  # before loading the model: a bad input file fails fast
    cb_config = build_cb_config(args)
    # Under torchrun every rank loads its shard and runs generate_batch; rank 0 (the driver) alone writes.
    driver = is_driver_process()
    output_file = _open_output(args.output) if driver else None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    hf_logging.disable_progress_bar()  # transformers' per-file loading bars; generate_batch's own bar stays
    started = time.perf_counter()
    try:
        sharding = tensor_parallel_load_kwargs(args.device) if torchrun_world_size() > 1 else None
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=device, sharding=sharding)
    except (ModelLoadError, OSError, ValueError) as error:
        raise UsageError(f"cannot load the model: {error}") from error
    name = args.model or "the default model (SmolLM2-135M-Instruct)"
    print(f"loaded {name} in {time.perf_counter() - started:.1f} s ({args.dtype}, {device})", file=stderr)

    inputs = encode_prompts(prompts, tokenizer, args.chat)
    gen_config = build_generation_config(model, args)
    if args.seed is not None:
        torch.manual_seed(args.seed)

    cbcore.enable(model)
    compiled_before = compile_seconds(model)
    started = time.perf_counter()
    try:
        outputs = model.generate_batch(
            inputs,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            progress_bar=driver and not args.no_progress,
        )
    except (ValueError, NotImplementedError) as error:  # a model or setting cbcore refuses (named in the error)
        raise UsageError(f"cannot serve this model: {error}") from error
    wall = time.perf_counter() - started
    if not driver:
        return EXIT_OK  # the driver prints the outputs (and fails for failed requests)
    compiled = compile_seconds(model) - compiled_before
    if compiled:  # paid once, before the first step (included in the wall time above)
        print(f"compiled the step ahead in {compiled:.1f} s (default_compile_level="
              f"{cb_config.default_compile_level})", file=stderr)

    pairs = enumerate(zip(prompts, inputs, strict=True))
    records = [_record(i, prompt, ids, outputs, tokenizer) for i, (prompt, ids) in pairs]
    if output_file is not None:
        with output_file:
            for record in records:
                output_file.write(json.dumps(record, ensure_ascii=False) + "\n")
    if not args.quiet:
        for record in records:
            _print_record(record, stdout)
    stdout.write(summary_line(records, wall) + "\n")
    stdout.flush()
    failed = sum(record["status"] != "FINISHED" for record in records)
    return EXIT_FAILED_REQUESTS if failed else EXIT_OK


def _open_output(path: Path | None) -> TextIO | None:
    # Opened before the model loads, so a bad path fails in a second rather than after the whole run.
    if path is None:
        return None
    try:
        return path.open("w", encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot write --output {path}: {error.strerror or error}") from error


def _record(index: int, prompt: Prompt, ids: list[int], outputs: dict, tokenizer: Any) -> dict[str, Any]:
    """The --output line for one request (also what is printed)."""
    request_id = f"req_{index}"  # generate_batch's ids, in input order
    output = outputs.get(request_id)
    record: dict[str, Any] = {"request_id": request_id, "prompt": prompt.text}
    if prompt.messages is not None:
        record["messages"] = prompt.messages
    record["input_tokens"] = len(ids)
    if output is None:
        # generate_batch returns only what ended; a missing id means the engine stopped before this request did.
        record.update(
            generated_tokens=[],
            text=None,
            status="FAILED",
            error="no result: the engine stopped before this request ended (see the log above)",
        )
        return record
    tokens = [int(t) for t in output.generated_tokens]
    text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    status = getattr(output.status, "name", str(output.status))
    error = output.error
    if status == "FINISHED" and error is not None:
        status = "FAILED"
    record.update(generated_tokens=tokens, text=text, status=status, error=error)
    return record


def _print_record(record: dict[str, Any], out: TextIO) -> None:
    header = (
        f"=== {record['request_id']} ({record['input_tokens']} prompt tokens, "
        f"{len(record['generated_tokens'])} generated, {record['status']}) ==="
    )
    print(header, file=out)
    if record["prompt"] is not None:
        print(f">>> {record['prompt']}", file=out)
    elif record.get("messages"):
        print(f">>> {record['messages'][-1]['content']}", file=out)
    if record["error"] is not None:
        print(f"error: {record['error']}", file=out)
    elif record["text"]:
        print(record["text"], file=out)
    elif record["text"] is not None:
        print("(empty text: only special tokens were generated)", file=out)
    else:
        print(record["generated_tokens"], file=out)
    print(file=out)


def summary_line(records: list[dict[str, Any]], wall: float) -> str:
    """`summary: 8 requests, 245 prompt tokens, 1024 generated tokens, 9.81 s, 104.4 generated tok/s, 0 failed`"""
    prompt_tokens = sum(r["input_tokens"] for r in records)
    generated = sum(len(r["generated_tokens"]) for r in records)
    failed = sum(r["status"] != "FINISHED" for r in records)
    rate = generated / wall if wall > 0 else 0.0
    return (
        f"summary: {len(records)} requests, {prompt_tokens} prompt tokens, {generated} generated tokens, "
        f"{wall:.2f} s, {rate:.1f} generated tok/s, {failed} failed"
    )
