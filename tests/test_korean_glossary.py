"""The Korean edition speaks one vocabulary: notebooks/ko/GLOSSARY.md names the one Korean term for each English one and
the variants not to use, and no Korean lab or solution source uses a variant."""
import re
from pathlib import Path

import pytest

KOREAN = Path(__file__).resolve().parent.parent / "notebooks" / "ko"
HANGUL = "\uac00-\ud7a3"


def glossary() -> dict[str, str]:
    """{variant not to use: the Korean term to write instead}, read from the glossary's table."""
    variants = {}
    for line in (KOREAN / "GLOSSARY.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("English", "---"):
            for variant in re.findall(r"`([^`]+)`", cells[2]):
                variants[variant] = cells[1]
    return variants


def violations(text: str, variants: dict[str, str]) -> list[str]:
    """Each use of a variant where a word starts with it ("line N: 층 (write 레이어)"), unless the word there is the
    right term itself (연습 문제 for the variant 연습)."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for variant, term in variants.items():
            for match in re.finditer(rf"(?<![{HANGUL}]){re.escape(variant)}", line):
                if not line.startswith(term, match.start()):
                    found.append(f"line {number}: {variant} (write {term})")
    return found


def korean_sources() -> list[Path]:
    return sorted(KOREAN.glob("[0-9][0-9]_*.py")) + sorted((KOREAN / "solutions").glob("[0-9][0-9]_*.py"))


def test_the_glossary_names_variants_and_each_has_one_korean_term():
    variants = glossary()
    assert {"층", "활성화", "전역 배치", "직접 구현", "연습", "대기(pend)"} <= set(variants)
    assert variants["층"] == "레이어" and variants["연습"] == "연습 문제"
    assert not set(variants) & set(variants.values()), "a term is listed as a variant of another"


@pytest.mark.parametrize("source", korean_sources(), ids=lambda p: str(p.relative_to(KOREAN)))
def test_no_korean_lab_uses_a_variant_the_glossary_rules_out(source: Path):
    found = violations(source.read_text(), glossary())
    assert found == [], f"notebooks/ko/{source.relative_to(KOREAN)}: " + "; ".join(found)


def test_a_variant_is_found_at_a_word_start_and_the_right_term_is_not():
    variants = {"층": "레이어", "연습": "연습 문제"}
    text = "# 모델은 층이 2개입니다.\n# 호환 계층과 출력층\n# ## 연습 문제\n# **연습 1.** 2층 GPT"
    assert violations(text, variants) == ["line 1: 층 (write 레이어)", "line 4: 층 (write 레이어)",
                                          "line 4: 연습 (write 연습 문제)"]


def test_the_korean_runtime_messages_speak_the_glossarys_vocabulary():
    from labkit.messages import table

    korean = "\n".join(f"{message_id}: {texts['ko']}" for message_id, texts in table().items())
    assert violations(korean, glossary()) == []
