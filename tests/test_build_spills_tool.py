"""tools/gpu/build_spills.py's attribution of machine code to source functions (no nvcc needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_scripts import load_module
from onestream.kernels.build import assemble_source
from onestream.kernels.plan import KernelPlan
from onestream.worker.testing import tiny_config

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu" / "build_spills.py"


def _tool():
    return load_module(TOOL)


def test_every_line_of_a_build_is_given_its_enclosing_function() -> None:
    text = assemble_source(KernelPlan(tiny_config(), num_sms=132, tokens_per_launch=4))
    names = _tool().enclosing_functions(text)
    lines = text.splitlines()
    assert len(names) == len(lines) + 1

    def function_at(fragment: str, after: str) -> str:
        start = next(i for i, line in enumerate(lines) if after in line)
        at = next(i for i in range(start, len(lines)) if fragment in lines[i])
        return names[at + 1]

    # A kernel's name follows its __launch_bounds__ line; a body's lines belong to the function they are in,
    # a lambda's to the function that holds it.
    assert function_at("read_step(tb, bs)", "mk_decode(const") == "mk_decode"
    assert function_at("s[r] *= decay;", "bool phase_dn_rec(") == "phase_dn_rec"
    assert function_at("auto att_step = [&]", "bool attention_items(") == "attention_items"
    assert "__launch_bounds__" not in names


def test_tuning_fields_take_the_bench_syntax_and_a_bad_one_names_itself(capsys) -> None:
    tool = _tool()
    args = tool.parse_args(["--tuning", "att_group=8,qunits=2,mma=true", "--threads", "640"])
    assert tool.build_fields(args) == {"att_group": 8, "qunits": 2, "mma": True, "threads": 640}
    assert tool.build_fields(tool.parse_args([])) == {}
    with pytest.raises(SystemExit):
        tool.parse_args(["--tuning", "qunits=two"])
    assert "qunits takes an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(["--tuning", "no_such_field=1"])
    assert "no_such_field" in capsys.readouterr().err


def test_loops_are_a_label_and_a_branch_back_to_it_with_arithmetic_in_between() -> None:
    tool = _tool()
    sass = "\n".join(
        [
            "mk_other:",
            ".L_x_1:",
            "        /*0000*/                   IDP.4A.S8.S8 R1, R2, R3, RZ ;",
            "        /*0010*/                   BRA `(.L_x_1) ;",
            "mk_phase:",
            ".L_x_2:",
            "        /*0000*/                   LDS.64 R98, [R56+UR9] ;",
            ".L_x_3:",
            "        /*0010*/                   IDP.4A.S8.S8 R98, R96, R98, RZ ;",
            "        /*0020*/              @!P3 IDP.4A.S8.S8 R98, R96, R98, RZ ;",
            "        /*0030*/                   BRA.DIV UR4, `(.L_x_2) ;",
            "        /*0040*/                   FADD R1, R2, R3 ;",
            "        /*0050*/               @P0 BRA `(.L_x_3) ;",
            "        /*0060*/                   IADD3 R1, R2, R3, RZ ;",
            "        /*0070*/                   BRA `(.L_x_2) ;",
            "        /*0080*/                   BRA `(.L_x_4) ;",
            ".L_x_4:",
            "        /*0090*/                   EXIT ;",
        ]
    )
    loops = tool.sass_loops(sass, "mk_phase")
    # The inner loop (a predicated branch back), then the outer one; the divergence check and the forward branch are
    # no loops, and the other kernel's loop is not counted.
    assert [loop.instructions for loop in loops] == [5, 8]
    assert loops[0].opcodes == {"IDP": 2, "BRA": 2, "FADD": 1}
    assert loops[1].opcodes["IDP"] == 2 and loops[1].opcodes["LDS"] == 1


def test_a_loop_of_integer_mma_is_arithmetic_and_an_address_loop_is_not() -> None:
    tool = _tool()
    sass = "\n".join(
        [
            "mk_phase:",
            ".L_x_1:",
            "        /*0000*/                   IMMA.16832.S8.S8 R20, R20.ROW, R92.COL, RZ ;",
            "        /*0010*/                   I2FP.F32.S32 R21, R20 ;",
            "        /*0020*/                   BRA `(.L_x_1) ;",
            ".L_x_2:",
            "        /*0030*/                   IADD3 R1, R2, R3, RZ ;",
            "        /*0040*/                   BRA `(.L_x_2) ;",
        ]
    )
    loops = tool.sass_loops(sass, "mk_phase")
    assert [loop.opcodes for loop in loops] == [{"IMMA": 1, "I2FP": 1, "BRA": 1}]


def test_spill_sites_count_marks_and_without_them_every_local_access() -> None:
    tool = _tool()
    functions = ["", "f", "f", "g"]  # lines 1-2 in f, line 3 in g

    def sass(*body: str) -> str:
        return "\n".join(["mk_decode:", *body])

    at = '        //## File "k.cu", line {}'
    ldl = "        /*0010*/                   LDL.64 R2, [R1+0x8] ;"
    stl = "        /*0020*/                   STL [R1+0x4], R3 ;"
    marked = '        /*0030*/                   STL [R1], R4 ; // "SpillRefill"'
    # With marks, only the marked instructions count (a local array's accesses are not spills).
    sites, is_marked = tool.count_sites(sass(at.format(1), ldl, at.format(3), marked), "k.cu", functions)
    assert is_marked and sites == {("mk_decode", "g", 3): 1}
    # Without any, every local-memory instruction counts, by the line and function it comes from.
    sites, is_marked = tool.count_sites(sass(at.format(1), ldl, stl, at.format(3), ldl), "k.cu", functions)
    assert not is_marked
    assert sites == {("mk_decode", "f", 1): 2, ("mk_decode", "g", 3): 1}
    # Lines of another file (a header) have no function of the build's text.
    sites, _ = tool.count_sites(sass('        //## File "other.h", line 2', ldl), "k.cu", functions)
    assert sites == {("mk_decode", "?", 0): 1}
