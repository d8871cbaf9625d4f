"""ggml-opt: AdamW and SGD steps, accumulation, results, progress line, schedule, dataset.

- One AdamW and one SGD step on a tiny model equal a torch computation of ggml's kernel
  formulas, written out by hand in float32 (``oracle``), bit for bit: the same IEEE float32
  operations in the same order (the square root correctly rounded, as C's ``sqrtf``); and
  equal ``torch.optim.AdamW`` / ``torch.optim.SGD`` (whose update is the same mathematics,
  with another rounding order) to 1e-6 relative.
- Gradient accumulation over ``opt_period`` ubatches equals one step on the gradient of the
  whole batch's mean loss (transformers' ``loss.backward()`` on the batch of sequences).
- The LR schedule, the dataset count and the split against the formulas of the notes
  (``llamacpp-apps.md`` section 8), written again here, on the edge cases.
- llama.cpp itself (``oracle``, through ctypes): one ``llama_opt_epoch`` on a tiny GGUF, one
  SGD or AdamW step, gives the spec's weights to float32 rounding (1e-6 of the weights' scale;
  measured ~6e-8) and the same loss/accuracy results; a second step shows the divergence
  (llama.cpp steps on the cumulative gradient).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference.gguf import read_gguf
from reference.hf import gguf_tensor_name, load_hf, permute
from reference.testing import random_weights, tiny_hparams, write_tiny_gguf
from reference.training.dataset import dataset_ndata, idata_split, opt_dataset_init
from reference.training.epoch import opt_epoch
from reference.training.errors import DatasetError, OptParamsError, ScheduleError, TrainingError
from reference.training.llama_grad import loss_and_grads
from reference.training.opt import (
    AdamWParams,
    OptContext,
    OptimizerParams,
    SGDParams,
    adamw_bias_corrections,
    check_optimizer_params,
    opt_step_adamw,
    opt_step_sgd,
    trainable_params,
)
from reference.training.result import OptResult, progress_bar, progress_bar_cells
from reference.training.schedule import get_lr, lr_log_line, lr_opt_init, opt_lr_pars
from tests.support.tiny_models import save_tiny_hf

# ---------------------------------------------------------------------------------------------
# the trainable-parameter filter


def test_trainable_params_exclude_token_embd_and_rope_freqs():
    hp = tiny_hparams(n_layer=2)
    w = random_weights(hp, seed=0)
    w["rope_freqs.weight"] = np.ones(2, np.float32)
    names = trainable_params(w)
    assert "token_embd.weight" not in names and "rope_freqs.weight" not in names
    assert "output.weight" in names and "output_norm.weight" in names
    assert len(names) == len(w) - 2
    # tied embeddings: the lm_head *is* token_embd.weight, so it is frozen too
    tied = random_weights(tiny_hparams(n_layer=2, tied=True), seed=0)
    assert "output.weight" not in tied and "token_embd.weight" not in trainable_params(tied)
    # only F32: an F16 tensor (or a quantized one) is not trained; the user's filter applies
    w["blk.0.ffn_up.weight"] = w["blk.0.ffn_up.weight"].astype(np.float16)
    assert "blk.0.ffn_up.weight" not in trainable_params(w)
    only_norms = trainable_params(w, lambda name, t: "norm" in name)
    assert only_norms and all("norm" in n for n in only_norms)


# ---------------------------------------------------------------------------------------------
# AdamW and SGD


def test_bias_corrections_at_iter_1_and_2():
    f32 = np.float32
    for it in (1, 2):
        b1h, b2h = adamw_bias_corrections(0.9, 0.999, it)
        assert b1h == f32(1) / (f32(1) - f32(f32(0.9) ** it))
        assert b2h == f32(1) / (f32(1) - f32(np.float64(f32(0.999)) ** it))
        assert b1h.dtype == np.float32
    assert abs(adamw_bias_corrections(0.9, 0.999, 1)[0] - 10.0) < 1e-5
    assert abs(adamw_bias_corrections(0.9, 0.999, 2)[0] - 1 / 0.19) < 1e-5


BAD = [
    ("adamw", AdamWParams(alpha=0.0), "alpha"),
    ("adamw", AdamWParams(alpha=-1e-3), "alpha"),
    ("adamw", AdamWParams(alpha=math.nan), "alpha"),
    ("adamw", AdamWParams(wd=-0.1), "wd"),
    ("adamw", AdamWParams(wd=1.5), "wd"),
    ("adamw", AdamWParams(beta1=1.1), "beta1"),
    ("adamw", AdamWParams(beta1=-0.1), "beta1"),
    ("adamw", AdamWParams(beta2=2.0), "beta2"),
    ("adamw", AdamWParams(eps=-1e-8), "eps"),
    ("sgd", SGDParams(alpha=0.0), "alpha"),
    ("sgd", SGDParams(wd=1.01), "wd"),
    ("sgd", SGDParams(wd=-0.5), "wd"),
]


@pytest.mark.parametrize("optimizer, p, field", BAD)
def test_invalid_hyperparameters_are_refused_before_anything_changes(optimizer, p, field):
    pars = OptimizerParams(**{optimizer: p})
    with pytest.raises(OptParamsError, match=f"{optimizer}.{field}"):
        check_optimizer_params(pars, optimizer)
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=0)
    before = {k: v.copy() for k, v in w.items()}
    ctx = OptContext(w, optimizer, get_opt_pars=lambda: pars)
    grads = {n: np.ones_like(w[n]) for n in ctx.params}
    with pytest.raises(OptParamsError):
        ctx.eval_backward(w, grads)
    assert all(np.array_equal(w[k], before[k]) for k in w)
    assert ctx.iter == 1 and ctx.opt_i == 0
    assert all(not a.any() for a in ctx.grad_accs.values())


def test_bounds_are_inclusive_and_bad_contexts_refused():
    check_optimizer_params(OptimizerParams(AdamWParams(beta1=0.0, beta2=1.0, eps=0.0, wd=1.0)),
                           "adamw")
    check_optimizer_params(OptimizerParams(sgd=SGDParams(wd=0.0)), "sgd")
    with pytest.raises(OptParamsError, match="optimizer"):
        OptContext({}, "lion")
    with pytest.raises(OptParamsError, match="opt_period"):
        OptContext({}, "sgd", opt_period=0)


def test_shape_mismatches_are_refused():
    from reference.ops.errors import OpShapeError

    w = {"output_norm.weight": np.ones(3, np.float32)}
    ctx = OptContext(w, "adamw")
    with pytest.raises(OpShapeError, match="output_norm"):
        ctx.eval_backward(w, {"output_norm.weight": np.ones(1, np.float32)})  # would broadcast
    assert ctx.opt_i == 0 and not ctx.grad_accs["output_norm.weight"].any()
    with pytest.raises(OpShapeError):
        opt_step_sgd(np.ones((2, 3)), np.ones(3), SGDParams())


def test_sgd_stores_wd_itself():
    """SGD's parameters are [alpha, wd]; the kernel computes keep = 1 - alpha * wd."""
    w = np.array([2.0], np.float32)
    out = opt_step_sgd(w, np.array([0.0], np.float32), SGDParams(alpha=0.5, wd=0.1))
    assert out[0] == np.float32(2.0) * (np.float32(1) - np.float32(0.5) * np.float32(0.1))


