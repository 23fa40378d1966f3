"""The block-diffusion loop against transformers' ``generate`` and its pieces against hand-computed cases.

End to end: transformers' ``generate`` runs with a torch seed while its random canvases and
samples are recorded; our loop replays exactly those draws (``tests.diffusion_tiny.ReplayNoise``)
and must commit the same tokens block after block, with the same steps and tokens per forward.
The cases cover prompts shorter and longer than the window, an image prompt, a batch of two whose
rows stop denoising at different steps, an EOS in the middle of a block (padding after it and in
the finished row's later blocks) and ``max_length``.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.diffusion_gemma import generation_diffusion_gemma as reference  # noqa: E402

from models.generation.diffusion_options import DiffusionGenerationConfig  # noqa: E402
from models.generation.diffusion import (  # noqa: E402
    CommittedBlock,
    DenoiseStep,
    Finished,
    MLXNoise,
    StableAndConfident,
    entropy_bound_accept,
    eos_padding,
    generate_diffusion,
    stream_diffusion,
    vocabulary_step,
)
from models.generation.prompts import prefill_chunks, token_runs  # noqa: E402
from models.processing.image_processor import Gemma4ImageProcessor  # noqa: E402
from tests import diffusion_tiny as tiny  # noqa: E402

C = 8


def entropy_of(logits) -> mx.array:
    """Per-position entropy (nats) of ``softmax(logits)`` as the generation loop computes it."""
    return vocabulary_step(mx.array(logits), 1.0)[2]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with tiny.one_torch_thread():
        yield


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, ours); "random" is T7 as is, "converging" denoises to early stops."""
    built = {}

    def get(kind):
        if kind not in built:
            directory = tmp_path_factory.mktemp(kind)
            options = {"random": {}, "converging": dict(sharpness=10.0, residual=0.3)}[kind]
            built[kind] = tiny.save_diffusion("T7", directory, **options), tiny.load_ours(directory)
        return built[kind]

    return get


def hf_generate(hf, ids: np.ndarray, seed: int = 0, hf_images: dict | None = None, **options):
    """transformers' generate with the torch seed; returns (output, recorded draws)."""
    extra = {}
    if hf_images:
        extra = dict(hf_images, mm_token_type_ids=torch.as_tensor(ids == 251).long())
    torch.manual_seed(seed)
    with tiny.record_torch_draws() as draws, torch.no_grad():
        out = hf.generate(torch.as_tensor(ids), **extra, **options)
    return out, draws


def replay(ours, ids, draws, images=(), **options):
    """Our loop on transformers' draws; returns (result, events)."""
    noise = tiny.ReplayNoise(draws)
    features = ours.image_features(images) if images else ()
    events = list(stream_diffusion(ours, ids, DiffusionGenerationConfig(**options), noise=noise, image_features=features))
    assert noise.exhausted, "our loop drew fewer random numbers than transformers"
    return events[-1].result, events


def assert_same_run(out, result):
    np.testing.assert_array_equal(result.sequences, out.sequences.numpy())
    np.testing.assert_allclose(result.tokens_per_forward, out.tokens_per_forward.numpy(), rtol=1e-6)


@pytest.mark.parametrize("length", [2, 6, 11])  # window history is 3: shorter, longer, much longer
def test_random_model_commits_what_transformers_commits(models, length):
    hf, ours = models("random")
    ids = np.random.default_rng(length).integers(3, 250, (1, length))
    options = dict(max_new_tokens=3 * C, max_denoising_steps=6)
    out, draws = hf_generate(hf, ids, **options)
    result, _ = replay(ours, ids, draws, **options)
    assert_same_run(out, result)
    assert result.steps_per_block == [6, 6, 6]


