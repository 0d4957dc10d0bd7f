"""Every algebraic property an op declares (a partial signature) holds on its kernel, tested numerically.

A wrong declaration, such as ``abs`` declared linear, fails here on its own: no model or mesh needed.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opcases import CASES, OpCase, marked
from partial_checks import PROPERTY_SETTINGS, check_kernel_properties, check_table
from sbpflow.ops.schema import REGISTRY


@pytest.mark.parametrize("case", marked(CASES, "property"), ids=str)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_declared_properties_hold_on_the_kernel(case: OpCase, data: st.DataObject, one_torch_thread: None) -> None:
    check_kernel_properties(case, data.draw)


@pytest.mark.parametrize("case", marked(CASES, "table"), ids=str)
def test_declared_partial_signatures_match_the_table(case: OpCase) -> None:
    check_table(case)


def test_every_op_has_a_case() -> None:
    """A new op gets a case, so its partial rules are tested (and flipped by the mutation check) too."""
    # ops registered by test modules or doctests (their rules live there) are not the library's
    library_ops = {name for name, opdef in REGISTRY.items() if opdef.sbp.__module__.startswith("sbpflow.")
                   and not getattr(getattr(opdef.kernel, "__code__", None), "co_filename", "").startswith("<doctest")}
    assert library_ops - {c.op for c in CASES} == set()
