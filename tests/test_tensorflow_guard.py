"""A numpy client's simulation keeps TensorFlow out of Flower's engine: importing the engine under
the guard leaves TensorFlow unimported and importable afterwards, and a Ray started under it gets
the worker setup hook that hides TensorFlow (Ray's RAY_RUNTIME_ENV_HOOK), without dropping the
runtime environment Flower passes."""

import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from corrflow.server.tensorflow_guard import (
    RAY_HOOK,
    WORKER_SETUP_HOOK,
    ray_workers_without_tensorflow,
    with_worker_setup_hook,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed"
)

IMPORT_ENGINE = """
import sys
from corrflow.server.tensorflow_guard import tensorflow_absent
with tensorflow_absent({hide}):
    import flwr.simulation
from flwr.simulation.ray_transport import utils
import importlib.util
found = importlib.util.find_spec("tensorflow") is not None
print("tensorflow" in sys.modules, utils.TF is None, found)
"""


def test_the_engine_imported_under_the_guard_leaves_tensorflow_unimported_but_importable():
    r = subprocess.run(
        [sys.executable, "-c", IMPORT_ENGINE.format(hide=True)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    imported, flower_sees_none, importable = r.stdout.split()
    # Flower's module took TensorFlow as absent, and it still imports afterwards
    assert (imported, flower_sees_none, importable) == ("False", "True", "True")


def test_a_ray_started_under_the_guard_hides_tensorflow_from_its_workers(monkeypatch):
    monkeypatch.delenv(RAY_HOOK, raising=False)
    flower = {"env_vars": {"PYTHONPATH": "/app"}}
    with ray_workers_without_tensorflow(True):
        module, _, name = os.environ[RAY_HOOK].rpartition(".")
        hook = getattr(importlib.import_module(module), name)
        assert hook(flower) == {**flower, "worker_process_setup_hook": WORKER_SETUP_HOOK}
    assert RAY_HOOK not in os.environ
    with ray_workers_without_tensorflow(False):  # a Keras client: untouched
        assert RAY_HOOK not in os.environ
    monkeypatch.setenv(RAY_HOOK, "users.own_hook")  # the user's own hook is kept
    with ray_workers_without_tensorflow(True):
        assert os.environ[RAY_HOOK] == "users.own_hook"
    assert os.environ[RAY_HOOK] == "users.own_hook"
    assert with_worker_setup_hook(None) == {"worker_process_setup_hook": WORKER_SETUP_HOOK}


def test_the_worker_hook_hides_tensorflow_in_a_fresh_interpreter():
    code = (
        "import sys; from corrflow.server.tensorflow_guard import hide_tensorflow_in_worker as h; "
        "h()\ntry:\n import tensorflow\nexcept ModuleNotFoundError:\n print('hidden')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "hidden", r.stderr[-2000:]
