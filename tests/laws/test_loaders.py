"""The two loaders agree: a HF checkpoint and the GGUF written from it are the same model.

Loading a HF folder, writing what we loaded as a GGUF (our writer, ``llama_metadata``) and
reading it back gives the same hyperparameters and the same weights: the HF loader produces
exactly what llama.cpp would read from the converted file.
"""

from __future__ import annotations

import numpy as np
import pytest

from reference.arch import hparams_from_file, llama_metadata
from reference.gguf import read_gguf, write_gguf
from reference.hf import load_hf
from reference.model_loader import load_model
from tests.support.tiny_models import save_tiny_hf


@pytest.mark.parametrize(
    ("kind", "extra"),
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {})],
)
def test_hf_then_gguf_round_trip_is_the_same_model(tmp_path, kind, extra):
    pytest.importorskip("transformers")
    folder = save_tiny_hf(tmp_path / "hf", kind=kind, **extra)
    hp, weights = load_hf(folder)
    path = tmp_path / "model.gguf"
    write_gguf(path, llama_metadata(hp), weights)
    g = read_gguf(path)
    assert hparams_from_file(g) == hp
    assert sorted(g.tensors) == sorted(weights)
    for name, w in weights.items():
        np.testing.assert_array_equal(g.tensors[name], w, err_msg=name)
    # and load_model dispatches on what it is given
    assert load_model(path)[0] == load_model(folder)[0] == hp
