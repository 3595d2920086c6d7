"""FloatFormat: properties against torch / ml_dtypes, names, parsing errors."""

from __future__ import annotations

import ml_dtypes
import pytest
import torch

from lpcompile import FloatFormat, parse_format
from lpcompile.numerics.formats import from_dtype, torch_dtype

TORCH_FORMATS = {
    "e5m2": torch.float8_e5m2,
    "e4m3": torch.float8_e4m3fn,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def test_fp8_constants():
    e5m2, e4m3 = parse_format("e5m2"), parse_format("e4m3")
    assert (e5m2.max, e5m2.min_normal, e5m2.min_subnormal) == (57344.0, 2.0**-14, 2.0**-16)
    assert (e4m3.max, e4m3.min_normal, e4m3.min_subnormal) == (448.0, 2.0**-6, 2.0**-9)
    assert (e5m2.bias, e4m3.bias) == (15, 7)
    assert e5m2.has_inf and e5m2.has_nan and not e4m3.has_inf and e4m3.has_nan


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_properties_match_torch_finfo(name):
    fmt, fi = parse_format(name), torch.finfo(TORCH_FORMATS[name])
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal
    assert fmt.min_subnormal == fi.smallest_normal * fi.eps  # torch.finfo has no smallest_subnormal
    assert 2.0**-fmt.man_bits == fi.eps
    assert from_dtype(TORCH_FORMATS[name]) == fmt and torch_dtype(fmt) == TORCH_FORMATS[name]


@pytest.mark.parametrize(
    "fmt,mltype",
    [
        (FloatFormat(3, 2, special="finite"), ml_dtypes.float6_e3m2fn),
        (FloatFormat(2, 3, special="finite"), ml_dtypes.float6_e2m3fn),
        (FloatFormat(2, 1, special="finite"), ml_dtypes.float4_e2m1fn),
        (FloatFormat(4, 3, special="ieee"), ml_dtypes.float8_e4m3),
        (FloatFormat(3, 4, special="ieee"), ml_dtypes.float8_e3m4),
        (FloatFormat(4, 3, special="fn"), ml_dtypes.float8_e4m3fn),
        (FloatFormat(5, 2), ml_dtypes.float8_e5m2),
    ],
    ids=str,
)
def test_properties_match_ml_dtypes(fmt, mltype):
    fi = ml_dtypes.finfo(mltype)
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.man_bits == fi.nmant and fmt.exp_bits == fi.nexp


@pytest.mark.parametrize(
    "spec,want",
    [
        ("e5m2", (5, 2, 15, "ieee")),
        ("E4M3", (4, 3, 7, "fn")),
        (" e4m3fn ", (4, 3, 7, "fn")),
        ("fp16", (5, 10, 15, "ieee")),
        ("bf16", (8, 7, 127, "ieee")),
        ("fp32", (8, 23, 127, "ieee")),
        ("e3m2", (3, 2, 3, "ieee")),
        ("e2m1-finite", (2, 1, 1, "finite")),
        ("e4m3-ieee", (4, 3, 7, "ieee")),
        ("e5m2fn", (5, 2, 15, "fn")),
        ("e5m2-bias16", (5, 2, 16, "ieee")),
        ("e4m3fn-bias11", (4, 3, 11, "fn")),
        ("e3m2-finite-bias2", (3, 2, 2, "finite")),
        ("e2m0-bias-3", (2, 0, -3, "ieee")),
    ],
)
def test_parse(spec, want):
    fmt = parse_format(spec)
    assert (fmt.exp_bits, fmt.man_bits, fmt.bias, fmt.special) == want
    assert parse_format(fmt) is fmt


def all_formats():
    for exp_bits in range(2, 9):
        for man_bits in range(24):
            for special in ["ieee", "fn", "finite"]:
                default = (1 << (exp_bits - 1)) - 1
                for bias in [None, default + 1, default - 3]:
                    try:
                        yield FloatFormat(exp_bits, man_bits, bias, special)
                    except ValueError:
                        pass


def test_name_round_trips():
    """quantize passes formats to the operator by name: every format must survive that."""
    formats = list(all_formats())
    assert len(formats) > 1000
    bad = [f for f in formats if parse_format(f.name) != f]
    assert not bad, f"{len(bad)} formats do not survive parse_format(fmt.name), e.g. {bad[:4]}"
    assert len({f.name for f in formats}) == len(formats)


@pytest.mark.parametrize(
    "spec", ["e5m3x", "fp8", "e1m2", "e9m2", "e5m24", "e2m0fn", "e8m23-finite", "", "e5m2-bias200"]
)
def test_parse_errors_list_valid_names(spec):
    with pytest.raises(ValueError, match="valid names: e5m2, e4m3") as info:
        parse_format(spec)
    assert "fp16" in str(info.value) and "bf16" in str(info.value)


def test_parse_rejects_non_strings():
    with pytest.raises(ValueError, match="valid names"):
        parse_format(8)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exp_bits=1, man_bits=2),
        dict(exp_bits=9, man_bits=2),
        dict(exp_bits=5, man_bits=24),
        dict(exp_bits=5, man_bits=-1),
        dict(exp_bits=4, man_bits=3, special="fnuz"),
        dict(exp_bits=4, man_bits=0, special="fn"),
        dict(exp_bits=5, man_bits=2, bias=200),  # subnormals below FP32's
        dict(exp_bits=8, man_bits=7, bias=100),  # max beyond FP32's
        dict(exp_bits=2, man_bits=0, bias=-120),  # subnormal spacing 2**121: rounding overflows
    ],
)
def test_bad_format_arguments(kwargs):
    with pytest.raises(ValueError):
        FloatFormat(**kwargs)


def test_fits_in():
    fits = {
        "e5m2": {torch.float16, torch.bfloat16, torch.float32},
        "e4m3": {torch.float16, torch.bfloat16, torch.float32},
        "fp16": {torch.float16, torch.float32},
        "bf16": {torch.bfloat16, torch.float32},
        "fp32": {torch.float32},
        "e8m3": {torch.bfloat16, torch.float32},
        "e5m8": {torch.float16, torch.float32},
        "e5m7": {torch.float16, torch.bfloat16, torch.float32},
        "e3m2-finite": {torch.float16, torch.bfloat16, torch.float32},
    }
    for name, dtypes in fits.items():
        for dtype in [torch.float16, torch.bfloat16, torch.float32]:
            assert parse_format(name).fits_in(dtype) == (dtype in dtypes), (name, dtype)


def test_special_conventions():
    finite = FloatFormat(3, 2, special="finite")
    assert not finite.has_inf and not finite.has_nan
    assert finite.max == 28.0 and finite.name == "e3m2-finite"
    assert FloatFormat(4, 3).max == 240.0 and FloatFormat(4, 3).name == "e4m3-ieee"
    assert str(parse_format("e4m3fn")) == "e4m3"
    assert from_dtype(torch.float32) == parse_format("fp32")
    assert torch_dtype(finite) is None
    with pytest.raises(ValueError):
        from_dtype(torch.int8)
