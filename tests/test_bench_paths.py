"""No machine paths in the code: PSPLIB is found relative to the repository or by $PSPLIB_ROOT,
and ``--set`` takes a set name or any directory of .sm files."""

import os
import re
import shutil

import pytest

from bench import psplib_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_absolute_machine_paths_in_sources():
    pattern = re.compile(r"""["'](/work/|/home/|/root/)""")
    offenders = []
    for top in ("concerto_jax", "hlo_passes", "bench", "models", "tests"):
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path) as f:
                        for k, line in enumerate(f, 1):
                            if pattern.search(line):
                                offenders.append(f"{os.path.relpath(path, REPO)}:{k}")
    assert not offenders, offenders


def test_default_root_is_next_to_the_repository(monkeypatch):
    monkeypatch.delenv("PSPLIB_ROOT", raising=False)
    assert psplib_bench.DEFAULT_PSPLIB_ROOT == os.path.join(os.path.dirname(REPO), "shared", "psplib")
    root = psplib_bench.psplib_root()
    assert root.endswith(os.path.join("shared", "psplib"))


def test_set_as_directory_or_name(tmp_path, monkeypatch):
    monkeypatch.delenv("PSPLIB_ROOT", raising=False)
    src = os.path.join(psplib_bench.psplib_root(), "j30")
    if not os.path.isdir(src):
        pytest.skip("PSPLIB data not available")
    own = tmp_path / "my_set"
    own.mkdir()
    shutil.copy(os.path.join(src, "j301_1.sm"), own)
    name, folder = psplib_bench.resolve_set(str(own))
    assert (name, folder) == ("my_set", str(own))
    monkeypatch.setenv("PSPLIB_ROOT", str(tmp_path))
    assert psplib_bench.resolve_set("my_set") == ("my_set", str(own))
    with pytest.raises(FileNotFoundError, match="PSPLIB_ROOT"):
        psplib_bench.resolve_set("no_such_set")
    monkeypatch.setattr(psplib_bench, "RESULTS", str(tmp_path / "results"))
    rows = psplib_bench.run(str(own), None, psplib_bench.SolverParams(time_limit_s=5.0, num_workers=1))
    assert len(rows) == 1 and rows[0].ref_hi is None and rows[0].makespan > 0
