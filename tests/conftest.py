import pytest

from tests.hf_models import save_model


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
