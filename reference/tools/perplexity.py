r"""Perplexity and KL divergence: ``llama-perplexity`` (``tools/perplexity/perplexity.cpp``).

Two numbers tell how well a model predicts a text, and how far a cheaper copy of it (quantized
weights, another backend) moved away from the original. Both come from the same loop, written
here once against the Context protocol, so that either twin's Context runs it (and so does
llama.cpp's own context, in the oracle test).

**Chunks.** The text is tokenized once (with BOS when the vocabulary adds one) and cut into
chunks of ``n_ctx`` tokens. Each chunk is decoded alone, from an empty memory, at positions
$0 \ldots n_{ctx}-1$. When the vocabulary adds BOS, the *first token of every chunk is
replaced* by BOS (llama.cpp overwrites it, it does not prepend). Only the second half is
scored, so that every scored token sees at least $n_{ctx}/2$ tokens of context: the logits at
positions $f = \lfloor n_{ctx}/2 \rfloor \ldots n_{ctx}-2$ predict tokens $f+1 \ldots
n_{ctx}-1$, $n_{ctx} - 1 - f$ tokens per chunk. Several chunks share one decode, each on its
own sequence: $n_{seq} = \max(1, \lfloor n_{batch} / n_{ctx} \rfloor)$ of them.

**Perplexity.** With $z_k$ the logits that predict token $t_{k+1}$, over the $N$ scored tokens

$$
\mathrm{nll}_k = -\log \mathrm{softmax}(z_k)_{t_{k+1}}, \qquad
\mathrm{PPL} = \exp\Big(\frac{1}{N} \sum_k \mathrm{nll}_k\Big),
$$

and its uncertainty is the standard error of the mean carried through the exponential:

$$
\sigma = \sqrt{\frac{\langle \mathrm{nll}^2 \rangle - \langle \mathrm{nll} \rangle^2}{N - 1}},
\qquad \mathrm{PPL} \pm \mathrm{PPL} \cdot \sigma .
$$

**KL divergence.** ``--kl-divergence-base FILE`` stores, for every scored token, the base
model's log-probabilities quantized to 16 bits ([`quantize_log_probs`][]); a later run with
``--kl-divergence`` reads them back and compares another model (or backend) token by token
([`kld_tokens`][]):

$$
\mathrm{KLD}_k = \sum_{i:\ \log p_i > -16} p_i \,(\log p_i - \log q_i),
\qquad \Delta p_k = q_{t_{k+1}} - p_{t_{k+1}},
$$

with $p$ the base and $q$ the model under test, summed up in [`KLDStats`][].

**Strided perplexity** (``--ppl-stride S``) slides a window of ``n_ctx`` tokens by $S$ and
scores its last $S$ tokens. llama.cpp's version at the pinned commit is broken (it replaces
the first token by BOS *after* the decode, and takes the window length from the padded,
multi-sequence context size); the one here is the intended one, with the same BOS rule and
the same batching as the standard mode: see the divergences page.

The arithmetic follows llama.cpp's types: logits and their log-sum-exp in float32, the sum
of exponentials and the running sums in float64.

What is here decides which numbers come out, and the bytes of the base file: the runs write
and read it through a binary stream they are given (``io.BytesIO`` as well as a file).
Opening files by path and llama-perplexity's console lines are the application's
([`llamaref.perplexity`][llamaref.perplexity]).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from reference.batch import Batch
from reference.common import LlamarefError
from reference.context import Context

#: the base file's magic (``"_logits_"``, 8 bytes, no terminator)
LOGITS_MAGIC = b"_logits_"
#: log-probabilities below this (nats, base model) do not count in the KL divergence
KLD_MIN_LOG_PROB = -16.0
#: the quantized range: logits more than this below the maximum are stored as 0
QUANT_LOGIT_RANGE = 16.0
#: bytes before the base file's tokens: the magic, then int32 ``n_ctx``, ``n_vocab``, ``n_chunk``
LOGITS_HEADER_SIZE = len(LOGITS_MAGIC) + 12


class PerplexityError(LlamarefError, ValueError):
    """A perplexity run that cannot start: bad sizes, too short a text, a context too small."""


class LogitsFileError(PerplexityError):
    """A ``--kl-divergence-base`` file that is not one, is truncated, or is for another model."""


# ---- the chunks ----------------------------------------------------------------------------

# --8<-- [start:ChunkPlan]
@dataclass(frozen=True)
class ChunkPlan:
    """Where the chunks are, which positions are scored, how many share a decode.

    Attributes:
        n_ctx: tokens per chunk (the ``-c`` asked for, never padded).
        n_batch: tokens per decode (``min(n_batch, n_seq * n_ctx)``, as llama-perplexity's
            ``main``).
        n_seq: chunks per decode, each on its own sequence.
        n_chunk: chunks to evaluate.
        first: the first position whose logits are requested; positions ``first .. n_ctx -
            2`` are scored.
        stride: tokens between the starts of two chunks (``n_ctx``, or ``--ppl-stride``).
    """

    n_ctx: int
    n_batch: int
    n_seq: int
    n_chunk: int
    first: int
    stride: int

    @property
    def n_scored(self) -> int:
        """Tokens scored per chunk: $n_{ctx} - 1 - f$."""
        return self.n_ctx - 1 - self.first

    @property
    def num_batches(self) -> int:
        r"""Decodes per group of chunks: $\lceil n_{ctx} / n_{batch} \rceil$."""
        return -(-self.n_ctx // self.n_batch)

    def start(self, i: int) -> int:
        """The index of chunk ``i``'s first token in the text."""
        return i * self.stride
# --8<-- [end:ChunkPlan]


