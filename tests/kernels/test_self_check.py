"""Self-checked dispatch under ``MMGEO_KERNELS=auto`` (docs/design.md §4, ``mmgeo.kernels._common.self_checked``).

``auto`` picks Triton only for CUDA tensors, so these tests make it pick Triton on CPU (run by the interpreter) by
monkeypatching ``use_triton`` in the kernel module's namespace to answer True while ``MMGEO_KERNELS`` stays
``auto``: nothing in the library changes for the test, and the rest of the dispatch (self-check, fallback,
launch) runs as it would on a GPU. Faults are injected by monkeypatching the Triton forward launcher.
"""

import importlib
import warnings

import pytest
import torch

from mmgeo.kernels import _common, geo_attention, geo_attention_reference, pair_score, pair_score_reference

ps_module = importlib.import_module("mmgeo.kernels.pair_score")
ga_module = importlib.import_module("mmgeo.kernels.geo_attention")


def _pair_inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    q, u, k, v = mk(3, 2, 7, 8), mk(3, 2, 7, 4), mk(2, 2, 20, 8), mk(2, 2, 20, 4)  # (B, H, T|S, d)
    q_mask = (torch.arange(7)[None] < torch.tensor([[7], [3], [5]])).to(device)  # (3, 7)
    k_mask = torch.ones(2, 20, dtype=torch.bool)
    k_mask[1, 15:] = False
    return q, q_mask, u, k, k_mask.to(device), v


def _attn_inputs(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    kpm = torch.zeros(2, 23, dtype=torch.bool)
    kpm[1, 18:] = True  # (B, M) True = padding
    return mk(2, 2, 20, 8), mk(2, 2, 23, 8), mk(2, 2, 23, 12), kpm.to(device)


def _attn_call(dtype, device, fn=geo_attention):
    q, k, v, kpm = _attn_inputs(dtype, device)
    return fn(q, k, v, key_padding_mask=kpm)


KERNELS = {  # name -> (module, launcher module, launcher, call, reference)
    "pair_score": (ps_module, "mmgeo.kernels._pair_score_triton", "pair_score_fwd",
                   lambda dt, dev: pair_score(*_pair_inputs(dt, dev)),
                   lambda dt, dev: pair_score_reference(*_pair_inputs(dt, dev))),
    "geo_attention": (ga_module, "mmgeo.kernels._geo_attention_triton", "geo_attention_fwd", _attn_call,
                      lambda dt, dev: _attn_call(dt, dev, geo_attention_reference)),
}


@pytest.fixture
def auto_on_cpu(monkeypatch):
    """``MMGEO_KERNELS=auto`` choosing Triton on any device; an empty self-check cache."""
    pytest.importorskip("triton")
    monkeypatch.setenv("MMGEO_KERNELS", "auto")
    for module in (ps_module, ga_module):
        monkeypatch.setattr(module, "use_triton", lambda name, *tensors: True)
    monkeypatch.setattr(_common, "SELF_CHECKS", {})


def _inject(monkeypatch, launcher_module: str, launcher: str, fault: str):
    """Replace the Triton forward launcher: ``garbage`` returns wrong numbers, ``raise`` fails like a compile."""
    module = importlib.import_module(launcher_module)
    real = getattr(module, launcher)

    def broken(*args, **kwargs):
        if fault == "raise":
            raise RuntimeError("injected compile error: PassManager::run failed")
        first, *rest = real(*args, **kwargs)
        return (torch.full_like(first, 123.0), *rest)

    monkeypatch.setattr(module, launcher, broken)


def _calls(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, RuntimeWarning) and "self-check" in str(w.message)]


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_passing_kernel_runs_triton_without_warning(name, device, auto_on_cpu):
    module, _, _, call, reference = KERNELS[name]
    out, caught = _calls(lambda: call(torch.float32, device))
    assert caught == [] and list(_common.SELF_CHECKS.values()) == [True]
    torch.testing.assert_close(out, reference(torch.float32, device), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_wrong_result_warns_once_and_falls_back_to_the_reference(name, device, auto_on_cpu, monkeypatch):
    module, launcher_module, launcher, call, reference = KERNELS[name]
    _inject(monkeypatch, launcher_module, launcher, "garbage")
    out, caught = _calls(lambda: call(torch.float32, device))
    assert len(caught) == 1, [str(w.message) for w in caught]
    msg = str(caught[0].message)
    assert f"Triton {name}" in msg and "float32" in msg and "max deviation" in msg and "reference is used" in msg
    torch.testing.assert_close(out, reference(torch.float32, device), atol=0, rtol=0)
    again, caught = _calls(lambda: call(torch.float32, device))
    assert caught == [] and torch.equal(again, out)  # cached: the class stays on the reference
    _, caught = _calls(lambda: call(torch.float16, device))  # another dtype is another class: checked on its own
    assert len(caught) == 1 and "float16" in str(caught[0].message)


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_compile_error_warns_and_falls_back_to_the_reference(name, device, auto_on_cpu, monkeypatch):
    module, launcher_module, launcher, call, reference = KERNELS[name]
    _inject(monkeypatch, launcher_module, launcher, "raise")
    out, caught = _calls(lambda: call(torch.float32, device))
    assert len(caught) == 1 and "injected compile error" in str(caught[0].message)
    torch.testing.assert_close(out, reference(torch.float32, device), atol=0, rtol=0)
    assert list(_common.SELF_CHECKS.values()) == [False]


@pytest.mark.parametrize("name", list(KERNELS))
def test_forced_triton_raises_instead_of_falling_back(name, device, force_triton, monkeypatch):
    module, launcher_module, launcher, call, _ = KERNELS[name]
    monkeypatch.setattr(_common, "SELF_CHECKS", {})
    _inject(monkeypatch, launcher_module, launcher, "raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning on the way
        with pytest.raises(RuntimeError, match="injected compile error"):
            call(torch.float32, device)
    assert _common.SELF_CHECKS == {}


def test_scaled_deviation_follows_the_test_tolerance():
    e = torch.tensor([1.0, -2.0, 0.0])
    assert _common.scaled_deviation(e + 1e-4, e, 1e-3)[0]
    ok, dev = _common.scaled_deviation(e + torch.tensor([0.0, 0.0, 0.1]), e, 1e-3)
    assert not ok and dev == pytest.approx(0.05)
    assert _common.scaled_deviation(torch.tensor([1.0, float("nan"), 0.0]), e, 1.0) == (False, float("inf"))