def _tiny_model_grads():
    hp = tiny_hparams(n_layer=1, n_vocab=16, n_embd=8, n_head=2, n_head_kv=1, n_ff=12)
    w = random_weights(hp, seed=3)  # float32
    _, grads, _ = loss_and_grads(w, hp, [1, 5, 2, 9], [5, 2, 9, 3])
    return w, grads


def _torch_adamw_kernel(torch, w, g, m, v, p: AdamWParams, it: int):
    """ggml's AdamW kernel by hand, in torch float32, in the kernel's order of operations."""
    f = torch.float32

    def s(x):
        return torch.tensor(x, dtype=f)

    beta1h = s(1.0) / (s(1.0) - s(float(np.float64(np.float32(p.beta1)) ** it)))
    beta2h = s(1.0) / (s(1.0) - s(float(np.float64(np.float32(p.beta2)) ** it)))
    keep = s(1.0) - s(p.alpha) * s(p.wd)
    m = m * s(p.beta1) + g * (s(1.0) - s(p.beta1))
    v = v * s(p.beta2) + g * g * (s(1.0) - s(p.beta2))
    mh = m * beta1h
    # C's sqrtf is correctly rounded; torch's vectorized float32 sqrt is not always (1 ulp
    # off on some inputs), so take it in double and round once, which is exact for sqrt
    vh = torch.sqrt((v * beta2h).double()).float() + s(p.eps)
    return w * keep - s(p.alpha) * mh / vh, m, v