# --8<-- [start:plan_chunks]
def plan_chunks(n_tokens: int, n_ctx: int, n_batch: int = 2048, n_chunks: int = -1,
                ppl_stride: int = 0, n_seq_max: int | None = None) -> ChunkPlan:
    r"""The chunks of a text of ``n_tokens`` tokens (``perplexity()``'s set-up).

    Standard mode: chunk $c$ is tokens $[c\,n_{ctx}, (c+1)\,n_{ctx})$, $\lfloor
    n_{tokens}/n_{ctx} \rfloor$ of them, the second half scored. Strided mode (``ppl_stride
    = S > 0``): chunk $c$ starts at $cS$, $\lceil (n_{tokens} - n_{ctx}) / S \rceil$ of them,
    the last $S$ tokens scored.

    Args:
        n_tokens: tokens of the text (BOS included when the vocabulary adds one).
        n_ctx: tokens per chunk (``-c``), at least 4.
        n_batch: the most tokens per decode (``-b``); ``n_batch // n_ctx`` chunks share one.
        n_chunks: the most chunks to evaluate (``--chunks``; negative: all).
        ppl_stride: 0 for the standard mode, else the stride $S$, ``0 < S < n_ctx``.
        n_seq_max: cap on the chunks per decode (the KL-divergence mode caps it at the
            context's ``n_seq_max``).

    Raises:
        PerplexityError: ``n_ctx < 4``, ``n_batch < 1``, a stride out of range, or fewer than
            $2\,n_{ctx}$ tokens (llama.cpp's rule, in both modes).

    Examples:
        >>> plan_chunks(1000, n_ctx=128, n_batch=256)
        ChunkPlan(n_ctx=128, n_batch=256, n_seq=2, n_chunk=7, first=64, stride=128)
        >>> plan_chunks(1000, n_ctx=128, n_batch=300).n_batch  # capped at n_seq * n_ctx
        256
        >>> plan_chunks(1000, n_ctx=128, n_batch=2048, ppl_stride=32).n_chunk
        28
        >>> plan_chunks(200, n_ctx=128)
        Traceback (most recent call last):
        ...
        reference.tools.perplexity.PerplexityError: the text tokenizes to 200 tokens; perplexity with a context of 128 needs at least 256
    """  # noqa: E501
    if n_ctx < 4:
        raise PerplexityError(f"-c/--ctx-size = {n_ctx}: perplexity needs a context of at "
                              "least 4 tokens")
    if n_batch < 1:
        raise PerplexityError(f"-b/--batch-size = {n_batch} must be >= 1")
    if not 0 <= ppl_stride < n_ctx:
        raise PerplexityError(f"--ppl-stride = {ppl_stride} must be in [0, n_ctx = {n_ctx})")
    if n_tokens < 2 * n_ctx:
        raise PerplexityError(f"the text tokenizes to {n_tokens} tokens; perplexity with a "
                              f"context of {n_ctx} needs at least {2 * n_ctx}")
    n_seq = max(1, n_batch // n_ctx)
    if n_seq_max is not None:
        n_seq = min(n_seq, n_seq_max)
    if ppl_stride > 0:
        n_chunk_max = (n_tokens - n_ctx + ppl_stride - 1) // ppl_stride
        first, stride = n_ctx - ppl_stride - 1, ppl_stride
    else:
        n_chunk_max = n_tokens // n_ctx
        first, stride = n_ctx // 2, n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(n_chunks, n_chunk_max)
    if n_chunk < 1:
        raise PerplexityError(f"--chunks = {n_chunks}: nothing to evaluate")
    return ChunkPlan(n_ctx=n_ctx, n_batch=min(n_batch, n_seq * n_ctx), n_seq=n_seq,
                     n_chunk=n_chunk, first=first, stride=stride)
# --8<-- [end:plan_chunks]


# --8<-- [start:context_params]
def context_params(n_ctx: int, n_batch: int = 2048) -> dict[str, int | bool]:
    """The context llama-perplexity's ``main`` asks for, as [`Context`][reference.context.Context]
    keyword arguments.

    ``n_parallel = max(1, n_batch // n_ctx)`` sequences of ``n_ctx`` cells each, one KV stream
    per sequence (``kv_unified`` is off by default in ``common_params``), and ``n_batch``
    capped at what they hold.

    Examples:
        >>> context_params(128, 512)
        {'n_ctx': 512, 'n_batch': 512, 'n_seq_max': 4, 'kv_unified': False}
    """
    n_parallel = max(1, n_batch // n_ctx)
    return {"n_ctx": n_parallel * n_ctx, "n_batch": min(n_batch, n_parallel * n_ctx),
            "n_seq_max": n_parallel, "kv_unified": False}
# --8<-- [end:context_params]


def check_context(ctx: Context, plan: ChunkPlan) -> None:
    """Raise [`PerplexityError`][] when ``ctx`` cannot hold ``plan``'s decodes.

    The context needs ``n_seq`` sequences, ``n_ctx`` cells for each of them, and batches of
    ``n_batch`` tokens ([`context_params`][] makes such a context).
    """
    unified = ctx.kv_unified
    cells = ctx.n_ctx // plan.n_seq if unified else ctx.n_ctx_seq
    problems = [
        (ctx.n_seq_max < plan.n_seq, f"n_seq_max = {ctx.n_seq_max} < {plan.n_seq} sequences"),
        (cells < plan.n_ctx, f"{cells} cells per sequence < n_ctx = {plan.n_ctx}"),
        (ctx.n_batch < plan.n_batch, f"n_batch = {ctx.n_batch} < {plan.n_batch}"),
    ]
    for failed, message in problems:
        if failed:
            raise PerplexityError(f"the context is too small for this run: {message} "
                                  "(make it with context_params)")


# --8<-- [start:chunk_batches]
def chunk_batches(tokens: np.ndarray, plan: ChunkPlan, i: int, n_seq_batch: int,
                  bos: int | None) -> list[Batch]:
    """The decodes of chunks ``i .. i + n_seq_batch - 1``, chunk ``i + s`` on sequence ``s``.

    Decode ``j`` holds positions ``j * n_batch ..`` of every chunk (one decode when several
    chunks share it); a position asks for logits when it is ``>= plan.first``. With ``bos``
    (the vocabulary adds BOS), the token at position 0 of every chunk is replaced by it.

    Examples:
        >>> plan = plan_chunks(16, n_ctx=4, n_batch=8)
        >>> [b.token.tolist() for b in chunk_batches(np.arange(16) + 10, plan, 0, 2, bos=1)]
        [[1, 11, 12, 13, 1, 15, 16, 17]]
        >>> b = chunk_batches(np.arange(16) + 10, plan, 0, 2, bos=1)[0]
        >>> b.pos.tolist(), [s[0] for s in b.seq_id], b.logits.astype(int).tolist()
        ([0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 1, 1])
    """
    batches = []
    for j in range(plan.num_batches):
        pos = np.arange(j * plan.n_batch, min(plan.n_ctx, (j + 1) * plan.n_batch))  # (size,)
        token, seq_pos, seq_id = [], [], []
        for s in range(n_seq_batch):
            chunk = np.array(tokens[plan.start(i + s) + pos], dtype=np.int32)  # (size,)
            if bos is not None and j == 0:
                chunk[0] = bos  # replaced, not prepended
            token.append(chunk)
            seq_pos.append(pos)
            seq_id += [(s,)] * len(pos)
        pos_all = np.concatenate(seq_pos)
        batches.append(Batch(token=np.concatenate(token), pos=pos_all, seq_id=seq_id,
                             logits=pos_all >= plan.first))
    return batches
# --8<-- [end:chunk_batches]


# --8<-- [start:eval_chunks]
def eval_chunks(ctx: Context, tokens: np.ndarray, plan: ChunkPlan, i: int, n_seq_batch: int,
                bos: int | None) -> np.ndarray:
    """Decode chunks ``i ..`` from an empty memory; their logits at positions ``first ..``.

    Returns:
        ``(n_seq_batch, n_ctx - first, n_vocab)`` float32: row $r$ of chunk $s$ holds the
        logits at position ``first + r``, which predict token ``first + r + 1``.

    Raises:
        PerplexityError: a decode did not return 0.
    """
    ctx.memory.clear(True)  # llama_memory_clear: every chunk starts from nothing
    rows = []
    for batch in chunk_batches(tokens, plan, i, n_seq_batch, bos):
        rc = ctx.decode(batch)
        if rc != 0:
            raise PerplexityError(f"failed to decode chunk {i + 1} (llama_decode returned {rc})")
        if batch.logits.any():
            rows.append(np.asarray(ctx.get_logits(), dtype=np.float32))
    logits = np.concatenate(rows)  # (n_seq_batch * (n_ctx - first), n_vocab)
    return logits.reshape(n_seq_batch, plan.n_ctx - plan.first, -1)
# --8<-- [end:eval_chunks]


# ---- one token's numbers -------------------------------------------------------------------

def expf(x: np.ndarray) -> np.ndarray:
    """C's ``expf``: $e^x$ rounded to float32.

    Computed in float64 and rounded once, which is what glibc's ``expf`` returns but for rare
    ties; NumPy's own float32 ``exp`` is one ulp off for about 40% of arguments, enough to
    move a base file's ``min_log_prob`` by one ulp now and then.
    """
    with np.errstate(under="ignore"):
        return np.exp(np.asarray(x, dtype=np.float64)).astype(np.float32)


def _max_and_lse(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Per row, the largest logit (float32) and $\log \sum_i e^{z_i - z_{max}}$ (float64)."""
    zmax = logits.max(axis=1)  # (n,)
    sum_exp = expf(logits - zmax[:, None]).sum(axis=1, dtype=np.float64)  # (n,)
    return zmax, np.log(sum_exp)


# --8<-- [start:token_nll]
def token_nll(logits: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
    r"""The negative log-likelihood of each next token (``log_softmax``, perplexity.cpp:60).

    $$ \mathrm{nll}_k = -\big((z_{k,t} - z_{k,\max}) - \log \textstyle\sum_i e^{z_{k,i} -
    z_{k,\max}}\big), \qquad t = t_{k+1} . $$

    Args:
        logits: ``(n, n_vocab)`` float32.
        next_tokens: ``(n,)`` the tokens they predict.

    Returns:
        ``(n,)`` float64.

    Examples:
        >>> token_nll(np.log(np.array([[0.25, 0.75]], np.float32)), np.array([1])).round(6)
        array([0.287682])
    """
    logits = np.asarray(logits, dtype=np.float32)
    zmax, lse = _max_and_lse(logits)
    z_tok = logits[np.arange(len(logits)), next_tokens]  # (n,)
    return -((z_tok - zmax).astype(np.float64) - lse)
# --8<-- [end:token_nll]


# --8<-- [start:nearest_int]
def nearest_int(x: np.ndarray) -> np.ndarray:
    r"""ggml's ``nearest_int``: add $1.5 \cdot 2^{23}$ in float32, read the low mantissa bits.

    The float32 addition rounds to the nearest integer, ties to even, for $|x| < 2^{22}$.

    Examples:
        >>> nearest_int(np.array([0.5, 1.5, 2.4, 65534.6], np.float32)).tolist()
        [0, 2, 2, 65535]
    """
    val = (np.asarray(x, dtype=np.float32) + np.float32(12582912.0)).astype(np.float32)
    return (val.view(np.int32) & 0x007FFFFF) - 0x00400000
# --8<-- [end:nearest_int]


def record_len(n_vocab: int) -> int:
    """uint16 values per scored token in a base file: two float32, ``n_vocab`` rounded up to
    even.

    Examples:
        >>> record_len(5), record_len(6)
        (10, 10)
    """
    return 2 * ((n_vocab + 1) // 2) + 4


# --8<-- [start:quantize_log_probs]
def quantize_log_probs(logits: np.ndarray, next_tokens: np.ndarray) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    r"""One base-file record per row, and the row's nll (perplexity.cpp:79).

    Only the top $16$ nats of logits are kept, in 65536 steps: with
    $m = \max(z_{\min}, z_{\max} - 16)$ and $\ell = \log \sum_i e^{z_i - z_{\max}}$,

    $$ s = \frac{z_{\max} - m}{65535}, \qquad
    q_i = \begin{cases} \mathrm{round}\big((z_i - m) / s\big) & z_i > m \\ 0 & \text{else}
    \end{cases}, \qquad \log p_i \approx s\, q_i + (m - z_{\max} - \ell) . $$

    A record is $s$ and $m - z_{\max} - \ell$ as two float32 (4 uint16), then the $q_i$, then
    one zero when ``n_vocab`` is odd. Every step is float32, as llama.cpp's.

    Args:
        logits: ``(n, n_vocab)`` float32.
        next_tokens: ``(n,)`` the tokens they predict.

    Returns:
        ``(records, nll)``: ``(n, record_len(n_vocab))`` little-endian uint16, and ``(n,)``
        float64 nll as this mode computes it ($z_{\max} + \ell - z_t$, in float32).

    Examples:
        >>> z = np.array([[0.0, -1.0, -30.0]], np.float32)
        >>> rec, nll = quantize_log_probs(z, np.array([1]))
        >>> rec[0, 4:].tolist(), round(float(nll[0]), 4)
        ([65535, 61439, 0, 0], 1.3133)
        >>> dequantize_log_probs(rec, 3).astype(float).round(4).tolist()  # the tail: the floor
        [[-0.3133, -1.3133, -16.3133]]
    """
    z = np.asarray(logits, dtype=np.float32)  # (n, n_vocab)
    n, n_vocab = z.shape
    zmax, lse64 = _max_and_lse(z)
    lse = lse64.astype(np.float32)
    zmin = np.maximum(z.min(axis=1), zmax - np.float32(QUANT_LOGIT_RANGE))  # (n,)
    min_log_prob = (zmin - zmax) - lse  # (n,) float32
    scale = (zmax - zmin) / np.float32(65535.0)  # (n,) float32
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv_scale = np.float32(1.0) / scale
        q = nearest_int(inv_scale[:, None] * (z - zmin[:, None]))  # (n, n_vocab)
    q = np.where((z > zmin[:, None]) & (scale[:, None] != 0), q, 0) & 0xFFFF
    records = np.zeros((n, record_len(n_vocab)), dtype="<u2")
    records[:, :4] = np.stack([scale, min_log_prob], axis=1).astype("<f4").view("<u2")
    records[:, 4:4 + n_vocab] = q
    nll = ((zmax + lse) - z[np.arange(n), next_tokens]).astype(np.float64)
    return records, nll
# --8<-- [end:quantize_log_probs]


def _record_floats(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    head = np.ascontiguousarray(records[:, :4], dtype="<u2").view("<f4")  # (n, 2)
    return head[:, 0].astype(np.float32), head[:, 1].astype(np.float32)


def dequantize_log_probs(records: np.ndarray, n_vocab: int) -> np.ndarray:
    """The base log-probabilities a record stands for: ``scale * q + min_log_prob`` (float32).

    Returns:
        ``(n, n_vocab)`` float32.
    """
    scale, min_log_prob = _record_floats(records)
    q = np.asarray(records[:, 4:4 + n_vocab]).astype(np.float32)  # (n, n_vocab)
    return scale[:, None] * q + min_log_prob[:, None]


# --8<-- [start:kld_tokens]
@dataclass(frozen=True)
class KLDTokens:
    r"""Per scored token of a KL-divergence run (perplexity.cpp:191), each ``(n,)``.

    Attributes:
        nll: the model's nll (float32, $z_{\max} + \ell - z_t$).
        nll_base: the base model's, from the record: $-(s\, q_t + \log p_{\min})$ (float32).
        kld: $\sum_{i:\ \log p_i > -16} p_i (\log p_i - \log q_i)$ (float32 terms, summed in
            float64, stored as float32).
        p_diff: $\Delta p = q_t - p_t = e^{-\mathrm{nll}} - e^{-\mathrm{nll}_{base}}$ (float32).
        same_top: the model's argmax equals the base's (the first maximum of each).
    """

    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    p_diff: np.ndarray
    same_top: np.ndarray


def kld_tokens(logits: np.ndarray, records: np.ndarray, next_tokens: np.ndarray) -> KLDTokens:
    """Compare the model's logits with the base file's records, token by token.

    Args:
        logits: ``(n, n_vocab)`` float32, the model under test.
        records: ``(n, record_len(n_vocab))`` uint16, the base model ([`quantize_log_probs`][]).
        next_tokens: ``(n,)`` the tokens the rows predict.

    Examples:
        >>> z = np.array([[2.0, 1.0, -3.0], [0.0, 0.0, 1.0]], np.float32)
        >>> rec, _ = quantize_log_probs(z, np.array([0, 2]))
        >>> same = kld_tokens(z, rec, np.array([0, 2]))
        >>> bool(np.abs(same.kld).max() < 1e-4), same.same_top.tolist()
        (True, [True, True])
        >>> other = kld_tokens(z[::-1].copy(), rec, np.array([0, 2]))
        >>> [round(float(k), 3) for k in other.kld], other.same_top.tolist()
        ([0.936, 2.435], [False, False])
    """
    z = np.asarray(logits, dtype=np.float32)  # (n, n_vocab)
    n, n_vocab = z.shape
    rows = np.arange(n)
    zmax, lse64 = _max_and_lse(z)
    log_norm = zmax + lse64.astype(np.float32)  # (n,) float32: log sum_i e^{z_i}
    nll = log_norm - z[rows, next_tokens]
    scale, min_log_prob = _record_floats(records)
    q = np.asarray(records[:, 4:4 + n_vocab])
    nll_base = -(scale * q[rows, next_tokens].astype(np.float32) + min_log_prob)
    log_p_base = dequantize_log_probs(records, n_vocab)  # (n, n_vocab) float32
    terms = expf(log_p_base) * ((log_p_base - z) + log_norm[:, None])  # (n, n_vocab)
    kld = np.where(log_p_base > np.float32(KLD_MIN_LOG_PROB), terms, 0).sum(
        axis=1, dtype=np.float64)
    p_diff = expf(-nll) - expf(-nll_base)
    same_top = z.argmax(axis=1) == log_p_base.argmax(axis=1)
    return KLDTokens(nll=nll, nll_base=nll_base, kld=kld.astype(np.float32), p_diff=p_diff,
                     same_top=same_top)
# --8<-- [end:kld_tokens]


# ---- the statistics ------------------------------------------------------------------------

# --8<-- [start:statistics]
def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    r"""A mean and its standard error from $\sum x$ and $\sum x^2$ (perplexity.cpp:1758).

    $$ \bar x = \frac{\sum x}{n}, \qquad \sigma_{\bar x} = \sqrt{\frac{\overline{x^2} -
    \bar x^2}{n - 1}} \quad (0 \text{ unless positive and } n > 10). $$

    Examples:
        >>> mean_and_uncertainty(3.0, 5.0, 2)  # n <= 10: no uncertainty
        (1.5, 0.0)
    """
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    r"""The covariance of the two means: $(\overline{ab} - \bar a \bar b) / (n - 1)$, 0 for
    $n < 10$."""
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """Linear interpolation at ``fraction * (n - 1)`` of sorted values, in float32 as llama.cpp.

    Examples:
        >>> percentile(np.array([0.0, 1.0, 2.0, 3.0], np.float32), 0.5)
        1.5
    """
    f32 = np.float32
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    p = f32(fraction) * f32(len(values) - 1)
    ip = int(p)
    p = f32(p - f32(ip))
    return float((f32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    """The middle value of sorted values, the mean of the middle two when even (float32)."""
    n = len(values)
    if n % 2:
        return float(values[n // 2])
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]))
# --8<-- [end:statistics]


def _sqrt(x: float) -> float:
    """``sqrt`` as C computes it: NaN for a negative argument."""
    return math.sqrt(x) if x >= 0 else math.nan


def _ieee(a: float, b: float) -> float:
    """``a / b`` as C computes it (inf or nan instead of an exception)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float64(a) / np.float64(b))


# --8<-- [start:PerplexitySums]
@dataclass
class PerplexitySums:
    r"""The running sums of a perplexity run: $N$, $\sum \mathrm{nll}$, $\sum \mathrm{nll}^2$."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0

    def add(self, nll: np.ndarray) -> None:
        """Add one chunk's nll values (float64)."""
        self.count += len(nll)
        self.nll += float(np.sum(nll))
        self.nll2 += float(np.sum(nll * nll))

    @property
    def ppl(self) -> float:
        r"""$\exp(\sum \mathrm{nll} / N)$: the running estimate printed as ``[i]``."""
        return math.exp(self.nll / self.count)

    @property
    def uncertainty(self) -> float:
        r"""$\mathrm{PPL} \cdot \sigma$ with $\sigma$ the standard error of the mean nll
        (NaN when the variance is not positive)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if not var > 0:
            return math.nan
        return math.sqrt(var / (self.count - 1)) * math.exp(mean)
# --8<-- [end:PerplexitySums]


# --8<-- [start:KLDStats]
@dataclass
class KLDStats:
    r"""The running sums of a KL-divergence run (``kl_divergence_result``) and every token's
    KLD and $\Delta p$ (for the percentiles)."""

    count: int = 0
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    def add(self, t: KLDTokens) -> None:
        """Add one chunk's tokens; products of two float32 stay float32, as in llama.cpp."""
        f64 = np.float64
        self.count += len(t.nll)
        self.sum_nll += float(np.sum(t.nll, dtype=f64))
        self.sum_nll2 += float(np.sum(t.nll * t.nll, dtype=f64))
        self.sum_nll_base += float(np.sum(t.nll_base, dtype=f64))
        self.sum_nll_base2 += float(np.sum(t.nll_base * t.nll_base, dtype=f64))
        self.sum_nll_nll_base += float(np.sum(t.nll * t.nll_base, dtype=f64))
        kld = t.kld.astype(f64)
        self.sum_kld += float(np.sum(kld))
        self.sum_kld2 += float(np.sum(kld * kld))
        p_diff2 = (t.p_diff * t.p_diff).astype(f64)
        self.sum_p_diff += float(np.sum(t.p_diff, dtype=f64))
        self.sum_p_diff2 += float(np.sum(p_diff2))
        self.sum_p_diff4 += float(np.sum(p_diff2 * p_diff2))
        self.max_p_diff = max(self.max_p_diff, float(np.abs(t.p_diff).max(initial=0)))
        self.n_same_top += int(np.sum(t.same_top))
        self.kld_values.append(t.kld)
        self.p_diff_values.append(t.p_diff)

    def log_ppl(self) -> tuple[float, float]:
        r"""$\overline{\mathrm{nll}}$ of the model and its uncertainty."""
        return mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)

    def log_ppl_base(self) -> tuple[float, float]:
        r"""$\overline{\mathrm{nll}}_{base}$ and its uncertainty."""
        return mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)

    def log_ppl_ratio(self) -> tuple[float, float]:
        r"""$\ln(\mathrm{PPL}(Q)/\mathrm{PPL}(base))$ and its uncertainty
        $\sqrt{\sigma_Q^2 + \sigma_b^2 - 2\,\mathrm{cov}}$."""
        (lq, uq), (lb, ub) = self.log_ppl(), self.log_ppl_base()
        return lq - lb, _sqrt(uq * uq + ub * ub - 2.0 * self.nll_covariance())

    def mean_kld(self) -> tuple[float, float]:
        """The mean KL divergence and its uncertainty."""
        return mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)

    def mean_p_diff(self) -> tuple[float, float]:
        r"""The mean $\Delta p$ and its uncertainty."""
        return mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)

    def rms_p_diff(self) -> tuple[float, float]:
        r"""$\sqrt{\overline{\Delta p^2}}$ and its uncertainty $\sigma_{\Delta p^2} / (2\,
        \mathrm{rms})$."""
        mse, mse_unc = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, _ieee(0.5, rms) * mse_unc

    def same_top(self) -> tuple[float, float]:
        r"""The fraction of tokens whose argmax agrees, $\hat p \pm \sqrt{\hat p (1 - \hat p) /
        (n - 1)}$."""
        p = self.n_same_top / self.count
        return p, _sqrt(_ieee(p * (1 - p), self.count - 1))

    def ppl(self) -> tuple[float, float]:
        r"""$\mathrm{PPL}(Q) = e^{\overline{\mathrm{nll}}}$ and its uncertainty
        $\mathrm{PPL}(Q) \cdot \sigma_Q$."""
        lq, uq = self.log_ppl()
        ppl = math.exp(lq)
        return ppl, ppl * uq

    def ppl_base(self) -> tuple[float, float]:
        r"""$\mathrm{PPL}(base)$ and its uncertainty."""
        lb, ub = self.log_ppl_base()
        ppl = math.exp(lb)
        return ppl, ppl * ub

    def nll_covariance(self) -> float:
        """The covariance of the two mean nll
        ([`covariance`][reference.tools.perplexity.covariance])."""
        return covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)

    def correlation(self) -> float:
        r"""The correlation of $\ln \mathrm{PPL}(Q)$ and $\ln \mathrm{PPL}(base)$:
        $\mathrm{cov} / (\sigma_Q \sigma_b)$ (inf or NaN as C divides)."""
        (_, uq), (_, ub) = self.log_ppl(), self.log_ppl_base()
        return _ieee(self.nll_covariance(), uq * ub)

    def ppl_diff(self) -> tuple[float, float]:
        r"""$\mathrm{PPL}(Q) - \mathrm{PPL}(base)$ and its uncertainty
        $\sqrt{u_Q^2 + u_b^2 - 2\,\mathrm{PPL}(Q)\,\mathrm{PPL}(base)\,\mathrm{cov}}$."""
        (ppl, ppl_unc), (ppl_base, ppl_base_unc) = self.ppl(), self.ppl_base()
        cov = self.nll_covariance()
        unc = _sqrt(ppl_unc ** 2 + ppl_base_unc ** 2 - 2 * ppl * ppl_base * cov)
        return ppl - ppl_base, unc

    def sorted_kld(self) -> np.ndarray:
        """Every token's KLD so far, sorted (float32): what the percentiles read."""
        return np.sort(np.concatenate(self.kld_values).astype(np.float32))

    def sorted_p_diff(self) -> np.ndarray:
        r"""Every token's $\Delta p$ so far, sorted (float32)."""
        return np.sort(np.concatenate(self.p_diff_values).astype(np.float32))
