"""Run configuration from the user: a TOML file of knob values plus ``--set name=value`` overrides.

A TOML file may hold the knobs at top level or under a ``[knobs]`` table. Every name and value is
checked against the target's knob space here, in the parent, so a typo fails in a second with one
sentence instead of inside a worker.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from targets.protocol import ConfigError, KnobSpace


def load_config_file(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist")
    try:
        data = tomllib.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"config file {file} cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8 by definition
        raise ConfigError(f"config file {file} is not UTF-8 text (byte {exc.start} is 0x{exc.object[exc.start]:02x}); "
                          f"TOML files must be UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from None
    knobs = data.get("knobs", data)
    if not isinstance(knobs, dict):
        raise ConfigError(f"config file {file}: [knobs] must be a table of knob = value")
    return dict(knobs)


def parse_sets(items: list[str], space: KnobSpace) -> dict[str, Any]:
    """``["precision=bf16", "data_workers=2"]`` -> typed values, each checked against its knob."""
    values: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set takes name=value, not {item!r}")
        values[name.strip()] = space[name.strip()].parse(text)
    return values


def build_overrides(space: KnobSpace, config_file: str | None, sets: list[str]) -> dict[str, Any]:
    """File values overlaid with --set values; validated as a whole (constraints included)."""
    overrides = load_config_file(config_file) if config_file else {}
    overrides.update(parse_sets(sets, space))
    space.resolve(overrides)
    return overrides