@pytest.mark.oracle
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_two_steps_equal_torch(wd):
    torch = pytest.importorskip("torch")
    w, grads = _tiny_model_grads()
    p = AdamWParams(alpha=1e-2, wd=wd)
    ctx = OptContext(w, "adamw", get_opt_pars=lambda: OptimizerParams(adamw=p))
    names = ctx.params
    t_w = {n: torch.tensor(w[n]) for n in names}
    t_opt = {n: torch.nn.Parameter(torch.tensor(w[n])) for n in names}
    optim = torch.optim.AdamW(list(t_opt.values()), lr=p.alpha, betas=(p.beta1, p.beta2),
                              eps=p.eps, weight_decay=wd)
    t_m = {n: torch.zeros_like(t_w[n]) for n in names}
    t_v = {n: torch.zeros_like(t_w[n]) for n in names}
    for it in (1, 2):  # the bias corrections of iter 1 and iter 2
        g = {n: grads[n] * np.float32(it) for n in names}  # another gradient at iter 2
        assert ctx.eval_backward(w, g) and ctx.iter == it + 1
        for n in names:
            t_w[n], t_m[n], t_v[n] = _torch_adamw_kernel(
                torch, t_w[n], torch.tensor(g[n]), t_m[n], t_v[n], p, it)
            t_opt[n].grad = torch.tensor(g[n])
        optim.step()
        for n in names:
            assert np.array_equal(w[n], t_w[n].numpy()), n  # bit for bit
            np.testing.assert_allclose(w[n], t_opt[n].detach().numpy(), rtol=1e-6, atol=1e-7)
    w0, _ = _tiny_model_grads()
    assert max(np.abs(w[n] - w0[n]).max() for n in names) > 1e-3  # the steps did something


@pytest.mark.oracle
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_sgd_step_equals_torch(wd):
    torch = pytest.importorskip("torch")
    w, grads = _tiny_model_grads()
    w0 = {k: v.copy() for k, v in w.items()}
    ctx = OptContext(w, "sgd", get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(0.05, wd)))
    assert ctx.eval_backward(w, grads) and not ctx.m
    f = torch.float32
    keep = torch.tensor(1.0, dtype=f) - torch.tensor(0.05, dtype=f) * torch.tensor(wd, dtype=f)
    params = {n: torch.nn.Parameter(torch.tensor(w0[n])) for n in ctx.params}
    optim = torch.optim.SGD(list(params.values()), lr=0.05, weight_decay=wd)
    for n in ctx.params:
        params[n].grad = torch.tensor(grads[n])
    optim.step()  # L2 decay folded into the gradient: w - lr (g + wd w), the same map
    for n in ctx.params:
        by_hand = torch.tensor(w0[n]) * keep - torch.tensor(0.05, dtype=f) * torch.tensor(grads[n])
        assert np.array_equal(w[n], by_hand.numpy()), n
        np.testing.assert_allclose(w[n], params[n].detach().numpy(), rtol=1e-6, atol=1e-7)
    assert np.array_equal(w["token_embd.weight"], w0["token_embd.weight"])  # never trained


def test_adamw_step_formula_in_float64():
    """The decay is w (1 - alpha wd), eps is outside the square root."""
    w, g = np.array([1.0, -2.0]), np.array([0.3, 0.0])
    p = AdamWParams(alpha=0.1, beta1=0.5, beta2=0.75, eps=0.01, wd=0.2)
    new_w, m, v = opt_step_adamw(w, g, np.zeros(2), np.zeros(2), p, 2.0, 4.0)
    m_hat, v_hat = 0.5 * g * 2.0, 0.25 * g * g * 4.0
    assert np.allclose(new_w, w * (1 - 0.1 * 0.2) - 0.1 * m_hat / (np.sqrt(v_hat) + 0.01))
    assert new_w[1] == -2.0 * (1 - 0.02)  # no gradient: only the decay


# ---------------------------------------------------------------------------------------------
# gradient accumulation


