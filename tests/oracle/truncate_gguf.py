#!/usr/bin/env python3
"""Writes a copy of a llama-family GGUF file that keeps only its first N blocks.

Why this exists: the GPU machine can only be sent 64 MiB, and
SmolLM2-135M-Instruct's Q4_1 GGUF is 98 MB. Its first few blocks, with the
real embedding, final norm and vocabulary, are a real (if shallower) model:
`kiln import` and HF load it like the original, so the GPU oracle can still
cover the imported-GGUF path. The tensors are copied byte for byte (no
requantization); only `<arch>.block_count` changes.

    python3 tests/oracle/truncate_gguf.py IN.gguf OUT.gguf --blocks 4

Needs the `gguf` package (pip install gguf). Not here: anything but llama-style
`blk.<i>.` tensor names.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--blocks", type=int, required=True)
    a = ap.parse_args()
    try:
        import gguf
    except ImportError:
        sys.exit("truncate_gguf.py needs the gguf package: pip install gguf")

    r = gguf.GGUFReader(a.src)
    arch_field = r.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        sys.exit(f"{a.src}: no general.architecture; is it a GGUF model file?")
    arch = arch_field.contents()
    count_key = f"{arch}.block_count"
    if count_key not in r.fields:
        sys.exit(f"{a.src}: no {count_key}")
    total = int(r.fields[count_key].contents())
    if not 1 <= a.blocks <= total:
        sys.exit(f"--blocks must be between 1 and {total} (the file's block count)")

    tmp = a.dst + ".tmp"
    w = gguf.GGUFWriter(tmp, arch, endianess=r.endianess)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = a.blocks if f.name == count_key else f.contents()
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    blk = re.compile(r"^blk\.(\d+)\.")
    kept = []
    for t in r.tensors:
        m = blk.match(t.name)
        if m and int(m.group(1)) >= a.blocks:
            continue
        kept.append(t)
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data, tensor_endianess=r.endianess)
    w.close()
    os.replace(tmp, a.dst)
    size = os.path.getsize(a.dst)
    print(f"{a.dst}: {a.blocks} of {total} blocks, {len(kept)} tensors, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
