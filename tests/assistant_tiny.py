"""Tiny random Gemma 4 assistants written by transformers, paired with the targets of ``tests.hf_tiny``.

``save_assistant`` builds ``Gemma4AssistantForCausalLM`` for a target config (same vocabulary,
backbone width = the target's hidden size, head dims of the target's sliding and full layers),
seeds it, gives its centroid head a random token ordering (transformers initialises it to zeros,
which would put every token in one cluster), saves it and returns it in eval mode. ``reference_drafts``
runs the reference's draft loop (transformers' ``SinglePositionMultiTokenCandidateGenerator``
steps) on the target's ``shared_kv_states`` from an uncached forward over the whole sequence.
Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

S, F = "sliding_attention", "full_attention"


def assistant_text_config(target: dict, **overrides) -> dict:
    config = dict(
        vocab_size=target["vocab_size"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=target["head_dim"],
        global_head_dim=target.get("global_head_dim", 64),
        sliding_window=target["sliding_window"],
        layer_types=[S, F],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=target.get("max_position_embeddings", 512),
        initializer_range=0.15,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    return dict(config, **overrides)


def save_assistant(target: dict, directory: Path, *, ordered: bool = True, seed: int = 1, centroids: int = 16, top_k: int = 4, **text):
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig(
        text_config=assistant_text_config(target, **text),
        backbone_hidden_size=target["hidden_size"],
        use_ordered_embeddings=ordered,
        num_centroids=centroids,
        centroid_intermediate_top_k=top_k,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).eval()
    if ordered:
        with torch.no_grad():
            model.masked_embedding.token_ordering.copy_(torch.randperm(target["vocab_size"]))
    model.save_pretrained(directory)
    return model


def reference_drafts(target, assistant, ids, token: int, k: int, truncate_sliding: int | None = None):
    """The reference drafter's logits ``[k, V]`` and tokens for ``token`` following ``ids``.

    The target runs uncached over ``ids``; the assistant drafts from position ``len(ids)``.
    ``truncate_sliding`` keeps only that many newest sliding positions (to show the window matters).
    """
    import torch

    n = len(ids)
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        shared = {name: (kv[0], kv[1]) for name, kv in out.shared_kv_states.items()}
        if truncate_sliding is not None:
            keys, values = shared[S]
            shared[S] = (keys[:, :, -truncate_sliding:], values[:, :, -truncate_sliding:])
        hidden = out.hidden_states[-1][:, -1:]
        last = torch.tensor([[token]])
        logits, tokens = [], []
        for _ in range(k):
            embedded = target.get_input_embeddings()(last)
            step = assistant(
                inputs_embeds=torch.cat([embedded, hidden], dim=-1),
                attention_mask=torch.ones(1, n + 1, dtype=torch.long),
                position_ids=torch.tensor([[n]]),
                shared_kv_states=shared,
                use_cache=False,
            )
            last = step.logits.argmax(dim=-1)
            hidden = step.last_hidden_state
            logits.append(step.logits[0, -1].numpy())
            tokens.append(int(last))
    return np.stack(logits), tokens
