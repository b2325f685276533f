"""A compiled kernel's machine code (SASS), read without a GPU.

Triton compiles a kernel to PTX, and ``ptxas`` turns the PTX into the GPU's own instruction
set, SASS, inside a cubin. Both tools ship in the triton wheel, with NVIDIA's disassembler
``nvdisasm``, so on any machine (:func:`labkit.compile_check.compile_launch` compiles for the
H200 without one) a chapter can count the instructions a kernel issues. When a kernel is
bound by issuing instructions rather than by memory, that count per unit of work is what
its speed follows.

- :func:`compile_sm90`: one launch of a kernel compiled for the H200, on any machine.
- :func:`disassemble`: the SASS of a compiled kernel, as ``nvdisasm -c`` prints it.
- :func:`opcodes`: each instruction's opcode (``LOP3.LUT R4, ...`` -> ``LOP3``).
- :func:`loop_opcodes`: the opcodes of the kernel's largest loop body, where a streaming
  kernel spends its time; :func:`loop_instructions`, the same instructions whole;
  :func:`loops`, every loop's.
- :func:`issued_while_pending`: how many instructions of a kind the code issues while an
  asynchronous warpgroup MMA is in flight (before the wait for it).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile

# nvdisasm -c: "        /*0c70*/   @!P0 LOP3.LUT R108, R108, 0x43800000, R11, 0xec, !PT ;"
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`\((\.L_x_\d+)\)")
_PREDICATED = re.compile(r"^\s*@!?U?P[0-9T]+\s+")


def compile_sm90(kernel, args: tuple, meta: dict):
    """Triton's compiled kernel for one launch of ``kernel`` (a ``triton.jit`` function) with
    ``args`` and ``meta`` (constexprs and launch options), without running it: on a GPU
    through Triton's own ``warmup``, on a CPU through :func:`labkit.compile_check.compile_launch`.
    Its ``asm`` holds the Triton IRs, the PTX and the cubin."""
    from . import backend

    if backend.on_gpu():
        return kernel.warmup(*args, grid=(1,), **meta)
    from .compile_check import compile_launch

    return compile_launch(kernel, args, meta)


def disassemble(compiled) -> str:
    """The SASS of a Triton compiled kernel (its ``asm["cubin"]``), from the ``nvdisasm`` in the triton wheel."""
    return _disassemble_cubin(compiled.asm["cubin"])


# nvdisasm takes most of a second for one of the chapters' kernels, and a chapter often reads
# the same cubin twice (two launch options that compile to the same code, say): kept by content.
@functools.lru_cache(maxsize=64)
def _disassemble_cubin(cubin: bytes) -> str:
    from triton import knobs

    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        # -ndf skips the dataflow pass, which only adds labels to jumps through the branch stack
        # (indirect ones): the same text for all 32 kernels the chapters disassemble, a quarter faster.
        done = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-ndf", path], capture_output=True, text=True,
                              check=False)
    finally:
        os.remove(path)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed on the kernel's cubin: {done.stderr.strip()}")
    return done.stdout


def opcodes(sass: str) -> list[str]:
    """Each instruction's opcode without its modifiers or predicate, in program order."""
    return [m.group(1) for line in sass.splitlines() if (m := _INSTRUCTION.match(line))]


def loop_opcodes(sass: str) -> list[str]:
    """The opcodes of the longest loop: from a label to the last branch back to it.

    Only branches before the first ``EXIT`` count: the compiler places out-of-line code
    (the retry loops of a barrier wait, for one) after it, and those blocks branch back
    into the middle of the function without being its loop. Raises ``ValueError`` when
    the code has no backward branch (no loop)."""
    return opcodes("\n".join(_longest_loop(sass)))


def loop_instructions(sass: str) -> list[str]:
    """The instructions of the longest loop (as :func:`loop_opcodes` finds it) with their
    modifiers and operands, predicates and addresses dropped: ``MUFU.EX2 R5, R5``."""
    return _instructions(_longest_loop(sass))


def loops(sass: str) -> list[list[str]]:
    """Every loop's instructions, as :func:`loop_instructions` gives the longest one's, in
    program order (a loop inside another is listed on its own and within the outer one)."""
    lines = sass.splitlines()
    return [_instructions(lines[start:end + 1]) for start, end in _loop_spans(lines)]


def _instructions(lines: list[str]) -> list[str]:
    return [_PREDICATED.sub("", line.split("*/", 1)[1]).strip().rstrip(" ;")
            for line in lines if _INSTRUCTION.match(line)]


def _longest_loop(sass: str) -> list[str]:
    lines = sass.splitlines()
    spans = _loop_spans(lines)
    if not spans:
        raise ValueError("this kernel's SASS has no loop (no branch back to an earlier label)")
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return lines[start:end + 1]


def _loop_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(label line, branch line) of each backward branch before the first ``EXIT``."""
    end = next((i for i, line in enumerate(lines) if (m := _INSTRUCTION.match(line)) and m.group(1) == "EXIT"),
               len(lines))
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    return [(labels[m.group(1)], i) for i, line in enumerate(lines[:end])
            if (m := _BRANCH.search(line)) and labels.get(m.group(1), len(lines)) < i]


def issued_while_pending(sass: str, op: str, issue: str = "HGMMA", wait: str = "WARPGROUP.DEPBAR") -> int:
    """How many ``op`` instructions (say ``MUFU.EX2``) come after an ``issue`` (an asynchronous
    warpgroup MMA) and before the next ``wait`` for it, in program order: work the code lets
    run while the tensor cores work. Program order, not time: branches are not followed."""
    pending, count = False, 0
    for line in sass.splitlines():
        if (m := _INSTRUCTION.match(line)) is None:
            continue
        if issue in line:
            pending = True
        elif wait in line:
            pending = False
        elif pending and op in line:
            count += 1
    return count
