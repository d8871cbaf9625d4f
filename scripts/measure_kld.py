"""Measure how far SmolLM2's 4-bit inference paths move from the exact dequantization.

The table of ``docs/perplexity.md``: ``python scripts/measure_kld.py [--n-ctx 256] [--chunks 6]``.

1. The reference (NumPy) on SmolLM2 Q4_1 dequantized exactly to float32 writes the base
   logits file (``llamaref perplexity --kl-divergence-base``).
2. Each candidate runs ``--kl-divergence`` against it on the same chunks:
   - the MLX twin on the quantized weights (``mx.quantized_matmul``: Q4_1 blocks are MLX's
     affine groups of 32, so the weights are the same numbers; what differs is the order of
     float32 operations);
   - llama.cpp (llama-cpp-python, f32 KV cache) on the Q4_1 file as shipped: its matmuls
     quantize the activations to Q8_1;
   - llama.cpp on the float32 rewrite of the same weights (a control: float32 throughout).

The text is shipped with Python: the docstrings of a few standard modules. Prints a Markdown
table; the runs' own reports go to stderr.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelerated.context import Context as AContext  # noqa: E402
from accelerated.models.llama import prepare_weights  # noqa: E402
from llamaref.llamacpp import LlamaCppContext  # noqa: E402
from llamaref.perplexity import read_logits_file, run_kl_divergence, run_perplexity  # noqa: E402
from reference.arch import hparams_from_file  # noqa: E402
from reference.context import Context  # noqa: E402
from reference.gguf import read_gguf, write_gguf  # noqa: E402
from reference.model_loader import default_model_path  # noqa: E402
from reference.quants import QuantizedTensor  # noqa: E402
from reference.tokenizer import load_tokenizer  # noqa: E402
from reference.tools.perplexity import context_params, percentile  # noqa: E402

MODULES = ("argparse", "json", "collections", "typing", "unittest", "logging")


def stdlib_text() -> str:
    """The docstrings of ``MODULES``, joined by blank lines."""
    import importlib

    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in MODULES)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def row(name: str, stats) -> str:
    kld = np.sort(np.concatenate(stats.kld_values).astype(np.float32))
    lq, _ = stats.log_ppl()
    ratio, ratio_unc = stats.log_ppl_ratio()
    mean, unc = stats.mean_kld()
    top, top_unc = stats.same_top()
    rms, _ = stats.rms_p_diff()
    return (f"| {name} | {np.exp(lq):.4f} | {ratio:+.5f} ± {ratio_unc:.5f} | {mean:.6f} ± {unc:.6f}"
            f" | {percentile(kld, 0.99):.6f} | {kld[-1]:.6f} | {100 * rms:.3f} % "
            f"| {100 * top:.2f} ± {100 * top_unc:.2f} % |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=6)
    args = ap.parse_args()
    n_ctx = args.n_ctx
    n_batch = n_ctx * 2
    path = default_model_path()
    gguf = read_gguf(path)
    hp = hparams_from_file(gguf)
    tok = load_tokenizer(path)
    bos = tok.bos_id if tok.add_bos else None
    tokens = np.array(tok.tokenize(stdlib_text(), add_special=True), np.int32)
    exact = {k: v.dequantize().astype(np.float32) if isinstance(v, QuantizedTensor)
             else np.asarray(v) for k, v in gguf.tensors.items()}
    work = Path(tempfile.mkdtemp(prefix="measure_kld_"))
    base_path = work / "base.bin"
    log(f"{len(tokens)} tokens: Python {sys.version.split()[0]}'s docstrings of {MODULES}")
    base_run = run_perplexity(Context(hp, exact, **context_params(n_ctx, n_batch)), tokens,
                              n_ctx, n_batch, args.chunks, bos=bos, base_path=base_path,
                              info=log)
    base = read_logits_file(base_path, hp.n_vocab)
    rows = []

    mlx = AContext(hp, prepare_weights(gguf.tensors, "quantized"), matmul="quantized",
                   **context_params(n_ctx, n_batch))
    rows.append(row("MLX twin, Q4_1 as MLX 4-bit (`quantized_matmul`)",
                    run_kl_divergence(mlx, base_path, n_batch, bos, info=log)))

    def llamacpp(file: Path):
        return LlamaCppContext(file, n_ctx=n_batch, n_batch=n_batch, n_ubatch=n_batch,
                               n_seq_max=2, kv_unified=False, n_threads=2)

    with llamacpp(path) as lc:
        rows.append(row("llama.cpp, Q4_1 (activations in Q8_1)",
                        run_kl_divergence(lc, base_path, n_batch, bos, info=log)))
    f32 = work / "smollm2-f32.gguf"
    write_gguf(f32, {**gguf.metadata, "general.file_type": 0}, exact)
    with llamacpp(f32) as lc:
        rows.append(row("llama.cpp, the float32 rewrite (control)",
                        run_kl_divergence(lc, base_path, n_batch, bos, info=log)))
    f32.unlink()
    print(f"Base: the reference on the exact dequantization, PPL = {base_run.ppl:.4f} ± "
          f"{base_run.uncertainty:.4f}; {base.n_chunk} chunks of {n_ctx}, "
          f"{base.n_chunk * base.n_scored} scored tokens.\n")
    print("| inference | PPL(Q) | ln(PPL(Q)/PPL(base)) | mean KLD | 99% KLD | max KLD | RMS Δp "
          "| same top p |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
