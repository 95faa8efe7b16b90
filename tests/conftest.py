import atexit
import os
import shutil
import tempfile

# Tests compile far more than they run (tiny models, many step variants): XLA's cheaper
# backend passes took the generate and LoRA tests from 129 to 93 s and change no result a
# test checks (steps run slower; no test times them). Set before jax starts its backend;
# exported with the environment to the subprocesses tests start.
os.environ["XLA_FLAGS"] = " ".join(filter(None, (
    os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true")))

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.hf_models import save_model  # noqa: E402

# One persistent XLA cache for the session, set before any test module computes anything:
# engines of the same configuration in different tests then compile each step variant once.
# A fresh directory, removed at exit, so nothing carries over between sessions; exported, so
# the subprocesses tests start use it too (and EngineConfig(compile_cache="auto") keeps it:
# no test writes the user's ~/.cache).
# pytest-xdist's workers inherit the directory the controlling process made (and removes).
_XLA_CACHE = os.environ.get("HETERO_JAX_TESTS_XLA_CACHE")
if _XLA_CACHE is None:
    _XLA_CACHE = os.environ["HETERO_JAX_TESTS_XLA_CACHE"] = tempfile.mkdtemp(
        prefix="hetero-jax-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
for _key, _value in dict(jax_compilation_cache_dir=_XLA_CACHE,
                         jax_persistent_cache_min_compile_time_secs=0.0,
                         jax_persistent_cache_min_entry_size_bytes=0).items():
    jax.config.update(_key, _value)
    os.environ[_key.upper()] = str(_value)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """name -> (directory, torch model), built once per session."""
    cache = {}

    def get(name):
        if name not in cache:
            path = str(tmp_path_factory.mktemp(name))
            cache[name] = (path, save_model(name, path))
        return cache[name]

    return get
