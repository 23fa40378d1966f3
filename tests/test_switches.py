"""zoo_cpu.switches: one table of the GEMMA_ZOO_* switches, one strict parser, values read once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zoo_cpu import switches as zs

ROOT = Path(__file__).resolve().parent.parent
BOOLS = [name for name, s in zs.SWITCHES.items() if s.kind == "bool"]


@pytest.fixture(autouse=True)
def fresh_cache():
    """Each test reads the environment anew, and leaves no value behind for the other tests."""
    zs.reload()
    yield
    zs.reload()


def test_the_table_has_every_switch_once():
    assert list(zs.SWITCHES) == [
        "GEMMA_ZOO_BLAS", "GEMMA_ZOO_PLAN", "GEMMA_ZOO_FAST_MATH", "GEMMA_ZOO_PREFILL_KERNELS", "GEMMA_ZOO_DECODE_KERNELS",
        "GEMMA_ZOO_STREAMS", "GEMMA_ZOO_COMPILE", "GEMMA_ZOO_COMPILE_STEP",
        "GEMMA_ZOO_CPU_QUANT",
        "GEMMA_ZOO_ASSETS", "GEMMA_ZOO_API_KEY", "GEMMA_ZOO_RANK_REPORT",
    ]
    for name, s in zs.SWITCHES.items():
        assert s.name == name and s.meaning and "\n" not in s.meaning
        assert s.kind in ("bool", "choice", "path", "text")
        assert s.parse(None) == s.default  # the default is a value the switch itself gives
        if s.kind == "choice":
            assert s.default in s.choices


def test_every_switch_the_project_names_is_in_the_table():
    """A new GEMMA_ZOO_* variable in the code or the docs must get a row (and so one parser)."""
    named = set()
    folders = ("zoo_cpu", "cache", "graphs", "models", "weights", "examples", "benchmarks", "tests", "docs")
    paths = [*ROOT.glob("*.py"), *ROOT.glob("*.md"), *(p for f in folders for p in (ROOT / f).rglob("*") if p.suffix in (".py", ".md"))]
    for path in paths:
        if path.name == "test_switches.py":  # names made up to test the refusals
            continue
        named |= set(re.findall(r"GEMMA_ZOO_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8", errors="replace")))
    assert named - set(zs.SWITCHES) == set()


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("text,want", [
    ("1", True), ("on", True), ("TRUE", True), (" Yes ", True), ("On", True),
    ("0", False), ("off", False), ("False", False), ("NO", False), ("\toff\n", False),
])
def test_booleans_take_the_usual_words_in_any_case(monkeypatch, name, text, want):
    monkeypatch.setenv(name, text)
    assert zs.value(name) is want
    assert zs.enabled(name) is want
    assert zs.source(name) == "environment"


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("text", ["2", "enabled", "disable", "o", "y", "none", "-1"])
def test_an_unknown_boolean_is_refused_not_guessed(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as err:
        zs.value(name)
    message = str(err.value)
    assert name in message and repr(text) in message and "on" in message and "off" in message
    with pytest.raises(ValueError):  # said again on every call, never cached as a guess
        zs.enabled(name)


@pytest.mark.parametrize("name", list(zs.SWITCHES))
def test_unset_or_empty_is_the_default(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    assert zs.value(name) == zs.SWITCHES[name].default and zs.source(name) == "default"
    zs.reload()
    monkeypatch.setenv(name, "  ")
    assert zs.value(name) == zs.SWITCHES[name].default and zs.source(name) == "default"


def test_cpu_quant_choices(monkeypatch):
    for text, want in [("auto", "auto"), ("Dequantize", "dequantize"), ("FP32-SCALES", "fp32-scales"), ("as-stored", "as-stored")]:
        monkeypatch.setenv("GEMMA_ZOO_CPU_QUANT", text)
        zs.reload()
        assert zs.value("GEMMA_ZOO_CPU_QUANT") == want
    monkeypatch.setenv("GEMMA_ZOO_CPU_QUANT", "fast")
    zs.reload()
    with pytest.raises(ValueError, match=r"GEMMA_ZOO_CPU_QUANT='fast'.*auto\|dequantize\|fp32-scales\|as-stored"):
        zs.value("GEMMA_ZOO_CPU_QUANT")
    with pytest.raises(TypeError, match="not an on/off switch"):
        zs.enabled("GEMMA_ZOO_CPU_QUANT")


@pytest.mark.parametrize("text,want", [
    ("auto", "auto"), ("MKL", "mkl"), ("openblas", "openblas"), ("off", "off"),
    ("0", "off"), ("none", "off"), ("no", "off"), ("false", "off"), ("reference", "off"), ("1", "auto"), ("on", "auto"),
    ("/opt/lib/libblis.so", "/opt/lib/libblis.so"), ("~/lib/libopenblas.so.0", "~/lib/libopenblas.so.0"),
    ("libopenblas.so.0", "libopenblas.so.0"),
])
def test_blas_choices_aliases_and_paths(text, want):
    assert zs.get("GEMMA_ZOO_BLAS", {"GEMMA_ZOO_BLAS": text}) == want
    assert zs.enabled("GEMMA_ZOO_BLAS") is True  # get() with a mapping leaves the cached value alone


@pytest.mark.parametrize("text", ["mkll", "openbals", "fast", "blis"])
def test_a_blas_typo_is_refused(text):
    with pytest.raises(ValueError, match=rf"GEMMA_ZOO_BLAS='{text}'.*auto\|mkl\|openblas\|off\|PATH"):
        zs.get("GEMMA_ZOO_BLAS", {"GEMMA_ZOO_BLAS": text})


def test_assets_is_a_path_kept_as_written(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMMA_ZOO_ASSETS", f"{tmp_path}/Some Dir")
    assert zs.value("GEMMA_ZOO_ASSETS") == f"{tmp_path}/Some Dir"
    with pytest.raises(TypeError):
        zs.enabled("GEMMA_ZOO_ASSETS")


def test_values_are_read_once_until_reload(monkeypatch):
    monkeypatch.setenv("GEMMA_ZOO_STREAMS", "off")
    assert zs.enabled("GEMMA_ZOO_STREAMS") is False
    monkeypatch.setenv("GEMMA_ZOO_STREAMS", "on")
    assert zs.enabled("GEMMA_ZOO_STREAMS") is False  # cached: one process, one setting
    assert zs.get("GEMMA_ZOO_STREAMS", os.environ) is True  # an explicit mapping is parsed afresh
    zs.reload()
    assert zs.enabled("GEMMA_ZOO_STREAMS") is True


def test_override_is_validated_scoped_and_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setenv("GEMMA_ZOO_COMPILE", "1")
    with zs.override(GEMMA_ZOO_COMPILE="0", GEMMA_ZOO_CPU_QUANT="FP32-scales"):
        assert zs.enabled("GEMMA_ZOO_COMPILE") is False and zs.source("GEMMA_ZOO_COMPILE") == "override"
        assert zs.value("GEMMA_ZOO_CPU_QUANT") == "fp32-scales"
        assert os.environ["GEMMA_ZOO_COMPILE"] == "1"
        with zs.override(GEMMA_ZOO_COMPILE=True):
            assert zs.enabled("GEMMA_ZOO_COMPILE") is True
        assert zs.enabled("GEMMA_ZOO_COMPILE") is False
    assert zs.enabled("GEMMA_ZOO_COMPILE") is True and zs.source("GEMMA_ZOO_COMPILE") == "environment"
    with pytest.raises(ValueError, match="GEMMA_ZOO_COMPILE='maybe'"):
        with zs.override(GEMMA_ZOO_COMPILE="maybe"):
            pass
    with pytest.raises(KeyError, match="GEMMA_ZOO_NOPE"):
        with zs.override(GEMMA_ZOO_NOPE="1"):
            pass


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="known: GEMMA_ZOO_BLAS"):
        zs.value("GEMMA_ZOO_STREAM")
    with pytest.raises(KeyError):
        zs.enabled("GEMMA_ZOO_FASTMATH")


def test_describe_gives_each_switch_its_value_and_source(monkeypatch):
    monkeypatch.setenv("GEMMA_ZOO_FAST_MATH", "0")
    monkeypatch.setenv("GEMMA_ZOO_CPU_QUANT", "bogus")
    monkeypatch.delenv("GEMMA_ZOO_STREAMS", raising=False)
    lines = zs.describe().splitlines()
    assert [line.split()[0] for line in lines] == list(zs.SWITCHES)
    by_name = {line.split()[0]: line for line in lines}
    assert "= off (set in the environment)" in by_name["GEMMA_ZOO_FAST_MATH"]
    assert "= on (default)" in by_name["GEMMA_ZOO_STREAMS"]
    assert "INVALID 'bogus'" in by_name["GEMMA_ZOO_CPU_QUANT"]  # shown, not raised
    for name, line in by_name.items():
        assert line.endswith(zs.SWITCHES[name].meaning)


def test_importing_it_loads_no_mlx_and_nothing_of_the_project():
    code = (
        "import json, sys; from zoo_cpu import switches; switches.describe();"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('mlx', 'numpy', 'cache', 'graphs', 'models', 'weights', 'examples'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_blas_reads_its_switch_through_the_table():
    code = "import zoo_cpu; from zoo_cpu import switches; print(switches.source('GEMMA_ZOO_BLAS'), zoo_cpu.blas.info()['reason'])"
    env = {**os.environ, "GEMMA_ZOO_BLAS": "No"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "environment"
    env["GEMMA_ZOO_BLAS"] = "nope"
    bad = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "GEMMA_ZOO_BLAS='nope'" in bad.stderr


def test_the_docs_table_lists_every_switch():
    text = (ROOT / "docs" / "speed.md").read_text(encoding="utf-8")
    section = text.split("\n## Switches\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(GEMMA_ZOO_[A-Z_]+)` \|", section, flags=re.M)
    assert rows == list(zs.SWITCHES)


def test_a_secret_is_never_shown(monkeypatch):
    monkeypatch.setenv("GEMMA_ZOO_API_KEY", "sk-do-not-print")
    zs.reload()
    assert zs.value("GEMMA_ZOO_API_KEY") == "sk-do-not-print"
    line = next(line for line in zs.describe().splitlines() if line.startswith("GEMMA_ZOO_API_KEY"))
    assert "sk-do-not-print" not in zs.describe() and "(set)" in line
