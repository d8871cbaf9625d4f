"""batched-bench, ours and llama.cpp's, on the same GGUF, by the same code.

``reference.batched_bench.batched_bench`` is written against the Context protocol, so it
runs unchanged over llama.cpp's own context: `LlamaCppBenchContext` gives a
``llama_context`` (through llama-cpp-python's low-level API) the names the bench calls
(``decode``, ``synchronize``, ``memory.clear / seq_cp / seq_rm``, the sizes). llama.cpp keeps
its defaults (f16 KV cache, the file's quantized matmuls, flash attention ``auto``,
``--threads`` threads); ours is ``--backend`` (the reference dequantizes to float32). Both
decode the same glibc ``rand()`` tokens. Usage::

    python scripts/batched_bench_vs_llamacpp.py -npp 128 -ntg 32 -npl 1,2,4,8,16,32

Prints each table, then S_TG (tokens generated per second, all sequences together) side by
side with the ratio ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaref.backends import make_context, prepare_weights  # noqa: E402
from reference.batched_bench import batched_bench, header, row_md  # noqa: E402
from reference.model import default_model_path, load_model  # noqa: E402


class LlamaCppBenchContext:
    """A ``llama_context`` of llama.cpp's defaults behind the names batched-bench calls."""

    recurrent = False

    def __init__(self, path: Path, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
                 kv_unified: bool, n_threads: int):
        import llama_cpp as ll

        self._ll = ll
        self._log = ll.llama_log_callback(lambda level, text, user_data: None)
        ll.llama_log_set(self._log, ctypes.c_void_p(0))
        ll.llama_backend_init()
        self._model = ll.llama_model_load_from_file(str(path).encode(),
                                                    ll.llama_model_default_params())
        cparams = ll.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_ubatch
        cparams.n_seq_max, cparams.kv_unified = n_seq_max, kv_unified
        cparams.n_threads = cparams.n_threads_batch = n_threads
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        self._mem = ll.llama_get_memory(self._ctx)
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self.n_batch = ll.llama_n_batch(self._ctx)
        self.n_ubatch = ll.llama_n_ubatch(self._ctx)
        self.n_seq_max = ll.llama_n_seq_max(self._ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        self.kv_unified = kv_unified
        self.memory = self

    def decode(self, batch) -> int:
        ll, n = self._ll, batch.n_tokens
        b = ll.llama_batch_init(n, 0, 1)
        try:
            b.n_tokens = n
            for i in range(n):
                b.token[i] = int(batch.token[i])
                b.pos[i] = int(batch.pos[i])
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = int(batch.seq_id[i][0])
                b.logits[i] = bool(batch.logits[i])
            return int(ll.llama_decode(self._ctx, b))
        finally:
            ll.llama_batch_free(b)

    def synchronize(self) -> None:
        self._ll.llama_synchronize(self._ctx)

    def clear(self, data: bool = True) -> None:
        self._ll.llama_memory_clear(self._mem, data)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(self._ll.llama_memory_seq_rm(self._mem, seq_id, p0, p1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None)
    p.add_argument("--backend", default="reference", choices=("reference", "accelerated"))
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-npp", type=lambda s: [int(v) for v in s.split(",")], default=[128])
    p.add_argument("-ntg", type=lambda s: [int(v) for v in s.split(",")], default=[32])
    p.add_argument("-npl", type=lambda s: [int(v) for v in s.split(",")],
                   default=[1, 2, 4, 8, 16, 32])
    p.add_argument("-kvu", action="store_true")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    path = Path(args.model) if args.model else default_model_path()
    n_ctx = args.ctx_size or max(pl * (pp + tg) for pp in args.npp for tg in args.ntg
                                 for pl in args.npl)
    sizes = dict(n_ctx=n_ctx, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                 n_seq_max=max(args.npl), kv_unified=args.kvu)
    hp, weights = load_model(path)
    contexts = {
        f"llamaref ({args.backend})": lambda: make_context(
            args.backend, hp, prepare_weights(weights, args.backend), **sizes),
        f"llama.cpp ({args.threads} threads)": lambda: LlamaCppBenchContext(
            path, n_threads=args.threads, **sizes),
    }
    s_tg = {}
    for name, new in contexts.items():
        ctx = new()
        cfg = dict(n_kv_max=ctx.n_ctx, n_batch=args.batch_size, n_ubatch=ctx.n_ubatch)
        print(f"\n## {name}: {path.name}\n")
        print("\n".join(header(cfg)[2:]))
        for row in batched_bench(ctx, args.npp, args.ntg, args.npl, n_batch=ctx.n_batch):
            print(row_md(row), flush=True)
            s_tg[name, row.pp, row.tg, row.pl] = row.speed_tg
        del ctx
    ours, theirs = contexts
    print(f"\n| PP | TG | B | S_TG {ours} | S_TG {theirs} | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for pp in args.npp:
        for tg in args.ntg:
            for pl in args.npl:
                a, b = s_tg.get((ours, pp, tg, pl)), s_tg.get((theirs, pp, tg, pl))
                if a and b:
                    print(f"| {pp} | {tg} | {pl} | {a:.1f} | {b:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
