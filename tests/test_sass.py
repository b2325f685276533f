"""labkit.sass: opcodes and loops read from nvdisasm's listing, and a real kernel compiled for sm_90."""

from __future__ import annotations

import pytest

import labkit  # noqa: F401  (sets the interpreter before triton)
from labkit import sass

LISTING = """
        .text._k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LOP3.LUT R4, R4, 0xf0000, RZ, 0xc0, !PT ;
        /*0030*/               @P1 FFMA R5, R4, R6, R5 ;
        /*0040*/                   SHF.R.U32.HI R4, RZ, 0x4, R4 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0060*/                   STG.E [R2.64], R5 ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R9 ;
        /*0090*/               @!P0 BRA `(.L_x_2) ;
        /*00a0*/                   BRA `(.L_x_1) ;
"""


def test_opcodes_drop_predicates_and_modifiers():
    assert sass.opcodes(LISTING) == ["LDC", "BRA", "LOP3", "FFMA", "SHF", "BRA", "STG", "EXIT", "SYNCS", "BRA", "BRA"]


def test_loop_opcodes_span_a_label_to_its_backward_branch():
    # After EXIT, a wait's retry block branches back to itself and into .L_x_1's body (as
    # the compiler lays out barrier waits): neither is the kernel's loop.
    assert sass.loop_opcodes(LISTING) == ["LOP3", "FFMA", "SHF", "BRA"]


def test_loop_instructions_keep_modifiers_and_drop_predicates():
    assert sass.loop_instructions(LISTING) == ["LOP3.LUT R4, R4, 0xf0000, RZ, 0xc0, !PT", "FFMA R5, R4, R6, R5",
                                               "SHF.R.U32.HI R4, RZ, 0x4, R4", "BRA `(.L_x_1)"]


def test_loops_lists_each_loop_before_the_exit():
    assert sass.loops(LISTING) == [sass.loop_instructions(LISTING)]


def test_loop_opcodes_without_a_loop():
    with pytest.raises(ValueError, match="no loop"):
        sass.loop_opcodes(LISTING.split(".L_x_1:")[0])


def test_issued_while_pending_counts_between_an_mma_and_its_wait():
    listing = """
        /*0000*/                   MUFU.EX2 R1, R1 ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR12], RZ, !UPT, gsb0 ;
        /*0020*/                   MUFU.EX2 R2, R2 ;
        /*0030*/                   FADD R3, R2, R1 ;
        /*0040*/                   MUFU.EX2 R4, R4 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
"""
    assert sass.issued_while_pending(listing, "MUFU.EX2") == 2
    assert sass.issued_while_pending(listing, "FADD") == 1


def test_a_compiled_kernel_disassembles():
    from labkit import quant

    mix = quant.gemv_instruction_mix(4, code_words=True)
    assert mix["FFMA"] > 0 and mix["total"] >= mix["integer"] + mix["float"]
