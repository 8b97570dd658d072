"""The one dtype map (``areal_async/dtypes.py``): names and torch dtypes both ways."""

import pytest
import torch

from areal_async.dtypes import DTYPES, FLOAT_DTYPES, dtype_from_name, dtype_name


def test_every_name_round_trips_with_and_without_the_torch_prefix():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name
        assert dtype_from_name(name) is dtype
        assert dtype_from_name(f"torch.{name}") is dtype
    assert set(FLOAT_DTYPES) == {"float32", "bfloat16", "float16"} and all(d.is_floating_point for d in FLOAT_DTYPES.values())


def test_an_unknown_or_excluded_name_is_a_value_error_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"unsupported weight dtype 'float64'; use one of \['bfloat16', 'float16', "
                                         r"'float32', 'int32', 'int64'\]"):
        dtype_from_name("float64", what="weight dtype")
    with pytest.raises(ValueError, match=r"unsupported model.dtype 'int64'; use one of \['bfloat16', 'float16', 'float32'\]"):
        dtype_from_name("int64", FLOAT_DTYPES, "model.dtype")
    assert dtype_from_name("torch.float16", FLOAT_DTYPES) is torch.float16
