"""Shared fixtures: the models, loaded once per session (SmolLM2 takes ~10 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.model.loader import LoadedModel, export_hf_folder, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny-random", progress=False)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's GGUF exported as a Hugging Face folder (dequantized, fp32)."""
    return export_hf_folder("smollm2-135m", tmp_path_factory.mktemp("smollm2-hf"), progress=False)