# --8<-- [end:KLDStats]


# ---- the base file -------------------------------------------------------------------------

# --8<-- [start:LogitsFile]
@dataclass(frozen=True)
class LogitsFile:
    """A ``--kl-divergence-base`` file's header and tokens, and where its records lie.

    Layout (little-endian): ``"_logits_"``, int32 ``n_ctx``, int32 ``n_vocab``, int32
    ``n_chunk``, int32 ``tokens[n_chunk * n_ctx]`` (the text's tokens, BOS not substituted),
    then per chunk ``n_ctx - 1 - n_ctx // 2`` records of [`record_len`][]``(n_vocab)`` uint16
    ([`quantize_log_probs`][]). [`encode_logits_header`][] writes the part before the
    records, [`read_logits`][] reads and checks it.
    """

    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray

    @property
    def n_scored(self) -> int:
        """Records per chunk."""
        return self.n_ctx - 1 - self.n_ctx // 2

    @property
    def records_offset(self) -> int:
        """Byte offset of the first record."""
        return LOGITS_HEADER_SIZE + 4 * self.n_chunk * self.n_ctx

    def expected_size(self) -> int:
        """The file size the header implies."""
        n_records = self.n_chunk * self.n_scored
        return self.records_offset + 2 * n_records * record_len(self.n_vocab)

    def records(self, stream: BinaryIO, chunk: int) -> np.ndarray:
        """Chunk ``chunk``'s records, read from ``stream`` (the file's bytes, seekable).

        Returns:
            ``(n_scored, record_len(n_vocab))`` little-endian uint16.

        Raises:
            LogitsFileError: the stream ends before the chunk's last record.
        """
        nv = record_len(self.n_vocab)
        stream.seek(self.records_offset + 2 * chunk * self.n_scored * nv)
        data = stream.read(2 * self.n_scored * nv)
        if len(data) != 2 * self.n_scored * nv:
            raise LogitsFileError(f"the base file ends inside the records of chunk {chunk + 1}")
        return np.frombuffer(data, dtype="<u2").reshape(self.n_scored, nv)