@pytest.mark.oracle
def test_accumulating_two_ubatches_equals_one_step_on_the_whole_batch(tmp_path):
    """opt_period = 2: each ubatch's loss scaled by 1/2, gradients summed, one AdamW step.

    The reference is transformers' gradient of the mean cross-entropy over both sequences at
    once, one step of ggml's AdamW on it.
    """
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = save_tiny_hf(tmp_path / "llama", "llama", seed=2, vocab_size=20, hidden_size=16,
                        intermediate_size=20)
    hp, w = load_hf(path)
    ids = np.random.default_rng(3).integers(0, 20, (2, 7))
    tokens, labels = ids[:, :-1], ids[:, 1:]
    pars = OptimizerParams(adamw=AdamWParams(alpha=1e-2, wd=0.1))
    ctx = OptContext(w, "adamw", opt_period=2, get_opt_pars=lambda: pars)
    w0 = {k: v.copy() for k, v in w.items()}
    result = OptResult()
    for u in range(2):
        loss, grads, logits = loss_and_grads(w, hp, tokens[u], labels[u], opt_period=2)
        result.add(loss, logits.argmax(-1), labels[u], opt_period=2)
        assert ctx.eval_backward(w, grads) == (u == 1)
        if u == 0:
            assert all(np.array_equal(w[k], w0[k]) for k in w)  # no step inside a period
    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                          dtype=torch.float32)
    logits = model(torch.tensor(tokens)).logits
    whole = torch.nn.functional.cross_entropy(logits.reshape(-1, 20),
                                              torch.tensor(labels).reshape(-1))
    whole.backward()
    assert abs(result.loss()[0] - whole.item()) < 1e-5  # the per-ubatch losses, rescaled
    b1h, b2h = adamw_bias_corrections(0.9, 0.999, 1)
    for name, p in model.named_parameters():
        gguf = gguf_tensor_name(name)
        g = p.grad.numpy()
        if ".attn_q." in gguf or ".attn_k." in gguf:
            g = permute(g, hp.n_head if ".attn_q." in gguf else hp.n_head_kv)
        if gguf not in ctx.params:
            continue
        acc = ctx.grad_accs[gguf]
        assert np.abs(acc - g).max() <= 1e-4 * np.abs(g).max(), gguf
        expected, _, _ = opt_step_adamw(w0[gguf], acc, np.zeros_like(acc), np.zeros_like(acc),
                                        pars.adamw, b1h, b2h)
        assert np.array_equal(w[gguf], expected)
    assert ctx.iter == 2


def test_accumulators_restart_with_each_period():
    w = {"output_norm.weight": np.zeros(1)}
    seen = []
    ctx = OptContext(w, "sgd", opt_period=2,
                     get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=1.0)))
    for g in (1.0, 2.0, 10.0, 20.0):
        ctx.eval_backward(w, {"output_norm.weight": np.array([g])})
        seen.append(float(w["output_norm.weight"][0]))
    assert seen == [0.0, -3.0, -3.0, -33.0]


# ---------------------------------------------------------------------------------------------
# loss, accuracy, uncertainties, progress line


def test_loss_and_accuracy_uncertainties():
    r = OptResult()
    assert r.loss()[0] == 0.0 and math.isnan(r.loss()[1])  # no batch
    r.add(np.float32(0.5), np.array([1, 2]), np.array([1, 2]), opt_period=2)
    loss, unc = r.loss()
    assert loss == 1.0 and math.isnan(unc)  # one batch: NaN, the loss rescaled by opt_period
    r.add(np.float32(1.5), np.array([0, 2]), np.array([1, 2]), opt_period=2)
    r.add(np.float32(1.0), np.array([3, 3]), np.array([1, 1]), opt_period=2)
    x = np.array([1.0, 3.0, 2.0])
    loss, unc = r.loss()
    assert loss == 2.0
    assert abs(unc - math.sqrt((np.mean(x * x) - 4.0) / 2)) < 1e-15
    acc, acc_unc = r.accuracy()
    assert acc == 3 / 6 and abs(acc_unc - math.sqrt(0.25 / 5)) < 1e-15
    one = OptResult()
    one.add(np.float32(1.0), np.array([4]), np.array([4]), opt_period=1)
    assert one.accuracy()[0] == 1.0 and math.isnan(one.accuracy()[1])  # < 2 rows
    with pytest.raises(TrainingError, match="varying batch size"):
        r.add(np.float32(1.0), np.array([1]), np.array([1]), opt_period=2)
    with pytest.raises(TrainingError, match="opt_period"):
        r.add(np.float32(1.0), np.array([1, 1]), np.array([1, 1]), opt_period=1)
    r.reset()
    assert r.ndata == 0 and r.loss()[0] == 0.0


def _c_bar(ibatch: int, ibatch_max: int) -> str:
    """``ggml_opt_epoch_callback_progress_bar``'s if-chain, transcribed."""
    out = ""
    for j in range(8):
        for k, ch in zip(range(8, 0, -1), "█▉▊▋▌▍▎▏", strict=True):
            if ibatch_max * (8 * j + k) // 8 < 8 * ibatch:
                out += ch
                break
        else:
            out += " "
    return out


@given(st.integers(1, 200), st.integers(0, 200))
def test_progress_bar_cells(ibatch_max, i):
    ibatch = 1 + i % ibatch_max
    assert progress_bar_cells(ibatch, ibatch_max) == _c_bar(ibatch, ibatch_max)


