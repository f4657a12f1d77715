"""The one table helper of the CLI's human output."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.tables import table


def test_columns_are_as_wide_as_their_widest_cell_numbers_right_words_left():
    text = table(("NAME", "N", "NOTE"), [("a", 5, "free text"), ("longer", 123, None)], "<><")
    assert text.splitlines() == [
        "NAME      N  NOTE",
        "a         5  free text",
        "longer  123",
    ]


@given(st.lists(st.tuples(st.text("ab ", max_size=6), st.integers(0, 10**6)), max_size=8))
def test_every_line_puts_the_second_column_in_the_same_place(rows):
    lines = table(("WORD", "COUNT"), rows, "<>").splitlines()
    assert len(lines) == len(rows) + 1
    assert len({len(line) for line in lines}) == 1  # right-aligned last column: one width


def test_a_row_of_the_wrong_length_or_a_bad_alignment_is_refused():
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        table(("A", "B"), [("x",)])
    with pytest.raises(ValueError, match="does not give < or >"):
        table(("A", "B"), [], "<")
