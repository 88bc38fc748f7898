"""kernels/tuning.py: the knobs timed on the host are set only to values the kernel tests check
(tests/test_kernels.py), stored per CPU (kernels/cpu_id.py) and kernel level, read back instead of
measured again, measured again when asked, when the file is unreadable, or when a later load finds the
host faster than at tuning time (a busy first run), and never change a result."""
from __future__ import annotations

import json

import gguf
import pytest
import torch

from wallbreaker import _C, kernels
from wallbreaker.kernels import tuning

T = gguf.GGMLQuantizationType
QUICK = dict(formats=(T.Q8_0, T.Q4_K), rows=(4,), short=(64, 512), long=(16, 4352), pool_mb=1, repeats=1)
QUICK_PROBE = dict(shape=(64, 512), pool_mb=1)


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """apply() on a file of its own, measuring QUICK, every choice restored to the default after."""
    monkeypatch.setenv("WALLBREAKER_KERNEL_TUNING", "1")
    monkeypatch.delenv("WALLBREAKER_RETUNE", raising=False)
    monkeypatch.setattr(tuning, "_applied", None)
    calls = []
    quick, quick_probe = tuning.measure, tuning.probe

    def measure(**kw):
        calls.append(1)
        return quick(**{**QUICK, **kw})
    monkeypatch.setattr(tuning, "measure", measure)
    monkeypatch.setattr(tuning, "probe", lambda **kw: quick_probe(**{**QUICK_PROBE, **kw}))
    path = tmp_path / "kernel_tuning.json"
    monkeypatch.setattr(tuning, "tuning_path", lambda: path)  # a model load's apply() too
    yield path, calls
    for qtype in kernels.SUPPORTED_TYPES:
        if _C.tuning(int(qtype), "rows"):
            for knob in _C.tuning_knobs():
                _C.set_tuning(int(qtype), knob, 0)


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
def test_a_measurement_is_stored_per_host_and_read_back(tuned):
    path, calls = tuned
    chosen = tuning.apply(path=path)
    assert set(chosen) == {"Q8_0", "Q4_K"} and calls == [1]
    for name, knobs in chosen.items():
        assert set(knobs) == set(_C.tuning_knobs())
        assert all(v in _C.tuning_choices(k) and _C.tuning(int(T[name]), k) == v for k, v in knobs.items())
    stored = json.loads(path.read_text())
    assert list(stored) == [tuning.host_key()] and stored[tuning.host_key()]["picks"] == chosen
    tuning._applied = None  # a new process
    _probe_never_beaten(path)
    assert tuning.apply(path=path) == chosen and calls == [1]  # read, not measured
    assert tuning.apply(retune=True, path=path) is not None and calls == [1, 1]


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "", '{"KEY": {"Q8_0": {"rows": 1}}}'])
def test_an_unreadable_file_is_measured_again(tuned, content):
    path, calls = tuned
    path.write_text(content.replace("KEY", tuning.host_key()))  # the last: an entry of the old shape
    tuning.apply(path=path)
    assert calls == [1] and tuning.host_key() in json.loads(path.read_text())


def _probe_never_beaten(path):
    """Make the stored probe so fast that no later load finds the host faster (no re-measurement)."""
    stored = json.loads(path.read_text())
    stored[tuning.host_key()]["probe_s"] = 1e-12
    path.write_text(json.dumps(stored))


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
def test_an_edited_entry_sets_what_is_valid_and_skips_the_rest(tuned):
    path, calls = tuned
    path.write_text(json.dumps({tuning.host_key(): {"probe_s": 0.0, "checks": tuning.CHECKS, "picks": {
        "Q8_0": {"rows": 1, "prefetch": 4096, "spin": 2}, "Q4_K": {"rows_m1": 3}, "Q6_K": 4, "NOPE": {"rows": 2}}}}))
    assert tuning.apply(path=path) == {"Q8_0": {"rows": 1, "prefetch": 4096}} and calls == []
    assert _C.tuning(int(T.Q8_0), "rows") == 1 and _C.tuning(int(T.Q8_0), "prefetch") == 4096


