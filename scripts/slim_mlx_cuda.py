r"""The files of an ``mlx-cuda-13`` wheel, cut to one GPU architecture, as ``.tar.xz``.

Usage::

    pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_35_x86_64 -d wheels mlx-cuda-13==0.32.4
    python scripts/slim_mlx_cuda.py wheels/mlx_cuda_13-*.whl cuda13-sm90.tar.xz --arch 90

Why: the GPU machines lent to this project reach no package index and take 64 MiB per call,
and the wheel is 90 MB, almost all of it ``mlx/lib/libmlx.so`` (146 MB unpacked). Its
``.nv_fatbin`` section holds the kernels compiled for several GPU architectures (sm_75 to
sm_121, about 9 MB each, already compressed); CUDA loads only the one that matches the GPU.
This writes the wheel's files with every other architecture's code zeroed (the headers stay,
so the section's layout is unchanged) and the symbol table stripped (``strip
--strip-unneeded``): 20 MB as xz, which ``scripts/nvidia_bench.sh`` unpacks into
``site-packages`` next to the ``mlx`` wheel. Only for a GPU of that architecture (90: the
H100 and H200).
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
"""The first word of each fat binary in ``.nv_fatbin``."""

CUBIN = 2
"""An entry's kind: compiled code for one architecture (1 is PTX)."""


def section(path: Path, name: str) -> tuple[int, int]:
    """The file offset and size of ELF section ``name`` (read with ``readelf``)."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        fields = line.split("]", 1)[-1].split()
        if fields and fields[0] == name:
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path} has no {name} section")


def keep_one_arch(path: Path, arch: int) -> tuple[int, int]:
    """Zero the payload of every fatbin entry that is not a cubin for ``arch``.

    Returns the bytes kept and the bytes zeroed.
    """
    data = bytearray(path.read_bytes())
    off, size = section(path, ".nv_fatbin")
    kept = zeroed = 0
    i = off
    while i + 16 <= off + size:
        magic, _, header, fat_size = struct.unpack_from("<IHHQ", data, i)
        if magic != FATBIN_MAGIC:  # fat binaries are 8-byte aligned
            i += 8
            continue
        j, end = i + header, i + header + fat_size
        while j < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, j)
            entry_arch = struct.unpack_from("<I", data, j + 28)[0]
            start = j + entry_header
            if kind == CUBIN and entry_arch == arch:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            j = start + payload
        i = end
    path.write_bytes(data)
    return kept, zeroed


def main() -> None:
    """Unpack the wheel, cut ``libmlx.so``, write the files as one ``.tar.xz``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel")
    parser.add_argument("out")
    parser.add_argument("--arch", type=int, default=90, help="the GPU architecture to keep")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        zipfile.ZipFile(args.wheel).extractall(root)
        lib = root / "mlx" / "lib" / "libmlx.so"
        subprocess.run(["strip", "--strip-unneeded", str(lib)], check=True)
        kept, zeroed = keep_one_arch(lib, args.arch)
        print(f"sm_{args.arch}: kept {kept / 1e6:.1f} MB of GPU code, zeroed {zeroed / 1e6:.1f} MB")
        with tarfile.open(args.out, "w:xz") as tar:
            for item in sorted(root.iterdir()):
                tar.add(item, arcname=item.name)


if __name__ == "__main__":
    main()
