"""Compile the GEMV kernel for sm_90 on a CPU-only machine and count the SASS of its K loop.

    .venv/bin/python scratch/gemv_sass.py [--file PATH | --rev GITREV] [--bits 4|8] [--dump DIR]

labkit would set TRITON_INTERPRET=1 on import (no GPU here), which makes ``@triton.jit``
return interpreter functions. So this loads ``labkit/quant/kernels.py`` (or a copy of it
from another git revision) under a stub ``labkit`` package whose backend says "GPU", then
hands ``_gemv_kernel`` to ``triton.compile`` with an explicit sm_90 target.

For each config it reports the innermost loop (the body of the last backward branch that
contains no other backward branch target, i.e. the steady-state K-chunk loop): the SASS
instructions in it, the weights one thread handles per trip, the ratio, an opcode
histogram, and the registers / spills from ``cuobjdump -res-usage``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ["TRITON_INTERPRET"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def load_kernels(path: str) -> types.ModuleType:
    """Import ``path`` as ``labkit.quant.kernels`` with a stub backend that reports a GPU."""
    for name in [m for m in sys.modules if m == "labkit" or m.startswith("labkit.")]:
        del sys.modules[name]
    pkg = types.ModuleType("labkit")
    pkg.__path__ = [os.path.join(ROOT, "src", "labkit")]
    backend = types.ModuleType("labkit.backend")
    backend.on_gpu = lambda: True
    backend.pick = lambda cpu, gpu: gpu
    backend.MODE = "gpu"
    pkg.backend = backend
    quant = types.ModuleType("labkit.quant")
    quant.__path__ = [os.path.join(ROOT, "src", "labkit", "quant")]
    pkg.quant = quant
    sys.modules.update({"labkit": pkg, "labkit.backend": backend, "labkit.quant": quant})
    spec = importlib.util.spec_from_file_location("labkit.quant.kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["labkit.quant.kernels"] = mod
    spec.loader.exec_module(mod)
    return mod


def compile_gemv(fn, constexprs: dict, ptr_types: dict, scalars: dict, num_warps: int, num_stages: int):
    """``triton.compile`` for sm_90. Pointers and ints divisible by 16 get ``tt.divisibility``
    as the JIT would give them for the 28672x8192 launch (aligned tensors, N, K and strides
    all multiples of 16)."""
    names = fn.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ptr_types:
            signature[name] = "*" + ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            kind, value = scalars[name]
            signature[name] = kind
            if kind.startswith("i") and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse_sass(sass: str):
    """[(address, text)] for each instruction in cuobjdump's listing."""
    out = []
    for line in sass.splitlines():
        m = LINE.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)  # predicate guard
    return text.split()[0] if text else ""


def inner_loop(instrs):
    """The innermost backward branch's body, as a list of instruction texts."""
    loops = []
    for addr, text in instrs:
        if opcode(text) == "BRA":
            m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
            if m and int(m.group(1), 16) < addr:  # not the trailing self-branch
                loops.append((int(m.group(1), 16), addr))
    if not loops:
        return None, []
    # innermost: no other loop strictly inside it; among those, the largest body (the K loop)
    inner = [l for l in loops if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]
    lo, hi = max(inner, key=lambda l: l[1] - l[0])
    return (lo, hi, len(loops)), [t for a, t in instrs if lo <= a <= hi]


def family(op: str) -> str:
    return op.split(".")[0]


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.check_output([os.path.join(BIN, "cuobjdump"), flag, f.name], text=True)
    finally:
        os.remove(f.name)


def disassemble(cubin: bytes) -> str:
    return cuobjdump(cubin, "-sass")


def res_usage(cubin: bytes) -> str:
    out = cuobjdump(cubin, "-res-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+).*?LOCAL:(\d+)", out)
    return f"regs {m.group(1)} stack {m.group(2)} smem {m.group(3)} local {m.group(4)}" if m else out.strip()


