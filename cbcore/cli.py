"""`python -m cbcore <command>`: cbcore's command line.

Commands:
    generate   prompts in (text, chat messages or token ids; JSONL), generated texts out, with a progress bar and a
               one-line summary. With no --model it uses the default model (see `cbcore.default_model`).

    bench      the side-by-side benchmark (`cbcore.benchmarks.side_by_side`, in the package, so it runs from an installed
               wheel too): one workload through cbcore, transformers' generate_batch, padded model.generate and
               vLLM-CPU; `python -m cbcore bench --help`.

    serve      an OpenAI-compatible HTTP server over one manager (`cbcore.serving.server`, needs the `serve` extra:
               fastapi, uvicorn, prometheus_client); `python -m cbcore serve --help`.

Exit status: 0 when every request finished; 1 when any request failed (or the engine stopped early);
2 for a bad command line, a bad input file or a model that cannot be loaded.

    python -m cbcore generate --prompt "What is 2+2?" --max-new-tokens 32
    python -m cbcore generate --input prompts.jsonl --output results.jsonl --quiet
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

# Short, varied chat prompts for a run with no prompts given: arithmetic, facts, code, lists, rewriting, a story.
DEFAULT_PROMPTS = (
    "What is 2+2?",
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for getting better sleep.",
    "Explain in one paragraph what a hash table is.",
    "Translate 'Good morning, how are you?' into Spanish.",
    "Write a haiku about the sea.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
)

EXIT_OK, EXIT_FAILED_REQUESTS, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line, input file or model: printed as `error: ...`, exit status 2."""


@dataclass
class Prompt:
    """One request as the user gave it: exactly one of `text`, `messages` or `input_ids` is set."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    source: str = "--prompt"  # where it came from, for error messages ("prompts.jsonl:3")


# ---------------------------------------------------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    """The `python -m cbcore` parser with its commands (generate, bench, serve)."""
    parser = argparse.ArgumentParser(prog="python -m cbcore", description="cbcore: continuous batching for HF models.")
    commands = parser.add_subparsers(dest="command", title="commands")
    commands.required = True
    generate = commands.add_parser(
        "generate",
        help="generate for a batch of prompts and print the texts and a summary",
        description="Generate for a batch of prompts with cbcore's continuous batching. With no --prompt and no "
        "--input, a built-in list of short chat prompts is used.",
    )
    _add_generate_arguments(generate)
    generate.set_defaults(handler=run_generate)
    bench = commands.add_parser(
        "bench",
        add_help=False,  # --help goes to the benchmark's own parser
        help="compare cbcore with transformers, model.generate and vLLM on one workload",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=run_bench)
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible HTTP server (FastAPI + uvicorn) over one continuous-batching manager: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    _add_serve_arguments(serve)
    serve.set_defaults(handler=run_serve)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model")
    src.add_argument(
        "--model",
        default=None,
        help="a local model folder, a .gguf file, or a hub id already in the local HF cache "
        "(default: the default model, SmolLM2-135M-Instruct)",
    )
    src.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    src.add_argument("--device", default=None, help="where to run (default: cuda if available, else cpu)")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    eng = p.add_argument_group("engine (cbcore.ContinuousBatchingConfig; default: the engine's own)")
    eng.add_argument("--page-size", type=int, help="tokens per page of the paged KV cache")
    eng.add_argument("--num-blocks", type=int, help="pages in the KV cache (default: sized from free memory)")
    eng.add_argument("--max-batch-tokens", type=int, help="query-token budget of one step")
    eng.add_argument("--scheduler", choices=("fifo", "prefill_first"), help="scheduling policy (default: fifo)")
    eng.add_argument("--no-prefix-sharing", action="store_true", help="turn off prefix caching (block sharing)")


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
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
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128)
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

    _add_engine_arguments(p)

    out = p.add_argument_group("output")
    out.add_argument(
        "--output",
        type=Path,
        help="write one JSON line per request: request_id, prompt, input_tokens, generated_tokens, text, status, error",
    )
    out.add_argument("--quiet", action="store_true", help="do not print the generated texts (the summary still is)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_jsonl(path: Path) -> list[Prompt]:
    """Parse an input file; a bad line raises UsageError naming the file and line number."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise UsageError(f"cannot read --input {path}: {error.strerror or error}") from error
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from error
        prompts.append(_prompt_from_record(record, where))
    if not prompts:
        raise UsageError(f"--input {path} holds no prompts")
    return prompts


