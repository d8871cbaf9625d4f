"""``llamaref verify`` (:mod:`llamaref.verify`): it passes on sound models, and it fails
when a twin is wrong.

- SmolLM2 (Q4_1): every check passes, llama.cpp included, in well under a minute;
- a tiny float32 llama GGUF: the llama.cpp check is the logits NMSE;
- a tiny HF folder (no tokenizer files): transformers is the oracle, ids stand in for text;
- a tiny Mamba GGUF: the twin-context check is skipped, the rest pass;
- a twin op made wrong by 0.1 % fails its line, and the command exits 1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from llamaref.cli import main
from llamaref.verify import nmse, run_verify
from tests.oracle.test_smollm2 import smollm2_path
from tests.support.tiny_models import (
    random_mamba_weights,
    random_weights,
    save_tiny_hf,
    tiny_hparams,
    tiny_mamba_hparams,
    write_tiny_gguf,
    write_tiny_mamba_gguf,
)


def verify(path, backend="reference", n_tokens=12):
    lines = []
    report = run_verify(path, backend=backend, n_tokens=n_tokens, emit=lines.append)
    return report, "\n".join(lines)


def statuses(report) -> dict[str, str]:
    return {c.name: c.status for c in report.checks}


@pytest.mark.oracle
def test_smollm2_passes_every_check():
    report, text = verify(smollm2_path(), n_tokens=8)  # 8 tokens: the properties' prompt
    assert report.passed, text
    groups = [c.group for c in report.checks]
    assert [g for i, g in enumerate(groups) if g not in groups[:i]] == [
        "ops", "context", "properties", "oracles"]
    assert all(c.status == "PASS" for c in report.checks), text  # nothing skipped
    names = " ".join(statuses(report))
    for op in ("GET_ROWS", "RMS_NORM", "ROPE_EXT", "SOFT_MAX_EXT", "ATTN", "SWIGLU", "MUL_MAT"):
        assert op in names
    assert "llama.cpp top-1 agreement (Q4_1/Q8_0/f32, n=64)" in names
    assert statuses(report)["max KL(reference || accelerated), nats (n=8)"] == "PASS"
    assert text.splitlines()[3].startswith("| group")


@pytest.mark.oracle
def test_a_float32_gguf_is_checked_by_llamacpp_logits(tmp_path):
    hp = tiny_hparams(n_vocab=300, n_embd=32, n_ff=48, n_head=4, n_head_kv=2)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hp, random_weights(hp))
    report, text = verify(path)
    assert report.passed, text
    assert statuses(report)["llama.cpp logits (f32 weights, f32 KV, n=64)"] == "PASS"


@pytest.mark.oracle
def test_a_hf_folder_is_checked_by_transformers(tmp_path):
    path = save_tiny_hf(tmp_path / "hf", kind="qwen2")
    report, text = verify(path)
    assert report.passed, text
    assert "no tokenizer" in text  # ids 1, 2, ... stand in for the prompt
    assert statuses(report)["transformers logits (n=64)"] == "PASS"


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_is_verified_with_its_own_ops(tmp_path, arch):
    """Gemma's FFN is GeGLU and Gemma 2 soft-caps: the op group checks those, and llama.cpp
    agrees on a GGUF whose window (8) is shorter than the 64-token oracle prompt."""
    from reference.testing import random_gemma_weights, tiny_gemma_hparams

    hp = tiny_gemma_hparams(arch, n_vocab=300, n_swa=8, n_ctx_train=4096)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", hp, random_gemma_weights(hp, seed=2))
    report, text = verify(path)
    assert report.passed, text
    names = statuses(report)
    assert "GEGLU(n_ff=24)" in names and not any(n.startswith("SWIGLU") for n in names)
    assert any(n.startswith("SOFTCAP") for n in names) == (arch == "gemma2")
    assert names["llama.cpp logits (f32 weights, f32 KV, n=64)"] == "PASS"


@pytest.mark.oracle
def test_a_mamba_model_skips_what_does_not_apply(tmp_path):
    hp = tiny_mamba_hparams("mamba2", n_vocab=300, n_embd=32)
    path = write_tiny_mamba_gguf(tmp_path / "mamba.gguf", hp, random_mamba_weights(hp))
    report, text = verify(path)
    assert report.passed, text
    skipped = [c.name for c in report.checks if c.status.startswith("skipped")]
    assert skipped == ["accelerated vs reference logits"]
    assert any(c.name.startswith("SSM_SCAN") and c.status == "PASS" for c in report.checks)


def test_a_wrong_twin_fails_and_exits_1(tmp_path, capsys, monkeypatch):
    import accelerated.ops

    hp = tiny_hparams(n_vocab=300, n_embd=32, n_ff=48)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hp, random_weights(hp))
    rms_norm = accelerated.ops.rms_norm
    monkeypatch.setattr(accelerated.ops, "rms_norm", lambda x, eps: rms_norm(x, eps) * 1.001)
    assert main(["verify", "-m", str(path), "--backend", "reference"]) == 1
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and "RMS_NORM" in failed[0]
    assert "1 failed" in out.splitlines()[-1]


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@given(arrays(np.float64, 16, elements=finite), arrays(np.float64, 16, elements=finite),
       st.floats(1e-3, 1e3))
def test_nmse_is_zero_on_equality_and_scale_free(a, b, c):
    assert nmse(a, a) == 0.0
    if (a**2).sum() > 1e-6:
        assert math.isclose(nmse(c * a, c * b), nmse(a, b), rel_tol=1e-9, abs_tol=1e-300)


def test_nmse_fails_on_nan_and_mismatched_infinities():
    assert nmse([1.0, np.nan], [1.0, np.nan]) == math.inf
    assert nmse([1.0, np.inf], [1.0, -np.inf]) == math.inf
    assert nmse([1.0, -np.inf], [1.0, -np.inf]) == 0.0


@pytest.mark.oracle
@pytest.mark.parametrize("arch, n_expert", [("qwen3", 0), ("qwen3moe", 4), ("llama", 4)],
                         ids=["qwen3", "qwen3moe", "mixtral"])
def test_qwen3_and_mixtures_of_experts_are_verified(tmp_path, arch, n_expert):
    """Qwen3's Q/K norms and the experts' ``mul_mat_id``: every check passes, the twin and
    llama.cpp included."""
    hp = tiny_hparams(arch, n_vocab=300, n_embd=32, n_ff=48, n_head=4, n_head_kv=2,
                      n_expert=n_expert, n_expert_used=2 if n_expert else 0,
                      n_ff_exp=24 if arch == "qwen3moe" else 0)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", hp, random_weights(hp))
    report, text = verify(path)
    assert report.passed, text
    names = statuses(report)
    assert names["llama.cpp logits (f32 weights, f32 KV, n=64)"] == "PASS"
    assert names["accelerated vs reference logits (n=12)"] == "PASS"