def test_progress_line_exact_format():
    r = OptResult()
    for loss, pred in ((2.0, [1, 1]), (3.0, [1, 2]), (4.0, [2, 2])):
        r.add(np.float32(loss), np.array(pred), np.array([1, 2]), opt_period=1)
    t = 3723 * 1_000_000 + 5  # 1 h 2 min 3 s
    line = progress_bar(True, r, 3, 8, 512, t)
    eta = t * 5 // 3 // 1_000_000  # 6205 s = 01:43:25
    assert eta == 6205
    assert line == (
        "train: [███      ] data=0001536/0004096 loss=3.00000±0.57735 acc=66.67±21.08% "
        "t=01:02:03 ETA=01:43:25 \r"
    ).replace("███      ", _c_bar(3, 8))
    last = progress_bar(False, r, 8, 8, 512, t)
    assert last.startswith("val:   [███████▉] data=0004096/0004096 ")
    assert last.endswith(" ETA=00:00:00 \r\n")
    empty = OptResult()
    empty.add(np.float32(1.0), np.array([0]), np.array([0]), opt_period=1)
    assert "loss=1.00000±nan acc=100.00±nan% " in progress_bar(True, empty, 1, 2, 1, 0)


# ---------------------------------------------------------------------------------------------
# the learning-rate schedule


def _notes_lr(lr0, lr_min, decay_epochs, epochs, epoch):
    """Section 8.3 of the notes, in double."""
    scale_epoch = 0.0
    if 0 < lr_min < lr0:
        nhalf = math.log2(lr0 / lr_min)
        e = decay_epochs if 0 < decay_epochs < epochs else epochs
        decay_epochs = e
        scale_epoch = nhalf / e
    if lr_min <= 0:
        return lr0
    return lr_min if epoch >= decay_epochs else lr0 * 0.5 ** (epoch * scale_epoch)


SCHEDULES = [
    dict(lr0=1e-3, lr_min=-1.0, decay_epochs=-1.0, epochs=4),  # off
    dict(lr0=1e-3, lr_min=0.0, decay_epochs=2.0, epochs=4),  # lr_min <= 0: off
    dict(lr0=1e-3, lr_min=1e-4, decay_epochs=-1.0, epochs=5),  # decay over every epoch
    dict(lr0=1e-3, lr_min=1e-4, decay_epochs=0.0, epochs=5),  # decay_epochs <= 0
    dict(lr0=1e-3, lr_min=1e-4, decay_epochs=2.0, epochs=5),  # then lr_min after epoch 2
    dict(lr0=1e-3, lr_min=1e-4, decay_epochs=9.0, epochs=5),  # decay_epochs >= epochs
    dict(lr0=1e-3, lr_min=1e-4, decay_epochs=5.0, epochs=5),
    dict(lr0=1e-3, lr_min=1e-3, decay_epochs=-1.0, epochs=3),  # lr_min == lr0
    dict(lr0=1e-3, lr_min=5e-3, decay_epochs=-1.0, epochs=3),  # lr_min > lr0: lr_min throughout
    dict(lr0=1e-3, lr_min=5e-3, decay_epochs=2.0, epochs=4),  # ... from decay_epochs on
]


@pytest.mark.parametrize("kw", SCHEDULES)
def test_lr_schedule_matches_the_formula(kw):
    lr = lr_opt_init(**kw)
    for epoch in range(kw["epochs"] + 3):  # epochs past the decay too
        expected = _notes_lr(kw["lr0"], kw["lr_min"], kw["decay_epochs"], kw["epochs"], epoch)
        assert abs(get_lr(lr, epoch) - expected) <= 1e-6 * expected, (epoch, expected)


def test_lr_schedule_edges_and_pars():
    lr = lr_opt_init(lr0=1e-3, lr_min=1e-4, decay_epochs=2.0, epochs=5)
    assert lr.decay_epochs == 2.0
    assert lr_opt_init(lr0=1e-3, lr_min=1e-4, decay_epochs=9.0, epochs=5).decay_epochs == 5.0
    assert get_lr(lr, 2) == get_lr(lr, 100) == np.float32(1e-4)
    assert get_lr(lr_opt_init(lr0=1e-3, lr_min=5e-3, epochs=3), 0) == np.float32(5e-3)
    p = opt_lr_pars(lr_opt_init(lr0=1e-3, lr_min=1e-4, wd=0.01, epochs=2), 1)
    assert p.adamw.alpha == p.sgd.alpha == get_lr(lr_opt_init(lr0=1e-3, lr_min=1e-4), 1)
    assert p.adamw.wd == p.sgd.wd == 0.01 and p.adamw.eps == 1e-8
    assert lr_log_line(1, 0.00031622776) == "epoch 1 lr=0.00032\n"
    with pytest.raises(ScheduleError):
        lr_opt_init(epochs=-1)


