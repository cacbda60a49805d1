"""alloc.units: the one home of the byte units and the MiB column the benchmarks' tables print."""

import re

from hypothesis import example, given, strategies as st

from alloc.units import MiB, PAGE, fmt_mib


@given(st.integers(0, 1 << 62), st.sampled_from([0, 1]))
@example(3 * MiB // 4, 1)  # 0.75 prints 0.8: half the last digit away, up to the parse's rounding
def test_fmt_mib_is_the_byte_count_in_mib_rounded_with_thousands_separated(n, decimals):
    text = fmt_mib(n, decimals)
    assert re.fullmatch(r"\d{1,3}(,\d{3})*" + (r"\.\d" if decimals else ""), text), text
    # within half the last digit, and the float parse's own rounding of the printed decimal
    assert abs(float(text.replace(",", "")) - n / MiB) <= 0.5 * 10 ** -decimals + 1e-12 * max(1, n / MiB)


def test_fmt_mib_marks_a_missing_figure_and_the_page_is_two_mib():
    assert fmt_mib(None) == "-" and fmt_mib(2950 * MiB) == "2,950" and fmt_mib(2750 * MiB, 1) == "2,750.0"
    assert PAGE == 2 * MiB
