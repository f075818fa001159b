#!/usr/bin/env bash
# Source at the start of a call on an offline GPU machine, from the tree's root: installs the wheels carried in
# .whl/ (benchmarks/device_wheels.sh) into $SITE and registers this tree's entry points there (targets are found
# through them), so that `python3 -m sg_opt.cli` runs from the tree without installing it.
# Usage: source benchmarks/device_env.sh   [SITE=/tmp/site] [WHL=path/to/.whl]
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${WHL:-.whl}"/*.whl
python3 - "$SITE" <<'PY'
import pathlib, sys, tomllib
project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = project.get("entry-points", {}) | {"console_scripts": project.get("scripts", {})}
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
    for group, points in groups.items() if points))
PY
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
