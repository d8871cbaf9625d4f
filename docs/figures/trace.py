"""Trace one real decode, end to end: the printed steps of ``docs/trace.md``.

Run from anywhere, after changing anything a decode goes through (tokenizer, batch, memory,
model, sampler)::

    python docs/figures/trace.py

and commit what it writes under ``docs/assets/trace/``: one Markdown fragment per step, a
code block of what that step printed. ``docs/trace.md`` shows the code of each step (the
sections of this file between snippet markers) followed by its fragment, and
``tests/docs/test_trace.py`` fails when the committed fragments differ from what this script
writes now, so the page cannot go stale.

The model is SmolLM2-135M-Instruct Q4_1 (``reference.model_loader.default_model_path``) on the
reference backend, the prompt "The capital of France is". The decode is done by hand, in the
steps of ``Context.decode`` and with the Context's own methods, so that every intermediate
value can be printed; the forward of the last ubatch is ``llm_build_llama`` written out, the
same op calls in the same order. A plain ``Context.decode`` of the same batch must then give
the same logits bit for bit, the same cells and the same keys and values, or the script
fails: the trace cannot drift from the code it traces.

Code lines stay within 80 characters: the sections are shown on the site.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
from pathlib import Path

# one BLAS thread, as under pytest (tests/conftest.py): the same sums, the same digits
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "assets" / "trace"
if str(ROOT) not in sys.path:  # run as a script: reference/ is beside docs/
    sys.path.insert(0, str(ROOT))

from reference.batch import Batch, BatchAllocr  # noqa: E402
from reference.context import Context  # noqa: E402
from reference.hparams import rope_cparams  # noqa: E402
from reference.memory import KVCells  # noqa: E402
from reference.model_loader import default_model_path, load_model  # noqa: E402
from reference.models.llama import (  # noqa: E402
    build_inp_embd,
    build_norm,
    build_qkv,
    get_weight,
    layer_weights,
    model_dtype,
)
from reference.ops import (  # noqa: E402
    add,
    build_attn_mha,
    get_rows,
    mul_mat,
    rope_ext,
    soft_max_ext,
    swiglu,
)
from reference.sampling import (  # noqa: E402
    Mt19937,
    SamplerChain,
    SamplerParams,
    TokenDataArray,
    dist,
    dry,
    get_rng_seed,
    greedy,
    min_p,
    penalties,
    temp_ext,
    top_k,
    top_n_sigma,
    top_p,
    typical,
    xtc,
)
from reference.tokenizer import Tokenizer  # noqa: E402

# --8<-- [start:constants]
PROMPT = "The capital of France is"
N_CTX = 64  # asked for; llama_context pads it to 256 cells
N_UBATCH = 3  # small on purpose: the 5-token prompt becomes 2 ubatches
SEED = 42  # the seed of the default chain's draws
N_SHOWN = 8  # cells (and mask columns) printed
# --8<-- [end:constants]


# --8<-- [start:helpers]
def piece(tok: Tokenizer, t: int) -> str:
    """The text of token ``t``, quoted: ``' Paris'``."""
    return repr(tok.token_to_piece(int(t)).decode("utf-8", "replace"))


def show(label: str, op: str, a: np.ndarray, values=None) -> None:
    """One step of the forward: its name, the op, the shape, a few values
    (by default the first three of the last token's row)."""
    values = a[-1].ravel()[:3] if values is None else values
    nums = "".join(f"{v:8.3f}" for v in values)
    print(f"{label:<14}{op:<14}{str(a.shape):<12}{nums}")


def skip(*args) -> None:
    """``show`` for the layers that are not printed."""


def show_cells(cells: KVCells) -> None:
    """The first ``N_SHOWN`` cells: position and sequence set (``{}`` empty)."""
    idx = range(N_SHOWN)
    seqs = [set(cells.seq_get_all(i)) or "{}" for i in idx]
    print("cell   " + "".join(f"{i:>5}" for i in idx))
    print("pos    " + "".join(f"{cells.pos[i]:>5}" for i in idx))
    print("seq_id " + "".join(f"{str(s):>5}" for s in seqs))
    print(f"used {cells.get_used()} of {cells.size()} cells, "
          f"cells {N_SHOWN}..{cells.size() - 1} empty")


def show_mask(mask: np.ndarray, labels: list[str]) -> None:
    """The first ``N_SHOWN`` columns of a KQ mask, one row per token."""
    print(" " * 16 + "cell" + "".join(f"{j:>5}" for j in range(N_SHOWN)))
    for label, row in zip(labels, mask, strict=True):
        cols = "".join(f"{v:>5.0f}" for v in row[:N_SHOWN])
        print(f"{label:<20}{cols}")


def show_candidates_header(tok: Tokenizer, ids: list[int]) -> None:
    """The two header lines of ``show_candidates``' table."""
    print(" " * 18 + "".join(f"{piece(tok, t):>16}" for t in ids))
    print("stage         size" + "    logit      p" * len(ids))


def show_candidates(stage: str, cur: TokenDataArray, ids: list[int]) -> None:
    """The candidates after a sampler: how many, and the logit and probability
    of the tokens ``ids`` (``p`` is ``-`` until a sampler computed it, a token
    is ``gone`` once a sampler removed it)."""
    cols = []
    for t in ids:
        at = np.flatnonzero(cur.ids == t)  # where token t is now, if kept
        if not at.size:
            cols.append(f"{'gone':>9}{'':>7}")
            continue
        p = f"{cur.p[at[0]]:7.3f}" if cur.p.any() else f"{'-':>7}"
        cols.append(f"{cur.logits[at[0]]:9.3f}{p}")
    print(f"{stage:<12}{cur.size:>6}" + "".join(cols))
# --8<-- [end:helpers]


def trace() -> tuple[dict[str, str], str]:
    """Run the decode step by step.

    Returns:
        What each step printed, by step name (in page order), and the text of the greedy
        token.
    """
    printed = io.StringIO()
    fragments: dict[str, str] = {}

    def cut(name: str) -> None:
        fragments[name] = printed.getvalue()
        printed.seek(0)
        printed.truncate()

    with contextlib.redirect_stdout(printed):
        # --8<-- [start:model]
        hp, weights = load_model(default_model_path())
        print(f"arch {hp.arch}: n_layer {hp.n_layer}, n_embd {hp.n_embd}, "
              f"n_ff {hp.n_ff}, n_vocab {hp.n_vocab}")
        print(f"heads: n_head {hp.n_head}, n_head_kv {hp.n_head_kv}, "
              f"head size {hp.n_embd_head_k}")
        print(f"rope: mode {hp.rope_type} (normal), "
              f"freq_base {hp.rope_freq_base_train:g}")
        print("tied output (lm_head = token_embd):",
              "output.weight" not in weights)
        wq = weights["blk.0.attn_q.weight"]
        print(f"blk.0.attn_q.weight: {wq.qtype.name}, shape {wq.shape}")
        # --8<-- [end:model]
        cut("model")

        # --8<-- [start:tokens]
        tok = Tokenizer.from_gguf(default_model_path())
        ids = tok.tokenize(PROMPT)  # add_special: a BOS if the vocab wants one
        print(repr(PROMPT), "->", ids)
        for t in ids:
            print(f"{t:>6}  {piece(tok, t)}")
        print("add_bos:", tok.add_bos)
        # --8<-- [end:tokens]
        cut("tokens")

        # --8<-- [start:batch]
        ctx = Context(hp, weights, n_ctx=N_CTX, n_ubatch=N_UBATCH)
        print(f"n_ctx {ctx.n_ctx}, n_batch {ctx.n_batch}, "
              f"n_ubatch {ctx.n_ubatch}, n_seq_max {ctx.n_seq_max}")
        batch = Batch(token=ids)  # pos, seq_id, logits left out
        print("given:  pos", batch.pos, " seq_id", batch.seq_id,
              " logits", batch.logits)
        # decode's step 1: validate and fill the batch (llama_batch_allocr)
        balloc = BatchAllocr(batch, n_vocab=ctx.n_vocab,
                             n_seq_max=ctx.n_seq_max, memory=ctx.memory,
                             n_embd=hp.n_embd, n_batch=ctx.n_batch)
        b = balloc.batch
        print("filled:")
        print("   i  token  piece        pos  seq_id  logits")
        for i in range(b.n_tokens):
            print(f"{i:>4} {b.token[i]:>6}  {piece(tok, b.token[i]):<12}"
                  f"{b.pos[i]:>4}  {str(b.seq_id[i]):<7} {b.logits[i]}")
        # --8<-- [end:batch]
        cut("batch")

        # --8<-- [start:ubatches]
        ctx.memory_update()  # decode's step 2: nothing pending in a new cache
        # step 3: split into ubatches, find a slot for each (all or none)
        mctx = ctx.memory.init_batch(balloc, ctx.n_ubatch)
        print("status", mctx.get_status().name)
        ubs = zip(mctx.ubatches, mctx.placements, strict=True)
        for k, (ub, slot) in enumerate(ubs):
            print(f"ubatch {k}: batch idx {ub.idx.tolist()}, "
                  f"pos {ub.pos.tolist()}, output {ub.output.tolist()}")
            print(f"          slot: cells {list(slot.idxs[0])}")
        print("out_ids", balloc.out_ids)
        print("cells in use after init_batch:", ctx.memory.v_cells[0].get_used())
        # --8<-- [end:ubatches]
        cut("ubatches")

        # --8<-- [start:cells]
        ctx.output_reserve(balloc.n_tokens)  # the previous outputs go
        cells = ctx.memory.v_cells[0]  # one stream: every sequence shares it
        mctx.apply()  # step 4: ubatch 0's positions and seq ids into cells
        print("after ubatch 0 is applied:")
        show_cells(cells)
        rows = [ctx.process_ubatch(mctx)]  # its forward: K, V into its cells
        print("ubatch 0's logits rows:", rows[0].shape)
        mctx.next()
        mctx.apply()
        print("after ubatch 1 is applied:")
        show_cells(cells)
        # --8<-- [end:cells]
        cut("cells")

        # --8<-- [start:mask]
        inp = mctx.graph_input()  # what the forward reads and writes
        ub = mctx.get_ubatch()
        mask = inp.get_kq_mask(0)  # the same for every layer (no SWA)
        print("n_kv", inp.n_kv, "(the used cells, padded to 256)")
        print("kq_mask", mask.shape, "(tokens of ubatch 1, cells)")
        labels = [f"{piece(tok, t)} pos {p}"
                  for t, p in zip(ub.token, ub.pos, strict=True)]
        show_mask(mask, labels)
        # --8<-- [end:mask]
        cut("mask")

        # --8<-- [start:forward]
        w = ctx.weights
        out_ids = np.flatnonzero(ub.output)  # [1]: only ' is' gets logits
        dtype = model_dtype(w)  # float32: quantized weights
        eps = hp.f_norm_rms_eps
        d = hp.n_embd_head_k
        kq_scale = 1.0 / math.sqrt(d)
        rope = rope_cparams(hp)  # n_dims, mode, freq_base, ...
        last = hp.n_layer - 1

        x = build_inp_embd(w, ub.token, None, dtype)
        show("inp_embd", "get_rows", x)
        for il in range(hp.n_layer):
            log = show if il in (0, last) else skip  # print 2 of 30 layers
            if il in (0, last):
                print(f"layer {il}")
            layer = layer_weights(w, il, dtype)  # Q4_1 -> float32
            inpSA = x
            cur = build_norm(x, layer["attn_norm"], eps)
            log("attn_norm", "rms_norm, mul", cur)
            q, k, v = build_qkv(layer, cur, d, hp.n_head, hp.n_head_kv)
            log("Qcur", "mul_mat", q)
            log("Kcur", "mul_mat", k)
            log("Vcur", "mul_mat", v)
            q = rope_ext(q, ub.pos, rope)
            k = rope_ext(k, ub.pos, rope)
            log("Qcur", "rope_ext", q)
            log("Kcur", "rope_ext", k)
            # build_attn: store K, V of ' France', ' is' in cells 3, 4
            inp.cpy_k(il, k)
            inp.cpy_v(il, v)
            k_all, v_all = inp.get_k(il), inp.get_v(il)  # every cell in view
            cell = inp.k_idxs[-1]  # 4: where ' is' went
            log("k", "get_k", k_all, k_all[cell].ravel()[:3])
            log("v", "get_v", v_all, v_all[cell].ravel()[:3])
            # build_attn_mha: heads first; query head h reads KV head h // 3
            kq = mul_mat(k_all.transpose(1, 0, 2), q.transpose(1, 0, 2))
            log("kq", "mul_mat", kq, kq[0, -1, :5])
            kq = soft_max_ext(kq, inp.get_kq_mask(il), kq_scale)
            log("kq_soft_max", "soft_max_ext", kq, kq[0, -1, :5])
            v_t = v_all.transpose(1, 2, 0)  # a view, as build_attn_mha takes it
            kqv = mul_mat(v_t, kq)  # (n_head, n_tokens, d)
            log("kqv", "mul_mat", kqv, kqv[0, -1, :3])
            cur = np.ascontiguousarray(kqv.transpose(1, 0, 2))
            cur = cur.reshape(ub.n_tokens, -1)  # the heads side by side
            log("kqv_out", "cont", cur)
            # build_attn_mha reads only the cells a token sees when they are few (5 of 256
            # here): the same values up to rounding, and the ones the decode goes on with
            mha = build_attn_mha(q, k_all, v_all, inp.get_kq_mask(il), kq_scale)
            # float32 sums in another order: 2.5e-6 apart at most here, on values up to 3.5
            assert np.allclose(mha, cur, rtol=0, atol=1e-5)
            cur = mha
            cur = mul_mat(layer["wo"], cur)
            log("attn_out", "mul_mat", cur)
            if il == last:  # only the output rows go on (inp_out_ids)
                cur = get_rows(cur, out_ids)
                inpSA = get_rows(inpSA, out_ids)
                log("attn_out", "get_rows", cur)
            ffn_inp = add(cur, inpSA)
            log("ffn_inp", "add", ffn_inp)
            cur = build_norm(ffn_inp, layer["ffn_norm"], eps)
            log("ffn_norm", "rms_norm, mul", cur)
            up = mul_mat(layer["ffn_up"], cur)
            log("ffn_up", "mul_mat", up)
            gate = mul_mat(layer["ffn_gate"], cur)
            log("ffn_gate", "mul_mat", gate)
            cur = swiglu(gate, up)  # silu(gate) * up
            log("ffn_swiglu", "swiglu", cur)
            cur = mul_mat(layer["ffn_down"], cur)
            log("ffn_out", "mul_mat", cur)
            x = add(cur, ffn_inp)
            log("l_out", "add", x)
        print("output")
        cur = build_norm(x, get_weight(w, "output_norm.weight", dtype), eps)
        show("result_norm", "rms_norm, mul", cur)
        lm_head = get_weight(w, "token_embd.weight", dtype)  # tied
        logits = mul_mat(lm_head, cur)  # (n_outputs, n_vocab)
        show("result_output", "mul_mat", logits)
        rows.append(logits)
        # --8<-- [end:forward]
        cut("forward")

        # --8<-- [start:logits]
        ctx.output_set(rows, balloc.out_ids)  # step 5: outputs in batch order
        row = ctx.get_logits_ith(-1)  # (n_vocab,): the last output, ' is'
        # the same batch through a plain decode: the same logits, bit for bit
        check = Context(hp, weights, n_ctx=N_CTX, n_ubatch=N_UBATCH)
        assert check.decode(batch) == 0
        assert np.array_equal(check.get_logits_ith(-1), row)
        mine, plain = ctx.memory, check.memory
        assert mine.v_cells == plain.v_cells
        assert all(np.array_equal(a, b) for a, b in zip(
            mine.k_l + mine.v_l, plain.k_l + plain.v_l, strict=True))
        print("logits", row.shape, row.dtype)
        print("rank      id  piece        logit")
        for rank, t in enumerate(np.argsort(-row)[:5], 1):
            print(f"{rank:>4}  {t:>6}  {piece(tok, t):<12}{row[t]:>6.3f}")
        # --8<-- [end:logits]
        cut("logits")

        # --8<-- [start:chain]
        p = SamplerParams(seed=SEED)  # llama.cpp's common defaults
        chain = SamplerChain.from_params(p, ctx.n_vocab)
        history = list(ids)  # the prompt joins the penalties' history
        rng_dist = Mt19937(get_rng_seed(p.seed))
        rng_xtc = Mt19937(get_rng_seed(p.seed))
        cur = TokenDataArray.from_logits(row)  # every token, in id order
        stages = {
            "penalties": lambda: penalties(
                cur, history, p.penalty_last_n, p.penalty_repeat,
                p.penalty_freq, p.penalty_present),
            "dry": lambda: dry(
                cur, history, p.dry_multiplier, p.dry_base,
                p.dry_allowed_length, p.dry_penalty_last_n, {}),
            "top_n_sigma": lambda: top_n_sigma(cur, p.top_n_sigma),
            "top_k": lambda: top_k(cur, p.top_k),
            "typ_p": lambda: typical(cur, p.typ_p, p.min_keep),
            "top_p": lambda: top_p(cur, p.top_p, p.min_keep),
            "min_p": lambda: min_p(cur, p.min_p, p.min_keep),
            "xtc": lambda: xtc(cur, p.xtc_probability, p.xtc_threshold,
                               p.min_keep, rng_xtc),
            "temperature": lambda: temp_ext(
                cur, p.temp, p.dynatemp_range, p.dynatemp_exponent),
            "dist": lambda: dist(cur, rng_dist),
        }
        assert list(stages) == chain.stages  # common_sampler_init's order
        best = np.argsort(-row)[:3].tolist()  # follow the top three
        show_candidates_header(tok, best)
        show_candidates("(logits)", cur, best)
        for stage, run in stages.items():
            run()
            show_candidates(stage, cur, best)
        token = int(cur.ids[cur.selected])
        print(f"dist drew candidate {cur.selected}: {token} {piece(tok, token)}")
        for t in ids:
            chain.accept(t)
        assert chain.sample(row) == token  # the chain itself: the same draw
        # --8<-- [end:chain]
        cut("chain")

        # --8<-- [start:greedy]
        cur = TokenDataArray.from_logits(row)
        greedy(cur)  # the largest logit
        token = int(cur.ids[cur.selected])
        print("greedy:", token, piece(tok, token))
        zero = SamplerChain.from_params(SamplerParams(temp=0.0), ctx.n_vocab)
        print("chain with temp 0:", zero.sample(row))
        # --8<-- [end:greedy]
        cut("greedy")

        # --8<-- [start:text]
        text = tok.token_to_piece(token)
        print("piece:", text)
        print("text: ", repr(tok.detokenize(ids + [token])))
        # the next step of generation: one token, continuing sequence 0
        assert ctx.decode_token(token) == 0
        show_cells(cells)
        following = int(np.argmax(ctx.get_logits_ith(-1)))
        print("next greedy token:", following, piece(tok, following))
        # --8<-- [end:text]
        cut("text")
    return fragments, text.decode()


def fence(printed: str) -> str:
    """A fragment: what a step printed, as a Markdown code block."""
    lines = [line.rstrip() for line in printed.strip("\n").splitlines()]
    return '```text title="printed"\n' + "\n".join(lines) + "\n```\n"


def write(out: Path) -> dict[str, Path]:
    """Run the trace and write one fragment per step into ``out``; returns the paths."""
    fragments, _ = trace()
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, printed in fragments.items():
        paths[name] = out / f"{name}.md"
        paths[name].write_text(fence(printed))
    return paths


def main() -> None:
    for path in write(OUT).values():
        print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