# ---------------------------------------------------------------------------------------------
# the dataset and the split


@given(st.integers(0, 400), st.integers(1, 64), st.integers(1, 40))
def test_dataset_count_and_contents(n_tokens, n_ctx, stride):
    tokens = np.arange(n_tokens) * 7 % 101
    if n_tokens - n_ctx - 1 < stride:  # llama.cpp would assert ndata > 0 (or wrap around)
        with pytest.raises(DatasetError, match=f"at least {n_ctx + 1 + stride} tokens"):
            opt_dataset_init(tokens, n_ctx, stride)
        return
    data, labels = opt_dataset_init(tokens, n_ctx, stride)
    assert len(data) == (n_tokens - n_ctx - 1) // stride == dataset_ndata(n_tokens, n_ctx, stride)
    for i in (0, len(data) - 1):
        assert data[i].tolist() == tokens[i * stride : i * stride + n_ctx].tolist()
        assert labels[i].tolist() == tokens[i * stride + 1 : i * stride + n_ctx + 1].tolist()
    assert data.dtype == labels.dtype == np.int32


def test_dataset_edges():
    assert dataset_ndata(32 + 1 + 16, 32, 16) == 1  # the shortest text
    with pytest.raises(DatasetError, match="at least 49 tokens are needed"):
        dataset_ndata(48, 32, 16)
    with pytest.raises(DatasetError, match="at least 49"):
        dataset_ndata(10, 32, 16)  # C's unsigned subtraction would wrap here
    with pytest.raises(DatasetError, match="positive"):
        dataset_ndata(100, 32, 0)
    data, _ = opt_dataset_init(np.arange(20), n_ctx=8)  # finetune's stride n_ctx / 2
    assert [d[0] for d in data] == [0, 4]


def _notes_split(ndata, val_split):
    return int(np.float32(ndata) * (np.float32(1.0) - np.float32(val_split)))


@pytest.mark.parametrize("ndata, val_split", [
    (20, 0.05), (10, 0.05), (1, 0.05), (7, 0.0), (7, 1.0), (3, 0.5), (100, 0.1), (19, 0.05),
])
def test_split_matches_the_formula(ndata, val_split):
    assert idata_split(ndata, val_split) == _notes_split(ndata, val_split)


def test_split_edges():
    assert idata_split(20, 0.05) == 19 and idata_split(10, 0.05) == 9  # float: 9.4999..
    assert idata_split(1, 0.05) == 0  # everything validates
    assert idata_split(10, 1.04) == 0  # -0.4 truncates to 0: accepted, as in C
    for bad in (1.5, -0.5, math.nan, math.inf):
        with pytest.raises(DatasetError, match="outside"):
            idata_split(10, bad)


# ---------------------------------------------------------------------------------------------
# an epoch


def test_epoch_trains_in_order_then_validates():
    hp = tiny_hparams(n_layer=1)
    w = random_weights(hp, seed=0)
    w0 = {k: v.copy() for k, v in w.items()}
    data, labels = opt_dataset_init(np.arange(40) * 5 % 32, n_ctx=8)  # stride 4: 7 datapoints
    split = idata_split(len(data), 0.3)
    ctx = OptContext(w, "sgd", get_opt_pars=lambda: OptimizerParams(sgd=SGDParams(alpha=0.1)))
    lines = []
    train, val = OptResult(), OptResult()
    opt_epoch(w, hp, ctx, data, labels, split, train, val,
              lambda *a: lines.append(progress_bar(*a, t_us=1_000_000)))
    assert (len(data), split, ctx.iter) == (7, 4, 5)  # one SGD step per training datapoint
    assert train.ndata == 4 * 8 and val.ndata == 3 * 8
    assert [line[:7] for line in lines] == ["train: "] * 4 + ["val:   "] * 3
    assert lines[3].endswith("\r\n") and lines[6].endswith("\r\n")
    assert "data=0000024/0000024" in lines[6]
    assert np.array_equal(w["token_embd.weight"], w0["token_embd.weight"])
    assert not np.array_equal(w["output.weight"], w0["output.weight"])
    # datapoint 0 alone, by hand: the same step
    by_hand = {k: v.copy() for k, v in w0.items()}
    _, grads, _ = loss_and_grads(by_hand, hp, data[0], labels[0])
    first = OptContext(by_hand, "sgd", get_opt_pars=ctx.get_opt_pars)
    first.eval_backward(by_hand, grads)
    again = {k: v.copy() for k, v in w0.items()}
    opt_epoch(again, hp, OptContext(again, "sgd", get_opt_pars=ctx.get_opt_pars), data[:1],
              labels[:1], 1, OptResult(), OptResult())
    assert all(np.array_equal(again[k], by_hand[k]) for k in w0)
    with pytest.raises(DatasetError):
        opt_epoch(w, hp, ctx, data, labels, 8, OptResult(), OptResult())


