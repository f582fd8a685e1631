"""`errors.plural`, the count-and-noun of messages: the plural `s` unless the count's magnitude is 1."""

import pytest

from hf_cfp.errors import plural


@pytest.mark.parametrize(
    ("number", "noun", "spec", "expected"),
    [
        (0, "parameter", "d", "0 parameters"),
        (1, "parameter", "d", "1 parameter"),
        (2, "anchor", "d", "2 anchors"),
        (1, "parameter", "+d", "+1 parameter"),
        (-1, "group", "+d", "-1 group"),
        (0, "group", "+d", "+0 groups"),
        (12345, "coordinate", ",", "12,345 coordinates"),
    ],
)
def test_plural(number, noun, spec, expected):
    assert plural(number, noun, spec) == expected
