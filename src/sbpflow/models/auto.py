"""``from_pretrained``: a Hugging Face folder to an sbpflow model, picked by the config's ``model_type``."""

from __future__ import annotations

from pathlib import Path

import sbpflow
from sbpflow.errors import SbpflowError
from sbpflow.models import hf, llama


def from_pretrained(folder: str | Path, data: int = 1, tensor: int = 1, device: str = "cpu") -> llama.Llama:
    """Builds the model ``folder/config.json`` describes and loads its safetensors weights.

    With ``data`` or ``tensor`` above 1 the model is parallelized first (built
    with no data under :func:`sbpflow.meta_init`), and each process then reads
    only the slices its ranks hold; ``model.strategy.shard_inputs`` lays out inputs.
    """
    config = hf.read_config(folder)
    kind = config.get("model_type")
    if kind != "llama":
        raise SbpflowError(f"from_pretrained supports model_type 'llama', but {Path(folder) / 'config.json'} has "
                           f"{kind!r}")
    cfg = llama.LlamaConfig.from_dict(config)
    parallel = data > 1 or tensor > 1
    with sbpflow.meta_init(parallel):
        model = llama.Llama(cfg)
    if parallel:
        llama.parallelize(model, data=data, tensor=tensor, device=device)
    hf.load_weights(model, folder, skip=["lm_head.weight"] if cfg.tie_word_embeddings else [])
    return model


__all__ = ["from_pretrained"]
