import pytest

from labkit.exercises import Incorrect, check_choice, check_number, check_spec
from labkit.spec import load_spec


def test_unanswered_exercise_passes_quietly_and_says_so(capsys):
    check_number(..., 42.0, name="ex 1")
    check_choice(None, "a", name="ex 2", choices=["a", "b"])
    check_spec(..., name="ex 3")
    assert capsys.readouterr().out.count("not answered yet") == 3


def test_check_number_accepts_within_tolerance_and_says_which_way_it_is_off(capsys):
    check_number(18_437_806_080, 18_437_806_080, name="params")
    check_number(157.7, 157.7297, name="TFLOP/s", rel_tol=1e-3)
    out = capsys.readouterr().out
    assert "params: correct" in out and "TFLOP/s: correct" in out
    with pytest.raises(Incorrect, match="too high"):
        check_number(160, 157.7, name="TFLOP/s", rel_tol=1e-3)
    with pytest.raises(Incorrect, match="too low.*use 96"):
        check_number(100, 157.7, name="TFLOP/s", hint="use 96, not 72")
    with pytest.raises(Incorrect, match="expected a number"):
        check_number("lots", 1.0, name="x")


def test_check_choice_rejects_answers_outside_the_choices(capsys):
    check_choice("bf16", "bf16", name="p", choices=["fp16", "bf16"])
    assert "p: correct" in capsys.readouterr().out
    with pytest.raises(Incorrect, match="not one of"):
        check_choice("fp8", "bf16", name="p", choices=["fp16", "bf16"])
    with pytest.raises(Incorrect, match="is not it. think about the range"):
        check_choice("fp16", "bf16", name="p", choices=["fp16", "bf16"], hint="think about the range")


def test_check_spec_compares_spec_fields_and_derived_figures(capsys):
    base = load_spec({"name": "t", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "parallel": {"data": 2}})
    check_spec(base, name="base", batch__micro=2, num_micro_batches=2, data_parallel=2)
    assert "base: correct (batch.micro=2, num_micro_batches=2, data_parallel=2)" in capsys.readouterr().out
    bigger = base.replace(**{"batch.global": 32})
    with pytest.raises(Incorrect, match="num_micro_batches is 8"):
        check_spec(bigger, name="accumulate", num_micro_batches=4)
    with pytest.raises(Incorrect, match="expected a RunSpec"):
        check_spec({"batch": 1}, name="x")


def test_every_exercise_is_checked_by_name_in_its_lab_and_solution_and_nowhere_shows_its_answer():
    import re
    from pathlib import Path

    from labkit.answer_key import KEY

    root = Path(__file__).resolve().parent.parent / "notebooks"
    for folder in (root, root / "solutions"):
        found = {}
        for path in sorted(folder.glob("[0-9][0-9]_*.py")):
            text = path.read_text()
            assert not re.search(r"^\s*check_(number|choice|spec)\(", text, re.M), f"{path.name} checks in the open"
            for exercise in re.findall(r'^check\("(\d\d\.\d)", answer_\d', text, re.M):
                assert exercise.startswith(path.name[:2]), (path.name, exercise)
                found[exercise] = path.name
        assert sorted(found) == sorted(KEY), folder


def test_the_answer_key_accepts_the_answer_and_refuses_another():
    from labkit.answer_key import check

    check("05.3", 109)
    check("07.3", 7 / 23)
    with pytest.raises(Incorrect, match="too low"):
        check("05.3", 108)
    with pytest.raises(Incorrect):
        check("07.2", "tp")
    with pytest.raises(KeyError, match="no exercise '09.9'"):
        check("09.9", 1)


def test_every_lab_that_measures_asks_for_a_prediction_before_its_estimate():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "notebooks"
    for lab in ("01", "02", "03", "04", "05", "06", "07"):
        [path] = root.glob(f"{lab}_*.ipynb")
        cells = json.loads(path.read_text())["cells"]
        tagged = [i for i, c in enumerate(cells) if "prediction" in c.get("metadata", {}).get("tags", [])]
        assert tagged, f"{path.name} has no cell tagged prediction"
        shown = [i for i, c in enumerate(cells) if "prediction_table(my_prediction" in "".join(c["source"])]
        assert shown and min(shown) > tagged[0], f"{path.name} never sets the prediction beside the measurement"
