"""The package as a newcomer installs it: the wheel built from this checkout, installed with its
dependencies into a clean virtual environment, used from an unrelated folder.

- ``import models``, a one-shot answer from the default model, ``python -m examples.serve --help``
  and a transformers Gemma 4 forward (transformers imports Hugging Face's ``kernels`` package) all
  work in that environment, the last two in the same process as the zoo;
- every top-level name the wheel installs is on a short allow-list, and none is the import name of
  any other distribution installed beside it (a shadowed package breaks one of the two);
- the wheel installs no startup file (``.pth``) into other programs' environment.

Slow (a wheel build with the C++ extension and a full install): about five minutes, mostly pip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The design card's packages, and the CPU backend under the project's prefix.
ALLOWED_TOP_LEVEL = {"cache", "graphs", "models", "weights", "examples", "zoo_cpu"}

pytestmark = pytest.mark.slow


def run(command: list[str], cwd: Path, env: dict | None = None, timeout: int = 1200) -> str:
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, command))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(the wheel, the environment's python, an unrelated working folder)``."""
    root = tmp_path_factory.mktemp("packaging")
    dist = root / "dist"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], cwd=root)
    (wheel,) = dist.glob("gemma_mlx_zoo-*.whl")
    run([sys.executable, "-m", "venv", str(root / "venv")], cwd=root)
    python = root / "venv" / "bin" / "python"
    # A PYTHONPATH into this checkout (its egg-info) would make pip count the zoo as installed already.
    run([str(python), "-m", "pip", "install", "-q", f"{wheel}[demo,server]", "torch==2.13.0"], cwd=root, env=clean_env(root))
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    return wheel, python, elsewhere


def clean_env(tmp: Path) -> dict:
    """The environment without anything that points into this checkout; the zoo's asset cache in ``tmp``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("GEMMA_ZOO_")}
    env["GEMMA_ZOO_ASSETS"] = str(tmp / "assets")
    env["USE_HUB_KERNELS"] = "0"  # the reference forward below is plain PyTorch
    return env


def test_wheel_names_only_allowed_top_level_packages_and_no_startup_files(installed):
    wheel, python, elsewhere = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    top = {t.removesuffix(".py") for t in top}
    assert top == ALLOWED_TOP_LEVEL, top
    assert not [n for n in names if n.endswith(".pth")], "the wheel installs a startup file"
    assert "zoo_cpu/_build.json" in names  # the extension's build record (built or why not)
    page = {f"models/serving/page/{name}" for name in ("index.html", "app.js", "style.css")}
    assert page <= set(names), f"the chat page's files are not package data: {page - set(names)}"
    code = """
        import json
        from importlib import metadata
        owners = metadata.packages_distributions()
        print(json.dumps({name: owners.get(name, []) for name in %r}))
    """ % sorted(ALLOWED_TOP_LEVEL)
    owners = json.loads(run([str(python), "-c", textwrap.dedent(code)], cwd=elsewhere, env=clean_env(elsewhere)).splitlines()[-1])
    shared = {name: dists for name, dists in owners.items() if set(dists) != {"gemma-mlx-zoo"}}
    assert not shared, f"top-level names another installed distribution also provides: {shared}"


def test_the_zoo_and_transformers_work_from_an_unrelated_folder(installed, tmp_path):
    _, python, elsewhere = installed
    code = """
        import json
        import models
        import transformers.activations
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
        import torch

        model = models.load("gemma-3-270m")
        answer = model.generate("The capital of France is", max_tokens=8, seed=1)  # sampled as the checkpoint says
        config = Gemma4TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16,
                                  layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                                  hidden_size_per_layer_input=0)
        logits = Gemma4ForCausalLM(config).eval()(torch.arange(6)[None]).logits
        print(json.dumps({"models": models.__file__, "answer": answer, "reference": list(logits.shape),
                          "notes": model.device_notes}))
    """
    got = json.loads(run([str(python), "-c", textwrap.dedent(code)], cwd=elsewhere, env=clean_env(tmp_path)).splitlines()[-1])
    assert str(ROOT) not in got["models"]  # the installed package, not this checkout
    import models

    assert got["answer"] and got["answer"] == models.load("gemma-3-270m").generate("The capital of France is", max_tokens=8, seed=1)
    assert got["reference"] == [1, 6, 128]
    assert any("C++ kernels" in n or "prefill kernels" in n or "decode kernels" in n for n in got["notes"]), got["notes"]
    help_text = run([str(python), "-m", "examples.serve", "--help"], cwd=elsewhere, env=clean_env(tmp_path))
    assert "--model" in help_text
