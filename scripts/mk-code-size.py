#!/usr/bin/env python3
"""Code size of the megakernel interpreter, per task kind, without a GPU.

Why: the interpreter is one kernel whose blocks jump between task kinds
every few microseconds, so the SASS a task runs is often cold in the SM's
instruction caches. This compiles kernels/gpu/megakernel.cu with NVRTC (as
kiln does: the same options, kiln_port.h inlined) and reports the size of
megakernel_run's .text, then, for each dispatch case, how much smaller it
gets when that case's call is replaced by a trap: the bytes that task kind
adds. Registers and spills come from ptxas's report.

    scripts/mk-code-size.py [--sm 90] [--define NAME[=VALUE] ...] [--total-only]

Needs libnvrtc (the nvidia-cuda-nvrtc wheel or a CUDA toolkit; set
KILN_NVRTC_LIB to its path otherwise). Not in CI: a measurement, not a check.
"""
import argparse
import ctypes
import glob
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GPU = os.path.join(ROOT, "kernels", "gpu")

# The dispatch cases of megakernel_run: (name, the start of the call as
# written in the dispatch switch; the call runs to the next ';').
CASES = [
    ("gemv T=1", "mk_gemv<1>("),
    ("gemv T=8", "mk_gemv<8>("),
    ("attention decode", "mk_attention<1, "),
    ("attention rows", "mk_attention<KILN_MK_ATTN_RT, "),
    ("attention combine", "mk_attention_combine(t)"),
    ("qkv rope kv write", "mk_qkv_rope_kv_write(t)"),
    ("rms_norm", "mk_rms_norm<0>(t"),
    ("add_rms_norm", "mk_rms_norm<1>(t"),
    ("argmax", "mk_argmax(t"),
    ("silu_mul", "mk_act_mul<0>(t"),
    ("gelu_tanh_mul", "mk_act_mul<1>(t"),
]


def nvrtc():
    cands = [os.environ.get("KILN_NVRTC_LIB", "")]
    try:
        import nvidia  # noqa: F401  (the pip wheels' namespace package)

        for p in nvidia.__path__:
            cands += sorted(glob.glob(os.path.join(p, "cu*", "lib", "libnvrtc.so.*")))
    except ImportError:
        pass
    cands += ["/usr/local/cuda/lib64/libnvrtc.so"]
    for c in cands:
        if c and os.path.exists(c) and "builtins" not in c and ".alt." not in c:
            # libnvrtc dlopens its builtins library by name; loading it
            # first from the same directory makes that name resolve.
            for b in glob.glob(os.path.join(os.path.dirname(c), "libnvrtc-builtins.so*"))[:1]:
                ctypes.CDLL(b)
            return ctypes.CDLL(c)
    sys.exit("libnvrtc not found (set KILN_NVRTC_LIB)")


def source(defines):
    header = open(os.path.join(GPU, "kiln_port.h")).read()
    out = []
    for line in open(os.path.join(GPU, "megakernel.cu")).read().splitlines():
        if line.strip() == '#include "kiln_port.h"':
            out += [f"#define {d.replace('=', ' ', 1)}" for d in defines]
            out.append(header)
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def compile_cubin(lib, src, sm):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"megakernel.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    # kiln_kernels::nvrtc::options, plus ptxas's resource report.
    opts = [f"--gpu-architecture=sm_{sm}", "--std=c++17", "--device-as-default-execution-space",
            "-DNDEBUG", "--fmad=true", "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    if rc:
        return None, log
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw, log


def text_sizes(elf):
    """Sizes of the ELF's .text.<function> sections."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = secs[shstrndx][4]
    out = {}
    for s in secs:
        name = elf[names + s[0]:elf.index(b"\0", names + s[0])].decode()
        if name.startswith(".text."):
            out[name[6:]] = s[5]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sm", type=int, default=90)
    ap.add_argument("--define", action="append", default=[])
    ap.add_argument("--total-only", action="store_true")
    a = ap.parse_args()
    lib = nvrtc()
    base = source(a.define)
    cubin, log = compile_cubin(lib, base, a.sm)
    if cubin is None:
        sys.exit(log)
    total = text_sizes(cubin)["megakernel_run"]
    print(f"megakernel_run sm_{a.sm}: {total} bytes of SASS")
    # ptxas reports each entry function after "Compiling entry function
    # 'NAME'"; only megakernel_run's registers are of interest.
    fn = None
    for line in log.splitlines():
        if "Compiling entry function" in line:
            fn = line.split("'")[1] if "'" in line else None
        elif fn == "megakernel_run" and "registers" in line:
            print(" ", line.strip())
    if a.total_only:
        return
    print(f"{'task kind':20} {'bytes':>8} {'share':>6}")
    for name, call in CASES:
        if call not in base:
            print(f"{name:20} {'(not in this source)':>15}")
            continue
        # The call (in the dispatch switch: the last occurrence) up to its
        # closing ';' becomes a trap.
        i = base.rindex(call)
        j = base.index(";", i)
        c, _ = compile_cubin(lib, base[:i] + "__trap()" + base[j:], a.sm)
        if c is None:
            print(f"{name:20} {'(did not compile)':>15}")
            continue
        d = total - text_sizes(c)["megakernel_run"]
        print(f"{name:20} {d:>8} {d / total:>6.1%}")


if __name__ == "__main__":
    main()
