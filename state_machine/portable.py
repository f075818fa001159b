"""What a run writes for others to read (events.jsonl, summary.json) holds no absolute path and no stack trace.

A path under the run directory is written relative to it, so that a run directory can be moved, archived or
attached to a CI job as it is and still be read; a traceback or a hung worker's stacks go to ``traces.log``
beside them, and the record keeps its first line and says where the rest is.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

TRACES_FILE = "traces.log"
TRACE = re.compile(r'Traceback \(most recent call last\)|^\s*File ".*", line \d+', re.MULTILINE)


def _prefixes(run_dir: str | Path) -> list[str]:
    """The run directory as given, made absolute and resolved: a record may name it either way; longest first."""
    given = str(run_dir).rstrip("/") or "/"
    return sorted({given, os.path.abspath(given), str(Path(given).resolve())}, key=len, reverse=True)


def _trace_to_log(text: str, run_dir: str | Path) -> str:
    with open(Path(run_dir) / TRACES_FILE, "a", encoding="utf-8") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text.rstrip()}\n")
    lines = [line for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text:  # its exception: the last line not indented
        kept = next((line for line in reversed(lines) if not line[0].isspace()), "")
    else:  # stacks: what was said before them
        kept = next((line for line in lines if not TRACE.match(line)), "")
    return f"{kept.strip()} (trace in {TRACES_FILE})".strip()


def _relative(text: str, prefixes: list[str]) -> str:
    for prefix in prefixes:
        if text == prefix:
            return "."
        text = text.replace(prefix + "/", "")
    return text


def relative_paths(text: str, run_dir: str | Path) -> str:
    """``text`` with every path under ``run_dir`` in it made relative to it (the directory itself: ".")."""
    return _relative(text, _prefixes(run_dir))


def portable(value: Any, run_dir: str | Path, traces: bool = True) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every path under ``run_dir`` made relative to it
    and (with ``traces``) every stack trace moved to traces.log."""
    prefixes = _prefixes(run_dir)

    def text(s: str) -> str:
        if traces and "\n" in s and TRACE.search(s):
            s = _trace_to_log(s, run_dir)
        return _relative(s, prefixes)

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return text(v)
        if isinstance(v, dict):
            return {k: walk(item) for k, item in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(item) for item in v]
        return v

    return walk(value)
