"""``llamaref quantize IN.gguf OUT.gguf TYPE``: llama.cpp's ``llama-quantize``, byte for byte.

The file written is the one ``llama-quantize`` writes without an importance matrix, byte for
byte (the type mix, the fallbacks, the tensor order, ``general.file_type``): the rules are
[`reference.model_quant`][reference.model_quant]; this module is the command around them.
``TYPE`` is llama-quantize's name (``Q4_K_M``, ``q6_k``, the aliases ``Q4_K`` ...) or its
number (``15``); the flags are llama-quantize's: ``--pure``, ``--output-tensor-type``,
``--token-embedding-type``, ``--leave-output-tensor``, ``--allow-requantize``.

Everything is checked before the output is opened (the type, the input file, the plan: a
type this project cannot write, a quantized source without ``--allow-requantize``), and the
output is written to a temporary file renamed over ``OUT``, so a failure leaves no file and
never a partial one.

Examples: ``llamaref quantize model-f32.gguf model-Q4_K_M.gguf Q4_K_M``.
"""

from __future__ import annotations

import argparse
import os
import time

from llamaref.common import CLIError, log
from reference.gguf import read_gguf, write_gguf
from reference.model_quant import (
    FTYPES,
    REFUSED_FTYPES,
    ModelQuantError,
    QuantizeParams,
    ftype_name,
    parse_ftype,
    parse_ggml_type,
    quantize_model,
    typed_metadata,
)

# llama-quantize's descriptions (tools/quantize/quantize.cpp, QUANT_OPTIONS)
FTYPE_HELP = {
    "Q4_0": " 4.34G, +0.4685 ppl @ Llama-3-8B", "Q4_1": " 4.78G, +0.4511 ppl @ Llama-3-8B",
    "Q5_0": " 5.21G, +0.1316 ppl @ Llama-3-8B", "Q5_1": " 5.65G, +0.1062 ppl @ Llama-3-8B",
    "Q2_K": " 2.96G, +3.5199 ppl @ Llama-3-8B", "Q3_K": "alias for Q3_K_M",
    "Q3_K_S": " 3.41G, +1.6321 ppl @ Llama-3-8B", "Q3_K_M": " 3.74G, +0.6569 ppl @ Llama-3-8B",
    "Q3_K_L": " 4.03G, +0.5562 ppl @ Llama-3-8B", "Q4_K": "alias for Q4_K_M",
    "Q4_K_S": " 4.37G, +0.2689 ppl @ Llama-3-8B", "Q4_K_M": " 4.58G, +0.1754 ppl @ Llama-3-8B",
    "Q5_K": "alias for Q5_K_M", "Q5_K_S": " 5.21G, +0.1049 ppl @ Llama-3-8B",
    "Q5_K_M": " 5.33G, +0.0569 ppl @ Llama-3-8B", "Q6_K": " 6.14G, +0.0217 ppl @ Llama-3-8B",
    "Q8_0": " 7.96G, +0.0026 ppl @ Llama-3-8B", "F16": "14.00G, +0.0020 ppl @ Mistral-7B",
    "BF16": "14.00G, -0.0050 ppl @ Mistral-7B", "F32": "26.00G              @ 7B",
}


def allowed_types_text() -> str:
    """The end of ``--help``: llama-quantize's table of the types, as it prints it."""
    rows = [f"  {int(ft):2d}  or  {name:<7} : {FTYPE_HELP[name]}" for name, ft in FTYPES.items()]
    return ("allowed quantization types:\n" + "\n".join(rows)
            + "\n\nnot supported here (llama-quantize writes them): "
            + ", ".join(REFUSED_FTYPES))


def quantize_params(args: argparse.Namespace) -> QuantizeParams:
    """The flags as ``llama_model_quantize_params``; a bad tensor type is a CLIError."""
    try:
        out = args.output_tensor_type and parse_ggml_type(args.output_tensor_type)
        emb = args.token_embedding_type and parse_ggml_type(args.token_embedding_type)
    except ModelQuantError as e:
        raise CLIError(str(e)) from None
    return QuantizeParams(output_tensor_type=out or None, token_embedding_type=emb or None,
                          quantize_output_tensor=not args.leave_output_tensor,
                          pure=args.pure, allow_requantize=args.allow_requantize)


# --8<-- [start:cmd_quantize]
def cmd_quantize(args: argparse.Namespace) -> int:
    """Quantize IN to OUT; everything is checked before OUT is written, atomically."""
    try:
        ftype = parse_ftype(args.type)
    except ModelQuantError as e:
        raise CLIError(str(e)) from None
    params = quantize_params(args)
    if not os.path.isfile(args.input):
        raise CLIError(f"input file not found: {args.input}")
    src = read_gguf(args.input)
    t0 = time.perf_counter()
    try:
        tensors, metadata = quantize_model(src.tensors, typed_metadata(src), ftype, params)
    except ModelQuantError as e:
        raise CLIError(f"{args.input}: {e}") from None
    write_gguf(args.output, metadata, tensors)
    size_in, size_out = os.path.getsize(args.input), os.path.getsize(args.output)
    log(f"llamaref: quantized '{args.input}' to '{args.output}' as {ftype_name(ftype)}: "
        f"{size_in / 2**20:.2f} MiB -> {size_out / 2**20:.2f} MiB in "
        f"{time.perf_counter() - t0:.1f} s")
    return 0
# --8<-- [end:cmd_quantize]


def add_quantize_command(sub) -> None:
    """Register ``llamaref quantize`` on the CLI's subparsers (the CLI calls this)."""
    p = sub.add_parser(
        "quantize", help="write a quantized model file (like llama-quantize)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Quantize a GGUF file to a file type (a type mix), byte for byte what "
                    "llama-quantize writes without an importance matrix.",
        epilog=allowed_types_text())
    p.add_argument("input", metavar="model-f32.gguf", help="the model to quantize")
    p.add_argument("output", metavar="model-quant.gguf", help="the file to write")
    p.add_argument("type", metavar="type", help="a file type: name or number (see below)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow requantizing tensors that have already been quantized "
                        "(WARNING: this can severely reduce quality compared to quantizing "
                        "from 16bit or 32bit!)")
    p.add_argument("--leave-output-tensor", action="store_true",
                   help="leave output.weight un(re)quantized")
    p.add_argument("--pure", action="store_true",
                   help="disable k-quant mixtures and quantize all tensors to the same type")
    p.add_argument("--output-tensor-type", metavar="ggml_type",
                   help="use this ggml_type for the output.weight tensor")
    p.add_argument("--token-embedding-type", metavar="ggml_type",
                   help="use this ggml_type for the token embeddings tensor")
    p.set_defaults(func=cmd_quantize)
