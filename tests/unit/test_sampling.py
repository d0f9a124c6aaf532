"""The one sampling-parameters type: its defaults, and the bounds every path checks it by."""

from __future__ import annotations

import pytest

from protocol.errors import ProtocolError
from protocol.sampling import SamplingParams, sampling_params


def test_defaults_are_greedy_one_choice_of_16_tokens():
    assert sampling_params() == SamplingParams() == SamplingParams(
        temperature=0.0, top_p=1.0, top_k=0, seed=None, max_tokens=16, n=1, stop=[],
        stop_token_ids=[], ignore_eos=False)
    assert SamplingParams().greedy and SamplingParams(temperature=2.0, top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_options_given_as_none_take_the_default_and_one_stop_string_is_a_list():
    assert sampling_params(seed=None, stop="\n", stop_token_ids=None, temperature=1) == \
        SamplingParams(stop=["\n"], temperature=1.0)


@pytest.mark.parametrize(("options", "expected"), [
    ({"stop_token_ids": [-1]}, "field 'stop_token_ids[0]': expected `int` >= 0"),
    ({"stop": [""]}, "field 'stop[0]': expected `str` of length >= 1"),
    ({"stop": ["s" * 257]}, "field 'stop[0]': expected `str` of length <= 256"),
    ({"top_p": 0.0}, "field 'top_p': expected `float` > 0.0"),
    ({"max_tokens": 0}, "field 'max_tokens': expected `int` >= 1"),
    ({"n": 65}, "field 'n': expected `int` <= 64"),
    ({"temperature": True}, "field 'temperature': expected `float`, got `bool`"),
    ({"seed": 1 << 63}, "field 'seed': expected `int` <= 9223372036854775807"),
    ({"max_tokenz": 3}, "unknown field 'max_tokenz'"),
])
def test_options_out_of_bounds_are_refused_naming_the_field(options, expected):
    with pytest.raises(ProtocolError) as e:
        sampling_params(**options)
    assert (e.value.code, e.value.message) == ("invalid_request", expected)
    assert e.value.field == expected.split("'")[1]
