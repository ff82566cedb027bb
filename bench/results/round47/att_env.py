"""Round 47: set the attention's launch settings from ATT_* variables, then run a script or
pytest under them."""

import os
import runpy
import sys

sys.path.insert(0, ".")
from specwire.common.model import triton_attention as ta  # noqa: E402

ta.SEGMENT = int(os.environ.get("ATT_SEG", ta.SEGMENT))
ta.KEY_TILE = int(os.environ.get("ATT_TILE", ta.KEY_TILE))
ta.NUM_STAGES = int(os.environ.get("ATT_STAGES", ta.NUM_STAGES))
cap = os.environ.get("ATT_MAXNREG", "None")
if cap not in ("", "None"):
    base = ta.launch_opts
    ta.launch_opts = lambda: {**base(), "maxnreg": int(cap)}
print("attention", ta.SEGMENT, ta.KEY_TILE, ta.NUM_STAGES, cap, flush=True)
if sys.argv[1] == "pytest":
    import pytest

    sys.exit(pytest.main(sys.argv[2:]))
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
