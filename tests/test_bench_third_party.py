"""bench.third_party without the third-party packages: rows that say what is missing, and its tables.

The trainers themselves (MaxText, transformers' Flax classes, Penzai) are an optional extra
(``pip install -e ".[third-party]"``), never installed by CI: this checks what a machine
without them gets, and runs a real row (or, for Penzai, the target row's builder at a tiny
width) only where they are installed.
"""

import csv
import importlib.util

import pytest

from bench import third_party


def test_a_missing_trainer_gives_a_row_that_says_what_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("maxtext", "transformers", "penzai") else real(name, *a))
    rows = [third_party.run_case(case, 256, 2, 128, timeout_s=10) for case in third_party.CASES]
    assert all(r["status"].startswith("skipped: ") and "[third-party]" in r["status"] for r in rows), rows
    assert {r["trainer"] for r in rows} == {"maxtext", "hf", "penzai"}
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


def test_merge_keeps_the_earlier_rows_of_the_cases_not_run_and_says_so(tmp_path):
    cases = list(third_party.CASES)
    earlier = [{"case": c, "trainer": third_party.CASES[c][0], "status": "old"} for c in cases[:3]]
    third_party.write(earlier, str(tmp_path / "before"), "python -m bench.third_party", 0.0)
    path = str(tmp_path / "before" / "third_party.csv")
    new = [{"case": cases[1], "trainer": third_party.CASES[cases[1]][0], "status": "new"},
           {"case": cases[-1], "trainer": third_party.CASES[cases[-1]][0], "status": "new"}]
    table, notes = third_party.merge(new, third_party.read_table(path), path)
    assert [(r["case"], r["status"]) for r in table] == [
        (cases[0], "old"), (cases[1], "new"), (cases[2], "old"), (cases[-1], "new")]
    assert f"`{cases[1]}`" in notes[0] and f"`{cases[0]}`" in notes[1] and "Command: `python -m" in notes[1]
    third_party.write(table, str(tmp_path), "python -m bench.third_party --merge x", 0.0, notes)
    md = (tmp_path / "third_party.md").read_text()
    assert "Rows kept from" in md and "commit " in md


@pytest.mark.skipif(third_party._installed("penzai") is not None, reason="penzai not installed")
def test_penzai_target_row_builds_a_step_compile_for_target_accepts():
    import concerto_jax

    step, args, kwargs, contexts, desc = third_party._penzai_target(128, 1, 64)
    assert contexts is None and "Penzai" in desc
    options = concerto_jax.Options(passes=("schedule",),
                                   deviceless=concerto_jax.DevicelessOptions(combine_thresholds=()))
    res = concerto_jax.compile_for_target(step, *args, target=third_party.TARGET, options=options, **kwargs)
    assert res.fallback_reason is None, res.fallback_reason
    assert 0 < res.final_step_us <= res.stock_step_us


def test_a_case_s_options_reach_options_groups_and_the_split_column_names_what_was_split():
    import concerto_jax
    from concerto_jax.report import PassRecord

    entry = third_party.CASES["maxtext mixtral 8 experts, ep8 scan, decompose entry only, unbounded search"][2]
    opts = third_party.case_options(entry, target=third_party.TARGET)
    assert opts.passes == third_party.PASSES and opts.deviceless.time_budget_s is None
    assert opts.decompose == concerto_jax.DecomposeOptions(loop_bodies=False)
    assert opts.deviceless.robust == concerto_jax.DevicelessOptions().robust
    forced = third_party.CASES["maxtext mixtral 8 experts, ep8 scan, 8 CPU devices, decompose forced"][2]
    opts = third_party.case_options(forced)
    assert (opts.decompose.force_degree, opts.decompose.region_degree) == (2, None)
    assert opts.deviceless == concerto_jax.DevicelessOptions()
    assert third_party.case_options({}) == concerto_jax.Options(passes=third_party.PASSES)

    record = PassRecord("decompose", True, 1.0, stats={"strategy": "contexts", "decomposed": [
        {"collective": "all-to-all.1"}, {"collective": "all-to-all"}, {"collective": "all-gather.7"}]})
    assert third_party.split_kinds([record]) == "contexts: 1 all-gather, 2 all-to-all split"
    assert third_party.split_kinds([PassRecord("decompose", False, 1.0, stats={"decomposed": []})]) == "nothing split"
    assert third_party.split_kinds([PassRecord("schedule", True, 1.0)]) == ""


@pytest.mark.skipif(third_party._installed("maxtext") is not None, reason="maxtext not installed")
def test_maxtext_mixtral_step_through_optimize_with_decompose_forced_keeps_the_original_results():
    case = "maxtext mixtral 8 experts, ep8 scan, 8 CPU devices, decompose forced"
    row = third_party.run_case(case, 256, 2, 128, timeout_s=1800)
    assert row["status"] == "ok" or row["status"].startswith("fell back"), row
    if row["status"] == "ok":
        assert "all-to-all" in row["decompose"], row
