"""A process that ends while a batcher's forward runs (a session stopped, its chunk still decoding) exits
cleanly: the forward ends first. Before, the interpreter's finalisation stopped the daemon worker inside
torch's C++ and the process aborted ("terminate called without an active exception")."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import time
import torch
from charstream.stages.shared.batcher import SessionBatcher

class Convolving(SessionBatcher):
    def forward(self, keys, items):
        x, w = torch.randn(1, 16, 8, 48, 48), torch.randn(16, 16, 3, 3, 3)
        for _ in range(40):
            torch.nn.functional.conv3d(x, w, padding=1)
        print("forward done", flush=True)
        return [None] * len(items)

batcher = Convolving(2, 0.0)
batcher.opened()
batcher.enqueue("session", 1)
time.sleep(0.3)  # inside the forward now
print("exiting", flush=True)
"""


def test_a_process_ending_during_a_forward_lets_it_end_and_exits_cleanly():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exiting", "forward", "done"]  # the exit waited for the forward
