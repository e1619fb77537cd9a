import pytest
from slug import slugify

CASES = [
    ("Hello World", "hello-world"),
    ("  spaces around  ", "spaces-around"),
    ("Crème brûlée", "creme-brulee"),
    ("a--b", "a-b"),
    ("", ""),
    ("123 Go!", "123-go"),
    ("CamelCase", "camelcase"),
    ("under_score", "under-score"),
    ("tab\tseparated", "tab-separated"),
    ("dots.and.dots", "dots-and-dots"),
    ("!!!", ""),
    ("x", "x"),
    ("Ünïcödé", "unicode"),
    ("multiple   spaces here", "multiple-spaces-here"),
    ("trailing-", "trailing"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_slugify(text: str, expected: str) -> None:
    assert slugify(text) == expected