# --8<-- [end:LogitsFile]


# --8<-- [start:encode_logits_header]
def encode_logits_header(n_ctx: int, n_vocab: int, n_chunk: int, tokens: np.ndarray) -> bytes:
    """The bytes before a base file's records: magic, sizes, the first ``n_chunk * n_ctx``
    tokens.

    Examples:
        >>> head = encode_logits_header(4, 32, 1, np.array([1, 2, 3, 4, 5]))
        >>> head[:8], len(head), np.frombuffer(head[8:], "<i4").tolist()
        (b'_logits_', 36, [4, 32, 1, 1, 2, 3, 4])
    """
    sizes = np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes()
    return LOGITS_MAGIC + sizes + np.asarray(tokens[:n_chunk * n_ctx]).astype("<i4").tobytes()
# --8<-- [end:encode_logits_header]


# --8<-- [start:read_logits]
def read_logits(stream: BinaryIO, n_vocab: int, name: str = "the base file") -> LogitsFile:
    """Read and check a base file's header from ``stream`` against a model of ``n_vocab``
    tokens.

    Args:
        stream: the file's bytes, seekable (an open file, ``io.BytesIO``).
        n_vocab: the model's vocabulary size.
        name: what the messages call the file (its path).

    Raises:
        LogitsFileError: no ``_logits_`` magic, a header out of range, another vocabulary
            size (llama.cpp only logs it and goes on), tokens out of the vocabulary, or a
            size that is not what the header says (a truncated file).

    Examples:
        >>> head = encode_logits_header(4, 32, 1, np.array([1, 2, 3, 4]))
        >>> read_logits(io.BytesIO(head + bytes(2 * 36)), 32).tokens.tolist()
        [1, 2, 3, 4]
        >>> read_logits(io.BytesIO(head), 32, "base.bin")
        Traceback (most recent call last):
        ...
        reference.tools.perplexity.LogitsFileError: base.bin is 36 bytes, its header (n_ctx=4, n_chunk=1, n_vocab=32) says 108: truncated or not a base logits file
    """  # noqa: E501
    stream.seek(0)
    head = stream.read(LOGITS_HEADER_SIZE)
    if len(head) < LOGITS_HEADER_SIZE or not head.startswith(LOGITS_MAGIC):
        raise LogitsFileError(f"{name} does not look like a file of log-probabilities "
                              "(no _logits_ header)")
    n_ctx, file_vocab, n_chunk = np.frombuffer(head[len(LOGITS_MAGIC):], dtype="<i4").tolist()
    if n_ctx < 4 or file_vocab < 1 or n_chunk < 1:
        raise LogitsFileError(f"{name}: bad header (n_ctx={n_ctx}, n_vocab={file_vocab}, "
                              f"n_chunk={n_chunk})")
    if file_vocab != n_vocab:
        raise LogitsFileError(f"{name} holds log-probabilities over {file_vocab} tokens, the "
                              f"model has {n_vocab}: it was made with another vocabulary")
    info = LogitsFile(n_ctx, file_vocab, n_chunk, np.zeros(0, np.int32))
    size = stream.seek(0, io.SEEK_END)
    if size != info.expected_size():
        raise LogitsFileError(f"{name} is {size} bytes, its header (n_ctx={n_ctx}, n_chunk="
                              f"{n_chunk}, n_vocab={file_vocab}) says {info.expected_size()}: "
                              "truncated or not a base logits file")
    stream.seek(LOGITS_HEADER_SIZE)
    tokens = np.frombuffer(stream.read(4 * n_chunk * n_ctx), dtype="<i4")
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise LogitsFileError(f"{name}: token ids outside [0, {n_vocab})")
    return LogitsFile(n_ctx, file_vocab, n_chunk, tokens.astype(np.int32))
