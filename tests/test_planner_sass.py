"""tools/planner_sass.py on a synthetic nvdisasm listing: which instructions belong to the chosen lines, and where
one inlined copy ends (the tool's end-to-end run needs ptxas and nvdisasm; see its docstring)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import planner_sass  # noqa: E402

LISTING = """
	//## File "/x/sorted_deal.py", line 455
        /*0010*/                   IMAD R1, R2, R3, RZ ;
	//## File "/x/device_planner.py", line 238
        /*0020*/                   BRA `(.L_x_1) ;
	//## File "/x/sorted_deal.py", line 458
        /*0030*/                   LDS.64 R4, [R5+0x10] ;
	//## File "/x/other.py", line 10
""" + "".join(f"        /*{0x40 + i:04x}*/                   NOP ;\n" for i in range(50)) + """
	//## File "/x/sorted_deal.py", line 456
        /*0100*/                   LDS R6, [R7] ;
	//## File "/x/sorted_deal.py", line 470
        /*0110*/                   STS [R8], R9 ;
"""


def test_instructions_carry_the_line_tag_before_them():
    code = planner_sass.tagged(LISTING.splitlines())
    assert code[0] == ("/x/sorted_deal.py", 455, "IMAD R1, R2, R3, RZ ;")
    assert code[1][:2] == ("/x/device_planner.py", 238) and code[2][2].startswith("LDS.64")


def test_stretches_keep_other_lines_between_hits_and_split_after_a_gap():
    stretches = planner_sass.blocks_of(planner_sass.tagged(LISTING.splitlines()), "sorted_deal.py", 455, 460)
    assert [len(s) for s in stretches] == [3, 1]  # IMAD, BRA (another file, between hits), LDS.64; then LDS
    assert stretches[1][0][1] == 456  # line 470 is outside the range
