"""bench.third_party without the third-party packages: rows that say what is missing, and its tables.

The trainers themselves (MaxText, transformers' Flax classes) are an optional extra
(``pip install -e ".[third-party]"``), never installed by CI: this checks what a machine
without them gets, and runs a real row only where they are installed.
"""

import csv
import importlib.util

import pytest

from bench import third_party


def test_a_missing_trainer_gives_a_row_that_says_what_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("maxtext", "transformers") else real(name, *a))
    rows = [third_party.run_case(case, 256, 2, 128, timeout_s=10) for case in third_party.CASES]
    assert all(r["status"].startswith("skipped: ") and "[third-party]" in r["status"] for r in rows), rows
    assert {r["trainer"] for r in rows} == {"maxtext", "hf"}
    third_party.write(rows, str(tmp_path), "python -m bench.third_party", 0.0)
    with open(tmp_path / "third_party.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["case"] for r in table] == list(third_party.CASES)
    assert tuple(table[0]) == third_party.COLUMNS
    md = (tmp_path / "third_party.md").read_text()
    assert "simulated" in md and "maxtext llama2 fsdp8 scan" in md


@pytest.mark.skipif(third_party._installed("hf") is not None, reason="transformers with Flax classes not installed")
def test_hugging_face_step_through_optimize_returns_the_original_results():
    row = third_party.run_case("hf gpt2 fsdp2 x tp4, 8 CPU devices", 256, 2, 128, timeout_s=900)
    assert row["status"] == "ok" or row["status"].startswith("fell back"), row
    assert "bitwise over 3 steps: True" in row["check"], row