def test_batch_with_early_stops_and_eos_inside_a_block(models):
    """Two rows that stop denoising at different steps; row 0 meets an EOS mid-block, so its later
    tokens and its later blocks are pad while row 1 goes on."""
    hf, ours = models("converging")
    ids = np.random.default_rng(0).integers(3, 250, (2, 6))
    options = dict(max_new_tokens=4 * C, max_denoising_steps=8)
    free, _ = hf_generate(hf, ids, **options)
    eos = _eos_inside_block(free.sequences.numpy(), prompt=6, block=1)
    options.update(eos_token_id=eos, pad_token_id=0)
    out, draws = hf_generate(hf, ids, **options)
    result, events = replay(ours, ids, draws, **options)
    assert_same_run(out, result)

    steps = [e for e in events if isinstance(e, DenoiseStep)]
    assert min(result.steps_per_block) < 8, "no block stopped early"
    assert any(e.done.any() and not e.done.all() for e in steps), "the rows never stopped at different steps"
    assert any((e.accepted.sum(axis=-1) > 1).any() for e in steps), "never more than one token accepted in a row"
    row0 = result.sequences[0, 6:]
    first = int(np.flatnonzero(row0 == eos)[0])
    assert C < first < 2 * C - 1  # inside the second block
    assert (row0[first + 1 :] == 0).all() and result.finish_reasons[0] == "stop"
    assert result.new_tokens(0) == row0[:first].tolist()


def _eos_inside_block(sequences: np.ndarray, prompt: int, block: int) -> int:
    """A token of row 0 in the middle of ``block`` that appears nowhere earlier in row 0 or in row 1."""
    new = sequences[:, prompt:]
    for position in range(block * C + 2, (block + 1) * C - 2):
        token = int(new[0, position])
        if token not in new[0, :position] and token not in new[1] and token != 0:
            return token
    raise AssertionError("no candidate EOS token in this run")


def test_max_length_stops(models):
    hf, ours = models("random")
    ids = np.random.default_rng(1).integers(3, 250, (1, 5))
    options = dict(max_length=5 + 2 * C + 3, max_denoising_steps=3)  # max_length wins over the default 256 tokens
    out, draws = hf_generate(hf, ids, **options)
    result, _ = replay(ours, ids, draws, **options)
    assert_same_run(out, result)
    assert result.sequences.shape[1] == 5 + 3 * C  # whole blocks: overshoots by less than a block


def test_image_prompt(models):
    hf, ours = models("random")
    picture = _picture()
    processed = Gemma4ImageProcessor(70)(picture)[0]
    ids = np.array([[2, 17, 250, *[251] * processed.num_soft_tokens, 252, 33, 41]])
    options = dict(max_new_tokens=2 * C, max_denoising_steps=4)
    out, draws = hf_generate(hf, ids, hf_images=tiny.hf_image_inputs([picture]), **options)
    result, _ = replay(ours, ids, draws, images=[(processed.patches, processed.position_ids)], **options)
    assert_same_run(out, result)


def _picture():
    rng = np.random.default_rng(5)
    return Image.fromarray(rng.integers(0, 256, (96, 144, 3), dtype=np.uint8))


def test_events_stream_in_order(models):
    _, ours = models("random")
    events = list(stream_diffusion(ours, [5, 6, 7], DiffusionGenerationConfig(max_new_tokens=2 * C, max_denoising_steps=3), seed=0))
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["DenoiseStep"] * 3 + ["CommittedBlock"] + ["DenoiseStep"] * 3 + ["CommittedBlock", "Finished"]
    committed = [e.tokens for e in events if isinstance(e, CommittedBlock)]
    np.testing.assert_array_equal(np.concatenate(committed, axis=1), events[-1].result.sequences[:, 3:])
    last_steps = [e for e in events if isinstance(e, DenoiseStep) and e.remaining == 1]
    np.testing.assert_array_equal(last_steps[0].argmax, committed[0])  # the committed block is the last argmax
    assert [e.temperature for e in events[:3]] == pytest.approx([0.8, 0.4 + 0.4 * 2 / 3, 0.4 + 0.4 / 3])


def test_seed_makes_a_run_reproducible(models):
    _, ours = models("random")
    options = DiffusionGenerationConfig(max_new_tokens=2 * C, max_denoising_steps=3)
    first = generate_diffusion(ours, [5, 6, 7], options, seed=7)
    again = generate_diffusion(ours, [5, 6, 7], options, seed=7)
    other = generate_diffusion(ours, [5, 6, 7], options, seed=8)
    np.testing.assert_array_equal(first.sequences, again.sequences)
    assert first.seed == 7 and not np.array_equal(first.sequences, other.sequences)
    assert generate_diffusion(ours, [5, 6, 7], options).seed is not None  # a fresh seed, reported


