"""Tiers: what the agent may try and spend per run, and each model's price, read from TOML.

The packaged ``tiers.toml`` holds ``offline`` (the default, no LLM, $0), ``normal`` and ``ultra``.
A user's ``--tiers FILE`` is merged over it (field by field for a tier of the same name), so a file
that only points ``normal`` at a local model is three lines. Every mistake becomes a ``ConfigError``
naming the file and the problem in one sentence, before anything runs or spends.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from targets.protocol import ConfigError

PACKAGED = "tiers.toml"
ANY_MODEL = "*"


class Price(BaseModel):
    """USD per million tokens. Cached input defaults to the full input price (the safe side)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0)
    cached_input: float | None = Field(None, ge=0)
    output: float = Field(ge=0)

    @property
    def cached(self) -> float:
        return self.input if self.cached_input is None else self.cached_input


class Tier(BaseModel):
    """One tier: model and effort, iteration and candidate limits, candidate kinds, $ budget, repair rounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model: str | None = None
    reasoning_effort: str | None = None
    max_iterations: int = Field(ge=1)
    candidates_per_iteration: int = Field(ge=1)
    kinds: tuple[Literal["knob", "kernel"], ...] = Field(min_length=1)
    budget_usd: float = Field(ge=0)
    max_output_tokens: int = Field(16000, ge=1)
    reply_repairs: int = Field(1, ge=0)
    kernel_repairs: int = Field(0, ge=0)

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _unset_effort(cls, value: object) -> object:
        """TOML has no null: "" (or false) takes a packaged tier's effort away, for models that refuse it."""
        return None if value == "" or value is False else value

    @property
    def uses_llm(self) -> bool:
        return self.model is not None


class TierSet(BaseModel):
    """All tiers and the price table; ``default`` names the tier a run gets without ``--tier``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: str = "offline"
    tiers: dict[str, Tier]
    prices: dict[str, Price] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _default_exists(self) -> "TierSet":
        if self.default not in self.tiers:
            raise ValueError(f"the default tier {self.default!r} is not defined")
        return self

    def tier(self, name: str | None = None) -> Tier:
        name = name or self.default
        if name not in self.tiers:
            raise ConfigError(f"unknown tier {name!r}; known tiers: {', '.join(sorted(self.tiers))}")
        return self.tiers[name]

    def price(self, model: str) -> Price:
        return price_for(self.prices, model)


def price_for(prices: Mapping[str, Price], model: str) -> Price:
    """The model's price, else the ``"*"`` entry; a model with neither must not spend tokens."""
    price = prices.get(model) or prices.get(ANY_MODEL)
    if price is None:
        raise ConfigError(f"model {model!r} has no price in the tiers file; add [prices.\"{model}\"] "
                          f"(or a [prices.\"*\"] default) so its spend can be counted")
    return price


def load_tiers(path: str | Path | None = None) -> TierSet:
    """The packaged tiers, with the user's file at ``path`` (if any) merged over them."""
    packaged = resources.files("sg_opt").joinpath(PACKAGED)
    data = _parse(packaged.read_text(), f"packaged {PACKAGED}")
    source = f"packaged {PACKAGED}"
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"tiers file {file} does not exist")
        data, source = _merge(data, _parse(file.read_text(), f"tiers file {file}")), f"tiers file {file}"
    return _validate(data, source)


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from None


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: tiers field by field, prices entry by entry, other keys replaced."""
    merged = dict(base) | {k: v for k, v in over.items() if k not in ("tiers", "prices")}
    for section in ("tiers", "prices"):
        table = over.get(section, {})
        if not isinstance(table, dict):
            merged[section] = table  # let validation report the wrong shape
            continue
        merged[section] = dict(base.get(section, {}))
        for name, entry in table.items():
            old = merged[section].get(name)
            both_tables = section == "tiers" and isinstance(old, dict) and isinstance(entry, dict)
            merged[section][name] = old | entry if both_tables else entry
    return merged


def _validate(data: dict[str, Any], source: str) -> TierSet:
    tiers = data.get("tiers")
    if isinstance(tiers, dict):
        data = data | {"tiers": {name: _named(name, entry) for name, entry in tiers.items()}}
    try:
        return TierSet.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_first_problem(exc)}") from None


def _named(name: str, entry: Any) -> Any:
    return {"name": name} | entry if isinstance(entry, dict) else entry


def _first_problem(exc: ValidationError) -> str:
    """Pydantic's first error as ``tiers.normal.kinds.0: Input should be 'knob' or 'kernel'``."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    problem = f"{where}: {message}" if where else message
    more = exc.error_count() - 1
    return problem + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")
