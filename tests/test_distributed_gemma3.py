"""Gemma 3 over real ranks (``mlx.launch --backend ring`` on loopback), tensor- and pipeline-parallel,
against the single process: split through its registry entry alone (``models.registry``'s decoder
shape; the pipeline stage runs ``Gemma3TextModel.run_layers``).

The rules are ``tests/test_distributed_tensor.py``'s: every rank holds the same logits; the split
model is no further from transformers' float64 logits than the single process is, plus 1e-5; greedy
generations equal token for token. The slow test does the same on the real Gemma 3 270M.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.generation.generate import SamplingOptions  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.distributed_tiny import NEAR, assert_logits_of, launch, results, same_on_every_rank, single, worst  # noqa: E402

S, F = "sliding_attention", "full_attention"
# 4 query heads over 2 kv heads, windows of 8 (the 96 positions wrap them), an untied head, a softcap.
CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, layer_types=[S, S, F] * 2,
    max_position_embeddings=512, initializer_range=0.05, tie_word_embeddings=False, final_logit_softcapping=30.0,
    pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
LONG = [2] + [int(t) for t in np.random.default_rng(2).integers(3, 250, 95)]  # prefill chunks of 64: micro-batches
PROMPT = LONG[:70]
MODES = ("tensor", "pipeline")


def job(name: str, mode: str, folder, task: str, out, **fields) -> dict:
    return dict(name=f"{name}_{mode}", folder=str(folder), mode=mode, task=task, out=str(out), **fields)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed_gemma3")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**CONFIG)).eval()
    model.save_pretrained(root / "gemma3")
    return {"root": root, "folder": root / "gemma3", "float64": hf_tiny.float64_logits(model, [LONG])}


@pytest.fixture(scope="module")
def two_ranks(tiny):
    out, folder = tiny["root"], tiny["folder"]
    jobs = []
    for mode in MODES:
        jobs += [
            job("logits", mode, folder, "logits", out, ids=LONG, chunks=[7, 1, 8]),
            job("generate", mode, folder, "generate", out, ids=PROMPT, max_tokens=24, prefill_step=64),
        ]
    return launch(jobs, 2, out)


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens, as the ranks' jobs ask for them (explicit ``SamplingOptions()``: the 270M's
    generation_config.json would otherwise sample)."""
    stream = model.stream(prompt, max_tokens=max_tokens, prefill_step_size=64, sampling=SamplingOptions())
    return [c.token for c in stream if c.token is not None]


@pytest.mark.parametrize("mode", MODES)
def test_logits_of_two_ranks(two_ranks, tiny, mode):
    ranks = results(tiny["root"], f"logits_{mode}", 2, two_ranks)
    assert_logits_of(ranks, single(tiny["folder"]), tiny["float64"], LONG, (7, 1, 8))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_generation_of_two_ranks(two_ranks, tiny, mode):
    want = greedy(single(tiny["folder"]), PROMPT, 24)
    for got in results(tiny["root"], f"generate_{mode}", 2, two_ranks):
        assert got["tokens"].tolist() == want


@pytest.mark.slow
def test_real_gemma3_270m_on_two_ranks(tmp_path):
    """The zoo's Gemma 3 270M (float32, fetched by the project's asset code): both plans give the
    single process's greedy tokens and, within ``NEAR``, its logits."""
    import models
    from models.assets.gemma3_270m import gemma3_270m_folder

    folder = gemma3_270m_folder()
    model = models.load(str(folder), dtype="float32")
    ids = model.tokenizer.encode("The capital of France is")
    jobs = []
    for mode in MODES:
        jobs += [
            job("logits", mode, folder, "logits", tmp_path, ids=ids, chunks=[3, 1]),
            job("generate", mode, folder, "generate", tmp_path, ids=ids, max_tokens=16, prefill_step=64),
        ]
    launched = launch(jobs, 2, tmp_path, timeout=1200)
    want_tokens = greedy(model, ids, 16)
    want_logits = np.array(model.logits([ids]))
    for mode in MODES:
        ranks = results(tmp_path, f"logits_{mode}", 2, launched)
        same_on_every_rank(ranks)
        assert worst(ranks[0]["full"], want_logits) < NEAR * float(np.abs(want_logits).max()), mode
        for got in results(tmp_path, f"generate_{mode}", 2, launched):
            assert got["tokens"].tolist() == want_tokens, mode