def test_many_blocks_stay_exact_with_memory_bounded_by_the_window(models):
    """60 blocks over a window of 4: a sliding cache's buffer grows to its fixed capacity
    (``window - 1`` + trim slack + one allocation step) and then stays there, while the full layer
    grows by a block per block; and the incremental cache gives the same logits as encoding the
    whole sequence at once."""
    _, ours = models("random")
    cache = ours.make_cache()
    options = DiffusionGenerationConfig(max_new_tokens=60 * C, max_denoising_steps=1)
    sizes = []
    for event in stream_diffusion(ours, np.arange(3, 14), options, seed=0, cache=cache):
        if isinstance(event, CommittedBlock):
            sizes.append([c.nbytes for c in cache])
        elif isinstance(event, Finished):
            result = event.result
    for i, layer in enumerate(cache):
        if layer.sliding_window:
            keys, values = layer.temporal()
            full_size = layer.capacity * (keys.nbytes + values.nbytes) // keys.shape[2]
            reached = next(b for b, size in enumerate(sizes) if size[i] == full_size)
            assert reached < 40 and all(size[i] == full_size for size in sizes[reached:])
            assert all(size[i] <= full_size for size in sizes)
        else:  # the full layer holds everything but the last block, which no later block needed
            assert layer.stored == result.sequences.shape[1] - C

    ours.prefill(mx.array(result.sequences[:, -C:]), cache)  # commit the last block too
    fresh = ours.make_cache()
    ours.prefill(mx.array(result.sequences), fresh)
    canvas = mx.array(np.random.default_rng(0).integers(0, 256, (1, C)))
    np.testing.assert_allclose(np.array(ours.denoise(canvas, cache)), np.array(ours.denoise(canvas, fresh)), atol=1e-5)


# ------------------------------------------------------------------------------------ the pieces
def test_temperature_schedule_divides_like_the_reference():
    options = DiffusionGenerationConfig(max_denoising_steps=4)
    assert [options.temperature(k) for k in (4, 3, 2, 1)] == pytest.approx([0.8, 0.7, 0.6, 0.5])  # t_min never used
    raw = np.random.default_rng(0).normal(size=(1, 8, 256)).astype(np.float32) * 10
    processor = reference.LinearTemperatureScheduleLogitsProcessor(t_min=0.4, t_max=0.8, max_denoising_steps=4)
    for k in (4, 3, 2, 1):
        want = processor(None, torch.as_tensor(raw), cur_step=torch.tensor(k, dtype=torch.int32)).numpy()
        got = np.array(mx.array(raw) / mx.array(options.temperature(k), dtype=mx.float32))
        np.testing.assert_array_equal(got, want)


def test_entropy_bound_acceptance_by_hand():
    entropies = mx.array([[0.05, 0.5, 0.02, 0.04, 0.0]])
    # ascending: 0.0, 0.02, 0.04, 0.05, 0.5; entropy before each: 0, 0, 0.02, 0.06, 0.11
    assert np.array(entropy_bound_accept(entropies, 0.1)).tolist() == [[True, False, True, True, True]]
    assert np.array(entropy_bound_accept(entropies, 0.01)).tolist() == [[False, False, True, False, True]]
    assert np.array(entropy_bound_accept(mx.array([[3.0, 2.0]]), 0.1)).tolist() == [[False, True]]  # the lowest always


def test_entropy_and_acceptance_match_the_reference_sampler():
    rng = np.random.default_rng(0)
    for bound in (0.1, 1.0, 5.0):
        logits = (rng.normal(size=(2, 16, 256)) * rng.uniform(1, 30, (2, 16, 1))).astype(np.float32)
        sampler = reference.EntropyBoundSampler(reference.EntropyBoundSamplerConfig(entropy_bound=bound), 16, 256, 4)
        canvas = torch.zeros(2, 16, dtype=torch.long)
        sampler.accept_canvas(canvas, canvas + 1, torch.as_tensor(logits), 1)
        want_entropy = torch.distributions.Categorical(logits=torch.as_tensor(logits)).entropy().numpy()
        np.testing.assert_allclose(np.array(entropy_of(logits)), want_entropy, atol=1e-5)
        np.testing.assert_array_equal(
            np.array(entropy_bound_accept(entropy_of(logits), bound)), sampler.accepted_token_mask.numpy()
        )


