"""labkit's runtime messages come from one table in both editions, and a lab run in Korean speaks Korean."""
import ast
import re
import string
from pathlib import Path

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
    with pytest.raises(Incorrect, match=r"^연습 문제 3 \(30일 안에 끝내는 GPU 수\): 너무 큽니다: 1e\+06"
                                        r"\(정답과 0\.0% 안으로 맞아야 합니다\)\. 학습 일수는 1/n에 비례합니다"):
        answer_key.check("05.3", 1e6)
    with pytest.raises(Incorrect, match="정답이 아닙니다: 'fp16'. fp32와 같은 8비트 지수"):
        answer_key.check("02.2", "fp16")
    with pytest.raises(Incorrect, match="선택지 \\['fp16', 'bf16'\\]에 없는 답입니다: 'fp8'"):
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


NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
ENGLISH_SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py")) + sorted((NOTEBOOKS / "solutions").glob("[0-9][0-9]_*.py"))
"""The labs and solutions whose code cells both editions run (the Korean ones' are the same, test_notebooks checks)."""

ENGLISH_WORDS = re.compile(r"(?<![\w/])[A-Za-z]+(?:'[a-z]+)?(?: [A-Za-z]+(?:'[a-z]+)?){2,}")
"""Three or more English words in a row, separated by single spaces ("bytes kept, " is two, "TFLOP/s per GPU" two;
an f-string's field counts as a word)."""


def code_cells(source: Path) -> list[tuple[int, ast.Module, list[str]]]:
    """Each code cell of a jupytext source as (cell number, parsed code, tags)."""
    import jupytext

    return [(number, ast.parse(cell.source), cell.metadata.get("tags", []))
            for number, cell in enumerate(jupytext.read(source).cells, start=1) if cell.cell_type == "code"]


def calls_of(tree: ast.AST, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name]


def printed_literals(node: ast.AST):
    """The string literals that a print argument prints as they are written (an f-string as one text, its fields
    standing in as words): not those inside a say(...) call, which are a message's id and fields."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "say":
        return
    if isinstance(node, ast.JoinedStr):  # read whole, each field as a word: "{d} days on {n} GPUs" is a sentence
        yield "".join(part.value if isinstance(part, ast.Constant) else "X" for part in node.values)
        return
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    for child in ast.iter_child_nodes(node):
        yield from printed_literals(child)


def english_sentences_printed(tree: ast.AST) -> list[str]:
    """The heuristic for a sentence a student reads, printed in English whatever the edition: a string literal in a
    print(...) call's arguments (not inside say(...)) holding three or more consecutive English words. Data has
    fewer: a number with its unit ("12 ms"), a job id and its state, a label and a value, a table or a file's text
    printed from a variable."""
    return [match.group() for call in calls_of(tree, "print") for argument in call.args
            for text in printed_literals(argument) for match in ENGLISH_WORDS.finditer(text)]


@pytest.mark.parametrize("source", ENGLISH_SOURCES, ids=lambda p: str(p.relative_to(NOTEBOOKS)))
def test_no_lab_prints_an_english_sentence_of_its_own(source: Path):
    """A sentence a lab's code prints comes from the message table, so that the Korean edition, whose code cells are
    the English ones, prints it in Korean. Cells tagged nbval-check-output are left out: their stored outputs are
    compared in both editions, so what they print is the same in each (numbers with their units)."""
    found = [f"cell {number}: {sentence!r}" for number, tree, tags in code_cells(source)
             if "nbval-check-output" not in tags for sentence in english_sentences_printed(tree)]
    assert found == [], f"{source.name} prints English sentences; route them through labkit.messages.say: {found}"


def test_the_sentence_heuristic_finds_prose_and_passes_data_and_messages():
    def found(code: str) -> list[str]:
        return english_sentences_printed(ast.parse(code))

    assert found('print(f"fp16: the scale fell from 2^32 to {x:.0f}")') == ["the scale fell from"]
    assert found('print("ok" if done else "no Slurm answers here")') == ["no Slurm answers here"]
    assert found('print(f"{job}: {state}")') == []
    assert found('print(f"{t:.1f} TFLOP/s per GPU, {n:,} bytes")') == []
    # an f-string is read whole, its fields standing in as words: its text parts alone have two words each
    assert found('print(f"{d} days on {n} GPUs at {t} TFLOP/s")') == ["X days on X GPUs at X TFLOP"]
    assert found('print(say("lab00.gpu_nodes", kind=kind or say("lab00.untyped"), nodes=2, counts="1"))') == []


def say_calls() -> list[tuple[str, ast.Call]]:
    """Every say(...) in the labs' and solutions' code cells, as (where, call)."""
    return [(f"{source.name} cell {number}", call) for source in ENGLISH_SOURCES
            for number, tree, _ in code_cells(source) for call in calls_of(tree, "say")]


def test_every_say_in_the_labs_names_a_message_and_fills_exactly_its_fields():
    calls = say_calls()
    assert len(calls) > 30
    table = messages.table()
    for where, call in calls:
        assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant), f"{where}: say's id is not a literal"
        message_id = call.args[0].value
        assert message_id in table, f"{where}: no message {message_id!r} in labkit/data/messages.yaml"
        given = {keyword.arg for keyword in call.keywords}
        assert None not in given, f"{where}: say({message_id!r}, **...) hides which fields it fills"
        wanted = {re.split(r"[.\[]", name)[0] for name, _, _ in fields(table[message_id]["en"])}
        assert given == wanted, f"{where}: {message_id} takes {sorted(wanted)}, given {sorted(given)}"


def test_every_lab_message_is_said_by_a_lab():
    said = {call.args[0].value for _, call in say_calls()}
    assert {message_id for message_id in messages.table() if re.match(r"lab\d\d\.", message_id)} == said


def test_a_labs_message_renders_in_korean(monkeypatch):
    monkeypatch.setenv("LABKIT_LANG", "ko")
    assert messages.say("lab02.fp16_scale_fell", final=65536.0, predicted=16, logged=16) == \
        "fp16: 손실 스케일이 떨어졌습니다: 2^32 → 65536. 건너뛴 반복 수의 예측: 16, 로그에 기록된 수: 16"
    counts = messages.say("lab00.or").join(["1", "2"])
    assert messages.say("lab00.gpu_nodes", kind=messages.say("lab00.untyped"), nodes=2, counts=counts) == \
        "종류 미지정 GPU: 노드 2개, 노드마다 1 또는 2개"
    monkeypatch.setenv("LABKIT_LANG", "en")
    assert messages.say("lab02.fp16_scale_fell", final=65536.0, predicted=16, logged=16) == \
        "fp16: the scale fell from 2^32 to 65536; predicted skipped iterations: 16, logged: 16"
