r"""LoRA adapters: gradients, training steps, merging, the adapter file and its errors.

- The gradients of $A$ and $B$ ([`lora_grads`] of the $W'$ gradients) against central finite
  differences of the adapted model's loss in float64, with $A$ and $B$ both random (at
  $B = 0$ the gradient of $A$ is zero and would test nothing); verdict as in
  tests/laws/test_training_grad.py: ``|fd - ours| <= 1e-6 * max|grad|``.
- At initialisation ($B = 0$) the adapted model's logits are the base model's, bit for bit.
- SGD and AdamW steps through ``LoraOptContext`` lower the loss, leave every base weight
  bit-identical, and are exactly ggml-opt's kernels applied to $A$ and $B$.
- ``build_lora_mm`` (llama.cpp's per-matmul form) equals the merged weight's matmul; a merged
  model written to GGUF and read back gives the adapted logits.
- ``save_lora_gguf`` / ``load_lora_gguf`` round-trip exactly; malformed files are refused
  with a ``LoraFileError`` (or the container's ``GGUFError``) that names the problem.

llama.cpp itself applying our adapters is tests/oracle/test_lora.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from reference.gguf import GGUFError, GGUFValue, GGUFValueType, read_gguf, write_gguf
from reference.model_loader import load_model
from reference.ops import mul_mat
from reference.ops.loss import cross_entropy_loss
from reference.quants import QuantizedTensor
from reference.testing import random_weights, reference_logits, tiny_hparams, write_tiny_gguf
from reference.training.epoch import opt_epoch
from reference.training.errors import OptParamsError, TrainingError
from reference.training.llama_grad import loss_and_grads, train_forward
from reference.training.lora import (
    LORA_TARGET_KINDS,
    LORA_TARGETS,
    LoraAdapter,
    LoraError,
    LoraFileError,
    LoraOptContext,
    build_lora_mm,
    init_lora,
    load_lora_gguf,
    lora_grads,
    lora_loss_and_grads,
    lora_scale,
    lora_targets,
    lora_weights,
    merge_lora,
    merge_lora_weight,
    save_lora_gguf,
)
from reference.training.opt import (
    AdamWParams,
    OptimizerParams,
    SGDParams,
    adamw_bias_corrections,
    opt_step_adamw,
    opt_step_sgd,
)
from reference.training.result import OptResult

TOKENS, LABELS = np.array([1, 4, 9, 3, 7]), np.array([4, 9, 3, 7, 2])


def _randomize(adapter: LoraAdapter, seed: int, b_std: float = 0.3) -> LoraAdapter:
    """Random non-zero B (and a new A), in the adapter's dtype."""
    rng = np.random.default_rng(seed)
    for name in adapter.targets:
        a, b = adapter.a(name), adapter.b(name)
        adapter.tensors[name + ".lora_a"] = rng.normal(0, 1, a.shape).astype(a.dtype)
        adapter.tensors[name + ".lora_b"] = rng.normal(0, b_std, b.shape).astype(b.dtype)
    return adapter


def _loss(weights, hp) -> float:
    logits, _ = train_forward(weights, hp, TOKENS)
    return float(cross_entropy_loss(logits, np.eye(hp.n_vocab)[LABELS]))


# ---------------------------------------------------------------------------------------------
# gradients


@pytest.mark.parametrize("kw", [dict(), dict(arch="qwen2", tied=True, n_head_kv=1)])
def test_adapter_gradients_match_finite_differences(kw):
    hp = tiny_hparams(n_layer=2, **kw)
    w = random_weights(hp, seed=1, dtype=np.float64)
    targets = LORA_TARGETS if hp.tied_output else LORA_TARGET_KINDS
    adapter = _randomize(init_lora(w, hp, rank=3, alpha=6.0, targets=targets), seed=2)
    loss, grads, _ = lora_loss_and_grads(w, adapter, hp, TOKENS, LABELS)
    assert loss == pytest.approx(_loss(lora_weights(w, adapter), hp), rel=1e-12)
    assert set(grads) == set(adapter.tensors)
    rng = np.random.default_rng(3)
    for name, g in grads.items():
        assert g.shape == adapter.tensors[name].shape and g.dtype == np.float64
        for _ in range(3):
            i = tuple(rng.integers(0, s) for s in g.shape)

            def at(delta, name=name, i=i):
                moved = dataclasses.replace(adapter, tensors=dict(adapter.tensors))
                moved.tensors[name] = adapter.tensors[name].copy()
                moved.tensors[name][i] += delta
                return _loss(lora_weights(w, moved), hp)

            fd = (at(1e-5) - at(-1e-5)) / 2e-5
            assert abs(fd - g[i]) <= 1e-6 * np.abs(g).max(), (name, i, fd, g[i])


