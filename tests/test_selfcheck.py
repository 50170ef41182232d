"""cake_cute.tools.selfcheck (``cake-cute check``): the case matrix on CPU, the whole check on a GPU."""

import io
import math

import pytest
import torch

from cake_cute.tools import selfcheck


def test_full_matrix_covers_the_issue():
    cases = selfcheck.case_matrix()
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16, torch.float32}
    assert {c.hidden for c in cases} == set(selfcheck.FULL_HIDDEN)
    assert {c.residual for c in cases} == {False, True}
    assert {c.rows for c in cases} == set(selfcheck.FULL_ROWS) | {0}
    assert any(c.w_dtype == torch.float32 and c.dtype != torch.float32 for c in cases)
    assert all(c.rows * c.hidden <= selfcheck.MAX_ELEMENTS for c in cases)
    for hidden in selfcheck.FULL_HIDDEN:  # every H is also checked with more than one row
        assert any(c.hidden == hidden and c.rows > 1 for c in cases)


def test_matrix_sizes():
    # dtypes x residual x (H, T) pairs within MAX_ELEMENTS, plus the 4 extra cases; in the full matrix
    # T = 4096 is too many elements at H = 65536 and 262144.
    assert len(selfcheck.case_matrix()) == 3 * 2 * (10 * 4 - 2) + 4
    assert len(selfcheck.case_matrix(quick=True)) == 3 * 2 * (4 * 2) + 4


def test_a_nan_error_fails():
    case = selfcheck.Case(torch.bfloat16, torch.bfloat16, 4096, 1, False)
    assert selfcheck.CaseResult(case, {"y": 1e-3}, {"y": 1e-2}).ok
    assert not selfcheck.CaseResult(case, {"y": math.nan}, {"y": 1e-2}).ok
    assert not selfcheck.CaseResult(case, {}, {}, error="RuntimeError: boom").ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message shown without a GPU")
def test_gpu_problem_without_gpu():
    assert "no CUDA GPU" in selfcheck.gpu_problem()


@pytest.mark.gpu
def test_quick_check_passes():
    out = io.StringIO()
    code = selfcheck.run_check(quick=True, stream=out)
    assert code == 0, out.getvalue()
    assert "0 failed" in out.getvalue()
