"""cake_cute.tools.selfcheck (``cake-cute check``): the case matrix on CPU, the whole check on a GPU."""

import io
import math

import pytest
import torch

from cake_cute.tools import selfcheck


def test_full_matrix_covers_the_issue():
    cases = selfcheck.case_matrix()
    assert {c.dtype for c in cases} == {torch.bfloat16, torch.float16, torch.float32}
    assert {c.hidden for c in cases} >= {1, 7, 512, 4096, 4097, 8192, 65536, 262144}
    assert {c.residual for c in cases} == {False, True}
    assert {1, 129} <= {c.rows for c in cases}
    assert any(c.w_dtype == torch.float32 and c.dtype != torch.float32 for c in cases)
    assert all(c.rows * c.hidden <= selfcheck.MAX_ELEMENTS for c in cases)
    for hidden in selfcheck.FULL_HIDDEN:  # every H is also checked with more than one row
        assert any(c.hidden == hidden and c.rows > 1 for c in cases)


def test_quick_matrix_is_smaller():
    assert len(selfcheck.case_matrix(quick=True)) < len(selfcheck.case_matrix()) / 2


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
