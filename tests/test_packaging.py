"""The installed package: its import names do not collide with a user's own `models` package, and the library does
not need what it does not import."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT

SOURCES = ("pyproject.toml", "README.md", "pulseinfer_jax", "models", "pallas_kernels", "host_offload")
USER_MODELS = '''
class ModelConfig:  # a user's own models/config.py, unrelated to the engine's
    OWNER = "user"
'''

CHECK = '''
import pathlib, sys
sys.path[:0] = [sys.argv[2], sys.argv[1]]  # the user's folder first, then the installed wheel, then the venv's deps
from models.config import ModelConfig  # the user's package
assert ModelConfig.OWNER == "user"
import pulseinfer_jax
from pulseinfer_jax.models.config import ModelConfig as EngineModelConfig
from pulseinfer_jax import EngineConfig, load_model
import pulseinfer_jax.pallas_kernels.merge, pulseinfer_jax.host_offload.host_pool
m = load_model("random:tiny-llama")
assert isinstance(m.cfg, EngineModelConfig) and EngineConfig.of(mode="offload").mode == "offload"
site = pathlib.Path(sys.argv[1]).resolve()
for name, mod in list(sys.modules.items()):
    if name.split(".")[0] == "pulseinfer_jax" and getattr(mod, "__file__", None):
        assert site in pathlib.Path(mod.__file__).resolve().parents, (name, mod.__file__)
print("ok")
'''


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="building the wheel needs setuptools")
def test_installed_names_do_not_collide_with_a_user_models_package(tmp_path):
    wheels, site, user, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "user", tmp_path / "src"
    src.mkdir()
    for name in SOURCES:  # a clean copy: the build leaves the checkout as it is
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, src / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), str(src)], check=True, capture_output=True, text=True, timeout=600)
    # the build backend's own warnings (deprecated pyproject fields, data outside the packages) stay out of an install
    noise = [line for line in (built.stdout + built.stderr).splitlines() if "DeprecationWarning" in line
             or "BuildBackendWarning" in line or "!!" in line]
    assert not noise, noise
    (wheel,) = wheels.glob("pulseinfer_jax-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    assert not any((site / name).exists() for name in ("models", "pallas_kernels", "host_offload"))
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("")
    (user / "models" / "config.py").write_text(USER_MODELS)
    (tmp_path / "check.py").write_text(CHECK)
    # -I: no PYTHONPATH, no script folder on sys.path; the source checkout is never importable
    p = subprocess.run([sys.executable, "-I", str(tmp_path / "check.py"), str(site), str(user)], capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_declared_dependencies_are_imported():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith("transformers") for d in deps)  # only the reference outputs use it (extra)