def gemv_setup(mod, bits: int, bn: int, block_k: int, group: int, k: int = 8192, n: int = 28672,
               x_dtype: str = "bf16", has_zeros: bool = False, split_k: int = 1, extra: dict | None = None):
    """Constexprs and argument types for one launch of ``mod._gemv_kernel`` as ``dequant_matmul`` makes it."""
    words = codes_are_words(mod)
    pairs = x_dtype == "bf16" and (bits == 4 or words)
    constexprs = dict(BITS=bits, GROUP=group, HAS_ZEROS=has_zeros, SUB=min(group, block_k),
                      X_BF16_PAIRS=pairs, BLOCK_K=block_k, BLOCK_N=bn, SPLIT_K=split_k)
    constexprs.update(extra or {})
    names = mod._gemv_kernel.arg_names
    constexprs = {k_: v for k_, v in constexprs.items() if k_ in names}
    row_bytes = k // 2 if bits == 4 else k
    ptr_types = dict(x_ptr="i32" if pairs else x_dtype, codes_ptr="u8", scales_ptr=x_dtype,
                     zeros_ptr=x_dtype, y_ptr=x_dtype if split_k == 1 else "fp32")
    if words:
        ptr_types["codes_ptr"] = "i32"
        row_bytes //= 4
    scalars = dict(N=("i32", n), K=("i32", k), stride_cn=("i32", row_bytes), stride_sn=("i32", k // group),
                   implicit_zero=("fp32", 0.0), exponents=("i32", 0x4F000001))
    scalars = {k_: v for k_, v in scalars.items() if k_ in names}
    return constexprs, ptr_types, scalars


def codes_are_words(mod) -> bool:
    """Whether this kernels.py passes the GEMV its codes as int32 words (and bf16 x as pairs at both widths)."""
    import inspect
    return "_code_words(" in inspect.getsource(mod.dequant_matmul)


def weights_per_thread(bits: int, bn: int, block_k: int, num_warps: int) -> float:
    return bn * block_k / (32 * num_warps)


def report(mod, bits, bn, w, st, block_k, group, dump=None, quiet=False, **kw):
    constexprs, ptr_types, scalars = gemv_setup(mod, bits, bn, block_k, group, **kw)
    ck = compile_gemv(mod._gemv_kernel, constexprs, ptr_types, scalars, w, st)
    sass = disassemble(ck.asm["cubin"])
    instrs = parse_sass(sass)
    span, body = inner_loop(instrs)
    per_thread = weights_per_thread(bits, bn, block_k, w)
    hist = collections.Counter(family(opcode(t)) for t in body)
    ldg = collections.Counter(opcode(t) for t in body if opcode(t).startswith(("LDG", "LDS", "LDGSTS", "LDC")))
    res = res_usage(ck.asm["cubin"])
    tag = f"INT{bits} BN={bn:<3} warps={w} stages={st} BK={block_k:<5} g={group:<5}"
    if dump:
        os.makedirs(dump, exist_ok=True)
        base = os.path.join(dump, f"int{bits}_bn{bn}_w{w}_s{st}_bk{block_k}")
        open(base + ".sass", "w").write(sass)
        open(base + ".ptx", "w").write(ck.asm["ptx"])
        open(base + ".ttgir", "w").write(ck.asm["ttgir"])
    n = len(body)
    result = dict(tag=tag, n=n, per_thread=per_thread, ipw=n / per_thread if per_thread else 0,
                  hist=hist, ldg=ldg, res=res, loops=span[2] if span else 0, total=len(instrs))
    if not quiet:
        print(f"{tag}  loop {n:5d} instr / {per_thread:6.0f} weights/thread = {result['ipw']:.2f} instr/weight"
              f"  ({res}; {result['loops']} back-branches, {len(instrs)} instr total)")
        top = ", ".join(f"{k} {v}" for k, v in hist.most_common(16))
        print(f"    {top}")
        print(f"    loads: {dict(ldg)}")
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=os.path.join(ROOT, "src", "labkit", "quant", "kernels.py"))
    ap.add_argument("--rev", help="take kernels.py from this git revision instead")
    ap.add_argument("--bits", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--configs", help="BN,W,S;BN,W,S;...  (default: the module's GEMV_CONFIGS)")
    ap.add_argument("--block-k", type=int, nargs="*", help="K chunks (default: GEMV_CHUNK)")
    ap.add_argument("--dump", help="write .sass/.ptx/.ttgir here")
    ap.add_argument("--zeros", action="store_true", help="HAS_ZEROS=True")
    ap.add_argument("--x", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = ap.parse_args()
    path = args.file
    if args.rev:
        text = subprocess.check_output(["git", "-C", ROOT, "show", f"{args.rev}:src/labkit/quant/kernels.py"], text=True)
        path = os.path.join(tempfile.mkdtemp(), "kernels.py")
        open(path, "w").write(text)
    mod = load_kernels(path)
    configs = ([tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")] if args.configs
               else mod.GEMV_CONFIGS)
    for bits in args.bits:
        group = 128 if bits == 4 else 8192
        for block_k in args.block_k or [mod.GEMV_CHUNK]:
            for bn, w, st in configs:
                try:
                    report(mod, bits, bn, w, st, block_k, group, dump=args.dump, x_dtype=args.x,
                           has_zeros=args.zeros)
                except Exception as e:  # a config that fails to compile is a result too
                    print(f"INT{bits} BN={bn} warps={w} stages={st} BK={block_k}: FAILED {type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1] if str(e) else ''}")


if __name__ == "__main__":
    main()
