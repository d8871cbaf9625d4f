r"""The peers of ``llamaref bench --vs``: mlx-lm and llama.cpp, on the same weights as ours.

- **mlx-lm** (``--vs mlx-lm``), the twin's rival on the same array library: its own Llama,
  Mamba and Mamba-2 (``mlx_lm.models``), its caches (``make_prompt_cache``) and its
  generation loop (``generate_step``, greedy), built from *our* tensors at the same precision
  ([`mlx_lm_model`][]). Only the ratio ours / mlx-lm means something across machines.
- **llama.cpp** (``--vs llama.cpp``), the reference's natural rival on a CPU: llama.cpp
  through llama-cpp-python's low-level API ([`llamaref.llamacpp`][llamaref.llamacpp]) on the
  same GGUF file ([`LlamaCppRunner`][]), with its defaults (f16 KV cache, its own quantized
  matmuls), the same ``n_ctx`` and ``n_batch`` as our contexts, and ``--threads`` CPU threads
  (default: every core, as OpenBLAS, which the reference's matmuls call, uses).

Every runner answers the same calls: ``set_depth(tokens)`` (fill the cache, not timed),
``pp(tokens)`` and ``tg(first, n_gen)`` after that depth, ``parallel_context`` and ``pl``;
each timed call returns seconds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from accelerated.quants import MLXQuantized, load_weight
from llamaref.llamacpp import LlamaCppContext
from reference.batch import Batch
from reference.common import LlamarefError
from reference.hparams import MAMBA_ARCHS, LlamaHParams, MambaHParams

if TYPE_CHECKING:
    import mlx.nn as nn

MLX_LM_PREFILL = 2048
"""Tokens per forward when mlx-lm fills a cache to a depth (its ``prefill_step_size``)."""


#: the error of a run that needs mlx-lm where it is not installed
MLX_LM_MISSING = "--vs mlx-lm needs mlx-lm: pip install 'llamaref[bench]'"


class PeerError(LlamarefError, ValueError):
    """The peer cannot run this model from these weights (or is not installed)."""


# ---------------------------------------------------------------------------------------------
# mlx-lm: its models built from our weights
# ---------------------------------------------------------------------------------------------


def check_mlx_lm_model(hparams) -> None:
    """Refuse a model that mlx-lm's ``llama``, ``mamba`` or ``mamba2`` cannot run exactly.

    Raises:
        PeerError: another architecture; a llama with a sliding window, RoPE scaling, a
            custom attention scale or partial RoPE; a Mamba-2 with more than one group
            (mlx-lm's gated norm spans all of ``d_inner``); a FalconMamba (``dt_b_c_rms``);
            a norm epsilon other than mlx-lm's ``1e-5``.

    Examples:
        >>> from reference.testing import tiny_hparams, tiny_mamba_hparams
        >>> check_mlx_lm_model(tiny_hparams("qwen2"))
        Traceback (most recent call last):
        ...
        llamaref.bench.peers.PeerError: --vs mlx-lm runs arch llama, mamba or mamba2; this model is 'qwen2'
        >>> check_mlx_lm_model(tiny_mamba_hparams("mamba2", n_group=2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        llamaref.bench.peers.PeerError: --vs mlx-lm: a Mamba-2 with 2 groups; ...
    """  # noqa: E501
    arch = hparams.arch
    if arch in MAMBA_ARCHS:
        if arch == "mamba2" and hparams.ssm_n_group != 1:
            raise PeerError(f"--vs mlx-lm: a Mamba-2 with {hparams.ssm_n_group} groups; "
                            "mlx-lm's gated norm spans the whole d_inner (one group)")
        if hparams.ssm_dt_b_c_rms or abs(hparams.f_norm_rms_eps - 1e-5) > 1e-9:
            raise PeerError("--vs mlx-lm: FalconMamba's dt/B/C norms, or a norm epsilon "
                            "other than 1e-5, are not built the same by mlx-lm")
        return
    if arch != "llama":
        raise PeerError(f"--vs mlx-lm runs arch llama, mamba or mamba2; this model is {arch!r}")
    if hparams.n_swa or hparams.rope_freq_scale_train != 1.0 or hparams.f_attention_scale:
        raise PeerError("--vs mlx-lm: this llama uses a sliding window, RoPE scaling or a "
                        "custom attention scale, which the peer's llama does not build the same")
    if hparams.n_rot != hparams.n_embd_head_k:
        raise PeerError("--vs mlx-lm: partial RoPE (n_rot < head_dim) is not mlx-lm's llama")


# --8<-- [start:mlx_lm_model]
def mlx_lm_model(hparams: LlamaHParams | MambaHParams, weights: dict,
                 matmul: str = "quantized") -> nn.Module:
    """mlx-lm's model holding *our* weights, in the form our MLX twin holds them.

    A llama: ``rope_traditional=True``: GGUF stores Q and K permuted for the interleaved
    RoPE (llama.cpp's "normal" mode), which is MLX's ``traditional`` RoPE. Each weight goes
    through [`accelerated.quants.load_weight`][accelerated.quants.load_weight]: with
    ``matmul="quantized"`` a tensor of a type MLX holds (exactly, or Q6_K and Q2_K within their
    bound, as the twin holds them) becomes
    [`accelerated.quants.MLXQuantized`][accelerated.quants.MLXQuantized] and its layer
    ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` with that ``w_q``, ``scales`` and ``biases``;
    with ``matmul="dense"`` every weight is dequantized (exactly) to float32 and the layers stay
    ``nn.Linear`` / ``nn.Embedding``. Other weights are float32 either way. A Mamba or Mamba-2:
    [`mlx_lm_mamba_model`][] (dense float32).

    Args:
        hparams: a llama, mamba or mamba2 ([`check_mlx_lm_model`][]).
        weights: GGUF-named weights (NumPy arrays or quantized tensors).
        matmul: ``"quantized"`` or ``"dense"``, as the twin's ``matmul``.

    Returns:
        ``mlx_lm.models.llama.Model`` (or ``mamba``/``mamba2``), parameters evaluated.

    Raises:
        PeerError: mlx-lm is not installed; see [`check_mlx_lm_model`][]; a weight with a
            bias.
    """
    import mlx.core as mx
    import mlx.nn as nn

    try:
        from mlx_lm.models import llama
    except ImportError:
        raise PeerError(MLX_LM_MISSING) from None
    check_mlx_lm_model(hparams)
    if hparams.arch in MAMBA_ARCHS:
        return mlx_lm_mamba_model(hparams, weights)
    w = {name: load_weight(t, mx.float32, keep_quantized=matmul == "quantized",
                           bounded=matmul == "quantized")
         for name, t in weights.items()}
    if any(name.endswith(".bias") for name in w):
        raise PeerError("--vs mlx-lm: this llama has biases; mlx-lm's llama has none")
    tied = "output.weight" not in w
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hparams.n_embd, num_hidden_layers=hparams.n_layer,
        intermediate_size=hparams.n_ff, num_attention_heads=hparams.n_head,
        num_key_value_heads=hparams.n_head_kv, head_dim=hparams.n_embd_head_k,
        rms_norm_eps=hparams.f_norm_rms_eps, vocab_size=hparams.n_vocab,
        rope_theta=hparams.rope_freq_base_train, rope_traditional=True,
        tie_word_embeddings=tied, max_position_embeddings=hparams.n_ctx_train,
    )
    model = llama.Model(args)
    gguf_names = _mlx_lm_names(hparams.n_layer, tied)
    by_path = {path: w[name] for path, name in gguf_names.items()}

    def quantize_as_ours(path, module):  # nn.quantize's predicate: our bits per layer
        q = by_path.get(path + ".weight")
        return {"group_size": q.group_size, "bits": q.bits, "mode": q.mode} \
            if isinstance(q, MLXQuantized) else False

    nn.quantize(model, class_predicate=quantize_as_ours)
    params = []
    for path, value in by_path.items():
        if isinstance(value, MLXQuantized):
            prefix = path.removesuffix(".weight")
            params += [(path, value.w_q), (prefix + ".scales", value.scales)]
            if value.biases is not None:  # MXFP4 has none
                params.append((prefix + ".biases", value.biases))
        else:
            params.append((path, value.astype(mx.float32)))
    model.load_weights(params, strict=True)
    mx.eval(model.parameters())
    return model
# --8<-- [end:mlx_lm_model]


def _mlx_lm_names(n_layer: int, tied: bool) -> dict[str, str]:
    """mlx-lm parameter path -> GGUF tensor name."""
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for il in range(n_layer):
        for ours, gguf in per_layer.items():
            names[f"model.layers.{il}.{ours}.weight"] = f"blk.{il}.{gguf}.weight"
    return names


# --8<-- [start:mlx_lm_mamba_model]
def mlx_lm_mamba_model(hparams: MambaHParams, weights: dict) -> nn.Module:
    r"""mlx-lm's Mamba (``mlx_lm.models.mamba``) or Mamba-2 (``mamba2``) on our weights.

    The GGUF tensors map onto mlx-lm's modules as llama.cpp's converter mapped them from
    HF's, backwards: ``ssm_a`` holds $A = -e^{A_{\log}}$, so ``A_log`` $= \log(-A)$ (one
    rounding; the logits then agree to NMSE far below an op's threshold,
    ``tests/app/test_bench.py``); the depthwise ``ssm_conv1d`` ``(channels, d_conv)`` becomes
    ``nn.Conv1d``'s ``(channels, d_conv, 1)``; a Mamba-2's per-head ``ssm_a``, ``ssm_d``
    ``(n_head, 1)`` become vectors, and its one-group ``ssm_norm`` the gated norm's gain.
    Mamba-2's ``dt`` is not clipped (``time_step_limit`` ``(0, inf)``), as in llama.cpp.
    Every weight is dense float32.

    Raises:
        PeerError: mlx-lm is not installed; see [`check_mlx_lm_model`][].
    """
    import mlx.core as mx

    try:
        from mlx_lm.models import mamba, mamba2
    except ImportError:
        raise PeerError(MLX_LM_MISSING) from None
    check_mlx_lm_model(hparams)
    w = {name: np.asarray(load_weight(t, mx.float32), dtype=np.float32)
         for name, t in weights.items()}
    tied = "output.weight" not in w
    d_inner, n_layer = hparams.ssm_d_inner, hparams.n_layer
    common = dict(vocab_size=hparams.n_vocab, hidden_size=hparams.n_embd,
                  intermediate_size=d_inner, state_size=hparams.ssm_d_state,
                  num_hidden_layers=n_layer, conv_kernel=hparams.ssm_d_conv, use_bias=False,
                  use_conv_bias=True, tie_word_embeddings=tied)
    if hparams.arch == "mamba":
        model = mamba.Model(mamba.ModelArgs(model_type="mamba",
                                            time_step_rank=hparams.ssm_dt_rank, **common))
    else:
        n_head = hparams.n_head()
        model = mamba2.Model(mamba2.ModelArgs(
            model_type="mamba2", num_heads=n_head, head_dim=d_inner // n_head,
            layer_norm_epsilon=hparams.f_norm_rms_eps, n_groups=1,
            time_step_limit=(0.0, float("inf")), time_step_rank=n_head, **common))
    params = {"backbone.embeddings.weight": w["token_embd.weight"],
              "backbone.norm_f.weight": w["output_norm.weight"]}
    if not tied:
        params["lm_head.weight"] = w["output.weight"]
    for il in range(n_layer):
        params.update(_mamba_layer(w, il, hparams))
    model.load_weights([(k, mx.array(v)) for k, v in params.items()], strict=True)
    mx.eval(model.parameters())
    return model
# --8<-- [end:mlx_lm_mamba_model]


def _mamba_layer(w: dict, il: int, hparams: MambaHParams) -> dict[str, np.ndarray]:
    """One layer's mlx-lm parameters (path -> array) from our GGUF-named weights."""
    b, m = f"blk.{il}.", f"backbone.layers.{il}."
    out = {
        m + "norm.weight": w[b + "attn_norm.weight"],
        m + "mixer.in_proj.weight": w[b + "ssm_in.weight"],
        m + "mixer.conv1d.weight": w[b + "ssm_conv1d.weight"][:, :, None],  # (C, d_conv, 1)
        m + "mixer.conv1d.bias": w[b + "ssm_conv1d.bias"],
        m + "mixer.out_proj.weight": w[b + "ssm_out.weight"],
    }
    a_log = np.log(-w[b + "ssm_a"].astype(np.float64)).astype(np.float32)
    if hparams.arch == "mamba":
        out.update({
            m + "mixer.x_proj.weight": w[b + "ssm_x.weight"],
            m + "mixer.dt_proj.weight": w[b + "ssm_dt.weight"],
            m + "mixer.dt_proj.bias": w[b + "ssm_dt.bias"],
            m + "mixer.A_log": a_log,  # (d_inner, d_state)
            m + "mixer.D": w[b + "ssm_d"],
        })
    else:
        out.update({
            m + "mixer.dt_bias": w[b + "ssm_dt.bias"],
            m + "mixer.A_log": a_log.reshape(-1),  # (n_head,)
            m + "mixer.D": w[b + "ssm_d"].reshape(-1),  # (n_head,)
            m + "mixer.norm.weight": w[b + "ssm_norm.weight"].reshape(-1),  # (d_inner,)
        })
    return out


# --8<-- [start:MLXLMRunner]
class MLXLMRunner:
    """Times mlx-lm on the three tests: its model, its caches, its ``generate_step``.

    Args:
        model: from [`mlx_lm_model`][].
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.last_tokens: list[int] = []
        self.depth = 0
        self._cache: list | None = None  # the cache at the depth, or None at depth 0
        self._saved: list | None = None  # a recurrent cache's states at the depth

    def set_depth(self, tokens: np.ndarray) -> None:
        """Fill a cache with ``tokens`` (not timed): ``pp`` and ``tg`` then start there."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.depth = len(tokens)
        self._cache = self._saved = None
        if not self.depth:
            return
        cache = make_prompt_cache(self.model)
        for i in range(0, self.depth, MLX_LM_PREFILL):
            self.model(mx.array(tokens[i:i + MLX_LM_PREFILL])[None], cache=cache)
            mx.eval([c.state for c in cache])
        self._cache = cache
        if not all(c.is_trimmable() for c in cache):  # a recurrent state: keep a copy
            self._saved = [c.state for c in cache]

    def _cache_at_depth(self) -> list:
        """The cache as [`set_depth`][] left it (later tokens trimmed, or states put back)."""
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        if self._cache is None:
            return make_prompt_cache(self.model)
        if self._saved is not None:
            for c, state in zip(self._cache, self._saved, strict=True):
                c.state = state
        else:
            trim_prompt_cache(self._cache, self._cache[0].offset - self.depth)
        return self._cache

    def pp(self, tokens: np.ndarray) -> float:
        """Seconds of mlx-lm's prompt processing after the depth.

        ``generate_step(max_tokens=0)`` is mlx-lm's prefill: the prompt but its last token
        (cache only: the lm_head is never evaluated for those rows), then the last token with
        logits and its greedy token, evaluated.
        """
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream

        cache = self._cache_at_depth()
        prompt = mx.array(tokens)
        t0 = time.perf_counter()
        for _ in generate_step(prompt, self.model, max_tokens=0, prompt_cache=cache):
            pass
        mx.synchronize(generation_stream)
        return time.perf_counter() - t0

    def tg(self, first_token: int, n_gen: int) -> float:
        """Seconds of ``n_gen`` one-token forwards after the depth, greedy.

        ``generate_step`` with a one-token prompt and ``max_tokens = n_gen - 1`` runs
        ``n_gen`` forwards (the prompt's, then one per token yielded; its next step is
        launched before a token is yielded); the last is waited for.
        """
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream

        cache = self._cache_at_depth()
        prompt = mx.array([int(first_token)], dtype=mx.int32)
        t0 = time.perf_counter()
        out = [int(t) for t, _ in generate_step(prompt, self.model, max_tokens=n_gen - 1,
                                                prompt_cache=cache)]
        mx.synchronize(generation_stream)  # the last forward was launched, not waited for
        seconds = time.perf_counter() - t0
        self.last_tokens = out
        return seconds

    def parallel_context(self, n_seq: int, n_prompt: int, n_steps: int) -> None:
        """Nothing to build: mlx-lm's cache is made per run (see [`pl`][])."""
        return None

    def pl(self, ctx: None, prompts: np.ndarray, n_steps: int) -> float:
        """Seconds of ``n_steps`` batched steps (batch ``n_seq``), after the prompts.

        The model is called on ``(n_seq, 1)`` tokens with mlx-lm's cache, and the greedy
        tokens are taken on the device; as ``generate_step``, the next step is launched
        (``mx.async_eval``) before the previous tokens are read back.
        """
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompts), cache=cache)  # (n_seq, n_prompt, n_vocab)
        y = mx.argmax(logits[:, -1, :], axis=-1)  # (n_seq,)
        mx.eval(y)
        t0 = time.perf_counter()
        for _ in range(n_steps):
            y_next = mx.argmax(self.model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y_next)
            y.tolist()
            y = y_next
        y.tolist()
        return time.perf_counter() - t0
# --8<-- [end:MLXLMRunner]


# ---------------------------------------------------------------------------------------------
# llama.cpp through llama-cpp-python
# ---------------------------------------------------------------------------------------------


# --8<-- [start:LlamaCppRunner]
class LlamaCppRunner:
    """Times llama.cpp on the three tests, over the application's one llama.cpp context.

    The same GGUF file as ours, read by llama.cpp itself: its weights stay in their file
    type (Q4_1 is multiplied as Q4_1, the activations quantized to Q8_1 inside the matmul),
    its KV cache is f16, flash attention as it decides (``auto``); nothing of this is
    changed ([`LlamaCppContext`][llamaref.llamacpp.LlamaCppContext] with ``f32=False``), so
    this is llama.cpp as ``llama-bench`` runs it. The sizes are ours: the same ``n_ctx``
    (llama.cpp pads it to 256 too) and ``n_batch = n_ubatch``; ``n_threads`` CPU threads for
    both prompt and generation. The greedy token is taken on the host with NumPy from
    ``llama_get_logits_ith``, as the reference takes its own.

    Args:
        path: the GGUF file.
        n_ctx: cells for ``pp``/``tg``.
        n_batch: the largest batch (``n_ubatch`` is the same).
        n_threads: CPU threads (None:
            [`default_threads`][llamaref.llamacpp.default_threads]).

    Raises:
        LlamaCppError: llama-cpp-python is missing, or llama.cpp cannot load the file.
    """

    def __init__(self, path: Path, n_ctx: int, n_batch: int, n_threads: int | None = None):
        self.path = path
        n_batch = max(1, n_batch)
        self.main = _peer_context(path, n_ctx, n_batch, 1, n_threads)
        self.n_threads = self.main.n_threads
        self.depth = 0
        self.last_tokens: list[int] = []

    def _decode(self, c: LlamaCppContext, tokens, pos0: int | list[int],
                seq_ids: list[int] | None = None, outputs: list[bool] | None = None) -> None:
        """``llama_decode`` of ``tokens`` at positions ``pos0, pos0 + 1, ...`` (or the list)."""
        n = len(tokens)
        pos = pos0 if isinstance(pos0, list) else list(range(pos0, pos0 + n))
        seq_id = [[0]] * n if seq_ids is None else [[s] for s in seq_ids]
        logits = [i == n - 1 for i in range(n)] if outputs is None else outputs
        rc = c.decode(Batch(token=tokens, pos=pos, seq_id=seq_id, logits=logits))
        if rc != 0:
            raise RuntimeError(f"llama.cpp's decode returned {rc}")

    def _argmax(self, c: LlamaCppContext, i: int) -> int:
        return int(np.argmax(c.get_logits_ith(i)))

    def set_depth(self, tokens: np.ndarray) -> None:
        """Fill the cache with ``tokens`` (not timed): ``pp`` and ``tg`` then start there."""
        c = self.main
        c.memory.clear(data=True)
        for i in range(0, len(tokens), c.n_batch):
            self._decode(c, tokens[i:i + c.n_batch], i)
        c.synchronize()
        self.depth = len(tokens)

    def _rewind(self) -> None:
        self.main.memory.seq_rm(0, self.depth, -1)

    def pp(self, tokens: np.ndarray) -> float:
        """Seconds to decode ``tokens`` in one batch after the depth (last logits only)."""
        self._rewind()
        t0 = time.perf_counter()
        self._decode(self.main, tokens, self.depth)
        self.main.synchronize()
        return time.perf_counter() - t0

    def tg(self, first_token: int, n_gen: int) -> float:
        """Seconds of ``n_gen`` one-token decodes after the depth, greedy on the host."""
        self._rewind()
        token, out = int(first_token), []
        t0 = time.perf_counter()
        for i in range(n_gen):
            self._decode(self.main, [token], self.depth + i)
            token = self._argmax(self.main, -1)
            out.append(token)
        seconds = time.perf_counter() - t0
        self.last_tokens = out
        return seconds

    def parallel_context(self, n_seq: int, n_prompt: int, n_steps: int) -> LlamaCppContext:
        """A context for ``pl{n_seq}``: ``n_seq`` sequences in one unified cache."""
        return _peer_context(self.path, n_seq * (n_prompt + n_steps),
                             max(n_seq * n_prompt, n_seq), n_seq, self.n_threads)

    def pl(self, c: LlamaCppContext, prompts: np.ndarray, n_steps: int) -> float:
        """Seconds of ``n_steps`` steps of one token per sequence, after the prompts."""
        n_seq, n_prompt = prompts.shape
        c.memory.clear(data=True)
        seq = [s for s in range(n_seq) for _ in range(n_prompt)]
        last = [i % n_prompt == n_prompt - 1 for i in range(n_seq * n_prompt)]
        self._decode(c, prompts.reshape(-1), [i % n_prompt for i in range(len(seq))], seq, last)
        tokens = [self._argmax(c, (s + 1) * n_prompt - 1) for s in range(n_seq)]
        t0 = time.perf_counter()
        for step in range(n_steps):
            self._decode(c, tokens, [n_prompt + step] * n_seq, list(range(n_seq)),
                         [True] * n_seq)
            tokens = [self._argmax(c, s) for s in range(n_seq)]
        return time.perf_counter() - t0
# --8<-- [end:LlamaCppRunner]


def _peer_context(path: Path, n_ctx: int, n_batch: int, n_seq_max: int,
                  n_threads: int | None) -> LlamaCppContext:
    """llama.cpp's context with its own defaults (f16 KV cache, flash attention ``auto``),
    one unified KV stream, ``n_ubatch = n_batch``."""
    return LlamaCppContext(path, n_ctx, n_batch, n_batch, n_seq_max=n_seq_max,
                           kv_unified=True, n_threads=n_threads, f32=False)
