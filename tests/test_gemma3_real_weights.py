"""Real weights end to end: the zoo's converted Gemma 3 270M in our graph against transformers.

Both sides load the same converted folder in float32. Teacher forcing over a 700-token English
text (the opening of the Declaration of Independence, public domain), well past the 512-token
window, with prefill chunks of 512, 100 and 1; then greedy continuations of plain prompts; and the
converted weights against transformers' own GGUF import of the same file.

Time on 2 CPU cores is dominated by MLX's float32 matmuls (about 5 positions/s for a full
forward with its 262144-wide head), so the chunk-1 run decodes the 128 positions 448..575, which
straddle the window's first wrap at 512, after one ``window`` prefill of the first 448 positions;
the 512 and 100 runs compare all 700 positions.
"""

from __future__ import annotations

import json
import time

import mlx.core as mx
import numpy as np
import pytest

from weights.resolve import ModelNotAvailableError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

N = 700
CHUNK_1_SPAN = (448, 576)
NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The quick brown fox",
    "Once upon a time, in a small village,",
]
# transformers' greedy ids (Gemma3ForCausalLM, float32, this GGUF's weights) for the first prompt (" the capital of the country of France. It is the largest").
GOLDEN_FRANCE = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488]

TEXT = """When in the Course of human events, it becomes necessary for one people to dissolve the political bands which have connected them with another, and to assume among the powers of the earth, the separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of mankind requires that they should declare the causes which impel them to the separation.

We hold these truths to be self-evident, that all men are created equal, that they are endowed by their Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness. That to secure these rights, Governments are instituted among Men, deriving their just powers from the consent of the governed, That whenever any Form of Government becomes destructive of these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, laying its foundation on such principles and organizing its powers in such form, as to them shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that Governments long established should not be changed for light and transient causes; and accordingly all experience hath shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right themselves by abolishing the forms to which they are accustomed. But when a long train of abuses and usurpations, pursuing invariably the same Object evinces a design to reduce them under absolute Despotism, it is their right, it is their duty, to throw off such Government, and to provide new Guards for their future security. Such has been the patient sufferance of these Colonies; and such is now the necessity which constrains them to alter their former Systems of Government. The history of the present King of Great Britain is a history of repeated injuries and usurpations, all having in direct object the establishment of an absolute Tyranny over these States. To prove this, let Facts be submitted to a candid world.

He has refused his Assent to Laws, the most wholesome and necessary for the public good.

He has forbidden his Governors to pass Laws of immediate and pressing importance, unless suspended in their operation till his Assent should be obtained; and when so suspended, he has utterly neglected to attend to them.

He has refused to pass other Laws for the accommodation of large districts of people, unless those people would relinquish the right of Representation in the Legislature, a right inestimable to them and formidable to tyrants only.

He has called together legislative bodies at places unusual, uncomfortable, and distant from the depository of their public Records, for the sole purpose of fatiguing them into compliance with his measures.

He has dissolved Representative Houses repeatedly, for opposing with manly firmness his invasions on the rights of the people.

He has refused for a long time, after such dissolutions, to cause others to be elected; whereby the Legislative powers, incapable of Annihilation, have returned to the People at large for their exercise; the State remaining in the mean time exposed to all the dangers of invasion from without, and convulsions within.

He has endeavoured to prevent the population of these States; for that purpose obstructing the Laws for Naturalization of Foreigners; refusing to pass others to encourage their migrations hither, and raising the conditions of new Appropriations of Lands.

He has obstructed the Administration of Justice, by refusing his Assent to Laws for establishing Judiciary powers.

He has made Judges dependent on his Will alone, for the tenure of their offices, and the amount and payment of their salaries.
"""


@pytest.fixture(scope="module")
def folder():
    from models.assets.gemma3_270m import gemma3_270m_folder

    try:
        return gemma3_270m_folder()
    except ModelNotAvailableError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def ids(tokenizer) -> np.ndarray:
    ids = tokenizer(TEXT).input_ids[:N]
    assert len(ids) == N and ids[0] == 2
    return np.array(ids)


