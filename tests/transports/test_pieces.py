"""The piece checks of a vectored put: the short-list path (plain integers, what a device
put takes) accepts and refuses exactly what the NumPy path does, with the same errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlink.errors import RegistrationError
from transports import _pieces
from transports._pieces import check_few, check_pieces

SRC, REGION = 64, 96


def _outcome(fn, so, do, ln):
    try:
        r = fn(so, do, ln, src_nbytes=SRC, region_nbytes=REGION, region_id=3)
    except (TypeError, ValueError, RegistrationError) as e:
        return type(e), str(e)
    if isinstance(r, tuple):
        r = list(zip(*(a.tolist() for a in r)))
    return r


_int = st.integers(min_value=-8, max_value=120)


def _numpy_path(*args, **kw):
    """check_pieces with its few-piece path and its C pass turned off: the NumPy checks alone."""
    few, _pieces._FEW = _pieces._FEW, 0
    c, _pieces._first_bad = _pieces._first_bad, None
    try:
        return check_pieces(*args, **kw)
    finally:
        _pieces._FEW, _pieces._first_bad = few, c


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_int, _int, _int), min_size=1, max_size=20), st.booleans())
def test_short_lists_get_the_numpy_paths_answer(pieces, as_arrays):
    """check_few, and check_pieces's own few-piece path, answer as the NumPy checks do:
    the same pieces, or the same error and message."""
    so, do, ln = (list(x) for x in zip(*pieces))
    if as_arrays:
        so, do, ln = (np.array(x, np.int32) for x in (so, do, ln))
    want = _outcome(_numpy_path, so, do, ln)
    assert _outcome(check_few, so, do, ln) == want
    assert _outcome(check_pieces, so, do, ln) == want


@pytest.mark.parametrize("so, do, ln, err", [
    ([0], [90], [8], RegistrationError),  # past the region's end
    ([60], [0], [8], ValueError),  # past the source's end
    ([0, 0], [0], [1, 1], ValueError),  # lengths differ
    ([], [], [], ValueError),  # no piece
    ([0.5], [0], [1], TypeError),  # not integers
])
def test_bad_pieces_raise_before_anything_moves(so, do, ln, err):
    with pytest.raises(err):
        check_few(so, do, ln, src_nbytes=SRC, region_nbytes=REGION)


def test_arrays_and_long_lists_take_the_numpy_path():
    n = 40
    so = np.arange(n, dtype=np.int64)
    assert check_few(so, so, np.ones(n, np.int64), src_nbytes=SRC, region_nbytes=REGION) == [(i, i, 1) for i in range(n)]


@pytest.mark.skipif(_pieces._first_bad is None, reason="transports._ringc is not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_int, _int, _int), min_size=17, max_size=60))
def test_int64_arrays_get_the_numpy_paths_answer_from_the_c_pass(pieces):
    """Many pieces as int64 arrays take one pass in C (transports._ringc.first_bad_piece): it
    accepts exactly what the NumPy checks accept, and a refused list still gets their error."""
    so, do, ln = (np.array(x, np.int64) for x in zip(*pieces))
    assert _outcome(check_pieces, so, do, ln) == _outcome(_numpy_path, so, do, ln)
