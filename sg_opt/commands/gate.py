"""`sg-opt gate`: the CI regression gate's options, checked, and its reports written (the rules: ``sg_opt.gate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sg_opt.cli_common import (CONFIG_OPT, DATA_OPT, DEVICE_OPT, SET_OPT, SIZE_OPT, TARGET_OPT, THREADS_OPT,
                               TIMEOUT_OPT, Working, console, fail, inputs)
from targets.protocol import ConfigError

def gate(
    target: str = TARGET_OPT, size: str = SIZE_OPT, config: Optional[str] = CONFIG_OPT,
    set_: list[str] = SET_OPT, data: Optional[str] = DATA_OPT, device: str = DEVICE_OPT,
    ref: Optional[str] = typer.Option(None, "--ref", help="git revision to compare the working tree with (checked "
                                                          "out apart, timed interleaved)"),
    ref_tree: Optional[str] = typer.Option(None, "--ref-tree", help="a code tree to compare the working tree with, "
                                                                    "checked out already (e.g. a CI job's base "
                                                                    "checkout; timed interleaved, as --ref)"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="compare with figures saved by `sg-opt bench "
                                                                    "--save FILE` (same device only; its target, "
                                                                    "size and config are used)"),
    max_regression: float = typer.Option(0.05, "--max-regression", min=0.0, help="allowed slowdown, 0.05 = 5%"),
    numerics_class: str = typer.Option("reorder", "--numerics-class", help="exact, reorder or precision: how "
                                                                          "close B's numerics must stay to A's"),
    numerics_steps: int = typer.Option(10, "--numerics-steps", min=1, help="--ref: steps of the numerics "
                                                                           "fingerprint"),
    blocks: int = typer.Option(10, min=2, help="--ref: interleaved blocks per side (even)"),
    block_steps: int = typer.Option(10, "--block-steps", min=1, help="--ref: steps per block (at least)"),
    block_seconds: float = typer.Option(0.5, "--block-seconds", min=0.0, help="--ref: the least a block lasts "
                                                                              "(0: --block-steps alone)"),
    warmup: int = typer.Option(5, min=0, help="--ref: untimed steps first"),
    floor: Optional[float] = typer.Option(None, min=0.0, help="noise floor (default: A/A calibration with --ref, "
                                                              "the runs' spread with --baseline)"),
    aa_runs: int = typer.Option(3, "--aa-runs", min=1, help="--ref: A/A runs that calibrate the noise floor, and "
                                                            "again at each extension while it is too wide"),
    ab_runs: int = typer.Option(2, "--ab-runs", min=1, help="--ref: A/B runs, each in fresh workers, before the "
                                                            "first verdict, and again at each extension"),
    max_extensions: int = typer.Option(3, "--max-extensions", min=0, help="while the step time is inconclusive, "
                                                                          "measure more (fresh workers, blocks "
                                                                          "pooled) at most this many times"),
    allow_inconclusive: bool = typer.Option(False, "--allow-inconclusive", help="exit 0, with a warning, instead of "
                                                                                "3 when the step time stays "
                                                                                "inconclusive"),
    junit: Optional[str] = typer.Option(None, "--junit", help="write a JUnit XML report here"),
    threads: Optional[int] = THREADS_OPT,
    ranks: Optional[int] = typer.Option(None, "--ranks", min=1, help="measure both sides as this many processes "
                                                                     "of one torch.distributed job, as bench "
                                                                     "--ranks (default 1; with --baseline, the "
                                                                     "saved number, and another one is refused)"),
    timeout: float = TIMEOUT_OPT,
    as_json: bool = typer.Option(False, "--json", help="print the gate's result as JSON"),
) -> None:
    """CI regression gate: fail (exit 1) if the working tree is slower beyond --max-regression, with confidence,
    or computes differently; exit 3 if the step time stays inconclusive after --max-extensions more measurements
    (neither shown within --max-regression nor beyond it); exit 2 on usage or set-up errors. Markdown goes to
    $GITHUB_STEP_SUMMARY.

    Example: sg-opt gate --target haste-rec --size tiny --ref origin/main --junit gate.xml
    Example: sg-opt gate --baseline base.json --ranks 2
    """
    from sg_opt.gate import GateOptions
    from sg_opt.gate_baseline import gate_against_baseline
    from sg_opt.gate_side_by_side import gate_against_ref, gate_against_tree
    from sg_opt.gate_report import render, write_reports
    from targets.worker_protocol import WorkerRequest

    if sum(given is not None for given in (ref, ref_tree, baseline)) != 1:
        fail("give exactly one of --ref GIT_REV, --ref-tree DIR or --baseline FILE")
    if numerics_class not in ("exact", "reorder", "precision"):
        fail(f"--numerics-class must be exact, reorder or precision, not {numerics_class!r}")
    if blocks % 2:
        fail("--blocks must be even, so that each side runs first equally often")
    if floor is not None and floor > max_regression:
        fail(f"--floor {floor:g} is wider than --max-regression {max_regression:g}, so no measurement could pass: "
             f"raise --max-regression, or leave --floor out to calibrate it")
    options = GateOptions(max_regression=max_regression, numerics_class=numerics_class, numerics_steps=numerics_steps,
                          blocks=blocks, block_steps=block_steps, block_seconds=block_seconds, floor=floor,
                          aa_runs=aa_runs, ab_runs=ab_runs, timeout_s=timeout,
                          max_extensions=max_extensions, allow_inconclusive=allow_inconclusive)
    with Working("setting up the gate ...") as status:
        try:
            if baseline is not None:
                if config or set_ or data:
                    raise ConfigError("--baseline runs the saved target, size and config; drop --config, --set "
                                      "and --data")
                result = gate_against_baseline(baseline, options, status.update, ranks)
            else:
                overrides = inputs(target, size, config, set_, data, ranks or 1)
                spec = WorkerRequest(target=target, size=size, mode="bench", config=overrides, device=device,
                                     warmup=warmup, threads=threads, ranks=ranks or 1,
                                     data=str(Path(data).resolve()) if data else None)
                result = (gate_against_ref(spec, ref, options, status.update) if ref is not None
                          else gate_against_tree(spec, Path(ref_tree), options, status.update))
        except ConfigError as exc:
            fail(str(exc))
    write_reports(result, junit)
    if as_json:
        print(result.model_dump_json(indent=1))
    else:
        render(result, console)
    raise typer.Exit(result.exit_code)