def _prompt_from_record(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
    keys = [k for k in ("prompt", "input_ids", "messages") if k in record]
    if len(keys) != 1:
        found = ", ".join(sorted(record)) or "none"
        raise UsageError(f'{where}: needs exactly one of "prompt", "input_ids" or "messages" (found keys: {found})')
    value = record[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise UsageError(f'{where}: "prompt" must be a string, got {type(value).__name__}')
        return Prompt(text=value, source=where)
    if keys[0] == "input_ids":
        ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        if not ok:
            raise UsageError(f'{where}: "input_ids" must be a list of non-negative integers')
        if not value:
            raise UsageError(f'{where}: "input_ids" is empty')
        return Prompt(input_ids=value, source=where)
    if not (isinstance(value, list) and value and all(_is_message(m) for m in value)):
        raise UsageError(f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}} objects')
    return Prompt(messages=value, source=where)


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def collect_prompts(args: argparse.Namespace) -> list[Prompt]:
    """--prompt texts first, then --input lines; the built-in prompts when neither is given."""
    prompts = [Prompt(text=text, source=f"--prompt #{i + 1}") for i, text in enumerate(args.prompt)]
    if args.input is not None:
        prompts += read_jsonl(args.input)
    if not prompts:
        prompts = [Prompt(text=text, source="built-in prompt") for text in DEFAULT_PROMPTS]
    return prompts


# ------------------------------------------------------------------------------------------------ model-side set-up


def encode_prompts(prompts: list[Prompt], tokenizer: Any, chat: bool | None) -> list[list[int]]:
    """Token ids for every prompt. Chat-templated text carries its own special tokens, so it is encoded without
    adding more (no second BOS); plain text gets the tokenizer's usual special tokens."""
    has_template = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise UsageError("--chat was given but the tokenizer has no chat template; drop --chat")
    use_chat = has_template if chat is None else chat
    encoded = []
    for prompt in prompts:
        if prompt.input_ids is not None:
            encoded.append(list(prompt.input_ids))
            continue
        if tokenizer is None:
            raise UsageError(
                f"{prompt.source}: the model has no tokenizer, so prompts must be given as token ids "
                '(--input with {"input_ids": [...]} lines)'
            )
        if prompt.messages is not None and not has_template:
            raise UsageError(f'{prompt.source}: "messages" need a chat template, and the tokenizer has none')
        if prompt.messages is not None or use_chat:
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt.text)["input_ids"]
        if not ids:
            raise UsageError(f"{prompt.source}: the prompt encodes to no tokens")
        encoded.append(list(ids))
    return encoded


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


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    srv = p.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send and /v1/models lists (default: --model, or the default model's)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    srv.add_argument("--max-queue-size", type=int, default=1024,
                     help="requests (choices) waiting for their first token before new ones are answered 429 "
                     "(0: unbounded; default 1024)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGINT/SIGTERM waits for requests in flight before cancelling them (default 30)")
    srv.add_argument("--seed", type=int, help="seed of the engine's one sampling generator (server-wide)")
    srv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    _add_engine_arguments(p)


def build_cb_config(args: argparse.Namespace, **overrides: Any):
    """cbcore.ContinuousBatchingConfig with only the fields given on the command line (and `overrides`); the rest
    keep their default."""
    import cbcore

    fields = {
        "page_size": args.page_size,
        "num_blocks": args.num_blocks,
        "max_batch_tokens": args.max_batch_tokens,
        "scheduler_type": args.scheduler,
        "seed": args.seed,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if args.no_prefix_sharing:
        fields["allow_block_sharing"] = False
    fields.update(overrides)
    try:
        return cbcore.ContinuousBatchingConfig(**fields)
    except ValueError as error:
        raise UsageError(f"bad engine settings: {error}") from error


# -------------------------------------------------------------------------------------------------------- generate


def run_generate(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """`python -m cbcore generate`: serve the prompts, print texts and the summary; the exit status."""
    import torch
    from transformers.utils import logging as hf_logging

    import cbcore
    from cbcore.default_model import ModelLoadError, load_model_and_tokenizer

    prompts = collect_prompts(args)  # before loading the model: a bad input file fails fast
    cb_config = build_cb_config(args)
    output_file = _open_output(args.output)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    hf_logging.disable_progress_bar()  # transformers' per-file loading bars; generate_batch's own bar stays
    started = time.perf_counter()
    try:
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=args.dtype, device=device)
    except (ModelLoadError, OSError, ValueError) as error:
        raise UsageError(f"cannot load the model: {error}") from error
    name = args.model or "the default model (SmolLM2-135M-Instruct)"
    print(f"loaded {name} in {time.perf_counter() - started:.1f} s ({args.dtype}, {device})", file=stderr)

    inputs = encode_prompts(prompts, tokenizer, args.chat)
    gen_config = build_generation_config(model, args)
    if args.seed is not None:
        torch.manual_seed(args.seed)

    cbcore.enable(model)
    started = time.perf_counter()
    outputs = model.generate_batch(
        inputs,
        generation_config=gen_config,
        continuous_batching_config=cb_config,
        progress_bar=not args.no_progress,
    )
    wall = time.perf_counter() - started

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


def run_bench(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Hand the arguments to `cbcore.benchmarks.side_by_side.main` (imported only now: it pulls in psutil and the
    peers' machinery, which `generate` does not need)."""
    from cbcore.benchmarks import side_by_side

    return side_by_side.main(args.bench_args)


def run_serve(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    """Hand the arguments to `cbcore.serving.server.launch` (imported only now: it needs the `serve` extra)."""
    try:
        from cbcore.serving.server import launch
    except ImportError as error:
        raise UsageError(f"serve needs fastapi, uvicorn and prometheus_client ({error}); install them with "
                         "`pip install fastapi uvicorn prometheus_client` (or the `serve` extra)") from error
    return launch.serve(args, stderr)


def main(argv: list[str] | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run the command line; returns the exit status (argparse itself exits with 2 on a malformed command line)."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER drops leading options such as --help, so the benchmark's arguments skip this parser.
        args = argparse.Namespace(handler=run_bench, bench_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.handler(args, stdout, stderr)
    except UsageError as error:
        print(f"error: {error}", file=stderr)
        return EXIT_USAGE
