"""Soak: 32 concurrent clients x 10 requests of mixed lengths against one server, through the
``openai`` client, on a tiny random Gemma 4 whose sliding windows (8) wrap and whose KV cache
switches to 8-bit storage mid-request, with a prefix store.

Every answer must equal that request's single-request greedy output (``Model.generate`` with the
same KV quantization and prefill chunks); no request may be lost or answered twice; clients that hang up mid-stream
must leave the server serving the rest; and when it is over, no row, ticket or queue entry is left
and the process's memory has stopped growing. Among the requests, some are penalised (presence,
frequency, logit bias), some constrained to a JSON schema and some ask for two choices: each still
equals its lone ``Model.generate`` with the same options.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import models  # noqa: E402
from models.generation.generate import KVQuantization, SamplingOptions  # noqa: E402
from benchmarks.json_schemas import SCHEMAS  # noqa: E402
from tests.server_tiny import http, running_server, save_random_chat  # noqa: E402

pytestmark = pytest.mark.slow

CLIENTS, REQUESTS = 32, 10
PENALTIES = {"presence_penalty": -1.5, "frequency_penalty": 0.5, "logit_bias": {"236772": 5.0}}
KV = dict(bits=8, group_size=32, start=16)
STEP = 7  # prefill chunk: prompts of 3-45 tokens are prefilled in several chunks


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return models.load(str(save_random_chat(tmp_path_factory.mktemp("soak"))))


def test_soak(model):
    from models.generation.prefix_store import PrefixStore

    rng = random.Random(0)
    base = model.encode("Tell me a story about a lighthouse keeper and the sea")
    # Mixed lengths (3-45 prompt tokens, 2-20 answer tokens); prompts share prefixes so the store is hit.
    cases = [(base[: rng.randint(3, len(base))] + [rng.randrange(1000, 200000) for _ in range(rng.randint(0, 30))], rng.randint(2, 20))
             for _ in range(24)]  # fmt: skip
    # Every fourth case penalised, every fourth constrained to a schema, every fourth asks for two choices.
    extras = [{}, dict(PENALTIES), {"guided_json": SCHEMAS["enum_colour"][0]}, {"n": 2}] * 6
    cases = [(ids, 40 if "guided_json" in extra else n) for (ids, n), extra in zip(cases, extras)]

    def alone(ids, n, extra) -> str:
        """The same prefill chunks (where the cache switches to 8 bits depends on them) and KV settings."""
        options = {}
        if "presence_penalty" in extra:
            bias = {int(k): v for k, v in extra["logit_bias"].items()}
            options["sampling"] = SamplingOptions(presence_penalty=extra["presence_penalty"], frequency_penalty=extra["frequency_penalty"],
                                                  logit_bias=bias)  # fmt: skip
        return model.generate(ids, max_tokens=n, kv_quantization=KVQuantization(**KV), prefill_step_size=STEP,
                              schema=extra.get("guided_json"), **options)  # fmt: skip

    expected = [alone(ids, n, extra) for (ids, n), extra in zip(cases, extras)]

    store = PrefixStore(64 << 20)
    answers: dict[tuple[int, int], str] = {}
    failures: list[str] = []
    memory: list[float] = []
    with running_server(model, max_batch=8, max_queue=CLIENTS, kv_quantization=KVQuantization(**KV), prefix_store=store,
                        prefill_step_size=STEP) as url:  # fmt: skip
        def client(index: int) -> None:
            api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            local = random.Random(index)
            for round_ in range(REQUESTS):
                case = local.randrange(len(cases))
                ids, n = cases[case]
                extra = extras[case]
                try:
                    if local.random() < 0.5:
                        texts = [c.text for c in api.completions.create(model="tiny", prompt=ids, max_tokens=n, extra_body=extra).choices]
                    else:
                        stream = api.completions.create(model="tiny", prompt=ids, max_tokens=n, stream=True, extra_body=extra)
                        texts = [""] * extra.get("n", 1)
                        for chunk in stream:
                            for choice in chunk.choices:
                                texts[choice.index] += choice.text
                    text = texts[0]
                    if len(set(texts)) != 1 or len(texts) != extra.get("n", 1):
                        failures.append(f"client {index} round {round_} case {case}: choices {texts!r}")
                except Exception as err:  # recorded, so one failure does not hide the others
                    failures.append(f"client {index} round {round_}: {err!r}")
                    continue
                if (index, round_) in answers:
                    failures.append(f"client {index} round {round_} answered twice")
                answers[(index, round_)] = text
                if text != expected[case]:
                    failures.append(f"client {index} round {round_} case {case}: {text!r} != {expected[case]!r}")
                if index == 0 and round_ in (2, REQUESTS - 1):
                    memory.append(rss_mb())

        def quitter() -> None:
            """Opens long streams and hangs up after the first chunk, three times."""
            api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            for _ in range(3):
                stream = api.completions.create(model="tiny", prompt=base, max_tokens=400, stream=True)
                next(iter(stream))
                stream.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)] + [threading.Thread(target=quitter)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=900)
        elapsed = time.monotonic() - start
        metrics = http(url + "/metrics")[1]
    assert not failures, "\n".join(failures[:10])
    assert len(answers) == CLIENTS * REQUESTS
    assert metrics["running_requests"] == 0 and metrics["queue_length"] == 0
    assert metrics["requests_finished"]["cancelled"] >= 3  # the hang-ups were cancelled, not run to 400 tokens
    assert metrics["requests_finished"]["error"] == 0
    assert metrics["prefix_store"]["hits"] > 0 and metrics["prefix_store"]["bytes"] <= 64 << 20
    assert memory[1] - memory[0] < 300, f"RSS grew from {memory[0]:.0f} MB to {memory[1]:.0f} MB"
    print(f"soak: {CLIENTS * REQUESTS} requests in {elapsed:.1f} s; metrics {metrics}; RSS {memory}")