# --8<-- [end:read_logits]


# ---- the two runs --------------------------------------------------------------------------

# --8<-- [start:PerplexityResult]
@dataclass
class PerplexityResult:
    """What a perplexity run returns: the final estimate, the running ones, the sums."""

    ppl: float
    uncertainty: float
    estimates: list[float]
    sums: PerplexitySums
    plan: ChunkPlan
# --8<-- [end:PerplexityResult]


OnChunk = Callable[[int, PerplexitySums | KLDStats], None]
"""Called after each chunk with its index (from 0) and the running sums, which it reads and
does not change: [`PerplexitySums`][] in [`perplexity`][], [`KLDStats`][] in
[`kl_divergence`][]."""


def perplexity_plan(ctx: Context, n_tokens: int, n_ctx: int, n_batch: int = 2048,
                    n_chunks: int = -1, ppl_stride: int = 0, base: bool = False) -> ChunkPlan:
    """The chunks of a [`perplexity`][] run on ``ctx``, or the errors it raises before it
    decodes or writes anything.

    Raises:
        PerplexityError: see [`plan_chunks`][] and [`check_context`][]; a base file
            (``base``) with a stride.
    """
    plan = plan_chunks(n_tokens, n_ctx, n_batch, n_chunks, ppl_stride)
    check_context(ctx, plan)
    if base and ppl_stride > 0:
        raise PerplexityError("--kl-divergence-base needs the standard mode (no --ppl-stride)")
    return plan