# ---------------------------------------------------------------------------------------------
# llama.cpp itself: llama_opt_init / llama_opt_epoch through ctypes
#
# llama-cpp-python binds llama_opt_* incompletely (no optimizer_type, no ggml_opt_* functions;
# notes 8.4), so the structs and functions are declared here from llama.h / ggml-opt.h. The
# context's n_ctx is padded to a multiple of 256 (llama_context's constructor), so the
# datapoints have 256 tokens. K/V are trained (n_ubatch == n_ctx), one ubatch per datapoint.

N_CTX_LLAMACPP = 256


def _llamacpp_train(gguf, data, labels, split: int, optimizer: str, pars: OptimizerParams):
    """One ``llama_opt_epoch`` of llama.cpp: the saved weights and the four result values."""
    import ctypes
    import os

    llama_cpp = pytest.importorskip("llama_cpp")
    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    ggml = ctypes.CDLL(os.path.join(lib, "libggml-base.so"))
    llama = ctypes.CDLL(os.path.join(lib, "libllama.so"))
    f, p, i64, dbl = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double

    class Pars(ctypes.Structure):  # struct ggml_opt_optimizer_params
        _fields_ = [("adamw", f * 5), ("sgd", f * 2)]

    class LlamaOptParams(ctypes.Structure):  # struct llama_opt_params (with optimizer_type)
        _fields_ = [("n_ctx_train", ctypes.c_uint32), ("param_filter", p),
                    ("param_filter_ud", p), ("get_opt_pars", p), ("get_opt_pars_ud", p),
                    ("optimizer_type", ctypes.c_int)]

    for name, res, args in [
        ("ggml_opt_dataset_init", p, [ctypes.c_int, ctypes.c_int, i64, i64, i64, i64]),
        ("ggml_opt_dataset_data", p, [p]), ("ggml_opt_dataset_labels", p, [p]),
        ("ggml_get_data", p, [p]), ("ggml_opt_result_init", p, []),
        ("ggml_opt_result_loss", None, [p, ctypes.POINTER(dbl), ctypes.POINTER(dbl)]),
        ("ggml_opt_result_accuracy", None, [p, ctypes.POINTER(dbl), ctypes.POINTER(dbl)]),
    ]:
        getattr(ggml, name).restype, getattr(ggml, name).argtypes = res, args
    llama.llama_opt_init.argtypes = [p, p, LlamaOptParams]
    llama.llama_opt_epoch.argtypes = [p, p, p, p, i64, p, p]

    mp = llama_cpp.llama_model_default_params()
    mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: writable weights, as finetune forces
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = N_CTX_LLAMACPP
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = 0  # F32, as finetune forces
    cp.flash_attn_type = 0
    ctx = llama_cpp.llama_init_from_model(model, cp)
    a, s = pars.adamw, pars.sgd
    c_pars = Pars((f * 5)(a.alpha, a.beta1, a.beta2, a.eps, a.wd), (f * 2)(s.alpha, s.wd))
    lp = LlamaOptParams(0, ctypes.cast(llama.llama_opt_param_filter_all, p), None,
                        ctypes.cast(ggml.ggml_opt_get_constant_optimizer_params, p),
                        ctypes.cast(ctypes.pointer(c_pars), p), ("adamw", "sgd").index(optimizer))
    llama.llama_opt_init(ctx, model, lp)
    dataset = ggml.ggml_opt_dataset_init(26, 26, N_CTX_LLAMACPP, N_CTX_LLAMACPP, len(data), 1)
    for tensor, src in ((ggml.ggml_opt_dataset_data(dataset), data),
                        (ggml.ggml_opt_dataset_labels(dataset), labels)):
        src = np.ascontiguousarray(src, dtype=np.int32)
        ctypes.memmove(ggml.ggml_get_data(tensor), src.ctypes.data, src.nbytes)
    results = [ggml.ggml_opt_result_init(), ggml.ggml_opt_result_init()]
    llama.llama_opt_epoch(ctx, dataset, results[0], results[1], split, None, None)
    values = []
    for r in results:
        v = [dbl() for _ in range(4)]
        ggml.ggml_opt_result_loss(r, ctypes.byref(v[0]), ctypes.byref(v[1]))
        ggml.ggml_opt_result_accuracy(r, ctypes.byref(v[2]), ctypes.byref(v[3]))
        values.append([x.value for x in v])
    out = gguf.with_name("trained.gguf")
    llama_cpp.llama_model_save_to_file(model, str(out).encode())
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return {k: np.array(v) for k, v in read_gguf(out).tensors.items()}, values


