"""The wall time of a node that never returned (the run was killed, or stopped by an exception): booked on resume.

The graph books a node's time once it returns, into the checkpoint it writes then; a run killed inside a node
lost that time, and a baseline killed after three minutes and redone in five reported five ("5.1 minutes used
of 4", really 8.1). While a node runs, ``node_clock.json`` in the run directory says which node started when
and when it was last seen alive (a stamp every HEARTBEAT_S); a node that returns removes it. A resume finds the
file of one that did not and books its time to that node.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

CLOCK_FILE = "node_clock.json"
HEARTBEAT_S = 1.0


class NodeClock:
    """``with NodeClock(run_dir, node):`` around one node's work."""

    def __init__(self, run_dir: str | Path, node: str):
        self.path, self.node = Path(run_dir) / CLOCK_FILE, node
        self.started, self.stop = time.time(), threading.Event()
        self.beat = threading.Thread(target=self._beat, name="sg-opt-node-clock", daemon=True)

    def _write(self) -> None:
        tmp = self.path.with_name(f".{CLOCK_FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps({"node": self.node, "started": self.started, "alive": time.time()}))
            os.replace(tmp, self.path)
        except OSError:  # a run directory gone or full: the time is lost, the run is not
            pass

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            self._write()

    def __enter__(self) -> "NodeClock":
        self._write()
        self.beat.start()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.stop.set()
        self.beat.join()
        if kind is None:
            self.path.unlink(missing_ok=True)
        else:  # raised (a stop, a pause inside it, an error): its time so far is booked on resume
            self._write()


def lost_time(run_dir: str | Path) -> tuple[str, float] | None:
    """(node, seconds) of a node that did not return in an earlier invocation, and forget it; None if none."""
    path = Path(run_dir) / CLOCK_FILE
    try:
        clock = json.loads(path.read_text())
        found = str(clock["node"]), max(0.0, float(clock["alive"]) - float(clock["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path.unlink(missing_ok=True)
    return found