@pytest.fixture(scope="module")
def reference(folder):
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference_logprobs(reference, ids) -> np.ndarray:
    """``[N, V]`` float32 log-probabilities of transformers' teacher-forced run."""
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor(ids[None])).logits[0].float(), dim=-1).numpy()


@pytest.fixture(scope="module")
def ours(folder):
    from graphs.gemma3_text import Gemma3TextModel
    from models.registry import load_gemma3_text_weights
    from graphs.gemma3_text_config import Gemma3TextConfig

    model = Gemma3TextModel(Gemma3TextConfig.from_dict(json.loads((folder / "config.json").read_text())))
    load_gemma3_text_weights(model, mx.load(str(folder / "model.safetensors")))
    model.eval()
    return model


def _logprobs(logits: mx.array) -> np.ndarray:
    logits = logits[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _teacher_forced(model, ids: np.ndarray, chunk: int):
    """Yield ``(first position, log-probs [L, V])`` for each read of the cached run."""
    cache = model.make_cache()
    if chunk == 1:
        start, stop = CHUNK_1_SPAN
        mx.eval(model(mx.array(ids[None, :start]), cache=cache, last_only=True))
        positions = range(start, stop)
    else:
        positions = range(0, len(ids), chunk)
    for p in positions:
        yield p, _logprobs(model(mx.array(ids[None, p : p + chunk]), cache=cache))


@pytest.mark.parametrize("chunk", [512, 100, 1])
def test_teacher_forced_logprobs_match_transformers(chunk, ours, ids, reference_logprobs, capsys):
    start = time.perf_counter()
    agree, positions, abs_sum, target_diffs = 0, 0, 0.0, []
    for p, got in _teacher_forced(ours, ids, chunk):
        want = reference_logprobs[p : p + got.shape[0]]
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        positions += got.shape[0]
        abs_sum += float(np.abs(got - want).mean(-1).sum())
        targets = ids[p + 1 : p + 1 + got.shape[0]]  # the next token, where the text has one
        rows = np.arange(len(targets))
        target_diffs.extend(np.abs(got[rows, targets] - want[rows, targets]).tolist())
    top1, mean_abs, target = agree / positions, abs_sum / positions, np.array(target_diffs)
    with capsys.disabled():
        print(
            f"\n[gemma-3-270m chunk {chunk}] {positions} positions: top-1 agreement {top1:.4f}, "
            f"mean |dlogprob| {mean_abs:.2e} (all vocab), next-token |dlogprob| mean {target.mean():.2e} "
            f"max {target.max():.2e}; {time.perf_counter() - start:.0f} s"
        )
    assert top1 >= 0.99
    assert mean_abs <= 1e-3
    assert target.mean() <= 1e-3 and target.max() <= 5e-2


def _greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    cache = model.make_cache()
    logits = model(mx.array([prompt_ids]), cache=cache, last_only=True)
    out: list[int] = []
    for _ in range(steps):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache=cache)
    return out


def test_greedy_continuations_match_transformers(ours, reference, tokenizer, capsys):
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            generated = reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        want = generated[0, len(prompt_ids) :].tolist()
        got = _greedy(ours, prompt_ids, NEW_TOKENS)
        with capsys.disabled():
            print(f"\n[gemma-3-270m greedy] {prompt!r} -> {tokenizer.decode(got)!r}")
        assert got == want, f"{prompt!r}: ours {got} != transformers {want}"
        if prompt == PROMPTS[0]:
            assert got == GOLDEN_FRANCE


def test_converted_weights_equal_transformers_gguf_loader(folder):
    """Our names, dequantization and norm offset agree bit for bit with transformers' own GGUF import."""
    from safetensors.numpy import load_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from models.assets.gemma3_270m import gemma3_270m_gguf

    with torch.device("meta"):
        skeleton = transformers.Gemma3ForCausalLM(transformers.AutoConfig.from_pretrained(folder))
    theirs = load_gguf_checkpoint(str(gemma3_270m_gguf()), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(folder / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, value in ours.items():
        np.testing.assert_array_equal(value, np.asarray(theirs[name], dtype=np.float32), err_msg=name)
