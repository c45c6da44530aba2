"""labkit's runtime messages come from one table in both editions, and a lab run in Korean speaks Korean."""
import string

import pytest

from labkit import answer_key, cli, lab, messages
from labkit.exercises import Incorrect, check_number, check_spec, prediction_table
from labkit.spec import load_spec


def fields(template: str) -> set[tuple]:
    """The template's fields: (name, conversion, format spec)."""
    return {(name, conversion, spec) for _, name, spec, conversion in string.Formatter().parse(template)
            if name is not None}


def test_every_message_has_both_languages_with_the_same_fields():
    table = messages.table()
    assert len(table) > 40
    for message_id, texts in table.items():
        assert set(texts) == set(messages.LANGUAGES), f"{message_id}: languages {sorted(texts)}"
        assert all(texts.values()), f"{message_id}: an empty text"
        assert fields(texts["ko"]) == fields(texts["en"]), f"{message_id}: the Korean's fields differ"


def test_the_languages_are_the_editions_of_the_labs():
    assert set(messages.LANGUAGES) == set(lab.EDITIONS)
    assert all(lab.EDITIONS[lang] == lang for lang in messages.LANGUAGES if lang != "en")


def test_every_exercise_has_a_name_in_the_table():
    assert {f"exercise.{exercise}" for exercise in answer_key.KEY} == {
        message_id for message_id in messages.table() if message_id.startswith("exercise.")}


def test_the_language_comes_from_labkit_lang_else_the_editions_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("LABKIT_LANG", raising=False)
    notebooks = tmp_path / "notebooks"
    assert messages.language(notebooks / "ko") == "ko"
    assert messages.language(notebooks / "ko" / "solutions") == "ko"
    assert messages.language(notebooks) == messages.language(notebooks / "solutions") == "en"
    assert messages.language(tmp_path / "ko") == "en", "a folder named ko outside notebooks/ is no edition"
    monkeypatch.setenv("LABKIT_LANG", "en")
    assert messages.language(notebooks / "ko") == "en"
    for written in ("ko_KR.UTF-8", "KO", "ko-KR"):
        monkeypatch.setenv("LABKIT_LANG", written)
        assert messages.language() == "ko"
    monkeypatch.setenv("LABKIT_LANG", "fr")
    with pytest.raises(ValueError, match="LABKIT_LANG='fr': choose one of en, ko"):
        messages.language()


def test_a_check_run_in_korean_prints_and_raises_korean(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_LANG", "ko")
    answer_key.check("05.1", ...)
    answer_key.check("05.1", 124_439_808)
    out = capsys.readouterr().out
    assert "연습 문제 1 (GPT-2 small의 파라미터 수): 아직 답하지 않았습니다." in out
    assert "연습 문제 1 (GPT-2 small의 파라미터 수): 정답입니다." in out
    with pytest.raises(Incorrect, match=r"^연습 문제 3 \(30일 안에 끝내는 GPU 수\): 1e\+06은 너무 큽니다"
                                        r"\(정답과 0\.0% 안으로 맞아야 합니다\)\. 학습 일수는 1/n에 비례합니다"):
        answer_key.check("05.3", 1e6)
    with pytest.raises(Incorrect, match="'fp16'은 정답이 아닙니다. fp32와 같은 8비트 지수"):
        answer_key.check("02.2", "fp16")
    with pytest.raises(Incorrect, match="'fp8'은 선택지 \\['fp16', 'bf16'\\]에 없습니다"):
        answer_key.check("02.2", "fp8")
    spec = load_spec({"name": "t", "model": {"preset": "tiny"}, "batch": {"micro": 2, "global": 8},
                      "parallel": {"data": 2}})
    with pytest.raises(Incorrect, match="아직 아닙니다: num_micro_batches의 값은 2"):
        check_spec(spec, name="x", num_micro_batches=4)
    with pytest.raises(Incorrect, match="숫자를 답해야 합니다. 받은 답: str 'lots'"):
        check_number("lots", 1.0, name="x")


def test_the_prediction_table_is_headed_in_the_editions_language(monkeypatch):
    monkeypatch.setenv("LABKIT_LANG", "ko")
    table = prediction_table({"peak MiB": ...}, {"peak MiB": 12.0}, {})
    assert table.index.name == "질문"
    assert list(table.columns) == ["여러분의 예측", "labkit의 추정치", "이 머신의 측정값"]
    assert table.loc["peak MiB"].tolist() == ["(쓰지 않음)", "12", "-"]
    monkeypatch.setenv("LABKIT_LANG", "en")
    assert list(prediction_table({"q": 1}, {}, {}).columns) == ["your prediction", "labkit's estimate",
                                                                 "measured here"]


@pytest.mark.parametrize("lang", ["en", "ko"])
def test_labkit_lab_runs_the_kernels_in_the_editions_language_and_restores_the_callers(lang, monkeypatch, capsys):
    seen = {}

    def fake_run_lab(**kwargs):
        seen["lang"], seen["notebook_dir"] = messages.language(), kwargs["notebook_dir"]
        raise lab.LabError("stop here")

    monkeypatch.setattr(lab, "run_lab", fake_run_lab)
    monkeypatch.setenv("LABKIT_LANG", "ko" if lang == "en" else "en")
    assert cli.main(["lab", "--lang", lang]) == 2
    assert seen["lang"] == lang and seen["notebook_dir"] == lab.edition_dir(lang)
    assert messages.language() != lang
