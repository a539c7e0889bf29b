"""The front door: the README's two commands, and the main job (`python -m concerto_jax`).

The default suite runs the main job with ``--quick`` (a smaller GPU step); the real job runs
with ``CONCERTO_FULL_SWEEP=1``. Either way it runs in a fresh process, from another directory,
with ``models`` and ``bench`` made unimportable (the installed package has neither).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests._helpers import FULL_SWEEP

ROOT = Path(__file__).resolve().parents[1]

SET_UP = 'pip install -e ".[dev,gpu]" && python -m concerto_jax.deviceless.cuda_plugin install && python -m concerto_jax'
TESTS = "python -m pytest -q"


def _code_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)]


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    first, second = _code_blocks(readme)[:2]
    assert (first, second) == (SET_UP, TESTS)
    # What the set-up command names exists: the extras, the plugin installer, the main job.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"dev", "gpu"} <= set(extras)
    for module in re.findall(r"python -m ([\w.]+)", first):
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() or \
            (ROOT / module.replace(".", "/") / "__main__.py").exists(), module


def test_readme_options_table_names_every_option():
    """Every field of ``Options`` and of its ``compile_for_target`` group is in the README's table."""
    import dataclasses

    import concerto_jax

    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Options"):text.index("## Guarantees")]
    missing = [f"{cls.__name__}.{f.name}" for cls in (concerto_jax.Options, concerto_jax.DevicelessOptions)
               for f in dataclasses.fields(cls) if f"`{f.name}`" not in table]
    assert not missing, missing


def test_wheel_installs_our_packages_only():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not [p for p in find["include"] if p.split("*")[0].split(".")[0] not in ("concerto_jax", "hlo_passes")]


def test_every_data_file_of_the_package_is_installed():
    """A file the package reads at run time (GPU configs, decompose's calibration, the NCCL tuner's
    sources) must be package data, or a non-editable install silently runs without it."""
    import fnmatch

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for package in ("concerto_jax", "hlo_passes"):
        # The repository's own files: build outputs of an install (the tuner's .so) are not sources.
        tracked = subprocess.run(["git", "ls-files", package], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
        assert tracked, f"git ls-files {package} listed nothing"
        data = [Path(f).relative_to(package).as_posix() for f in tracked
                if Path(f).suffix not in (".py", ".pyc")]
        missing = [f for f in data if not any(fnmatch.fnmatch(f, g) for g in globs.get(package, ()))]
        assert not missing, f"{package}: not in [tool.setuptools.package-data]: {missing}"


def _run_main_job(tmp_path, *flags) -> tuple[str, str, Path]:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    code = ("import sys; sys.modules['models'] = sys.modules['bench'] = None\n"
            "from concerto_jax.__main__ import main\n"
            f"sys.exit(main({[*flags, '--out', str(out)]!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, env=env, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout, proc.stderr, out


def _check_output(stdout: str, stderr: str, out: Path) -> None:
    lines = stdout.splitlines()
    assert len(lines) <= 40, stdout
    # No warning the user did not cause; the GPU plugin is only used deviceless.
    assert "WARNING" not in stderr and "Warning" not in stderr, stderr[-3000:]
    assert "Jax plugin configuration error" not in stdout + stderr
    result = [ln for ln in lines if "RESULT:" in ln]
    assert len(result) == 1 and re.search(
        r"RESULT: (bitwise equal to plain jax\.jit|within the declared tolerance [\d.e-]+ of plain "
        r"jax\.jit) on all \d+ steps", result[0]), stdout
    if "2. skipped" in stdout:
        pytest.skip("the CUDA plugin for deviceless compiles is not installed")
    us = {}
    for name in ("step time", "exposed communication"):
        m = re.search(rf"^\s+{name} \(simulated\)\s+([\d,.]+) us\s+([\d,.]+) us$", stdout, flags=re.M)
        assert m, (name, stdout)
        us[name] = [float(v.replace(",", "")) for v in m.groups()]
    assert re.search(r"^\s+peak memory \(simulated\)\s+[\d,]+ MiB\s+[\d,]+ MiB$", stdout, flags=re.M)
    gain = re.search(r"gain \(simulated\): ([\d.]+)x", stdout)
    assert gain and float(gain.group(1)) >= 1.0
    stock, ours = us["step time"]
    assert abs(float(gain.group(1)) - stock / ours) < 5e-3  # printed values are rounded
    assert us["exposed communication"][0] <= stock and us["exposed communication"][1] <= ours
    png, trace = out / "gpt_tp8_h100.gantt.png", out / "gpt_tp8_h100.trace.json"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(trace.read_text())
    slices = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    for pid in (0, 1):  # stock, ours: compute (thread 0) and communication (threads >= 1)
        tids = {e["tid"] for e in slices if e["pid"] == pid}
        assert 0 in tids and any(t >= 1 for t in tids), tids
    names = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"stock XLA", "ours (decompose + schedule)"}


@pytest.mark.slow
def test_main_job_quick(tmp_path):
    stdout, stderr, out = _run_main_job(tmp_path, "--quick", "--steps", "2")
    _check_output(stdout, stderr, out)


@pytest.mark.skipif(not FULL_SWEEP, reason="the full main job (about 3 minutes): CONCERTO_FULL_SWEEP=1")
def test_main_job_full(tmp_path):
    stdout, stderr, out = _run_main_job(tmp_path)
    _check_output(stdout, stderr, out)
    assert "hidden 2048" in stdout
