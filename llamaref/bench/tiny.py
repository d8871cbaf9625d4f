r"""The shipped tiny models of ``llamaref bench``: ``tiny``, ``tiny-mamba``, ``tiny-mamba2``.

On a model this small the forward costs a fraction of a millisecond, so what a generated token
costs is the work *around* the forward: batch validation, the slot search, the KQ mask, the
graph launch, the sampling, the loop. These models measure that overhead against mlx-lm's own
loop on the same configuration and the same weights (``--vs mlx-lm``). Their weights are
random ([`reference.testing`][reference.testing], seeded): nothing is downloaded, the numbers are
the same on every machine, and their text is noise.

| name | architecture | layers | ``n_embd`` | other |
|---|---|---|---|---|
| ``tiny`` | llama | 2 | 64 | 4 heads, 2 KV heads, ``n_ff`` 128, ``n_vocab`` 256 |
| ``tiny-mamba`` | mamba | 2 | 64 | ``d_state`` 16, ``d_inner`` 128, ``n_vocab`` 256 |
| ``tiny-mamba2`` | mamba2 | 2 | 64 | ``d_state`` 16, 8 heads of 16, 1 group, ``n_vocab`` 256 |
"""

from __future__ import annotations

from reference.testing import (
    random_mamba_weights,
    random_weights,
    tiny_hparams,
    tiny_mamba_hparams,
)

N_CTX_TRAIN = 32768
"""The tiny Llama's training context: room for the deepest depth of the overhead table."""


def _tiny_llama():
    hp = tiny_hparams(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=256,
                      n_ctx_train=N_CTX_TRAIN)
    return hp, random_weights(hp, seed=0)


def _tiny_mamba(arch: str):
    hp = tiny_mamba_hparams(arch, n_vocab=256, n_embd=64, n_layer=2, d_state=16, head_dim=16)
    return hp, random_mamba_weights(hp, seed=0)


TINY_MODELS = {
    "tiny": _tiny_llama,
    "tiny-mamba": lambda: _tiny_mamba("mamba"),
    "tiny-mamba2": lambda: _tiny_mamba("mamba2"),
}
"""``--model`` name -> a function returning ``(hparams, weights)``."""


def tiny_model(name: str):
    """The hyperparameters and seeded random weights of a shipped tiny model.

    Raises:
        KeyError: not a tiny model's name ([`TINY_MODELS`][]).

    Examples:
        >>> hp, w = tiny_model("tiny")
        >>> hp.arch, hp.n_layer, hp.n_embd, w["token_embd.weight"].shape
        ('llama', 2, 64, (256, 64))
        >>> tiny_model("tiny-mamba2")[0].n_head()
        8
    """
    return TINY_MODELS[name]()
