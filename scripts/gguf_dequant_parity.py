#!/usr/bin/env python3
"""Dequantize GGUF tensors with the `gguf` Python package (llama.cpp's own
reference reader), for kiln's dequantization parity tests.

    gguf_dequant_parity.py FILE.gguf OUT_DIR [TENSOR ...]

Writes OUT_DIR/<tensor name>.f32 (little-endian f32, GGML element order) for
each named tensor (every tensor when none is named) and OUT_DIR/index.json
mapping names to their GGML type name and element count. Exits 3 with a note
when the `gguf` package is missing, so callers can skip.
"""
import json
import os
import sys

try:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
except ImportError as e:  # pragma: no cover - depends on the machine
    print(f"gguf_dequant_parity: the gguf Python package is missing ({e}); pip install gguf", file=sys.stderr)
    sys.exit(3)


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, out = sys.argv[1], sys.argv[2]
    wanted = set(sys.argv[3:])
    os.makedirs(out, exist_ok=True)
    reader = GGUFReader(path)
    index = {}
    for t in reader.tensors:
        if wanted and t.name not in wanted:
            continue
        values = dequantize(t.data, t.tensor_type).astype("<f4").reshape(-1)
        values.tofile(os.path.join(out, t.name + ".f32"))
        index[t.name] = {"type": t.tensor_type.name, "n": int(values.size)}
    missing = wanted - set(index)
    if missing:
        print(f"gguf_dequant_parity: no tensors named {sorted(missing)}", file=sys.stderr)
        return 1
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