def test_gradient_formula_and_the_zero_gradient_of_a_at_init():
    r"""$\partial L/\partial A = s B^T G$, $\partial L/\partial B = s G A^T$; A still at B = 0."""
    rng = np.random.default_rng(0)
    a, b, g = rng.normal(size=(2, 5)), rng.normal(size=(4, 2)), rng.normal(size=(4, 5))
    ad = LoraAdapter({"w.lora_a": a, "w.lora_b": b}, 3.0, "llama")  # s = 1.5
    out = lora_grads({"w": g}, ad, adapter_scale=2.0)  # s = 3
    np.testing.assert_allclose(out["w.lora_a"], 3 * b.T @ g, rtol=1e-14)
    np.testing.assert_allclose(out["w.lora_b"], 3 * g @ a.T, rtol=1e-14)
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=0)
    _, grads, _ = lora_loss_and_grads(w, init_lora(w, hp, 2, 4.0), hp, TOKENS, LABELS)
    assert all(not g.any() for n, g in grads.items() if n.endswith(".lora_a"))
    assert all(g.any() for n, g in grads.items() if n.endswith(".lora_b"))


# ---------------------------------------------------------------------------------------------
# initialisation


def test_init_is_the_base_model_exactly():
    hp = tiny_hparams(n_layer=2)
    w = random_weights(hp, seed=5)
    adapter = init_lora(w, hp, rank=4, alpha=16.0, targets=LORA_TARGET_KINDS, seed=1)
    adapted = lora_weights(w, adapter)
    np.testing.assert_array_equal(train_forward(adapted, hp, TOKENS)[0],
                                  train_forward(w, hp, TOKENS)[0])
    np.testing.assert_array_equal(reference_logits(adapted, hp, TOKENS),
                                  reference_logits(w, hp, TOKENS))
    for name in adapter.targets:
        a, b = adapter.a(name), adapter.b(name)
        n_in = w[name].shape[1]
        assert a.dtype == b.dtype == np.float32 and not b.any()
        assert np.abs(a).max() <= 1 / np.sqrt(n_in) and np.abs(a).max() > 0.5 / np.sqrt(n_in)


def test_init_is_seeded_and_ordered():
    hp = tiny_hparams(n_layer=2)
    w = random_weights(hp, seed=5)
    one = init_lora(w, hp, 2, 4.0, targets=("ffn_up", "attn_q"), seed=7)
    two = init_lora(w, hp, 2, 4.0, targets=("attn_q", "ffn_up"), seed=7)
    other = init_lora(w, hp, 2, 4.0, targets=("attn_q", "ffn_up"), seed=8)
    assert list(one.tensors) == list(two.tensors) == [
        "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b",
        "blk.0.ffn_up.weight.lora_a", "blk.0.ffn_up.weight.lora_b",
        "blk.1.attn_q.weight.lora_a", "blk.1.attn_q.weight.lora_b",
        "blk.1.ffn_up.weight.lora_a", "blk.1.ffn_up.weight.lora_b",
    ]
    assert all(np.array_equal(one.tensors[n], two.tensors[n]) for n in one.tensors)
    assert not np.array_equal(one.a("blk.0.attn_q.weight"), other.a("blk.0.attn_q.weight"))
    assert one.alpha == 4.0 and one.arch == "llama" and one.rank("blk.1.ffn_up.weight") == 2
    assert init_lora(w, hp, 2, 0.1).alpha == float(np.float32(0.1))  # stored as float32