# --8<-- [start:perplexity]
def perplexity(ctx: Context, tokens: Sequence[int], n_ctx: int, n_batch: int = 2048,
               n_chunks: int = -1, ppl_stride: int = 0, bos: int | None = None,
               base: BinaryIO | None = None, on_chunk: OnChunk | None = None
               ) -> PerplexityResult:
    """``llama-perplexity``: the perplexity of ``tokens``, chunk by chunk.

    Args:
        ctx: a Context (either twin's, or anything with ``decode``, ``get_logits``,
            ``memory.clear``, ``n_ctx``, ``n_ctx_seq``, ``n_seq_max``, ``n_batch``,
            ``n_vocab``), sized by [`context_params`][].
        tokens: the text's tokens, BOS first when the vocabulary adds one.
        n_ctx: tokens per chunk (``-c``).
        n_batch: tokens per decode (``-b``); chunks share a decode when it holds several.
        n_chunks: the most chunks (``--chunks``, negative: all).
        ppl_stride: 0, or the stride of strided perplexity (``--ppl-stride``).
        bos: the BOS id when the vocabulary adds one (``llama_vocab_get_add_bos``), else
            None: the first token of each chunk is replaced by it.
        base: a binary stream to write the base file to (``--kl-divergence-base``):
            [`encode_logits_header`][], then one record per scored token. Standard mode only.
        on_chunk: called after each chunk (``OnChunk``); llama-perplexity prints the
            running estimate ``[i]ppl,`` there.

    Returns:
        [`PerplexityResult`][].

    Raises:
        PerplexityError: see [`perplexity_plan`][], raised before anything is decoded or
            written; a failed decode.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), **context_params(8, 16))
        >>> text = np.random.default_rng(0).integers(3, 32, 40)
        >>> res = perplexity(ctx, text, n_ctx=8, n_batch=16, bos=1)
        >>> [round(p, 4) for p in res.estimates]
        [105.6618, 56.759, 44.2787, 45.0933, 51.098]
        >>> res.sums.count, round(res.ppl, 4), round(res.uncertainty, 4)
        (15, 51.098, 14.3378)
    """
    tokens = np.asarray(tokens, dtype=np.int32)
    plan = perplexity_plan(ctx, len(tokens), n_ctx, n_batch, n_chunks, ppl_stride,
                           base is not None)
    if base is not None:
        base.write(encode_logits_header(n_ctx, ctx.n_vocab, plan.n_chunk, tokens))
    sums, estimates = PerplexitySums(), []
    for i in range(0, plan.n_chunk, plan.n_seq):
        n_seq_batch = min(plan.n_seq, plan.n_chunk - i)
        logits = eval_chunks(ctx, tokens, plan, i, n_seq_batch, bos)
        for s in range(n_seq_batch):
            first = plan.start(i + s) + plan.first
            rows = logits[s, :plan.n_scored]  # (n_scored, n_vocab)
            next_tokens = tokens[first + 1:first + 1 + plan.n_scored]
            if base is not None:
                records, nll = quantize_log_probs(rows, next_tokens)
                base.write(records.tobytes())
            else:
                nll = token_nll(rows, next_tokens)
            sums.add(nll)
            estimates.append(sums.ppl)
            if on_chunk is not None:
                on_chunk(i + s, sums)
    return PerplexityResult(sums.ppl, sums.uncertainty, estimates, sums, plan)
