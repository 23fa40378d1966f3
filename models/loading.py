"""``load()``: resolve a model, read its config and weights, build the graph, attach the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

from weights import load_safetensors, read_config, resolve_model_path
from weights.quantize import QuantizationPolicy, plan_load, quantize_model

from .model import Model
from .precision import AUTO, cast_weights, choose, prepare
from .registry import architecture_for
from .zoo import zoo_folder


def read_generation_config(folder: Path) -> dict:
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def load(
    name_or_path: str,
    dtype=AUTO,
    tokenizer: bool = True,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_policy: QuantizationPolicy | None = None,
):
    """Load a model by zoo name (``models.zoo.ZOO``), local folder or Hub repo id: a ``Model``, or a
    ``DiffusionModel`` for DiffusionGemma checkpoints.

    ``dtype`` casts floating weights (the scales of a quantized checkpoint are floating too);
    ``"auto"`` (default) lets ``models.precision`` choose for the device (float32 on a CPU with a
    fast BLAS, the checkpoint's dtype elsewhere) and ``None`` keeps the checkpoint's dtypes. The
    tokenizer, with mlx-lm's streaming detokenizer, is attached unless ``tokenizer=False``.
    Pre-quantized MLX checkpoints load as stored; ``q_bits`` (4 or 8) and ``q_group_size`` (32, 64
    or 128; default 64), or a whole ``q_policy``, quantize a full-precision checkpoint on load
    (``docs/quantization.md``). On a CPU, ``models.precision.prepare`` then makes the graph fast
    there (quantized layers dequantized to float32 by default: ``$GEMMA_ZOO_CPU_QUANT``).
    """
    folder = zoo_folder(str(name_or_path)) or resolve_model_path(str(name_or_path))
    config_dict = read_config(folder)
    if config_dict.get("model_type") == "diffusion_gemma":
        # Block diffusion is not autoregressive: its own model object and loop (models.diffusion_model).
        from .diffusion_model import load_diffusion

        return load_diffusion(
            folder, dtype=None if dtype == AUTO else dtype, tokenizer=tokenizer, q_bits=q_bits, q_group_size=q_group_size, q_policy=q_policy
        )
    weights, _ = load_safetensors(folder)
    precision = choose(dtype, weights)
    weights = cast_weights(weights, precision)
    quantization = plan_load(config_dict, weights, str(folder / "config.json"), q_bits, q_group_size, q_policy)
    architecture = architecture_for(config_dict, str(folder / "config.json"), weights.keys())
    config = architecture.parse_config(config_dict)
    graph = architecture.build_graph(config)
    architecture.load_weights(graph, weights)
    if quantization is not None:
        quantize_model(graph, quantization)
    del weights  # the graph holds what it needs; the rest (e.g. float weights quantized away) can go
    device_notes = prepare(graph, precision)  # CPU: quantized layers and the output head (models.precision)
    graph.eval()
    generation_config = read_generation_config(folder)
    wrapper = None
    if tokenizer:
        eos = generation_config.get("eos_token_id")
        wrapper = load_mlx_lm_tokenizer(folder, eos_token_ids=eos)
    model = Model(graph, config, wrapper, generation_config, folder, config_dict["model_type"])
    model.precision, model.device_notes = precision, device_notes  # stated by --verbose
    return model