def test_lora_scale_as_llamacpp():
    assert lora_scale(16.0, 8) == 2.0 and lora_scale(16.0, 8, 0.25) == 0.5
    assert lora_scale(0.0, 8) == 1.0 and lora_scale(0.0, 8, 0.25) == 0.25  # alpha 0: no alpha/r
    assert lora_scale(1.0, 3) == np.float32(1.0) / np.float32(3.0)
    assert lora_scale(1.0, 3).dtype == np.float32


# ---------------------------------------------------------------------------------------------
# training steps


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_steps_lower_the_loss_and_freeze_the_base(optimizer):
    hp = tiny_hparams(n_layer=2)
    base = random_weights(hp, seed=3)
    frozen = {name: np.array(t, copy=True) for name, t in base.items()}
    adapter = init_lora(base, hp, rank=4, alpha=8.0, seed=0)
    pars = OptimizerParams(AdamWParams(alpha=1e-2), SGDParams(alpha=0.5))
    ctx = LoraOptContext(base, adapter, optimizer, get_opt_pars=lambda: pars)
    w = lora_weights(base, adapter)
    losses = []
    for _ in range(5):
        loss, grads, _ = loss_and_grads(w, hp, TOKENS, LABELS)
        losses.append(loss)
        assert ctx.eval_backward(w, grads)
    assert losses[-1] < losses[0] - 0.1 and all(np.diff(losses) < 0), losses
    assert ctx.iter == 6 and sorted(ctx.params) == sorted(adapter.tensors)
    assert set(base) == set(frozen)
    for name, t in base.items():
        np.testing.assert_array_equal(t, frozen[name])  # the base, bit for bit
    for name in adapter.targets:  # the forward's weights are W + s B A of the new adapter
        np.testing.assert_array_equal(w[name], lora_weights(base, adapter)[name])
    assert w["token_embd.weight"] is base["token_embd.weight"]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_is_ggml_opts_kernel_on_a_and_b(optimizer):
    hp = tiny_hparams(n_layer=1)
    base = random_weights(hp, seed=3)
    adapter = _randomize(init_lora(base, hp, rank=2, alpha=2.0), seed=4)
    before = dict(adapter.tensors)
    pars = OptimizerParams(AdamWParams(alpha=1e-2, wd=0.1), SGDParams(alpha=0.1, wd=0.1))
    ctx = LoraOptContext(base, adapter, optimizer, get_opt_pars=lambda: pars)
    w = lora_weights(base, adapter)
    _, grads, _ = loss_and_grads(w, hp, TOKENS, LABELS)
    expected_grads = lora_grads(grads, adapter)
    ctx.eval_backward(w, grads)
    b1h, b2h = adamw_bias_corrections(0.9, 0.999, 1)
    for name, t in before.items():
        g = expected_grads[name]
        if optimizer == "sgd":
            want = opt_step_sgd(t, g, pars.sgd)
        else:
            want = opt_step_adamw(t, g, np.zeros_like(t), np.zeros_like(t), pars.adamw, b1h, b2h)[0]
        np.testing.assert_array_equal(adapter.tensors[name], want)


def test_opt_epoch_trains_an_adapter_unchanged():
    """F1's path: ``opt_epoch`` over the adapted weights with a ``LoraOptContext``."""
    hp = tiny_hparams(n_layer=1)
    base = random_weights(hp, seed=3)
    adapter = init_lora(base, hp, rank=2, alpha=4.0)
    ctx = LoraOptContext(base, adapter, "adamw",
                         get_opt_pars=lambda: OptimizerParams(AdamWParams(alpha=1e-2)))
    w = lora_weights(base, adapter)
    data = np.array([[1, 4, 9, 3], [9, 3, 7, 2], [3, 7, 2, 5]])
    labels = np.array([[4, 9, 3, 7], [3, 7, 2, 5], [7, 2, 5, 1]])
    first, second = [], []
    for losses in (first, second):
        train, val = OptResult(), OptResult()
        opt_epoch(w, hp, ctx, data, labels, 2, train, val)
        losses.append(train.loss()[0])
    assert ctx.iter == 5 and second[0] < first[0]
    assert adapter.b("blk.0.attn_q.weight").any()
    np.testing.assert_array_equal(w["blk.0.ffn_down.weight"],
                                  lora_weights(base, adapter)["blk.0.ffn_down.weight"])