def test_stable_and_confident_by_hand():
    confident = mx.zeros((1, 3))  # mean entropy 0
    a, b = mx.array([[1, 2, 3]]), mx.array([[1, 2, 4]])
    one = StableAndConfident(stability_threshold=1, confidence_threshold=0.005)
    assert [bool(one(x, confident)[0]) for x in (a, a, b, b, b)] == [False, True, False, True, True]
    two = StableAndConfident(stability_threshold=2, confidence_threshold=0.005)  # k + 1 identical drafts
    assert [bool(two(x, confident)[0]) for x in (a, a, a, b, b, b)] == [False, False, True, False, False, True]
    zero = StableAndConfident(stability_threshold=0, confidence_threshold=0.005)
    assert bool(zero(a, confident)[0]) and not bool(zero(a, mx.full((1, 3), 0.01))[0])


def test_stop_rule_matches_the_reference():
    rng = np.random.default_rng(0)
    for threshold in (0, 1, 2):
        ours = StableAndConfident(threshold, confidence_threshold=0.5)
        theirs = reference.StableAndConfidentStoppingCriteria(threshold, confidence_threshold=0.5)
        drafts = [rng.integers(0, 2, (3, 4)) for _ in range(12)]  # few values: repeats happen
        for draft in drafts:
            logits = (rng.normal(size=(3, 4, 16)) * rng.uniform(1, 40, (3, 1, 1))).astype(np.float32)
            want = theirs(torch.as_tensor(draft), torch.as_tensor(logits)).numpy()
            got = np.array(ours(mx.array(draft), entropy_of(logits)))
            np.testing.assert_array_equal(got, want)


def test_eos_padding_matches_the_reference():
    block = np.array([[5, 1, 7, 1, 9], [5, 6, 7, 8, 9], [1, 4, 4, 4, 4]])
    padded, has_eos = eos_padding(block, (1,), 0)
    assert padded.tolist() == [[5, 1, 0, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]] and has_eos.tolist() == [True, False, True]
    kept, _ = eos_padding(block, (1,), None)  # without a pad id the tokens stay
    np.testing.assert_array_equal(kept, block)

    criteria = reference.StoppingCriteriaList([reference.EosTokenCriteria([1])])
    config = reference.DiffusionGemmaGenerationConfig(eos_token_id=[1], pad_token_id=0)
    sequences = torch.as_tensor(np.concatenate([np.full((3, 2), 9), block], axis=1))
    want, finished = reference.DiffusionGemmaGenerationMixin._finalize_canvas(
        sequences, torch.zeros(3, dtype=torch.bool), config, criteria, 5, torch.tensor([1])
    )
    np.testing.assert_array_equal(padded, want.numpy()[:, 2:])
    np.testing.assert_array_equal(has_eos, finished.numpy())


def test_prefill_chunks_never_split_an_image():
    """The encoder chunks batched prompts with the autoregressive loop's rule over the runs of image
    tokens of any row."""
    ids = np.array([[1, 2, 9, 9, 9, 9, 3, 4, 5, 9, 9, 6], [1, 9, 9, 3, 3, 3, 3, 4, 5, 6, 9, 9]])
    runs = token_runs(ids, 9)
    assert runs == [(1, 6), (9, 12)]
    assert prefill_chunks(12, runs, 3) == [(0, 1), (1, 6), (6, 9), (9, 12)]
    assert prefill_chunks(12, [], 5) == [(0, 5), (5, 10), (10, 12)]


def test_mlx_noise_draws_the_whole_vocabulary():
    noise = MLXNoise(0)
    drawn = np.array(noise.canvas((64, 256), 256))
    assert drawn.min() == 0 and drawn.max() == 255 and len(np.unique(drawn)) == 256


