"""ContinuousBatchingConfig: transformers' fields and defaults, its deprecations, validation, and no silent no-ops."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig as TransformersConfig

import cbcore
from conftest import greedy_config, tiny_model


def test_fields_and_defaults_match_transformers() -> None:
    ours = {f.name: f.default for f in dataclasses.fields(cbcore.ContinuousBatchingConfig)}
    theirs = {f.name: f.default for f in dataclasses.fields(TransformersConfig)}
    assert ours == theirs
    assert isinstance(cbcore.ContinuousBatchingConfig(), TransformersConfig)


def test_deprecated_block_size_warns_and_maps_to_page_size(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = cbcore.ContinuousBatchingConfig(block_size=32)
    assert config.page_size == 32
    assert "block_size is deprecated" in caplog.text


def test_deprecated_use_default_compile_configs_maps_to_compile_level() -> None:
    assert cbcore.ContinuousBatchingConfig(use_default_compile_configs=False).default_compile_level == 0
    assert cbcore.ContinuousBatchingConfig(use_default_compile_configs=True).default_compile_level == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"page_size": 2}, "page_size must be at least 4"),
        ({"num_blocks": 0}, "num_blocks must be >= 1"),
        ({"max_batch_tokens": -1}, "max_batch_tokens must be >= 1"),
        ({"max_requests_per_batch": 0}, "max_requests_per_batch must be >= 1"),
        ({"max_memory_percent": 1.5}, "max_memory_percent must be in (0, 1]"),
        ({"safety_margin": -0.1}, "safety_margin must be in [0, 1]"),
        ({"scheduler_type": "lifo"}, "scheduler_type must be one of"),
        ({"max_queue_size": -1}, "max_queue_size must be >= 0"),
    ],
)
def test_out_of_range_values_raise_a_value_error_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        cbcore.ContinuousBatchingConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"use_cuda_graph": True},
        {"use_cuda_graph": (False, True)},
        {"use_async_batching": True},
    ],
)
def test_unsupported_options_raise_instead_of_being_ignored(kwargs: dict) -> None:
    with pytest.raises(NotImplementedError):
        cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(4), cbcore.ContinuousBatchingConfig(**kwargs))


def test_padding_intervals_are_accepted_while_cuda_graphs_are_off() -> None:
    """They only shape CUDA graphs; transformers accepts them with graphs off, and so does cbcore."""
    config = cbcore.ContinuousBatchingConfig(q_padding_interval_size=64, kv_padding_interval_size=256)
    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(4), config)
    manager.destroy()


def test_a_transformers_config_is_accepted_and_not_mutated() -> None:
    theirs = TransformersConfig(page_size=8, num_blocks=20)
    manager = cbcore.ContinuousBatchingManager(tiny_model("llama_gqa"), greedy_config(4), theirs)
    manager.warmup()
    assert manager.cache.page_size == 8 and manager.cache.num_blocks == 20
    assert theirs.max_batch_tokens is None  # the resolved values went to cbcore's copy
    manager.destroy()


def test_version_is_exposed() -> None:
    assert isinstance(cbcore.__version__, str) and cbcore.__version__.count(".") == 2
    assert torch.__version__.startswith("2.14.1")