def test_bad_gradients_change_nothing():
    hp = tiny_hparams(n_layer=1)
    base = random_weights(hp, seed=3)
    adapter = init_lora(base, hp, rank=2, alpha=4.0, targets=("attn_q", "ffn_up"))
    ctx = LoraOptContext(base, adapter, "sgd")
    w = lora_weights(base, adapter)
    _, grads, _ = loss_and_grads(w, hp, TOKENS, LABELS)
    before = dict(adapter.tensors)
    missing = {k: v for k, v in grads.items() if k != "blk.0.ffn_up.weight"}
    with pytest.raises(LoraError, match="blk.0.ffn_up.weight"):
        ctx.eval_backward(w, missing)
    bad_pars = LoraOptContext(base, adapter, "sgd",
                              get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=-1.0)))
    with pytest.raises(OptParamsError):
        bad_pars.eval_backward(w, grads)
    assert all(adapter.tensors[n] is t for n, t in before.items())
    assert ctx.iter == 1 and ctx.opt_i == 0 and bad_pars.iter == 1


# ---------------------------------------------------------------------------------------------
# per matmul vs merged


@pytest.mark.parametrize("shape", [(4, 6, 1, 3), (8, 5, 3, 7), (3, 3, 2, 1)])
def test_build_lora_mm_equals_the_merged_weight(shape):
    n_out, n_in, rank, n_tokens = shape
    rng = np.random.default_rng(sum(shape))
    w, x = rng.normal(size=(n_out, n_in)), rng.normal(size=(n_tokens, n_in))
    a, b = rng.normal(size=(rank, n_in)), rng.normal(size=(n_out, rank))
    per_matmul = build_lora_mm(w, x, a, b, 0.75)
    merged = mul_mat(merge_lora_weight(w, a, b, 0.75), x)
    np.testing.assert_allclose(per_matmul, merged, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged, x @ (w + 0.75 * b @ a).T, rtol=1e-12, atol=1e-12)
    assert np.abs(merged - mul_mat(w, x)).max() > 0.1  # the adapter term is there


def test_merged_model_through_gguf_gives_the_adapted_logits(tmp_path):
    hp = tiny_hparams(n_layer=2, arch="qwen2")
    base = random_weights(hp, seed=6)
    adapter = _randomize(init_lora(base, hp, rank=3, alpha=6.0, targets=LORA_TARGET_KINDS), 7)
    merged = merge_lora(base, adapter, adapter_scale=0.5)
    path = write_tiny_gguf(tmp_path / "merged.gguf", hp, merged)
    hp_file, w_file = load_model(path)
    ours = reference_logits(lora_weights(base, adapter, 0.5), hp, TOKENS)
    np.testing.assert_array_equal(reference_logits(w_file, hp_file, TOKENS), ours)
    assert np.abs(ours - reference_logits(base, hp, TOKENS)).max() > 0.1


def test_a_quantized_base_is_dequantized_then_adapted():
    hp = tiny_hparams(n_layer=1, n_embd=32)
    w = random_weights(hp, seed=2)
    q = QuantizedTensor.from_float(w["blk.0.attn_q.weight"], GGMLQuantizationType.Q8_0)
    wq = dict(w, **{"blk.0.attn_q.weight": q})
    adapter = _randomize(init_lora(wq, hp, 2, 2.0, targets=("attn_q",)), 1)
    got = lora_weights(wq, adapter)["blk.0.attn_q.weight"]
    a, b = adapter.a("blk.0.attn_q.weight"), adapter.b("blk.0.attn_q.weight")
    np.testing.assert_array_equal(got, merge_lora_weight(q.dequantize(), a, b, 1.0))
    assert wq["blk.0.attn_q.weight"] is q


# ---------------------------------------------------------------------------------------------
# the adapter file


def _adapter(tmp_path, **kw):
    hp = tiny_hparams(n_layer=2, **kw)
    w = random_weights(hp, seed=1)
    targets = LORA_TARGETS if hp.tied_output else LORA_TARGET_KINDS
    return hp, w, _randomize(init_lora(w, hp, rank=3, alpha=5.0, targets=targets), seed=9)


