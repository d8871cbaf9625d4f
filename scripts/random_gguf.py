"""A GGUF with a model's metadata, tensor names, shapes and types, and random weights.

Usage::

    python scripts/random_gguf.py skeleton SmolLM2-135M-Instruct.Q4_1.gguf smollm2.json.xz
    python scripts/random_gguf.py fill smollm2.json.xz random-smollm2.gguf --seed 0

Why: a benchmark's time depends on a model's shapes and tensor types, not on its values, and
a machine the weights cannot be copied to (the 98 MB GGUF of SmolLM2 is larger than what a
lent GPU machine accepts in one call; see ``scripts/nvidia_bench.sh``) can still time the
same model. ``skeleton`` writes every metadata key (the tokenizer's vocabulary and merges
included, so the file loads as the original does) and every tensor's name, shape and type
to a compressed JSON file of a few hundred kilobytes; ``fill`` writes a GGUF from it, with
normal weights of standard deviation 0.02 (norm weights 1), quantized to each tensor's own
type by gguf-py. Its tokens mean nothing, so it is only for timing.
"""

from __future__ import annotations

import argparse
import json
import lzma

import gguf
import numpy as np

VALUE_TYPES = {t.name: t for t in gguf.GGUFValueType}
"""GGUF's metadata value types by name, as the skeleton records them."""


def _plain(value):
    """A metadata value as JSON holds it (bytes as text, NumPy scalars as Python numbers)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="surrogateescape")
    if isinstance(value, np.generic):
        return value.item()
    return value


def skeleton(src: str, dst: str) -> None:
    """Write ``src``'s metadata and tensor specs (not its data) to ``dst`` (JSON, xz)."""
    reader = gguf.GGUFReader(src)
    kv = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts: the writer sets them
            continue
        types = [t.name for t in field.types]
        kv.append([key, types, _plain(field.contents())])
    tensors = [[t.name, [int(d) for d in t.shape], t.tensor_type.name] for t in reader.tensors]
    with lzma.open(dst, "wt", encoding="utf-8", errors="surrogateescape") as f:
        json.dump({"kv": kv, "tensors": tensors}, f)


def fill(src: str, dst: str, seed: int = 0) -> None:
    """Write a GGUF from the skeleton ``src``: its metadata, random weights of its shapes."""
    with lzma.open(src, "rt", encoding="utf-8", errors="surrogateescape") as f:
        spec = json.load(f)
    kv = {key: (types, value) for key, types, value in spec["kv"]}
    writer = gguf.GGUFWriter(dst, kv.pop("general.architecture")[1])
    for key, (types, value) in kv.items():
        vtype = VALUE_TYPES[types[0]]
        sub = VALUE_TYPES[types[1]] if len(types) > 1 else None
        writer.add_key_value(key, value, vtype, sub)
    rng = np.random.default_rng(seed)
    for name, shape, type_name in spec["tensors"]:
        qtype = gguf.GGMLQuantizationType[type_name]
        rows = tuple(reversed(shape))  # GGUF lists ne0 first; NumPy wants the last axis last
        if name.endswith("norm.weight"):
            data = np.ones(rows, dtype=np.float32)
        else:
            data = (0.02 * rng.standard_normal(rows)).astype(np.float32)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(name, data.astype(np.float16 if qtype.name == "F16" else np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    """The command line: ``skeleton SRC DST`` or ``fill SRC DST [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("skeleton", help="a GGUF's metadata and tensor specs, as JSON (xz)")
    s.add_argument("src")
    s.add_argument("dst")
    f = sub.add_parser("fill", help="a GGUF from a skeleton, with random weights")
    f.add_argument("src")
    f.add_argument("dst")
    f.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "skeleton":
        skeleton(args.src, args.dst)
    else:
        fill(args.src, args.dst, args.seed)


if __name__ == "__main__":
    main()
