"""The map of names: which of llama.cpp's public API we implement, under which name, and where
the site explains it.

llamaref follows llama.cpp at a pinned commit (the one vendored by llama-cpp-python 0.3.36) and
keeps its names: ggml ops without the ``ggml_`` prefix, ``llama_context``'s methods on
[`Context`][reference.context.Context], ``llama_memory_seq_rm`` as ``seq_rm`` on the memory.
This module is the table a reader of llama.cpp looks things up in: one [`Entry`][] per name,

- ``llama``: the name as llama.cpp spells it (``llama_decode``, ``ggml_rms_norm``,
  ``llama_kv_cache::find_slot``);
- ``kind``: where that name lives in llama.cpp, one of [`KINDS`][]: the C API (``llama.h``), a
  sampler of the C API, the ``common/`` library and tools, a ggml op, another ``ggml.h`` or
  ``gguf.h`` name, or a C++ name inside ``src/``;
- ``ours``: our full dotted name, in ``reference/`` (the MLX twin, where there is one, has the
  same name under ``accelerated/``);
- ``chapter``: the page of the site that explains it, relative to ``docs/``, with the anchor
  of its section when one section does (``"decode.md#outputs-and-get_logits_ith"``);
- ``note``: one line of Markdown, when the correspondence is not one to one.

It is part of the specification: ``docs/figures/map.py`` writes the site's map page from it,
and ``tests/docs/test_surface_map.py`` holds it to the code and the pages. Every name in ``ours``
resolves, every chapter and anchor exists, and every public method of the
[`Context`][reference.context.Context], every memory operation, every sampler and every op
that ``reference.ops`` exports is either here or in [`NOT_IN_LLAMA_CPP`][], with the reason.

What is not here is not implemented: embeddings outputs (``llama_get_embeddings*``),
grammars, encoder models, ``llama_batch_ext``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a llama.cpp name lives, in the order the map page shows the groups.
LLAMA_H = "llama.h"
SAMPLER = "sampler"
COMMON = "common"
GGML_OP = "ggml op"
GGML_H = "ggml.h"
INTERNAL = "internal"

KINDS: dict[str, str] = {
    LLAMA_H: "The C API: `llama.h`",
    SAMPLER: "Samplers: `llama_sampler_init_*`",
    COMMON: "The `common/` library and the tools",
    GGML_OP: "Operators: ggml ops",
    GGML_H: "Types, helpers and files: `ggml.h`, `gguf.h`",
    INTERNAL: "Inside llama.cpp: `src/`",
}
"""``kind -> the heading of its group`` on the map page, in page order."""


@dataclass(frozen=True)
class Entry:
    """One row of the map: a llama.cpp name, our name for it, and the chapter that explains it.

    Attributes:
        llama: the name as llama.cpp spells it.
        kind: one of [`KINDS`][].
        ours: our full dotted name (module, then class and attribute).
        chapter: a page under ``docs/``, with ``#anchor`` of a section or without.
        note: one line of Markdown when the correspondence is not one to one, else empty.
    """

    llama: str
    kind: str
    ours: str
    chapter: str
    note: str = ""


# ---------------------------------------------------------------------------------------------
# The tables, one per kind: (llama.cpp name, ours, chapter, note)
# ---------------------------------------------------------------------------------------------

_LLAMA_H = [
    # model and context
    ("llama_model_load_from_file", "reference.model_loader.load_model", "cli.md#loading",
     "a GGUF file or a HF folder; returns (hparams, weights)"),
    ("llama_model_is_recurrent", "reference.context.is_recurrent",
     "decode.md#recurrent-models-the-same-decode-another-memory", ""),
    ("llama_model_is_recurrent", "reference.context.Context.recurrent",
     "decode.md#recurrent-models-the-same-decode-another-memory", "asked of the context"),
    ("llama_context", "reference.context.Context", "decode.md#creating-a-context",
     "the constructor is `llama_init_from_model`"),
    ("llama_set_abort_callback", "reference.context.Context",
     "decode.md#return-codes-and-atomicity", "the `abort_callback` argument"),
    ("llama_n_ctx", "reference.context.Context.n_ctx", "decode.md#creating-a-context", ""),
    ("llama_n_ctx_seq", "reference.context.Context.n_ctx_seq", "decode.md#creating-a-context", ""),
    ("llama_n_batch", "reference.context.Context.n_batch", "batch.md#n_batch-and-n_ubatch", ""),
    ("llama_n_ubatch", "reference.context.Context.n_ubatch", "batch.md#n_batch-and-n_ubatch", ""),
    ("llama_n_seq_max", "reference.context.Context.n_seq_max", "decode.md#creating-a-context",
     ""),
    ("llama_max_parallel_sequences", "reference.common.LLAMA_MAX_SEQ", "memory/ops.md",
     "`LLAMA_MAX_SEQ`, 256"),
    ("llama_vocab_n_tokens", "reference.context.Context.n_vocab",
     "decode.md#outputs-and-get_logits_ith", "the width of a logits row"),
    ("llama_get_memory", "reference.context.Context.get_memory", "memory/ops.md", ""),
    ("llama_get_memory", "reference.context.Context.memory", "memory/ops.md",
     "the same, as a property"),
    ("llama_memory_t", "reference.memory.interface.Memory",
     "decode.md#recurrent-models-the-same-decode-another-memory",
     "`llama_memory_i`: a KV cache or a recurrent memory"),
    # batches and decoding
    ("llama_batch", "reference.batch.Batch", "batch.md#llama_batch", ""),
    ("llama_batch_init", "reference.batch.Batch", "batch.md#llama_batch",
     "`Batch(token=...)` or `Batch(embd=...)`"),
    ("llama_batch_get_one", "reference.batch.Batch", "batch.md#filling-in-the-missing-fields",
     "`Batch(token=...)`: `pos`, `seq_id`, `logits` filled in"),
    ("llama_decode", "reference.context.Context.decode", "decode.md#decode-step-by-step", ""),
    ("llama_synchronize", "reference.context.Context.synchronize",
     "mlx.md#laziness-where-evaluation-happens", "a no-op in NumPy"),
    ("llama_get_logits", "reference.context.Context.get_logits",
     "decode.md#outputs-and-get_logits_ith", ""),
    ("llama_get_logits_ith", "reference.context.Context.get_logits_ith",
     "decode.md#outputs-and-get_logits_ith", ""),
    # the memory: one row per implementation
    ("llama_memory_clear", "reference.memory.kv_cache.KVCache.clear", "memory/ops.md", ""),
    ("llama_memory_seq_rm", "reference.memory.kv_cache.KVCache.seq_rm", "memory/ops.md", ""),
    ("llama_memory_seq_cp", "reference.memory.kv_cache.KVCache.seq_cp", "memory/ops.md", ""),
    ("llama_memory_seq_keep", "reference.memory.kv_cache.KVCache.seq_keep", "memory/ops.md", ""),
    ("llama_memory_seq_add", "reference.memory.kv_cache.KVCache.seq_add", "memory/kshift.md", ""),
    ("llama_memory_seq_div", "reference.memory.kv_cache.KVCache.seq_div",
     "memory/kshift.md#the-sign-of-seq_div", ""),
    ("llama_memory_seq_pos_min", "reference.memory.kv_cache.KVCache.seq_pos_min",
     "memory/ops.md", ""),
    ("llama_memory_seq_pos_max", "reference.memory.kv_cache.KVCache.seq_pos_max",
     "memory/ops.md", ""),
    ("llama_memory_can_shift", "reference.memory.kv_cache.KVCache.can_shift",
     "context-shift.md", ""),
    ("llama_memory_clear", "reference.memory.kv_cache_iswa.KVCacheISWA.clear",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_rm", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_rm",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_cp", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_cp",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_keep", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_keep",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_add", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_add",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_div", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_div",
     "memory/swa.md#swa_full", "both caches"),
    ("llama_memory_seq_pos_min", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_pos_min",
     "memory/swa.md#swa_full", "from the SWA cache"),
    ("llama_memory_seq_pos_max", "reference.memory.kv_cache_iswa.KVCacheISWA.seq_pos_max",
     "memory/swa.md#swa_full", "from the SWA cache"),
    ("llama_memory_can_shift", "reference.memory.kv_cache_iswa.KVCacheISWA.can_shift",
     "memory/swa.md#swa_full", "both can, and the two sizes are equal"),
    ("llama_memory_clear", "reference.memory.recurrent.RecurrentMemory.clear",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_seq_rm", "reference.memory.recurrent.RecurrentMemory.seq_rm",
     "memory/recurrent.md#side-by-side", "a partial range fails"),
    ("llama_memory_seq_cp", "reference.memory.recurrent.RecurrentMemory.seq_cp",
     "memory/recurrent.md#placing-a-ubatch-and-copy-on-write", "shared, copied on write"),
    ("llama_memory_seq_keep", "reference.memory.recurrent.RecurrentMemory.seq_keep",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_seq_add", "reference.memory.recurrent.RecurrentMemory.seq_add",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_seq_div", "reference.memory.recurrent.RecurrentMemory.seq_div",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_seq_pos_min", "reference.memory.recurrent.RecurrentMemory.seq_pos_min",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_seq_pos_max", "reference.memory.recurrent.RecurrentMemory.seq_pos_max",
     "memory/recurrent.md#side-by-side", ""),
    ("llama_memory_can_shift", "reference.memory.recurrent.RecurrentMemory.can_shift",
     "memory/recurrent.md#side-by-side", ""),
    # state
    ("llama_state_get_data", "reference.context.Context.state_get_data",
     "state.md#files-and-the-contexts-state", ""),
    ("llama_state_set_data", "reference.context.Context.state_set_data",
     "state.md#files-and-the-contexts-state", ""),
    ("llama_state_seq_get_data", "reference.context.Context.state_seq_get_data",
     "state.md#what-is-saved", ""),
    ("llama_state_seq_set_data", "reference.context.Context.state_seq_set_data",
     "state.md#reading-check-everything-then-change-the-memory", ""),
    ("llama_state_seq_get_data_ext", "reference.context.Context.state_seq_get_data_ext",
     "state.md#what-is-saved", "flags: `NONE` or `PARTIAL_ONLY` (the SWA cache of an iSWA pair)"),
    ("llama_state_seq_set_data_ext", "reference.context.Context.state_seq_set_data_ext",
     "state.md#reading-check-everything-then-change-the-memory",
     "a refused blob raises `StateError`, nothing changed (llama.cpp clears the sequence)"),
    ("LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
     "reference.memory.state.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY", "state.md#what-is-saved",
     "alias `LLAMA_STATE_SEQ_FLAGS_SWA_ONLY`; `ON_DEVICE` is refused"),
    ("llama_state_save_file", "reference.context.Context.state_save_file",
     "state.md#files-and-the-contexts-state", ""),
    ("llama_state_load_file", "reference.context.Context.state_load_file",
     "state.md#files-and-the-contexts-state", ""),
    ("llama_state_seq_save_file", "reference.context.Context.state_seq_save_file",
     "state.md#files-and-the-contexts-state", ""),
    ("llama_state_seq_load_file", "reference.context.Context.state_seq_load_file",
     "state.md#files-and-the-contexts-state", ""),
    # vocabulary and text
    ("llama_vocab", "reference.tokenizer.vocab.Tokenizer", "tokenization.md", ""),
    ("llama_vocab_n_tokens", "reference.tokenizer.vocab.Tokenizer.n_vocab", "tokenization.md", ""),
    ("llama_vocab_bos", "reference.tokenizer.vocab.Tokenizer.bos_id",
     "tokenization.md#add_special-bos-and-eos", ""),
    ("llama_vocab_eos", "reference.tokenizer.vocab.Tokenizer.eos_id",
     "tokenization.md#add_special-bos-and-eos", ""),
    ("llama_vocab_eot", "reference.tokenizer.vocab.Tokenizer.eot_id",
     "tokenization.md#chat-templates", ""),
    ("llama_vocab_is_eog", "reference.tokenizer.vocab.Tokenizer.is_eog", "tokenization.md", ""),
    ("llama_tokenize", "reference.tokenizer.vocab.Tokenizer.tokenize",
     "tokenization.md#two-algorithms", ""),
    ("llama_token_to_piece", "reference.tokenizer.vocab.Tokenizer.token_to_piece",
     "tokenization.md#back-to-text-pieces-detokenization-and-partial-utf-8", ""),
    ("llama_detokenize", "reference.tokenizer.vocab.Tokenizer.detokenize",
     "tokenization.md#back-to-text-pieces-detokenization-and-partial-utf-8", ""),
    ("llama_chat_apply_template", "reference.tokenizer.vocab.Tokenizer.apply_chat_template",
     "tokenization.md#chat-templates", "Jinja, as transformers renders it"),
    ("llama_chat_apply_template", "reference.chat_template.render_chat_template",
     "tokenization.md#chat-templates", "the renderer itself"),
    # sampling: the types and the chain (the samplers have their own group)
    ("llama_token_data_array", "reference.sampling.TokenDataArray",
     "sampling.md#the-candidates-array", ""),
    ("LLAMA_DEFAULT_SEED", "reference.common.LLAMA_DEFAULT_SEED",
     "sampling.md#seeds-and-reproducible-draws", "a random seed"),
    # timings
    ("llama_perf_context", "reference.context.Context.perf", "mlx.md#timings-perf", ""),
    ("llama_perf_context_data", "reference.context.PerfContextData", "mlx.md#timings-perf", ""),
    ("llama_perf_context_reset", "reference.context.Context.perf_reset", "mlx.md#timings-perf",
     ""),
    ("llama_perf_context_print", "reference.tools.generate.Perf.lines", "cli.md#llamaref-generate",
     "the lines, not the printing"),
    ("LLAMA_ROPE_TYPE_NORM", "reference.ops.rope.ROPE_TYPE_NORM",
     "ops/rope.md#which-dimensions-pair-up-the-two-layouts", ""),
    ("LLAMA_ROPE_TYPE_NEOX", "reference.ops.rope.ROPE_TYPE_NEOX",
     "ops/rope.md#which-dimensions-pair-up-the-two-layouts", "`GGML_ROPE_TYPE_NEOX`"),
    # training
    ("llama_opt_init", "reference.training.opt.OptContext", "training.md#gradient-accumulation",
     "the trainable tensors and ggml-opt's state; `opt_period = n_batch / n_ubatch`"),
    ("llama_opt_params", "reference.training.opt.OptContext", "training.md#gradient-accumulation",
     "the constructor's arguments"),
    ("llama_opt_param_filter", "reference.training.opt.trainable_params",
     "training.md#what-is-trained", "the `param_filter` argument"),
    ("llama_opt_param_filter_all", "reference.training.opt.trainable_params",
     "training.md#what-is-trained", "`param_filter=None`"),
    ("llama_opt_epoch", "reference.training.epoch.opt_epoch", "training.md#an-epoch",
     "`n_ubatch == n_ctx`: one optimizer step per training datapoint"),
    ("llama_model_save_to_file", "reference.training.save.model_save_to_file",
     "training.md#llamaref-finetune", "every tensor F32, the source's metadata"),
    # LoRA adapters
    ("llama_adapter_lora_init", "reference.training.lora.load_lora_gguf",
     "training.md#lora-adapters", "a refused file raises `LoraFileError` (llama.cpp: NULL)"),
    ("llama_set_adapters_lora", "reference.training.lora.lora_weights",
     "training.md#lora-adapters", "merged: $W + sBA$, with `adapter_scale`"),
]

_SAMPLER = [
    ("llama_sampler_init_greedy", "reference.sampling.greedy", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_dist", "reference.sampling.dist",
     "sampling.md#seeds-and-reproducible-draws", ""),
    ("llama_sampler_init_top_k", "reference.sampling.top_k", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_top_p", "reference.sampling.top_p", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_min_p", "reference.sampling.min_p", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_typical", "reference.sampling.typical", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_temp", "reference.sampling.temp", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_temp_ext", "reference.sampling.temp_ext", "sampling.md#the-samplers",
     "dynamic temperature"),
    ("llama_sampler_init_xtc", "reference.sampling.xtc", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_top_n_sigma", "reference.sampling.top_n_sigma",
     "sampling.md#the-samplers", ""),
    ("llama_sampler_init_mirostat", "reference.sampling.mirostat", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_mirostat_v2", "reference.sampling.mirostat_v2",
     "sampling.md#the-samplers", ""),
    ("llama_sampler_init_penalties", "reference.sampling.penalties", "sampling.md#the-samplers",
     ""),
    ("llama_sampler_init_dry", "reference.sampling.dry", "sampling.md#the-samplers", ""),
    ("llama_sampler_init_logit_bias", "reference.sampling.logit_bias", "sampling.md#the-samplers",
     ""),
    ("llama_sampler_chain_init", "reference.sampling.SamplerChain",
     "sampling.md#the-default-order-and-why-order-matters", "built by `common_sampler_init`"),
]

_COMMON = [
    ("common_params_sampling", "reference.sampling.SamplerParams",
     "sampling.md#the-default-order-and-why-order-matters", ""),
    ("common_sampler_init", "reference.sampling.SamplerChain.from_params",
     "sampling.md#the-default-order-and-why-order-matters", ""),
    ("common_sampler_sample", "reference.sampling.SamplerChain.sample",
     "sampling.md#a-worked-example", ""),
    ("common_sampler_accept", "reference.sampling.SamplerChain.accept",
     "sampling.md#a-worked-example", "the history the penalties read"),
    ("common_sampler_reset", "reference.sampling.SamplerChain.reset",
     "sampling.md#seeds-and-reproducible-draws", ""),
    ("the generation loop", "reference.tools.generate.Generator.generate",
     "cli.md#llamaref-generate",
     "`llama-completion`, `llama-simple`"),
    ("context shift", "reference.context.context_shift", "context-shift.md",
     "`seq_rm`, then `seq_add`; `llama-completion`, `llama-server`"),
    ("a chat turn", "reference.tools.generate.ChatSession.turn", "cli.md#llamaref-chat",
     "`llama-cli`; the common prefix stays in the cache"),
    ("common_opt_dataset_init", "reference.training.dataset.opt_dataset_init",
     "training.md#the-dataset", "`finetune` passes `stride = n_ctx / 2`"),
    ("the validation split", "reference.training.dataset.idata_split", "training.md#the-dataset",
     "`finetune`'s `idata_split`, from `-val-split`"),
    ("struct lr_opt", "reference.training.schedule.LrOpt",
     "training.md#the-learning-rate-schedule",
     "`common_params::lr`: `-lr`, `-lr-min`, `-decay-epochs`, `-wd`, `-epochs`"),
    ("lr_opt::init (after parsing)", "reference.training.schedule.lr_opt_init",
     "training.md#the-learning-rate-schedule", ""),
    ("lr_opt::get_lr (every step)", "reference.training.schedule.get_lr",
     "training.md#the-learning-rate-schedule", "constant within an epoch"),
    ("common_opt_lr_pars", "reference.training.schedule.opt_lr_pars",
     "training.md#the-learning-rate-schedule", "$\\alpha$ and `wd` for both optimizers"),
    ("the fine-tuning loop", "reference.training.finetune.finetune",
     "training.md#llamaref-finetune", "`examples/training/finetune.cpp`, on either twin"),
    ("llama-export-lora's merge", "reference.training.lora.merge_lora",
     "training.md#lora-adapters", "$W + sBA$, a model that needs no adapter"),
]

_GGML_OP = [
    ("ggml_mul_mat", "reference.ops.matmul.mul_mat", "ops/basic.md#mul_mat-rows-against-rows", ""),
    ("ggml_get_rows", "reference.ops.rows.get_rows",
     "ops/basic.md#get_rows-and-set_rows-gather-and-scatter", ""),
    ("ggml_set_rows", "reference.ops.rows.set_rows",
     "ops/basic.md#get_rows-and-set_rows-gather-and-scatter", ""),
    ("ggml_add", "reference.ops.elementwise.add",
     "ops/basic.md#add-mul-scale-the-repeat-broadcast", ""),
    ("ggml_mul", "reference.ops.elementwise.mul",
     "ops/basic.md#add-mul-scale-the-repeat-broadcast", ""),
    ("ggml_scale", "reference.ops.elementwise.scale",
     "ops/basic.md#add-mul-scale-the-repeat-broadcast", ""),
    ("ggml_norm", "reference.ops.norm.norm", "ops/norm.md#layer-norm", ""),
    ("ggml_rms_norm", "reference.ops.norm.rms_norm", "ops/norm.md#rms-norm", ""),
    ("ggml_silu", "reference.ops.ffn.silu", "ops/activations.md#silu-and-swiglu", ""),
    ("ggml_swiglu_split", "reference.ops.ffn.swiglu", "ops/activations.md#silu-and-swiglu", ""),
    ("ggml_gelu", "reference.ops.ffn.gelu", "ops/activations.md#gelu-and-geglu", ""),
    ("ggml_geglu_split", "reference.ops.ffn.geglu", "ops/activations.md#gelu-and-geglu", ""),
    ("ggml_rope_ext", "reference.ops.rope.rope_ext", "ops/rope.md#the-whole-op", ""),
    ("ggml_soft_max_ext", "reference.ops.attention.soft_max_ext",
     "ops/attention.md#soft_max_ext-scale-mask-alibi-softmax", ""),
    ("ggml_ssm_conv", "reference.ops.ssm.ssm_conv",
     "ops/ssm.md#the-conv-step-and-the-self-overlapping-view", ""),
    ("ggml_ssm_scan", "reference.ops.ssm.ssm_scan", "ops/ssm.md#the-scan",
     "Mamba-1 and Mamba-2"),
    ("ggml_tanh", "reference.ops.softcap.tanh", "gemma.md#soft-capping", ""),
    ("ggml_mul_mat_id", "reference.ops.moe.mul_mat_id", "moe.md#mul_mat_id-one-matrix-per-row", ""),
    ("ggml_argsort", "reference.ops.moe.argsort", "moe.md#ties-which-expert-wins",
     "CPU kernel: libstdc++'s std::sort"),
    ("ggml_argsort_top_k", "reference.ops.moe.argsort_top_k", "moe.md#ties-which-expert-wins",
     ""),
]

_GGML_H = [
    ("ggml_rope_yarn_corr_dims", "reference.ops.rope.rope_yarn_corr_dims", "ops/rope.md#yarn", ""),
    ("ggml_row_size", "reference.quants.row_size", "quantization.md#reading-a-tensor", ""),
    ("ggml_get_type_traits", "reference.quants.dequantize", "quantization.md#reading-a-tensor",
     "its `to_float`"),
    ("ggml_quantize_chunk", "reference.quants.quantize",
     "quantization.md#writing-the-reference-quantizers", ""),
    ("gguf_init_from_file", "reference.gguf.read_gguf", "gguf.md#reading", ""),
    ("gguf_write_to_file", "reference.gguf.write_gguf", "gguf.md#writing", ""),
    # the backward ops (beside their forwards in reference.ops, or compositions in
    # reference.training.grad) and the optimizer steps (ggml.h)
    ("ggml_get_rows_back", "reference.ops.rows.get_rows_back",
     "training.md#tensors-and-matmul", "a scatter-add"),
    ("ggml_repeat_back", "reference.training.grad.repeat_back", "training.md#tensors-and-matmul",
     "the gradient of `add`'s and `mul`'s broadcast operand"),
    ("ggml_out_prod", "reference.training.grad.mul_mat_back", "training.md#tensors-and-matmul",
     "the two products of `mul_mat`'s backward"),
    ("ggml_rms_norm_back", "reference.training.grad.rms_norm_back", "training.md#normalization",
     ""),
    ("ggml_silu_back", "reference.training.grad.silu_back", "training.md#activations", ""),
    ("ggml_rope_ext_back", "reference.ops.rope.rope_back", "training.md#rope",
     "the inverse rotation, `rope_ext` at `-pos`"),
    ("ggml_soft_max_ext_back", "reference.ops.attention.soft_max_ext_back",
     "training.md#softmax-and-attention", "no ALiBi (`max_bias == 0`)"),
    ("ggml_cross_entropy_loss", "reference.ops.loss.cross_entropy_loss",
     "training.md#the-loss", ""),
    ("ggml_cross_entropy_loss_back", "reference.ops.loss.cross_entropy_loss_back",
     "training.md#the-loss", ""),
    ("ggml_build_backward_expand", "reference.training.llama_grad.train_backward",
     "training.md#the-model-backward", "the walk written out for the Llama graph"),
    ("ggml_opt_step_adamw", "reference.training.opt.opt_step_adamw", "training.md#adamw-and-sgd",
     ""),
    ("ggml_opt_step_sgd", "reference.training.opt.opt_step_sgd", "training.md#adamw-and-sgd", ""),
    # ggml-opt.h
    ("ggml_opt_get_default_optimizer_params", "reference.training.opt.OptimizerParams",
     "training.md#adamw-and-sgd", "`ggml-opt.h`; the defaults of `ggml_opt_optimizer_params`"),
    ("ggml_opt_init", "reference.training.opt.OptContext", "training.md#gradient-accumulation",
     "`ggml-opt.h`"),
    ("ggml_opt_eval", "reference.training.opt.OptContext.eval_backward",
     "training.md#gradient-accumulation",
     "accumulate, then step; the loss is `loss_and_grads`, the result `OptResult.add`"),
    ("ggml_opt_result_init", "reference.training.result.OptResult",
     "training.md#loss-accuracy-and-the-progress-line", "`ggml-opt.h`"),
    ("ggml_opt_result_loss", "reference.training.result.OptResult.loss",
     "training.md#loss-accuracy-and-the-progress-line", "with its uncertainty"),
    ("ggml_opt_result_accuracy", "reference.training.result.OptResult.accuracy",
     "training.md#loss-accuracy-and-the-progress-line", "with its uncertainty"),
    ("ggml_opt_result_reset", "reference.training.result.OptResult.reset",
     "training.md#loss-accuracy-and-the-progress-line", ""),
    ("ggml_opt_epoch_callback_progress_bar", "reference.training.result.progress_bar",
     "training.md#loss-accuracy-and-the-progress-line", "returns the text it writes to stderr"),
]

_INTERNAL = [
    # the context
    ("llama_context::memory_update", "reference.context.Context.memory_update",
     "decode.md#decode-step-by-step", ""),
    ("llama_context::output_reserve", "reference.context.Context.output_reserve",
     "decode.md#decode-step-by-step", ""),
    ("llama_context::process_ubatch", "reference.context.Context.process_ubatch",
     "decode.md#decode-step-by-step", ""),
    ("llama_context::output_reorder", "reference.context.Context.output_set",
     "batch.md#output-order", "rows kept in batch order"),
    ("llama_context::output_resolve_row", "reference.context.Context.output_row",
     "decode.md#outputs-and-get_logits_ith", ""),
    ("llama_context::n_outputs", "reference.context.Context.n_outputs",
     "decode.md#outputs-and-get_logits_ith", ""),
    ("llama_model::create_memory", "reference.memory.create_memory",
     "decode.md#recurrent-models-the-same-decode-another-memory", ""),
    ("llama_model::create_memory", "reference.context.Context.create_memory",
     "decode.md#recurrent-models-the-same-decode-another-memory", "the MLX twin puts its own"),
    ("llama_hparams", "reference.hparams.LlamaHParams", "gguf.md#hyperparameters-from-metadata",
     ""),
    ("llama_hparams::is_masked_swa", "reference.hparams.is_masked_swa", "memory/swa.md", ""),
    # batches
    ("llama_batch_allocr", "reference.batch.BatchAllocr", "batch.md#validation", ""),
    ("llama_batch_allocr::split_simple", "reference.batch.BatchAllocr.split_simple",
     "batch.md#the-allocator-and-its-three-splits", ""),
    ("llama_batch_allocr::split_equal", "reference.batch.BatchAllocr.split_equal",
     "batch.md#the-allocator-and-its-three-splits", ""),
    ("llama_batch_allocr::split_seq", "reference.batch.BatchAllocr.split_seq",
     "batch.md#the-allocator-and-its-three-splits", ""),
    ("llama_ubatch", "reference.batch.Ubatch", "batch.md#the-allocator-and-its-three-splits", ""),
    # the KV cache
    ("llama_kv_cells", "reference.memory.kv_cells.KVCells", "memory/cells.md", ""),
    ("llama_kv_cache", "reference.memory.kv_cache.KVCache", "memory/cells.md", ""),
    ("llama_kv_cache::find_slot", "reference.memory.kv_cache.KVCache.find_slot",
     "memory/ops.md#slot-search", ""),
    ("llama_kv_cache::prepare", "reference.memory.kv_cache.KVCache.prepare",
     "memory/ops.md#slot-search", ""),
    ("llama_kv_cache::get_n_kv", "reference.memory.kv_cache.KVCache.get_n_kv",
     "memory/ops.md#n_kv", ""),
    ("llama_kv_cache::set_input_kq_mask", "reference.memory.kq_mask.set_input_kq_mask",
     "memory/cells.md#the-mask", ""),
    ("llama_kv_cache::update", "reference.memory.kv_cache.KVCache.update", "memory/kshift.md",
     "the K-shift"),
    ("llama_kv_cache::build_rope_shift", "reference.memory.kv_cache.build_rope_shift",
     "memory/kshift.md", ""),
    ("llama_kv_cells::pos_div", "reference.memory.kv_cells.KVCells.pos_div",
     "memory/kshift.md#the-sign-of-seq_div", "the sign of its shift differs"),
    ("llama_kv_cache_iswa", "reference.memory.kv_cache_iswa.KVCacheISWA",
     "memory/swa.md#swa_full", "a base cache and a SWA cache, each over its own layers"),
    ("llama_kv_cache_iswa::init_batch", "reference.memory.kv_cache_iswa.KVCacheISWA.init_batch",
     "memory/swa.md#swa_full", "one split, both caches prepared"),
    ("llama_kv_cache_iswa::state_write", "reference.memory.kv_cache_iswa.KVCacheISWA.state_write",
     "state.md#the-byte-layout", "base then SWA; SWA only with `PARTIAL_ONLY`"),
    ("llm_graph_input_attn_kv_iswa", "reference.memory.kv_cache_iswa.KVCacheISWAAttnInput",
     "memory/swa.md#swa_full", "two masks; layer `il` to the SWA cache when `is_swa(il)`"),
    ("llama_kv_cache::state_write", "reference.memory.state.state_write",
     "state.md#the-byte-layout", ""),
    ("llama_kv_cache::state_read", "reference.memory.state.state_read",
     "state.md#reading-check-everything-then-change-the-memory", ""),
    # the recurrent memory
    ("llama_memory_recurrent", "reference.memory.recurrent.RecurrentMemory",
     "memory/recurrent.md", ""),
    ("llama_memory_recurrent::find_slot", "reference.memory.recurrent.RecurrentMemory.find_slot",
     "memory/recurrent.md#placing-a-ubatch-and-copy-on-write", ""),
    # the graphs
    ("llama_model_llama::graph", "reference.models.llama.llm_build_llama",
     "llama.md#one-forward-pass", "`llm_build_llama` in older llama.cpp"),
    ("llm_graph_context::build_inp_embd", "reference.models.llama.build_inp_embd",
     "llama.md#embedding", ""),
    ("llm_graph_context::build_norm", "reference.models.llama.build_norm", "llama.md#norm", ""),
    ("llm_graph_context::build_ffn", "reference.models.llama.build_ffn",
     "llama.md#residual-ffn-residual", ""),
    ("llm_graph_context::build_attn_mha", "reference.ops.attention.build_attn_mha",
     "ops/attention.md#build_attn_mha", ""),
    ("llama_model_gemma2::graph", "reference.models.gemma.llm_build_gemma",
     "gemma.md#one-forward-pass", "one function for `gemma`, `gemma2` and `gemma3`"),
    ("llama_model_gemma2::graph", "reference.ops.softcap.softcap", "gemma.md#soft-capping",
     "its `ggml_scale`, `ggml_tanh`, `ggml_scale` on the scores and on the logits"),
    ("llama_model_mamba::graph", "reference.models.mamba.llm_build_mamba", "mamba.md#the-block",
     "`mamba` and `mamba2`"),
    ("llm_build_mamba_base::build_mamba_layer", "reference.models.mamba.build_mamba_layer",
     "mamba.md#mamba-1", ""),
    ("llm_build_mamba_base::build_mamba2_layer", "reference.models.mamba.build_mamba2_layer",
     "mamba.md#mamba-2", ""),
    # sampling
    ("llama_sampler_softmax_impl", "reference.sampling.softmax",
     "sampling.md#the-candidates-array", "the softmax most samplers start with"),
    # training
    ("llama_set_param", "reference.training.opt.trainable_params", "training.md#what-is-trained",
     "F32 only; never `token_embd.weight` or `rope_freqs.weight`"),
    ("llama_context::opt_epoch_iter", "reference.training.llama_grad.loss_and_grads",
     "training.md#the-model-backward", "one datapoint: forward, loss, backward"),
    ("llm_graph_context::build_lora_mm", "reference.training.lora.build_lora_mm",
     "training.md#lora-adapters", "$Wx + sB(Ax)$; the specification runs the merged weights"),
    ("llama_adapter_lora_weight::get_scale", "reference.training.lora.lora_scale",
     "training.md#lora-adapters", ""),
]

SURFACE: tuple[Entry, ...] = tuple(
    Entry(llama, kind, ours, chapter, note)
    for kind, rows in [(LLAMA_H, _LLAMA_H), (SAMPLER, _SAMPLER), (COMMON, _COMMON),
                       (GGML_OP, _GGML_OP), (GGML_H, _GGML_H), (INTERNAL, _INTERNAL)]
    for llama, ours, chapter, note in rows
)
"""The map: every [`Entry`][], group by group in the order of [`KINDS`][]."""

NOT_IN_LLAMA_CPP: dict[str, str] = {
    "reference.context.Context.decode_token": (
        "decode(Batch(token=[t], seq_id=[[s]])); the MLX twin takes a token still on the device"
    ),
    "reference.context.Context.on_device": (
        "whether the logits can stay on the device for a device sampler (ContextLike's "
        "capability flag); False here, True on the MLX twin"
    ),
}
"""Public names that ``tests/docs/test_surface_map.py`` checks and llama.cpp has no name for:
``ours -> why``."""
