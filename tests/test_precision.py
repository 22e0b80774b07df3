"""One working-precision rule: attnscale.precision is the only home of the float32 upcast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import attnscale
from attnscale import precision, stats
from attnscale.precision import check_floating, upcast, work_dtype

ROOT = Path(attnscale.__file__).parent
# Inline spellings of the upcast rule that belong in precision.py only.
INLINE = re.compile(r"float16,\s*torch\.bfloat16|bfloat16,\s*torch\.float16|promote_types\(")


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in ROOT.rglob("*.py")}


def test_no_module_but_precision_defines_an_upcast():
    defined = [name for name, text in _sources().items()
               for node in ast.walk(ast.parse(text))
               if isinstance(node, ast.FunctionDef) and "upcast" in node.name]
    assert defined == ["precision.py"] * len(defined) and defined, defined


def test_no_module_restates_the_half_types_inline():
    inline = [name for name, text in _sources().items()
              if name != "precision.py" and INLINE.search(text)]
    assert inline == []


def test_stats_has_no_upcast_of_its_own():
    assert not hasattr(stats, "upcast") or stats.upcast is upcast
    assert "upcast" not in stats.__all__


@pytest.mark.parametrize("dtype,expected", [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_upcast_and_work_dtype_agree(dtype, expected):
    x = torch.linspace(-2, 2, 7).to(dtype)
    assert upcast(x).dtype == expected == work_dtype(dtype)
    assert_close(upcast(x), x.to(expected), rtol=0, atol=0)


def test_check_floating_names_the_parameter():
    x = torch.ones(3)
    assert check_floating(x, "q") is x
    with pytest.raises(TypeError, match="^logits must be floating point, got torch.int64$"):
        check_floating(torch.zeros(3, dtype=torch.int64), "logits")
    with pytest.raises(TypeError, match="logits must be floating point"):
        stats.row_stats(torch.zeros(2, 3, dtype=torch.int32))


def test_half_types_are_defined_once():
    assert precision.HALF_TYPES == (torch.float16, torch.bfloat16)
