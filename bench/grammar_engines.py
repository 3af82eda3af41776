"""xgrammar against llguidance on the default model's tokenizer (SmolLM2, 49,152 tokens): what cbcore's structured
output pays per engine for its three costs. Preparing the tokenizer (once per process), compiling a JSON schema
(once per distinct schema), and filling one request's token bitmask per generated token (every step, for every
constrained row), measured by walking the tokens of a document the schema accepts. Then applying a step's masks to
its logits (64 rows of 49,152 fp32 logits): xgrammar's CPU kernel against cbcore's (`_C.apply_token_bitmask`), on a
mask that allows few tokens (a grammar inside keys, enums or numbers) and on random words of allowed, disallowed and
mixed tokens.

    .venv/bin/python bench/grammar_engines.py [--repeat 3]

Engines are interleaved round by round; medians reported. Writes nothing: the table goes to stdout (committed as
bench/results/grammar_engines.md with the command).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "country": {"enum": ["FR", "DE", "US", "JP"]}},
            "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "country": "FR"}}


def xgrammar_costs(tokenizer, vocab_size: int, tokens: list[int]) -> dict[str, float]:
    """Seconds to prepare the tokenizer and compile SCHEMA, and the median and worst fill of one row's mask."""
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    prepared = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compiled_at = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    fills = []
    for token in tokens:
        began = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        fills.append(time.perf_counter() - began)
        assert matcher.accept_token(token), token
    return {"tokenizer": prepared - start, "compile": compiled_at - prepared, "fill": statistics.median(fills),
            "fill_max": max(fills)}


def llguidance_costs(tokenizer, vocab_size: int, tokens: list[int]) -> dict[str, float]:
    """As `xgrammar_costs`, with llguidance."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    prepared = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    compiled_at = time.perf_counter()
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    fills = []
    for token in tokens:
        began = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        fills.append(time.perf_counter() - began)
        assert matcher.consume_token(token), (token, matcher.get_error())
    return {"tokenizer": prepared - start, "compile": compiled_at - prepared, "fill": statistics.median(fills),
            "fill_max": max(fills)}


APPLY_ROWS = 64
APPLY_CALLS = 20  # per round and kernel: the median call is kept


def bitmasks(vocab_size: int) -> dict[str, torch.Tensor]:
    """The two masks of the apply comparison: few tokens allowed (three, in one word), and random words (a third of
    them all allowed, a third none, a third mixed)."""
    words = (vocab_size + 31) // 32
    few = torch.zeros(APPLY_ROWS, words, dtype=torch.int32)
    few[:, 5] = 7
    generator = torch.Generator().manual_seed(0)
    mixed = torch.randint(-2**31, 2**31 - 1, (APPLY_ROWS, words), dtype=torch.int32, generator=generator)
    kind = torch.randint(0, 3, (APPLY_ROWS, words), generator=generator)
    mixed[kind == 0] = -1
    mixed[kind == 1] = 0
    return {"few allowed": few, "random words": mixed}


def apply_seconds(kernel: str, bitmask: torch.Tensor, vocab_size: int) -> float:
    """The median seconds of one call applying `bitmask` to 64 rows of logits, by xgrammar's or cbcore's kernel."""
    import xgrammar

    from cbcore.grammar import apply_bitmask

    logits = torch.randn(APPLY_ROWS, vocab_size)
    rows = list(range(APPLY_ROWS))
    calls = []
    for _ in range(APPLY_CALLS):
        began = time.perf_counter()
        if kernel == "xgrammar":
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        else:
            apply_bitmask(logits, bitmask, rows)
        calls.append(time.perf_counter() - began)
    return statistics.median(calls)


def main() -> None:
    """Interleave the engines (and the kernels) round by round; print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from cbcore.default_model import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    vocab_size = model.config.vocab_size
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    engines = {"xgrammar": xgrammar_costs, "llguidance": llguidance_costs}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.repeat):
        for name, costs in engines.items():
            rounds[name].append(costs(tokenizer, vocab_size, tokens))
    print(f"default model's tokenizer ({vocab_size} tokens), a {len(tokens)}-token document, torch "
          f"{torch.__version__}, medians of {args.repeat} interleaved rounds\n")
    print("| engine | prepare tokenizer (ms) | compile schema (ms) | fill one row, median (us) | fill, worst (us) |")
    print("|---|---|---|---|---|")
    for name, runs in rounds.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"| {name} | {median['tokenizer'] * 1e3:.0f} | {median['compile'] * 1e3:.1f} | "
              f"{median['fill'] * 1e6:.0f} | {median['fill_max'] * 1e6:.0f} |")
    masks = bitmasks(vocab_size)
    applied: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeat):
        for mask_name, bitmask in masks.items():
            for kernel in ("xgrammar", "cbcore"):
                applied.setdefault((mask_name, kernel), []).append(apply_seconds(kernel, bitmask, vocab_size))
    print(f"\napplying a step's masks: {APPLY_ROWS} rows of {vocab_size} fp32 logits, median call of {APPLY_CALLS} "
          f"per round, medians of {args.repeat} interleaved rounds\n")
    print("| mask | xgrammar's CPU kernel (ms) | cbcore's (ms) | xgrammar / cbcore |")
    print("|---|---|---|---|")
    for mask_name in masks:
        theirs = statistics.median(applied[(mask_name, "xgrammar")])
        ours = statistics.median(applied[(mask_name, "cbcore")])
        print(f"| {mask_name} | {theirs * 1e3:.2f} | {ours * 1e3:.2f} | {theirs / ours:.1f} |")


if __name__ == "__main__":
    main()