def test_the_switch_keeps_the_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("WALLBREAKER_KERNEL_TUNING", "0")
    assert tuning.apply(path=tmp_path / "t.json") == {} and not (tmp_path / "t.json").exists()


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
def test_a_value_outside_the_compiled_ones_is_refused():
    with pytest.raises(RuntimeError, match="no rows_m1 choice 3"):
        _C.set_tuning(int(T.Q4_K), "rows_m1", 3)
    with pytest.raises(RuntimeError, match="no prefetch choice 1000"):
        _C.set_tuning(int(T.Q4_K), "prefetch", 1000)
    with pytest.raises(RuntimeError, match="unknown tuning knob"):
        _C.set_tuning(int(T.Q4_K), "spin", 1)


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
def test_the_chosen_shapes_give_the_same_model_output(tuned, tiny_llama):
    """A model's tokens and log-probabilities with each value of each knob: the same bits."""
    from wallbreaker import LLM, SamplingParams
    llm = LLM(str(tiny_llama.quantized_gguf(T.Q8_0)), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["one two three", "four five six seven", "eight"]

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].top_logprobs) for o in llm.generate(prompts, params)]
    default = run()
    for knob in _C.tuning_knobs():
        for value in _C.tuning_choices(knob):
            _C.set_tuning(int(T.Q8_0), knob, value)
            assert run() == default, (knob, value)
        _C.set_tuning(int(T.Q8_0), knob, 0)


class Neighbour:
    """An injected clock: a Q8_0 call costs 1.0 and 0.8 with rows_m1 = `fast` (the truth); while a
    neighbour is busy every call costs twice as much, and `fast`'s passes happened to be slowed most."""

    def __init__(self) -> None:
        default = _C.tuning(int(T.Q8_0), "rows_m1")
        self.fast = next(c for c in _C.tuning_choices("rows_m1") if c != default)
        self.busy, self.calls = True, 0

    def __call__(self, fn, pool) -> float:
        self.calls += 1
        fast = _C.tuning(int(T.Q8_0), "rows_m1") == self.fast
        if self.busy:
            return 3.0 if fast else 2.0
        return 0.8 if fast else 1.0


@pytest.mark.skipif(kernels.isa() == "generic", reason="the generic level has no tiles to choose among")
def test_a_tuning_run_beside_a_busy_neighbour_is_corrected_by_a_later_idle_load(tuned):
    path, calls = tuned
    clock = Neighbour()
    default = _C.tuning(int(T.Q8_0), "rows_m1")
    assert tuning.apply(path=path, timer=clock)["Q8_0"]["rows_m1"] == default  # the busy run's wrong pick
    assert json.loads(path.read_text())[tuning.host_key()]["probe_s"] == 2.0

    tuning._applied = None  # a later process, on an idle host: the probe runs faster, so all is timed again
    clock.busy = False
    assert tuning.apply(path=path, timer=clock)["Q8_0"]["rows_m1"] == clock.fast and calls == [1, 1]
    entry = json.loads(path.read_text())[tuning.host_key()]
    assert (entry["probe_s"], entry["retimed"], entry["checks"]) == (1.0, 1, 1) and entry["timed"].endswith("Z")

    tuning._applied = None  # busy again: slower than the stored probe, the idle picks stay
    clock.busy = True
    assert tuning.apply(path=path, timer=clock)["Q8_0"]["rows_m1"] == clock.fast and calls == [1, 1]
    assert json.loads(path.read_text())[tuning.host_key()]["probe_s"] == 1.0

    for _ in range(tuning.CHECKS):  # the probe runs only at the first CHECKS loads after the tuning
        tuning._applied = None
        before = clock.calls
        tuning.apply(path=path, timer=clock)
    assert clock.calls == before and calls == [1, 1]
    assert json.loads(path.read_text())[tuning.host_key()]["checks"] == tuning.CHECKS
    lines = tuning.describe(path)
    assert entry["timed"] in lines[0] and f"rows_m1={clock.fast}" in lines[1]
