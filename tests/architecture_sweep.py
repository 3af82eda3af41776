"""The architecture sweep: every decoder architecture of the installed transformers (5.24 or 5.25), served by cbcore,
against `model.generate`.

For every model type in `MODEL_FOR_CAUSAL_LM_MAPPING` a tiny seeded model is built from a shrunk copy of its default
config, a few prompts of different lengths are served through cbcore (small pages, a small step budget so that long
prompts are chunked) and through `model.generate` one prompt at a time (greedy, fp32, the model's own attention),
and the model is classified:

    SAME     identical greedy tokens for every prompt, and each token's logprob within 1e-5 of generate's
    REFUSED  cbcore raised NotImplementedError/ValueError naming the model class before serving anything
    WRONG    cbcore finished, with different tokens (the one outcome that must never happen)
    CRASH    any other failure inside cbcore (an exception, a FAILED request)
    SKIP     the tiny model cannot be built, or `model.generate` itself fails on it (the reason says which)

Run it as a script to write the table:

    python tests/architecture_sweep.py --out docs/architecture_sweep.md [--jobs 2] [--only llama gpt2 ...]
    PYTHONPATH=.venv/alt/transformers-5.25.0 python tests/architecture_sweep.py --out docs/architecture_sweep_5.25.md

`tests/test_architecture_sweep.py` asserts that no model is WRONG or CRASH.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import torch

# Runnable as a script from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SAME, REFUSED, WRONG, CRASH, SKIP = "SAME", "REFUSED", "WRONG", "CRASH", "SKIP"
RESULTS = (SAME, REFUSED, WRONG, CRASH, SKIP)

VOCAB = 128
MAX_NEW_TOKENS = 8
# One token, a short prompt inside one page, and one long enough to be chunked (budget 16) and to pass the window.
PROMPT_LENGTHS = (1, 11, 29)
PAGE_SIZE = 4
MAX_BATCH_TOKENS = 16
SLIDING_WINDOW = 8
# Random init gives near-uniform attention, which hides masking, position and window bugs; sharpen it.
QK_SCALE = 6.0
SEED = 1234
# Largest difference allowed between cbcore's and generate's log-probability of each generated token (fp32).
LOGPROB_TOLERANCE = 1e-5

# Config attribute -> the tiny value (None: leave it). Applied to the config and every sub-config.
_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim", "hidden_dim", "d_embed")
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
           "encoder_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "num_heads", "attention_heads",
          "encoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_key_value_groups")
_FFN = ("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "ffn_hidden_size", "d_ff", "d_inner",
        "encoder_ffn_dim")
_SMALL_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
              "moe_shared_expert_intermediate_size", "mlp_hidden_size")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k", "num_selected_experts")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id", "unk_token_id", "image_token_id", "image_token_index",
              "boi_token_id", "eoi_token_id", "video_token_id", "audio_token_id")


def _tiny_value(key: str, value, config_dict: dict):
    """The tiny replacement for one config field, or `value` unchanged."""
    if value is None and key in ("head_dim", "num_key_value_heads", "moe_intermediate_size"):
        # Unset in some default configs and read as-is by their attention/MoE modules (Ministral, Nemotron, ...).
        return {"head_dim": 16, "num_key_value_heads": 4, "moe_intermediate_size": 32}[key]
    if value is None and key in ("n_shared_experts", "num_shared_experts"):
        return 1  # Dots1 multiplies by it
    if value is None and (key in _EXPERTS or key in _TOP_K):
        return 4 if key in _EXPERTS else 2  # Dots1's default config leaves its MoE unset
    if key == "is_decoder":
        return True  # a causal LM class built from an encoder config (Reformer, BERT-likes) wants the decoder
    if isinstance(value, bool) or not isinstance(value, (int, float)) and key not in _TOKEN_IDS:
        return value
    if key in _HIDDEN:
        return 64
    if key in _LAYERS:
        return min(value, 2)
    if key in _HEADS:
        return min(value, 4)
    if key in _KV_HEADS:
        heads = next((config_dict[h] for h in _HEADS if isinstance(config_dict.get(h), int)), None)
        if value == 1:
            return 1
        return 4 if heads is not None and value >= heads else 2
    if key == "head_dim" or key == "attention_head_dim":
        return 16
    if key in _FFN:
        return 128
    if key in _SMALL_FFN:
        return 32
    if key in _EXPERTS:
        return min(value, 4)
    if key in _TOP_K:
        return min(value, 2)
    if key in ("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        return min(value, 1)
    if key in ("vocab_size", "vocab_size_per_layer_input"):
        return VOCAB
    if key == "hidden_size_per_layer_input":
        return 16 if value else value
    if key in _POSITIONS:
        return 512
    if key == "sliding_window" or key == "attention_window_size":
        return SLIDING_WINDOW
    if key == "kv_lora_rank":
        return 16
    if key == "q_lora_rank":
        return 24
    if key in ("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim", "rotary_emb_dim"):
        return 8
    if key == "v_head_dim":
        return 16
    if key in ("first_k_dense_replace", "num_dense_layers"):
        return min(value, 1)
    if key in _TOKEN_IDS:
        return _tiny_token_id(value)
    return value


def _tiny_token_id(value):
    if isinstance(value, list):
        return [_tiny_token_id(v) for v in value]
    if isinstance(value, int) and value >= VOCAB - 8:
        return VOCAB - 1 - (value % 7)  # keep distinct ids distinct-ish, inside the tiny vocabulary
    return value


def _shrink(config) -> dict:
    """Overrides (field -> tiny value) for one config object; sub-configs become dicts of their own overrides.

    Per-layer lists (layer_types, mlp_layer_types, per-layer head counts, hybrid patterns) keep the entries of the
    layers kept: the first layer of each of the first two kinds in `layer_types` (sliding + full, linear + full
    attention), else the first two layers."""
    values = config.to_dict()
    overrides = {}
    for key, value in values.items():
        try:
            sub = getattr(config, key, None)
        except Exception:  # noqa: BLE001 - a per-layer field read globally (Gemma-4) is no sub-config
            sub = None
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
            shrunk = _shrink(sub)
            if shrunk:  # an empty dict would rebuild the sub-config from its class defaults (DBRX's lose rope_theta)
                overrides[key] = shrunk
            continue
        tiny = _tiny_value(key, value, values)
        if tiny is not value and tiny != value:
            overrides[key] = tiny
    if "qk_rope_head_dim" in values and "head_dim" in values:
        overrides["head_dim"] = overrides.get("qk_rope_head_dim", values["qk_rope_head_dim"])  # MLA: the rope part
    layer_counts = [values[k] for k in _LAYERS if isinstance(values.get(k), int) and not isinstance(values[k], bool)]
    num_layers = layer_counts[0] if layer_counts else None
    if num_layers and num_layers > 2:
        keep = [0, 1]
        layer_types = values.get("layer_types")
        if isinstance(layer_types, list) and len(layer_types) == num_layers:
            first = sorted({layer_types.index(kind) for kind in dict.fromkeys(layer_types)})
            keep = (first[:2] + [i for i in range(num_layers) if i not in first])[:2]
            keep.sort()
        for key, value in values.items():
            if key in overrides:
                continue
            if isinstance(value, list) and len(value) == num_layers:
                overrides[key] = [value[i] for i in keep]
            elif isinstance(value, str) and len(value) == num_layers and key.endswith("pattern"):
                overrides[key] = "".join(value[i] for i in keep)
        per_layer = values.get("per_layer_config")
        if isinstance(per_layer, dict) and per_layer:
            # Heterogeneous configs (Gemma-4): {layer index: fields that differ}; keep the kept layers' entries, their
            # sizes scaled like the global ones so that the layers still differ.
            shrunk_layers = {}
            for new_index, old_index in enumerate(keep):
                entry = next((v for k, v in per_layer.items() if k.isdigit() and int(k) == old_index), None)
                if entry:
                    shrunk_layers[str(new_index)] = {
                        k: _scaled(v, values.get(k), overrides.get(k)) for k, v in entry.items()
                    }
            overrides["per_layer_config"] = shrunk_layers
    for key in ("tie_word_embeddings", "tie_word_embedding"):
        if key in values:
            overrides[key] = False
    return overrides


def _scaled(value, global_value, tiny_global):
    """A per-layer size scaled as its global value was (512 where the global is 256 -> twice the tiny global)."""
    if isinstance(value, int) and isinstance(global_value, int) and isinstance(tiny_global, int) and global_value:
        return max(1, value * tiny_global // global_value)
    return value


# Hybrids whose shrunk default config would keep only their stateful layers (or only their attention layers): the
# layout that gives the 2-layer model one of each (layer 0 stateful, layer 1 attention), and configs whose defaults
# do not shrink consistently. The stateful layers are what these types are in the sweep for.
STATE_LAYOUTS: dict[str, dict] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "zamba": {"layers_block_type": ["mamba", "hybrid"]},
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "bailing_hybrid": {"n_group": 1, "topk_group": 1},
}


def tiny_config(model_type: str):
    """The default config of `model_type`, shrunk to a 2-layer, 64-wide, 128-token-vocabulary model (a hybrid's
    with one stateful and one attention layer, `STATE_LAYOUTS`)."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class(**{**_shrink(config_class()), **STATE_LAYOUTS.get(model_type, {})})
    for target in (config, config.get_text_config()):
        if hasattr(target, "tie_word_embeddings"):
            target.tie_word_embeddings = False
    return config


