"""Every benchmark runs in the suite: ``python -m benchmarks.X --smoke`` (tiny sizes, one round) must
exit cleanly with a record that ``benchmarks.smoke.problems`` finds nothing wrong with -- every stack
of ours has a row, every installed peer has one, stacks that should agree do. Peers that are not
installed are printed as such (run with ``-s`` to see them). DiffusionGemma's smoke test is its own
(``test_benchmark_smoke_diffusion.py``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent

# module -> extra arguments. Comments: what one smoke run costs (processes, sizes; wall seconds on the
# 2-core VM at load average 4-15, other jobs running); docs/benchmarks.md, "Test suite time".
BENCHMARKS = {
    "batching": [],  # 3 processes: each stack at B=3, the stored system prompt
    "batch_step": [],  # one process: 3 rows of a tiny Gemma 3, one step
    "compiled_step": [],  # 12 s
    "gemma4_text_vs_mlx_lm": [],  # 19 s
    "gemma4_vision_vs_mlx_vlm": [],  # a tiny-sized checkpoint of its own: both stacks load 0.15 GB side by side
    "interleaved": [],  # 38 s
    "kv_quantization": [],  # 2 processes: one per stack for the three cache configurations
    "long_context": [],  # 21 s
    "packed_kernels": [],  # 1 s
    "prefill": [],  # 36 s
    "prompt_lookup": [],  # a tiny random Gemma 3: plain and prompt-lookup greedy agree
    "sampling": [],  # one process: 1,024-word rows, three ways, eight requests
    "speculative": [],  # a tiny random Gemma 4 target for the assistant
    "speed": ["--models", "gemma3", "--sampling", "greedy,checkpoint"],  # 140 s: 6 stacks, each in its own process, greedy then sampled (Gemma 4: gemma4_text_vs_mlx_lm)
}
# benchmarks whose smoke mode needs real assets or a large checkpoint (built once, minutes)
SLOW = {
    "constrained_step": [],  # the real 270M and its tokenizer: one schema, 8 tokens
    "embedding": [],  # the real EmbeddingGemma 300M (1.2 GB, assembled once) against sentence-transformers
    "grammar_masks": [],  # the real Gemma 4 tokenizer: each grammar library's mask on one schema
    "accelerator_check": [],  # a parity file and four benchmarks' smoke runs under the accelerator plan: minutes
    "distributed": [],  # 2-rank launches; the MoE-shaped checkpoint is built once
    "gemma4_media_vs_mlx_vlm": ["--profile"],  # an audio tower of the released size: ~1.5 GB written once; and its profile
    "gemma4_unified_vs_mlx_vlm": [],  # the released media embedders: built once, ~1 GB
    "server": [],  # the real 270M behind both servers
}


def run_smoke(module: str, extra: list[str]) -> dict:
    # The benchmark runs as a user starts it: not under the suite's as-stored quantization policy.
    env = {k: v for k, v in os.environ.items() if k != "GEMMA_ZOO_CPU_QUANT"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--smoke", *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    tail = (out.stdout[-3000:] + "\n" + out.stderr[-3000:]).strip()
    assert out.returncode == 0, f"benchmarks.{module} --smoke exited {out.returncode}:\n{tail}"
    record = smoke.parse(out.stdout)
    absent = {name: s["package"] for name, s in record["stacks"].items() if s["status"] == "not installed"}
    if absent:
        print(f"benchmarks.{module}: not installed, no row: {absent}")
    return record


@pytest.mark.parametrize("module", sorted(BENCHMARKS))
def test_benchmark_smoke(module):
    record = run_smoke(module, BENCHMARKS[module])
    assert smoke.problems(record) == []
    assert any(s["status"] == "row" and s["ours"] for s in record["stacks"].values())


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(SLOW))
def test_benchmark_smoke_real_assets(module):
    record = run_smoke(module, SLOW[module])
    assert smoke.problems(record) == []


def test_every_benchmark_has_a_smoke_test():
    modules = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    helpers = {"peers", "smoke", "json_schemas"}  # no benchmark of their own
    own_test = {"diffusion_gemma"}  # tests/test_benchmark_smoke_diffusion.py
    assert modules - helpers - own_test - set(BENCHMARKS) - set(SLOW) == set()


# ---------------------------------------------------------------------------------------- the rules
def record_of(**stacks) -> dict:
    return {"benchmark": "t", "stacks": stacks, "groups": []}


def row(ids=(1, 2), ours=True, **values):
    return {"status": "row", "ours": ours, "values": values or {"tps": 1.0}, "ids": list(ids)}


def test_a_clean_record_has_no_problems():
    record = record_of(ours=row(), peer=row(ours=False))
    record["groups"] = [["ours", "peer"]]
    assert smoke.problems(record) == []


def test_ours_skipped_for_any_reason_fails():
    r = smoke.Record("t")
    r.row("ours", [1])
    r.missing("ours 8-bit", "config check refused the checkpoint")
    assert smoke.problems(r.as_dict()) == ["ours 8-bit (ours) has no row: config check refused the checkpoint"]


def test_no_row_of_ours_fails():
    r = smoke.Record("t")
    r.row("peer", [1], ours=False)
    assert "no row of ours at all" in smoke.problems(r.as_dict())


def test_an_installed_peer_without_a_row_fails():
    r = smoke.Record("t")
    r.row("ours", [1])
    r.missing("torch", "worker crashed", ours=False, package="torch")  # torch is installed in the test environment
    assert smoke.problems(r.as_dict()) == ["torch is installed but has no row: worker crashed"]


def test_a_peer_not_installed_is_reported_not_passed():
    r = smoke.Record("t")
    r.row("ours", [1])
    r.missing("peer", "not installed", ours=False, package="no_such_package_for_the_smoke_test")
    record = r.as_dict()
    assert record["stacks"]["peer"]["status"] == "not installed"
    assert smoke.problems(record) == []
    record["stacks"]["peer"]["package"] = "json"  # claims absent, but imports
    assert smoke.problems(record) == ["peer was reported not installed, but json imports"]


def test_stacks_that_should_agree_must():
    record = record_of(ours=row((1, 2, 3)), peer=row((1, 2, 4), ours=False))
    record["groups"] = [["ours", "peer"]]
    (problem,) = smoke.problems(record)
    assert problem.startswith("stacks that should agree differ")


def test_measurements_must_be_finite_and_positive():
    record = record_of(ours=row(tps=float("nan")))
    assert smoke.problems(record) == ["ours: measurements not finite and positive: {'tps': nan}"]
    assert smoke.problems(record_of(ours=row(ids=()))) == ["ours: generated no tokens"]


def test_a_record_is_read_back_from_the_output(capsys):
    r = smoke.Record("t")
    r.row("ours", [5], tps=2.0)
    r.finish()
    assert smoke.parse("noise\n" + capsys.readouterr().out) == r.as_dict()
    r.missing("ours 4-bit", "failed")
    with pytest.raises(SystemExit):
        r.finish()


def test_a_peer_may_refuse_a_configuration_only_with_its_own_not_implemented_error():
    r = smoke.Record("t")
    r.row("ours", [1])
    r.unsupported("peer kv 8-bit", "NotImplementedError: RotatingKVCache Quantization NYI")
    assert smoke.problems(r.as_dict()) == []
    r.unsupported("peer kv 4-bit", "ValueError: shapes")
    assert smoke.problems(r.as_dict()) == ["peer kv 4-bit is called unsupported, but failed otherwise: ValueError: shapes"]