def _llamacpp_case(tmp_path, ndata: int):
    hp = tiny_hparams(n_layer=1, n_ctx_train=N_CTX_LLAMACPP)
    w = random_weights(hp, seed=0)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", hp, w)
    n_tokens = N_CTX_LLAMACPP + 1 + N_CTX_LLAMACPP // 2 * ndata
    data, labels = opt_dataset_init(np.random.default_rng(1).integers(3, 32, n_tokens),
                                    N_CTX_LLAMACPP)
    assert len(data) == ndata
    return hp, w, gguf, data, labels


def _spec_epoch(hp, w, data, labels, split, optimizer, pars, cumulative=False):
    ours = {k: v.copy() for k, v in w.items()}
    ctx = OptContext(ours, optimizer, get_opt_pars=lambda: pars)
    train, val = OptResult(), OptResult()
    if not cumulative:
        opt_epoch(ours, hp, ctx, data, labels, split, train, val)
        return ours, [[*train.loss(), *train.accuracy()], [*val.loss(), *val.accuracy()]]
    running = {}
    for idata in range(split):  # what llama.cpp does: the accumulators are never zeroed
        _, grads, _ = loss_and_grads(ours, hp, data[idata], labels[idata])
        running = {k: running.get(k, 0) + g for k, g in grads.items()}
        ctx.eval_backward(ours, running)
    return ours, None


LLAMACPP_PARS = OptimizerParams(AdamWParams(alpha=1e-2, wd=0.1), SGDParams(alpha=0.1, wd=0.1))


@pytest.mark.oracle
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_one_llamacpp_training_step_equals_the_spec(tmp_path, optimizer):
    """One datapoint trains (one step), one validates: weights and results as llama.cpp's."""
    hp, w, gguf, data, labels = _llamacpp_case(tmp_path, ndata=2)
    theirs, their_results = _llamacpp_train(gguf, data, labels, 1, optimizer, LLAMACPP_PARS)
    ours, our_results = _spec_epoch(hp, w, data, labels, 1, optimizer, LLAMACPP_PARS)
    assert set(theirs) == set(w)
    for name in w:
        moved = np.abs(ours[name] - w[name]).max()
        assert np.abs(theirs[name] - ours[name]).max() <= 1e-6 * np.abs(w[name]).max(), name
        assert moved > 1e-4 or name == "token_embd.weight"  # every trained tensor moved
    assert np.array_equal(theirs["token_embd.weight"], w["token_embd.weight"])
    np.testing.assert_allclose(our_results, their_results, rtol=1e-6)  # NaN where theirs is


@pytest.mark.oracle
def test_llamacpp_steps_on_the_cumulative_gradient(tmp_path):
    r"""Divergence: llama.cpp never zeroes its gradient accumulators between steps.

    ``llama_opt_epoch`` builds non-static graphs, so ``ggml_opt_build`` makes accumulators
    (``accumulate`` is true) that only the first allocation zeroes: ``ggml_opt_alloc``'s reset
    (``ggml_graph_reset(opt_ctx->gb_grad)`` at the start of a period) finds ``gb_grad`` already
    set to NULL by the previous ``ggml_opt_eval``. Step $t$ then uses $\sum_{s \le t} g_s$.
    The specification zeroes them with each period, as ggml-opt intends.
    """
    hp, w, gguf, data, labels = _llamacpp_case(tmp_path, ndata=3)
    theirs, _ = _llamacpp_train(gguf, data, labels, 2, "sgd", LLAMACPP_PARS)
    ours, _ = _spec_epoch(hp, w, data, labels, 2, "sgd", LLAMACPP_PARS)
    cumulative, _ = _spec_epoch(hp, w, data, labels, 2, "sgd", LLAMACPP_PARS, cumulative=True)
    for name in w:
        scale = np.abs(w[name]).max()
        assert np.abs(theirs[name] - cumulative[name]).max() <= 1e-6 * scale, name
        if name != "token_embd.weight":
            assert np.abs(theirs[name] - ours[name]).max() > 1e-3 * scale, name
