"""`gate.json_items`: a body's JSON items counted without parsing it, as the gate counts them: commas and opening
brackets outside strings, plus one, whatever the strings hold (escaped quotes and backslashes, windows' edges)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from assistgen.serving.gate import WINDOW, json_items

values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet=',[{"\\\\ab\\n'),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet=',{"a'), inner,
                                                                                  max_size=4),
                      max_leaves=20)



def counted(value) -> int:
    """parsed_items, expressed as the gate's count: commas + opening brackets + 1."""
    if isinstance(value, list):
        return 1 + max(len(value) - 1, 0) + sum(counted(v) for v in value)
    if isinstance(value, dict):
        return 1 + max(len(value) - 1, 0) + sum(counted(v) for v in value.values())
    return 0


@settings(max_examples=300, deadline=None)
@given(values)
def test_the_count_is_the_commas_and_brackets_outside_strings(value):
    body = json.dumps(value).encode()
    assert json_items(body, 0) == counted(value) + 1  # (most 0: always the exact count)


def test_strings_across_windows_and_escapes_are_not_counted():
    text = "," * (WINDOW - 3) + '\\"[{' + "\\\\" + ",,"
    body = json.dumps({"prompt": text, "stop": [[], []]}).encode()
    assert len(body) > WINDOW  # (the string runs across the first window's edge)
    assert json_items(body, 0) == 2 + 4 + 1  # the object's and the list's commas, four opening brackets, plus one
    assert json_items(b'["a,b",2]', 10) == 4  # (within `most`: the raw count, an upper bound, is enough)