@pytest.mark.parametrize("kw", [dict(), dict(arch="qwen2", tied=True)])
def test_save_load_round_trip(tmp_path, kw):
    hp, w, adapter = _adapter(tmp_path, **kw)
    save_lora_gguf(tmp_path / "a.gguf", adapter)
    f = read_gguf(tmp_path / "a.gguf")
    assert f.metadata == {"general.architecture": hp.arch, "general.type": "adapter",
                          "adapter.type": "lora", "adapter.lora.alpha": 5.0}
    assert f.value_types["adapter.lora.alpha"] == GGUFValueType.FLOAT32
    assert list(f.tensors) == list(adapter.tensors)
    back = load_lora_gguf(tmp_path / "a.gguf", w, hp)
    assert (back.alpha, back.arch, back.targets) == (adapter.alpha, adapter.arch, adapter.targets)
    for name, t in adapter.tensors.items():
        assert back.tensors[name].dtype == np.float32 and back.tensors[name].flags.writeable
        np.testing.assert_array_equal(back.tensors[name], t)
    q = "blk.0.attn_q.weight"
    assert f.tensors[q + ".lora_a"].shape == (3, hp.n_embd)  # ne = [n_in, rank]
    assert f.tensors[q + ".lora_b"].shape == (w[q].shape[0], 3)  # ne = [rank, n_out]


def _write(path, md_changes=None, tensors=None, drop=()):
    md = {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora",
          "adapter.lora.alpha": 2.0}
    md.update(md_changes or {})
    md = {k: v for k, v in md.items() if k not in drop}
    if tensors is None:
        tensors = {"blk.0.attn_q.weight.lora_a": np.ones((2, 16), np.float32),
                   "blk.0.attn_q.weight.lora_b": np.ones((16, 2), np.float32)}
    write_gguf(path, md, tensors)
    return path


