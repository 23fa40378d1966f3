"""The parallel plans and the shard reader, in one process (no ranks launched).

What each rank reads of a checkpoint (``part_of``), where the pipeline cuts (``stage_bounds``),
which MoE split the tensor plan takes, what it refuses by name, and that ``weights.shards``
reads exactly numpy's slice of the stored bytes (bf16 and packed uint32 included).
"""

from __future__ import annotations

from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest

from graphs.gemma4_text_config import Gemma4TextConfig
from models.parallel import ParallelSetupError, sharding_for
from models.parallel.pipeline import stage_bounds
from models.registry import gemma4_decoder_shape
from weights.shards import SKIP, STAND_IN, Part, ShardError, read_parts

S, F = "sliding_attention", "full_attention"


class Group:
    """Stands in for an ``mx.distributed.Group`` of ``size`` ranks, seen from ``rank``."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def text(**fields) -> Gemma4TextConfig:
    base = dict(model_type="gemma4_text", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64, layer_types=[S, S, S, F],
                hidden_size_per_layer_input=0)  # fmt: skip
    return Gemma4TextConfig.from_dict({**base, **fields})


def planned(mode: str, config, rank: int = 0, size: int = 2, raw=None, **options):
    sharding = sharding_for(mode, Group(rank, size), **options)
    sharding.configure(gemma4_decoder_shape(config), raw or {})
    return sharding


# ---------------------------------------------------------------------------------------- pipeline
def test_pipeline_splits_evenly_without_kv_sharing():
    assert stage_bounds(gemma4_decoder_shape(text(num_hidden_layers=60, layer_types=None)), 4) == [0, 15, 30, 45, 60]
    assert stage_bounds(gemma4_decoder_shape(text(num_hidden_layers=7, layer_types=None)), 2) == [0, 4, 7]


def test_kv_shared_layers_stay_on_their_donors_stage():
    # E2B's shape: 35 layers, the last 20 reuse the keys and values of layers 11 (full) and 14 (sliding).
    e2b = text(num_hidden_layers=35, layer_types=None, num_kv_shared_layers=20)
    assert min(e2b.kv_donors.values()) == 11
    assert stage_bounds(gemma4_decoder_shape(e2b), 2) == [0, 11, 35]
    assert stage_bounds(gemma4_decoder_shape(e2b), 4) == [0, 4, 7, 11, 35]


def test_pipeline_refuses_what_it_cannot_split():
    shared_early = text(layer_types=[S, F, S, F], num_kv_shared_layers=2)  # donors 0 and 1
    with pytest.raises(ParallelSetupError, match="layers 0-3 share keys and values"):
        planned("pipeline", shared_early)
    with pytest.raises(ParallelSetupError, match="4 layers give at most 4 stages"):
        planned("pipeline", text(), size=5)


def test_pipeline_reads_only_its_layers_and_its_per_layer_columns():
    config = text(num_hidden_layers=8, layer_types=None, num_kv_shared_layers=2, hidden_size_per_layer_input=16)
    second = planned("pipeline", config, rank=1)
    assert (second.start, second.end) == (4, 8)
    assert second.part_of("model.layers.3.mlp.up_proj.weight", (128, 64)) == SKIP
    assert second.part_of("model.layers.4.mlp.up_proj.weight", (128, 64)) is None
    # vocabulary rows, read in the layout the CPU keeps the output head in
    assert second.part_of("model.embed_tokens.weight", (256, 64)) == Part(0, ((Fraction(1, 2), Fraction(1)),), transposed=True)
    assert second.part_of("model.norm.weight", (64,)) is None
    assert second.part_of("model.embed_tokens_per_layer.weight", (256, 128)) == Part(-1, ((Fraction(1, 2), Fraction(1)),))
    assert second.part_of("model.per_layer_model_projection.weight", (128, 64)) == Part(0, ((Fraction(1, 2), Fraction(1)),))


# ---------------------------------------------------------------------------------------- tensor
def test_tensor_heads_columns_and_vocabulary_rows():
    plan = planned("tensor", text(), rank=1)
    half = ((Fraction(1, 2), Fraction(1)),)
    assert plan.part_of("model.layers.0.self_attn.q_proj.weight", (128, 64)) == Part(0, half)
    assert plan.part_of("model.layers.0.self_attn.o_proj.weight", (64, 128)) == Part(-1, half)
    assert plan.part_of("model.layers.0.self_attn.k_norm.weight", (32,)) is None
    assert plan.part_of("model.layers.0.mlp.down_proj.scales", (64, 1)) == Part(-1, half)
    assert plan.part_of("model.layers.0.self_attn.o_proj.bias", (64,)) is None  # added once, after the sum
    assert plan.part_of("model.embed_tokens.weight", (256, 64)) == Part(0, half, transposed=True)
    assert plan.part_of("model.embed_tokens_per_layer.weight", (256, 64)) == Part(0, half)
    assert plan.part_of("model.norm.weight", (64,)) is None


def test_one_kv_head_is_replicated_to_the_ranks_that_read_it():
    # E2B: 8 query heads, 1 key/value head. Every rank of 2 or 4 holds the one kv head.
    config = text(num_attention_heads=8, num_key_value_heads=1, num_global_key_value_heads=1)
    for size in (2, 4):
        for rank in range(size):
            plan = planned("tensor", config, rank=rank, size=size)
            assert plan.part_of("model.layers.0.self_attn.k_proj.weight", (32, 64)) == Part(0, ((Fraction(0), Fraction(1)),))
            q = plan.part_of("model.layers.0.self_attn.q_proj.weight", (256, 64))
            assert q == Part(0, ((Fraction(rank, size), Fraction(rank + 1, size)),))


def test_kv_shared_layers_read_no_keys_or_values():
    plan = planned("tensor", text(layer_types=[S, F, S, F], num_kv_shared_layers=2))
    assert plan.part_of("model.layers.3.self_attn.k_proj.weight", (128, 64)) == SKIP
    assert plan.part_of("model.layers.1.self_attn.k_proj.weight", (128, 64)) is not None


def test_moe_split_follows_the_quantization_groups():
    moe = dict(enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704)
    config = text(**moe)
    quantized = {"quantization": {"group_size": 64, "bits": 4}}
    assert planned("tensor", config).expert_mode == "columns"
    assert planned("tensor", config, raw=quantized).expert_mode == "rows"  # 352 columns are not whole groups of 64
    with pytest.raises(ParallelSetupError, match="704 hidden columns"):
        planned("tensor", config, raw=quantized, experts="columns")
    plan = planned("tensor", config, rank=1)
    quarter = Fraction(1, 4)
    gate_up = plan.part_of("model.language_model.layers.0.experts.gate_up_proj", (128, 1408, 64))
    assert gate_up == Part(1, ((quarter, 2 * quarter), (3 * quarter, 1)))  # this rank's gate rows, then its up rows
    assert plan.part_of("language_model.model.layers.0.experts.switch_glu.down_proj.weight", (128, 64, 704)).axis == -1
    rows = planned("tensor", config, rank=1, experts="rows")
    assert rows.part_of("model.layers.0.experts.down_proj", (128, 64, 704)) == Part(0, ((Fraction(1, 2), Fraction(1)),))


def test_tensor_refuses_what_it_cannot_split():
    with pytest.raises(ParallelSetupError, match="3 attention heads"):
        planned("tensor", text(num_attention_heads=3, num_key_value_heads=1, num_global_key_value_heads=1))
    with pytest.raises(ParallelSetupError, match="layer 0 has 3 key/value heads"):
        planned("tensor", text(num_attention_heads=6, num_key_value_heads=3, num_global_key_value_heads=3))
    with pytest.raises(ParallelSetupError, match="vocab_size 255"):
        planned("tensor", text(vocab_size=255))


def test_media_towers_are_read_on_rank_0_only():
    config = text()
    key = "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight"
    assert planned("tensor", config, rank=0)._decision(key, (32, 32)) is None
    assert planned("tensor", config, rank=1)._decision(key, (32, 32)) == STAND_IN


# ---------------------------------------------------------------------------------------- the reader
def test_read_parts_reads_exactly_the_slices(tmp_path):
    rng = np.random.default_rng(0)
    stored = {
        "a.weight": mx.array(rng.standard_normal((6, 8)).astype(np.float32)).astype(mx.bfloat16),
        "b.weight": mx.array(rng.integers(0, 2**32, (4, 6), dtype=np.uint32)),
        "c.weight": mx.array(rng.standard_normal((2, 12, 3)).astype(np.float32)),
        "d.weight": mx.array(rng.standard_normal(5).astype(np.float32)),
        "e.weight": mx.array(rng.standard_normal(3).astype(np.float32)),
    }
    mx.save_safetensors(str(tmp_path / "model.safetensors"), stored)
    third = Fraction(1, 3)
    plan = {
        "a.weight": Part(0, ((third, 2 * third),), transposed=True),
        "b.weight": Part(-1, ((Fraction(1, 2), Fraction(1)),)),
        "c.weight": Part(1, ((Fraction(0), Fraction(1, 4)), (Fraction(1, 2), Fraction(3, 4)))),
        "d.weight": None,
        "e.weight": SKIP,
    }
    weights, sources = read_parts(tmp_path, lambda key, shape: plan[key])
    assert sorted(weights) == ["a.weight", "b.weight", "c.weight", "d.weight"] and sorted(sources) == sorted(stored)
    assert weights["a.weight"].dtype == mx.bfloat16 and mx.array_equal(weights["a.weight"], stored["a.weight"][2:4])
    assert mx.array_equal(weights["b.weight"], stored["b.weight"][:, 3:])
    want_c = mx.concatenate([stored["c.weight"][:, 0:3], stored["c.weight"][:, 6:9]], axis=1)
    assert mx.array_equal(weights["c.weight"], want_c)
    assert mx.array_equal(weights["d.weight"], stored["d.weight"])


def test_a_cut_off_the_groups_is_refused_by_name(tmp_path):
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"layers.0.o_proj.scales": mx.zeros((4, 5))})
    with pytest.raises(ShardError, match=r"layers.0.o_proj.scales: shape \[4, 5\] cannot be cut at 0..1/2 of axis -1"):
        read_parts(tmp_path, lambda key, shape: Part(-1, ((Fraction(0), Fraction(1, 2)),)))


def test_a_transposed_part_is_relaid_out_without_a_copy(tmp_path):
    table = mx.array(np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"embed_tokens.weight": table})
    weights, _ = read_parts(tmp_path, lambda key, shape: Part(0, ((Fraction(0), Fraction(1, 2)),), transposed=True))
    held = weights["embed_tokens.weight"]
    assert mx.array_equal(held, table[:256])
    before = mx.get_active_memory()
    relaid = mx.contiguous(held.T)  # what VocabularyHead.split_head does on the CPU
    mx.eval(relaid)
    assert mx.get_active_memory() == before


def test_families_without_a_decoder_shape_are_refused_by_name(tmp_path):
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"layers.0.fc.weight": mx.zeros((2, 2))})
    with pytest.raises(ParallelSetupError, match="model_type 'gemma4_assistant' is not split across ranks"):
        sharding_for("tensor", Group(0, 2)).read(tmp_path, {"model_type": "gemma4_assistant"})
