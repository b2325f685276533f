"""labkit.compile_check: interpreted launches also compile for the H200, on a machine without one.

Each case runs in a fresh CPU-mode process, as ``make test`` runs everything: the check is
installed when labkit is first imported, before any kernel has been interpreted.
"""

import os
import subprocess
import sys
import textwrap

import labkit
import pytest

pytestmark = pytest.mark.skipif(labkit.on_gpu(), reason="the check compiles what the interpreter runs; a GPU compiles anyway")

KERNELS = '''
import labkit
import torch
import triton
import triton.language as tl

SCALE = 2.0  # a plain global: the interpreter reads it; compiled kernels see only constexpr globals


@triton.jit
def _row_max(x):
    return x.max(axis=0)  # a tensor method, forwarded to triton.language's jit function


@triton.jit
def scaled_by_max(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=-float("inf"))
    y = x / tl.maximum(_row_max(x), 1e-6) + tl.cdiv(n, 2)
    tl.store(y_ptr + offs, y, mask=offs < n)


@triton.jit
def doubled(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) * SCALE)


@triton.jit
def tile_product(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
    b = tl.load(b_ptr + r[:, None] * BLOCK + r[None, :])
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))


def scaled(x):
    y = torch.empty_like(x)
    scaled_by_max[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return y
'''


def _run(tmp_path, program: str, check: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "kernels.py").write_text(KERNELS)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LABKIT_COMPILE_CHECK")}
    env.update(LABKIT_MODE="cpu", PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]))
    if check:
        env["LABKIT_COMPILE_CHECK"] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(program)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)


def test_a_kernel_with_helpers_compiles_and_still_computes(tmp_path):
    """Module helpers, tensor methods and tl functions reach the compiler as JIT functions, also
    after an interpreted launch has left the interpreter's patches in triton.language."""
    out = _run(tmp_path, """
        import torch
        from kernels import scaled, scaled_by_max
        from labkit import compile_check
        x = torch.arange(1.0, 12.0)
        for _ in range(2):  # the second launch compiles after the first one was interpreted
            torch.testing.assert_close(scaled(x), x / 11 + 6)
        y = torch.empty(5)
        kernel = compile_check.compile_launch(scaled_by_max, (y[:5], y, 5), {"BLOCK": 8})
        print("sm", kernel.metadata.target.arch, "cubin", len(kernel.asm["cubin"]) > 0)
    """)
    assert out.returncode == 0, out.stderr
    assert "sm 90 cubin True" in out.stdout


def test_a_kernel_only_the_interpreter_accepts_is_refused_at_its_launch(tmp_path):
    program = """
        import torch
        from kernels import doubled
        x, y = torch.arange(4.0), torch.zeros(4)
        doubled[(1,)](x, y, BLOCK=4)
        print(y.tolist())
    """
    unchecked = _run(tmp_path, program, check=False)
    assert unchecked.returncode == 0 and "[0.0, 2.0, 4.0, 6.0]" in unchecked.stdout, unchecked.stderr
    checked = _run(tmp_path, program)
    assert checked.returncode != 0
    assert "KernelCompileError: doubled does not compile for sm_90 (the H200)" in checked.stderr
    assert "global variable SCALE" in checked.stderr, checked.stderr[-2000:]


def test_a_kernel_that_overflows_shared_memory_is_refused(tmp_path):
    """tl.dot stages its operands in shared memory; with the limit lowered below that, the check refuses."""
    out = _run(tmp_path, """
        import torch
        from kernels import tile_product
        from labkit import compile_check
        a = torch.randn(32, 32)
        c = torch.empty(32, 32)
        needed = compile_check.compile_launch(tile_product, (a, a, c), {"BLOCK": 32}).metadata.shared
        assert needed > 0
        compile_check.MAX_SHARED_MEMORY = needed - 1
        tile_product[(1,)](a, a, c, BLOCK=32, num_stages=1)
    """)
    assert out.returncode != 0
    assert "tile_product needs" in out.stderr and "bytes of shared memory on sm_90" in out.stderr, out.stderr[-2000:]


def test_a_kernel_defined_after_a_launch_sees_the_helpers_defined_with_it(tmp_path):
    """As in a notebook: a later cell adds a helper and a kernel to globals already mirrored."""
    out = _run(tmp_path, """
        import linecache
        import kernels
        import torch
        kernels.scaled(torch.arange(1.0, 12.0))  # mirrors the module's globals as they are
        cell = (
            "@triton.jit\\n"
            "def _plus_one(x):\\n"
            "    return x + 1\\n"
            "@triton.jit\\n"
            "def incremented(x_ptr, y_ptr, BLOCK: tl.constexpr):\\n"
            "    offs = tl.arange(0, BLOCK)\\n"
            "    tl.store(y_ptr + offs, _plus_one(tl.load(x_ptr + offs)))\\n"
        )
        linecache.cache["<cell 2>"] = (len(cell), None, cell.splitlines(True), "<cell 2>")  # as IPython does
        exec(compile(cell, "<cell 2>", "exec"), vars(kernels))
        y = torch.empty(4)
        kernels.incremented[(1,)](torch.arange(4.0), y, BLOCK=4)
        print(y.tolist())
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[1.0, 2.0, 3.0, 4.0]" in out.stdout