ONES = np.ones((2, 16), np.float32)
MALFORMED = {  # id -> (_write kwargs, message)
    "a-model": (dict(md_changes={"general.type": "model"}), "general.type to be 'adapter'"),
    "no-type": (dict(drop=("general.type",)), "general.type to be 'adapter'"),
    "control-vector": (dict(md_changes={"adapter.type": "control_vector"}),
                       "adapter.type to be 'lora'"),
    "alpha-f64": (dict(md_changes={"adapter.lora.alpha": GGUFValue(2.0, GGUFValueType.FLOAT64)}),
                  "must be FLOAT32"),
    "alpha-int": (dict(md_changes={"adapter.lora.alpha": 2}), "must be FLOAT32"),
    "alora": (dict(md_changes={"adapter.alora.invocation_tokens": [1, 2]}), "not supported"),
    "bad-suffix": (dict(tensors={"blk.0.attn_q.weight": ONES}), "unexpected suffix"),
    "unpaired": (dict(tensors={"blk.0.attn_q.weight.lora_a": ONES}), "missing one component"),
    "transposed-a": (dict(tensors={"blk.0.attn_q.weight.lora_a": np.ones((16, 2), np.float32),
                                   "blk.0.attn_q.weight.lora_b": np.ones((16, 2), np.float32)}),
                     "not transposed"),
    "vector": (dict(tensors={"blk.0.attn_q.weight.lora_a": np.ones(16, np.float32),
                             "blk.0.attn_q.weight.lora_b": np.ones((16, 2), np.float32)}),
               "must be matrices"),
    "token-embd": (dict(tensors={"token_embd.weight.lora_a": np.ones((32, 2), np.float32),
                                 "token_embd.weight.lora_b": np.ones((16, 2), np.float32)}),
                   "token_embd"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_adapter_files_are_refused(tmp_path, case):
    kwargs, message = MALFORMED[case]
    path = _write(tmp_path / f"{case}.gguf", **kwargs)
    with pytest.raises(LoraFileError, match=message) as e:
        load_lora_gguf(path)
    assert str(path) in str(e.value) and isinstance(e.value, GGUFError)
    assert isinstance(e.value, TrainingError)


def test_what_llamacpp_tolerates_is_tolerated(tmp_path):
    """No alpha reads as 0 (scale = adapter_scale); ``*_norm.weight`` tensors are skipped."""
    tensors = {"blk.0.attn_q.weight.lora_a": ONES, "blk.0.attn_q.weight.lora_b": ONES.T.copy(),
               "blk.0.attn_norm.weight": np.ones(16, np.float32)}
    adapter = load_lora_gguf(_write(tmp_path / "a.gguf", drop=("adapter.lora.alpha",),
                                    tensors=tensors))
    assert adapter.alpha == 0.0 and list(adapter.tensors) == list(tensors)[:2]
    assert lora_scale(adapter.alpha, adapter.rank("blk.0.attn_q.weight")) == 1.0


def test_an_f16_adapter_is_read_as_float32(tmp_path):
    """``convert_lora_to_gguf.py`` writes F16 by default; llama.cpp reads any type."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 32)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    f16 = {"blk.0.attn_q.weight.lora_a": QuantizedTensor.from_float(a, GGMLQuantizationType.F16),
           "blk.0.attn_q.weight.lora_b": QuantizedTensor.from_float(b, GGMLQuantizationType.F16)}
    adapter = load_lora_gguf(_write(tmp_path / "f16.gguf", tensors=f16))
    np.testing.assert_array_equal(adapter.a("blk.0.attn_q.weight"), a.astype(np.float16))
    np.testing.assert_array_equal(adapter.b("blk.0.attn_q.weight"), b.astype(np.float16))
    assert adapter.a("blk.0.attn_q.weight").dtype == np.float32


def test_container_errors_and_model_mismatches(tmp_path):
    path = _write(tmp_path / "a.gguf")
    raw = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(raw[: len(raw) - 40])
    with pytest.raises(GGUFError, match="truncated|beyond|exceeds|end of"):
        load_lora_gguf(tmp_path / "cut.gguf")
    with pytest.raises(GGUFError, match="general.architecture"):
        load_lora_gguf(_write(tmp_path / "noarch.gguf", drop=("general.architecture",)))
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp)
    assert load_lora_gguf(path, w, hp).targets == ["blk.0.attn_q.weight"]
    with pytest.raises(LoraError, match="arch mismatch"):
        load_lora_gguf(path, w, dataclasses.replace(hp, arch="qwen2"))
    with pytest.raises(LoraError, match="does not exist in base model"):
        load_lora_gguf(path, {"token_embd.weight": w["token_embd.weight"]})
    wide = dict(w, **{"blk.0.attn_q.weight": np.ones((16, 8), np.float32)})
    with pytest.raises(LoraError, match="incorrect shape"):
        load_lora_gguf(path, wide)


# ---------------------------------------------------------------------------------------------
# bad arguments


def test_bad_arguments_are_refused():
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp)
    tied = tiny_hparams(n_layer=1, tied=True)
    for bad in [dict(rank=0), dict(rank=2.0), dict(alpha=float("nan")),
                dict(targets=("attn_x",)), dict(targets=()), dict(targets=("attn_q", "attn_q"))]:
        kw = dict(rank=2, alpha=4.0) | bad
        with pytest.raises(LoraError):
            init_lora(w, hp, **kw)
    with pytest.raises(LoraError, match="ties its lm_head"):
        lora_targets(random_weights(tied), tied, ("attn_q", "output"))
    with pytest.raises(LoraError, match="has no 'blk.0.ffn_gate.weight'"):
        lora_targets({k: v for k, v in w.items() if "ffn_gate" not in k}, hp)
    with pytest.raises(LoraError, match="missing one component"):
        LoraAdapter({"w.lora_a": np.ones((1, 2))}, 1.0, "llama")
    with pytest.raises(LoraError, match="finite"):
        LoraAdapter({}, float("inf"), "llama")
    adapter = init_lora(w, hp, 2, 4.0)
    other = tiny_hparams(n_layer=1, n_embd=32)
    with pytest.raises(LoraError, match="incorrect shape"):
        lora_weights(random_weights(other), adapter)
    with pytest.raises(LoraError, match="incorrect shape"):
        LoraOptContext(random_weights(other), adapter)
    with pytest.raises(LoraError, match="need the gradient"):
        lora_grads({"blk.0.attn_q.weight": np.ones((3, 3))}, adapter)
