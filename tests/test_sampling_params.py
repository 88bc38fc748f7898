import pytest
import torch

from wallbreaker.errors import InvalidRequestError
from wallbreaker.layers.sampler import processed_probs
from wallbreaker.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.n == 1 and p.max_tokens == 16 and p.stop == [] and not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0).temperature == 0.0


def test_stop_is_normalized():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


@pytest.mark.parametrize("off", [{"top_k": -1}, {"top_k": 0}, {"top_p": 1.0}, {"min_p": 0.0},
                                 {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}])
def test_off_values_are_accepted_and_leave_the_distribution_alone(off):
    """Each 'off' value is taken and changes nothing: the sampler draws from softmax(logits) itself."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    probs = processed_probs(logits, [SamplingParams(**off)], [[1, 2]], [[3, 3, 4]])
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))


def test_edge_values_are_kept_as_given():
    p = SamplingParams(max_tokens=None, logprobs=0, seed=0)
    assert p.max_tokens is None and p.logprobs == 0 and p.seed == 0  # 0 is a value here, not "off"
    q = SamplingParams(logprobs=20, presence_penalty=-2, frequency_penalty=2, min_p=1)
    assert (q.logprobs, q.presence_penalty, q.frequency_penalty, q.min_p) == (20, -2.0, 2.0, 1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"temperature": "hot"}, "temperature must be a number, got str"),
        ({"temperature": float("nan")}, "temperature must be finite, got nan"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be >= 1, or 0 / -1 to disable, got -2"),
        ({"top_k": 2.5}, "top_k must be an int, got float"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": "16"}, "max_tokens must be an int, got str"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["a", ""]}, "stop strings must be non-empty"),
        ({"stop": ["a", 3]}, "stop strings must be strings, got int"),
        ({"stop": 3}, "stop must be a string or a list of strings, got int"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must be non-negative ints, got -1"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of ints, got int"),
        ({"seed": 1.0}, "seed must be an int, got float"),
        ({"n": True}, "n must be an int, got bool"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got int"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message
    assert "\n" not in str(err.value)
    assert isinstance(err.value, ValueError)
