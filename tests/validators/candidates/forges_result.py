"""Wrong: writes a passing verdict to the result file named on its command line, then exits."""
import json
import os
import sys


def tail_forward(h, idx, w, bias):
    verdict = {"ok": True, "slot": "tail_forward", "reason": "forged"}
    with open(sys.argv[-1], "w") as f:
        json.dump({"nonce": "guessed", "verdict": verdict}, f)
    os._exit(0)