def build_model(model_type: str) -> torch.nn.Module:
    """The tiny seeded fp32 model of `model_type`, eval mode, query/key projections sharpened, embeddings untied."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = tiny_config(model_type)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    expected = getattr(model_class, "config_class", None)
    if expected is not None and not isinstance(config, expected):
        config = config.get_text_config()  # a text-only class registered for a composite config (Qwen3.5, Emu3)
    torch.manual_seed(SEED)
    model = model_class(config).eval().float()
    _sharpen_attention(model)
    model.generation_config.pad_token_id = 0
    return model


_QK_NAMES = {"q_proj", "k_proj", "query", "key", "q", "k", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
             "qkv_proj", "c_attn", "query_key_value", "Wqkv", "W_pack", "qkv", "in_proj", "q_lin", "k_lin", "wq", "wk",
             "wqkv", "query_proj", "key_proj", "k_proj_weight", "q_layer", "k_layer"}


@torch.no_grad()
def _sharpen_attention(model: torch.nn.Module) -> None:
    """Scale the query and key projections (fused ones too) so that attention is far from uniform."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in _QK_NAMES:
            module.weight.mul_(QK_SCALE**0.5)


def prompts() -> list[list[int]]:
    """Seeded prompts of `PROMPT_LENGTHS` tokens, ids in [3, VOCAB - 8) (clear of the shrunk special tokens)."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB - 8, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def greedy_config():
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                            bos_token_id=None)


@dataclasses.dataclass
class SweepResult:
    """One row of the table."""

    model_type: str
    model_class: str
    result: str
    reason: str = ""
    seconds: float = 0.0


def _short(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reference(model, prompt_list) -> list[tuple[list[int], list[float]]]:
    """`model.generate` on each prompt alone (greedy, fp32, the model's own attention): tokens and their logprobs."""
    config = greedy_config()
    outputs = []
    with torch.no_grad():
        for prompt in prompt_list:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                 output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [float(torch.log_softmax(score[0].float(), -1)[token])
                        for score, token in zip(out.scores, tokens)]
            outputs.append((tokens, logprobs))
    return outputs


# `--compile`: serve through the compiled step (cbcore/compiled_step.py) with fullgraph=True, so a graph break raises,
# and count as a failure any graph compiled after warm-up. Handed to spawned workers through the environment.
COMPILE_ENV = "CBCORE_SWEEP_COMPILE"


class _Recompiled(RuntimeError):
    pass


def serve(model, prompt_list, timeout: float = 120.0) -> list:
    """Serve the prompts through a cbcore manager; the terminal outputs in prompt order."""
    import cbcore

    compiled = os.environ.get(COMPILE_ENV) == "1"
    extra = {}
    if compiled:
        from transformers.generation.configuration_utils import CompileConfig

        step = CompileConfig(mode="default", fullgraph=True, dynamic=True)
        extra = {"varlen_compile_config": step, "decode_compile_config": step}
    config = cbcore.ContinuousBatchingConfig(page_size=PAGE_SIZE, max_batch_tokens=MAX_BATCH_TOKENS, num_blocks=64,
                                             return_logprobs=True, **extra)
    manager = cbcore.ContinuousBatchingManager(model, greedy_config(), config)
    if compiled:
        import torch._dynamo.utils

        manager.warmup()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    manager.start()
    try:
        request_ids = manager.add_requests(prompt_list)
        finals = {}
        deadline = time.monotonic() + timeout
        while len(finals) < len(request_ids) and time.monotonic() < deadline:
            output = manager.get_result(timeout=1)
            if output is None:
                if not manager.is_running():
                    break
                continue
            if output.is_finished():
                finals[output.request_id] = output
    finally:
        manager.stop(block=True, timeout=60)
    missing = [rid for rid in request_ids if rid not in finals]
    if missing:
        raise RuntimeError(f"no terminal output for {missing}")
    if compiled:
        new = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        if new:
            raise _Recompiled(f"{new} graph(s) compiled after warm-up, while serving")
    return [finals[rid] for rid in request_ids]


MODEL_TIMEOUT_S = 180


class _ModelTimeout(BaseException):  # not caught by the per-stage `except Exception`
    pass


def _on_alarm(signum, frame):
    raise _ModelTimeout(f"took longer than {MODEL_TIMEOUT_S} s")


def run_one(model_type: str) -> SweepResult:
    """Build, reference, serve and classify one model type (CRASH if it takes over `MODEL_TIMEOUT_S`)."""
    import signal

    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(MODEL_TIMEOUT_S)
    try:
        return _run_one(model_type)
    except _ModelTimeout as error:
        return SweepResult(model_type, "?", CRASH, f"timed out: {error}", MODEL_TIMEOUT_S)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _run_one(model_type: str) -> SweepResult:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    started = time.perf_counter()
    _worker_init()
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?")

    def done(result: str, reason: str = "") -> SweepResult:
        return SweepResult(model_type, class_name, result, reason, time.perf_counter() - started)

    try:
        model = build_model(model_type)
        class_name = type(model).__name__
    except Exception as error:  # noqa: BLE001 - any failure to build is a SKIP with its reason
        return done(SKIP, f"tiny config not buildable: {_short(error)}")
    prompt_list = prompts()
    # cbcore first: a model it refuses is REFUSED even where `model.generate` itself cannot run the tiny model.
    try:
        outputs = serve(model, prompt_list)
    except (NotImplementedError, ValueError) as error:
        if class_name in str(error):
            return done(REFUSED, _refusal_reason(error, class_name))
        return done(CRASH, f"refused without naming {class_name}: {_short(error)}")
    except Exception as error:  # noqa: BLE001
        return done(CRASH, _short(error) + " @ " + _where(error))
    try:
        want = reference(model, prompt_list)
    except Exception as error:  # noqa: BLE001
        return done(SKIP, f"model.generate fails: {_short(error)}")
    for output, prompt, expected in zip(outputs, prompt_list, want):
        if output.error is not None or output.status.name != "FINISHED":
            return done(CRASH, f"{len(prompt)}-token prompt {output.status.name}: {output.error}"[:400])
    diffs = [(len(p), o.generated_tokens, w) for o, p, (w, _) in zip(outputs, prompt_list, want)
             if o.generated_tokens != w]
    if diffs:
        n, got, expected = diffs[0]
        return done(WRONG, f"{len(diffs)}/{len(prompt_list)} prompts differ; {n}-token prompt: cbcore {got} vs "
                           f"generate {expected}")
    # Same tokens can hide different numbers (a tiny random model's argmax can ignore attention): logprobs too.
    worst = max(abs(a - b) for o, (_, ref) in zip(outputs, want) for a, b in zip(o.logprobs, ref))
    if worst > LOGPROB_TOLERANCE:
        return done(WRONG, f"same tokens, but logprobs differ from generate's by up to {worst:.2g} "
                           f"(tolerance {LOGPROB_TOLERANCE:g})")
    return done(SAME, f"logprobs within {worst:.1g}" if worst else "")


def _refusal_reason(error: BaseException, class_name: str) -> str:
    """The reason part of a refusal, without the boilerplate around it."""
    text = str(error)
    text = text.split(f"cbcore cannot serve {class_name} exactly: ", 1)[-1]
    text = text.split(". cbcore refuses it rather than", 1)[0]
    return f"{type(error).__name__}: {text}".replace("\n", " ").replace("|", "/")[:500]


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    frame = frames[-1] if frames else None
    return f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"


def _worker_init() -> None:
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("cbcore").setLevel(logging.CRITICAL)
    logging.getLogger("transformers").setLevel(logging.ERROR)


def all_model_types() -> list[str]:
    """Every model type with a causal-LM class in transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(model_types: list[str], jobs: int = 1, progress: bool = False) -> list[SweepResult]:
    """Run `run_one` over `model_types` (in `jobs` <= 2 spawned processes of one thread each, or in this process)."""
    results: list[SweepResult] = []
    if jobs <= 1:
        for model_type in model_types:
            results.append(run_one(model_type))
            if progress:
                _print_progress(results[-1], len(results), len(model_types))
        return results
    import multiprocessing

    # A fresh worker every few models: some architectures leave large modules or threads behind.
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(jobs, 2), initializer=_worker_init, maxtasksperchild=20) as pool:
        for result in pool.imap_unordered(run_one, model_types):
            results.append(result)
            if progress:
                _print_progress(result, len(results), len(model_types))
    return sorted(results, key=lambda r: r.model_type)


def _print_progress(result: SweepResult, done: int, total: int) -> None:
    print(f"[{done}/{total}] {result.model_type:28s} {result.result:8s} {result.seconds:5.1f}s {result.reason[:150]}",
          flush=True)


def counts(results: list[SweepResult]) -> dict[str, int]:
    """How many models got each result."""
    return {name: sum(r.result == name for r in results) for name in RESULTS}


def write_table(results: list[SweepResult], path: Path, seconds: float, jobs: int, compiled: bool = False) -> None:
    """The committed markdown table."""
    import transformers

    tally = counts(results)
    title = "# Architecture sweep, compiled step" if compiled else "# Architecture sweep"
    compiled_note = (
        "Served through the compiled step: `varlen_compile_config` and `decode_compile_config` both "
        "`CompileConfig(mode='default', fullgraph=True, dynamic=True)`, compiled in `warmup()`; a graph break raises "
        "(fullgraph) and any graph compiled after warm-up counts as a CRASH.") if compiled else ""
    lines = [
        title,
        "",
        *([compiled_note, ""] if compiled else []),
        f"Every model type in transformers {transformers.__version__}'s `MODEL_FOR_CAUSAL_LM_MAPPING` "
        f"({len(results)}), as a tiny seeded fp32 model (2 layers, hidden 64, vocabulary {VOCAB}, sliding windows "
        f"{SLIDING_WINDOW}, query/key projections scaled so attention is sharp, embeddings untied), prompts of "
        f"{', '.join(map(str, PROMPT_LENGTHS))} tokens, {MAX_NEW_TOKENS} greedy tokens, served by cbcore "
        f"(page_size={PAGE_SIZE}, max_batch_tokens={MAX_BATCH_TOKENS}: the longest prompt is chunked) and compared "
        "token for token with `model.generate` on each prompt alone (the model's own attention implementation), and "
        f"each generated token's log-probability within {LOGPROB_TOLERANCE:g} of generate's.",
        "",
        "SAME: identical tokens and log-probabilities. REFUSED: cbcore raised a clear error naming the model before "
        "serving anything. WRONG: different tokens or log-probabilities (must never happen). CRASH: any other failure (must never happen). SKIP: the tiny "
        "model cannot be built or `model.generate` itself fails on it.",
        "",
        f"Counts: {', '.join(f'{k} {v}' for k, v in tally.items())}. Run time {seconds / 60:.1f} min with "
        f"{jobs} process(es) of one thread each on {os.cpu_count()} CPU cores.",
        "",
        f"Reproduce: `{_reproduce_command(path, compiled)}`",
        "",
        "| model type | class | result | reason |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.model_type} | {r.model_class} | {r.result} | {r.reason} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _reproduce_command(path: Path, compiled: bool) -> str:
    """The command that writes this table again: on the overlay of the other supported transformers release when it
    is the one imported (scripts/transformers_versions.sh)."""
    import transformers

    overlay = Path(transformers.__file__).parent.parent
    prefix = f"PYTHONPATH=.venv/alt/{overlay.name} " if overlay.name.startswith("transformers-") else ""
    flag = "--compile " if compiled else ""
    out = path.as_posix() if not path.is_absolute() else f"docs/{path.name}"
    return f"{prefix}python tests/architecture_sweep.py {flag}--out {out} --jobs 2"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--jobs", type=int, default=1, help="processes (at most 2; each runs one torch thread)")
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--compile", action="store_true",
                        help="serve through the compiled step (fullgraph=True: a graph break fails the model; so does "
                        "a graph compiled after warm-up)")
    args = parser.parse_args(argv)
    if args.compile:
        os.environ[COMPILE_ENV] = "1"
    _worker_init()
    model_types = args.only or all_model_types()
    started = time.perf_counter()
    results = sweep(model_types, args.jobs, progress=True)
    seconds = time.perf_counter() - started
    print(counts(results), f"{seconds:.0f}s")
    if args.out:
        write_table(results, args.out, seconds, args.jobs, args.compile)
    return 0 if not any(r.result in (WRONG, CRASH) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