# ---------------------------------------------------------------------------------------- options
@pytest.mark.parametrize("name, hint", [("top_p", "entropy bound"), ("top_k", "entropy bound"), ("temperature", "t_max"),
                                        ("min_p", "entropy bound"), ("do_sample", "argmax"), ("foo", "the options are")])  # fmt: skip
def test_options_the_algorithm_does_not_have_raise(name, hint):
    with pytest.raises(ValueError, match=hint):
        DiffusionGenerationConfig().updated(**{name: 1})
    with pytest.raises(ValueError, match=name):
        DiffusionGenerationConfig.from_generation_config({name: 1})


@pytest.mark.parametrize(
    "bad", [dict(t_min=0.8, t_max=0.8), dict(max_denoising_steps=0), dict(stability_threshold=-1),
            dict(confidence_threshold=0), dict(entropy_bound=-0.1), dict(max_new_tokens=1.5), dict(max_length=0)],
)  # fmt: skip
def test_invalid_values_raise(bad):
    with pytest.raises(ValueError):
        DiffusionGenerationConfig(**bad)


def test_defaults_are_the_reference_defaults():
    defaults = reference.DiffusionGemmaGenerationConfig._get_default_generation_params()
    ours = DiffusionGenerationConfig()
    for name, value in defaults.items():
        expected = value.entropy_bound if name == "sampler_config" else value
        assert getattr(ours, "entropy_bound" if name == "sampler_config" else name) == expected


def test_generation_config_json_as_transformers_writes_it(tmp_path):
    written = reference.DiffusionGemmaGenerationConfig(
        max_denoising_steps=5, sampler_config=reference.EntropyBoundSamplerConfig(entropy_bound=0.3), t_max=0.9,
        eos_token_id=[1, 106], pad_token_id=0, max_new_tokens=64,
    )  # fmt: skip
    written.save_pretrained(tmp_path)
    options = DiffusionGenerationConfig.from_generation_config(json.loads((tmp_path / "generation_config.json").read_text()))
    assert (options.max_denoising_steps, options.entropy_bound, options.t_max, options.t_min) == (5, 0.3, 0.9, 0.4)
    assert (options.eos_token_id, options.pad_token_id, options.max_new_tokens) == ((1, 106), 0, 64)
    assert options.stability_threshold == 1 and options.confidence_threshold == 0.005  # null -> default
    assert options.updated(t_max=1.2).t_max == 1.2  # explicit options override the file


@pytest.mark.parametrize("value", ["static", "quantized", "offloaded"])
def test_cache_implementations_we_do_not_build_raise(value):
    with pytest.raises(ValueError, match="cache_implementation"):
        DiffusionGenerationConfig.from_generation_config({"cache_implementation": value})


def test_max_length_rule():
    assert DiffusionGenerationConfig().lengths(10) == (266, 256)
    assert DiffusionGenerationConfig(max_length=50).lengths(10) == (50, 40)  # max_new_tokens still 256: max_length wins
    assert DiffusionGenerationConfig(max_length=50, max_new_tokens=100).lengths(10) == (110, 100)
    assert DiffusionGenerationConfig(max_new_tokens=17).num_blocks(10, 8) == 3


def test_kv_quantization_switches_the_encoder_caches(models):
    """``--kv-bits`` for DiffusionGemma: below the start offset nothing changes; past it every
    cache holds quantized storage and the canvas reads run on it."""
    from models.generation.generate import KVQuantization

    _, ours = models("random")
    options = DiffusionGenerationConfig(max_new_tokens=3 * C, max_denoising_steps=3)
    plain = generate_diffusion(ours, [5, 6, 7], options, seed=7)
    late = generate_diffusion(ours, [5, 6, 7], options, seed=7, kv_quantization=KVQuantization(8, 32, start=10_000))
    np.testing.assert_array_equal(plain.sequences, late.sequences)
    quantized = generate_diffusion(ours, [5, 6, 7], options, seed=7, kv_quantization=KVQuantization(8, 32, start=0))
    assert all(c.codec.quantized for c in quantized.cache)
    assert quantized.sequences.shape == plain.sequences.shape
