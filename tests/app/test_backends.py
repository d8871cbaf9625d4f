"""The backend choice (``llamaref.backends.pick_backend``): one rule for every architecture.

``reference`` and ``accelerated`` are themselves; ``auto`` is ``accelerated`` exactly when
MLX's default device is a GPU, for llama, qwen2, gemma and the recurrent Mamba and Mamba-2
alike, since the MLX twin runs them all; and a command asked for ``accelerated`` on a Mamba
runs it there.
"""

from __future__ import annotations

import pytest

from llamaref import backends
from llamaref.backends import BackendError, pick_backend
from llamaref.cli import main
from reference.testing import (
    random_mamba_weights,
    tiny_gemma_hparams,
    tiny_hparams,
    tiny_mamba_hparams,
    write_tiny_mamba_gguf,
)

MODELS = {
    "llama": lambda: tiny_hparams(),
    "qwen2": lambda: tiny_hparams("qwen2"),
    "gemma3": lambda: tiny_gemma_hparams("gemma3"),
    "mamba": lambda: tiny_mamba_hparams("mamba"),
    "mamba2": lambda: tiny_mamba_hparams("mamba2"),
}


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_auto_follows_the_device_for_every_architecture(monkeypatch, arch, gpu):
    monkeypatch.setattr(backends, "mlx_has_gpu", lambda: gpu)
    assert pick_backend("auto", MODELS[arch]()) == ("accelerated" if gpu else "reference")


@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("name", ["accelerated", "reference"])
def test_a_named_backend_is_itself_for_every_architecture(monkeypatch, arch, name):
    for gpu in (True, False):
        monkeypatch.setattr(backends, "mlx_has_gpu", lambda gpu=gpu: gpu)
        assert pick_backend(name, MODELS[arch]()) == name


def test_an_unknown_backend_is_refused():
    with pytest.raises(BackendError, match="unknown backend 'gpu'"):
        pick_backend("gpu", tiny_hparams())


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_generate_runs_a_mamba_on_the_twin(tmp_path, capsys, arch):
    """Greedy text from a tiny Mamba: the MLX twin prints what the reference prints."""
    hp = tiny_mamba_hparams(arch, n_vocab=300)  # every byte a token: any text tokenizes
    path = write_tiny_mamba_gguf(tmp_path / f"{arch}.gguf", hp, random_mamba_weights(hp))
    argv = ["generate", "ab", "-m", str(path), "-n", "6", "--temp", "0", "--ignore-eos",
            "--no-display-prompt", "-c", "64"]
    texts = {}
    for backend in ("reference", "accelerated"):
        assert main([*argv, "--backend", backend]) == 0
        out, err = capsys.readouterr()
        assert f"llamaref: backend {backend}\n" in err
        texts[backend] = out
    assert texts["accelerated"] == texts["reference"]


@pytest.mark.parametrize("gpu", [False, True])
def test_bounded_types_stay_packed_only_where_matmuls_run_quantized(monkeypatch, gpu):
    """A Q4_K_M file's Q6_K tensors: packed within their bound where the Context multiplies
    quantized (a GPU), dequantized exactly where it multiplies dense (the CPU), and exact
    whenever asked (``verify``); Q4_K stays packed and exact everywhere."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    import accelerated.models.llama as AL
    from accelerated.quants import MLXQuantized
    from reference.quants import QuantizedTensor

    monkeypatch.setattr(AL, "gpu_paths", lambda: gpu)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    weights = {name: QuantizedTensor.from_float(x, t) for name, t in
               (("blk.0.attn_v.weight", T.Q6_K), ("blk.0.attn_q.weight", T.Q4_K))}
    got = backends.prepare_weights(weights, "accelerated")
    assert isinstance(got["blk.0.attn_q.weight"], MLXQuantized)
    assert isinstance(got["blk.0.attn_v.weight"], MLXQuantized) == gpu
    exact = backends.prepare_weights(weights, "accelerated", bounded=False)
    assert not isinstance(exact["blk.0.attn_v.weight"], MLXQuantized)
    np.testing.assert_array_equal(np.array(exact["blk.0.attn_v.weight"]),
                                  weights["blk.0.attn_v.weight"].dequantize())