# --8<-- [end:perplexity]


# --8<-- [start:kl_divergence]
def kl_divergence_plan(ctx: Context, base: LogitsFile, n_batch: int = 2048) -> ChunkPlan:
    """The chunks of a KL-divergence run on ``ctx``: the base file's, at most
    ``ctx.n_seq_max`` per decode.

    Raises:
        PerplexityError: ``ctx`` cannot hold them ([`check_context`][]).

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), **context_params(8, 16))
        >>> kl_divergence_plan(ctx, LogitsFile(8, 32, 5, np.zeros(40, np.int32)), 16)
        ChunkPlan(n_ctx=8, n_batch=16, n_seq=2, n_chunk=5, first=4, stride=8)
    """
    n_seq = min(max(1, n_batch // base.n_ctx), ctx.n_seq_max)
    plan = ChunkPlan(n_ctx=base.n_ctx, n_batch=min(n_batch, n_seq * base.n_ctx), n_seq=n_seq,
                     n_chunk=base.n_chunk, first=base.n_ctx // 2, stride=base.n_ctx)
    check_context(ctx, plan)
    return plan


def kl_divergence(ctx: Context, base: LogitsFile, stream: BinaryIO, n_batch: int = 2048,
                  bos: int | None = None, on_chunk: OnChunk | None = None) -> KLDStats:
    """``llama-perplexity --kl-divergence``: the model against a base file, chunk by chunk.

    The chunks, positions and BOS rule are the file's run's ([`perplexity`][]); the tokens
    come from the file.

    Args:
        ctx: a Context sized by [`context_params`][]``(base.n_ctx, n_batch)``.
        base: the base file's header ([`read_logits`][], which checked its vocabulary).
        stream: the base file's bytes, its records read chunk by chunk.
        n_batch: tokens per decode; chunks per decode are capped at ``ctx.n_seq_max``.
        bos: as in [`perplexity`][].
        on_chunk: called after each chunk (``OnChunk``) with the running [`KLDStats`][];
            llama-perplexity prints a row of its table there.

    Raises:
        PerplexityError: a context too small for the file's ``n_ctx``; a failed decode.

    Examples:
        >>> from reference.context import Context
        >>> from reference.testing import tiny_hparams, random_weights
        >>> hp = tiny_hparams()
        >>> ctx = Context(hp, random_weights(hp), **context_params(8, 16))
        >>> text = np.random.default_rng(0).integers(3, 32, 40)
        >>> stream = io.BytesIO()
        >>> _ = perplexity(ctx, text, n_ctx=8, n_batch=16, bos=1, base=stream)
        >>> base = read_logits(stream, hp.n_vocab)
        >>> stats = kl_divergence(ctx, base, stream, 16, bos=1)
        >>> stats.count, bool(abs(stats.mean_kld()[0]) < 1e-4), stats.n_same_top
        (15, True, 15)
    """
    plan = kl_divergence_plan(ctx, base, n_batch)
    stats, tokens = KLDStats(), base.tokens
    for i in range(0, plan.n_chunk, plan.n_seq):
        n_seq_batch = min(plan.n_seq, plan.n_chunk - i)
        logits = eval_chunks(ctx, tokens, plan, i, n_seq_batch, bos)
        for s in range(n_seq_batch):
            first = plan.start(i + s) + plan.first
            next_tokens = tokens[first + 1:first + 1 + plan.n_scored]
            records = base.records(stream, i + s)
            stats.add(kld_tokens(logits[s, :plan.n_scored], records, next_tokens))
            if on_chunk is not None:
                on_chunk(i + s, stats)
    return stats
# --8<-- [end:kl_divergence]
