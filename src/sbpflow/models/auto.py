"""``from_pretrained``: a Hugging Face folder to an sbpflow model, picked by the config's ``model_type``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sbpflow
from sbpflow.errors import SbpflowError
from sbpflow.models import hf, llama, moe

MODELS: dict[str, tuple[type[llama.LlamaConfig], Any]] = {
    "llama": (llama.LlamaConfig, llama.Llama),
    "mixtral": (moe.MixtralConfig, moe.Mixtral),
}


def from_pretrained(folder: str | Path, data: int = 1, tensor: int = 1, pipeline: int = 1,
                    device: str = "cpu", expert_axis: int | None = None, expert: int = 1) -> llama.Llama:
    """Builds the model ``folder/config.json`` describes (Llama or Mixtral) and loads its safetensors weights.

    With ``data``, ``tensor`` or ``pipeline`` above 1 the model is parallelized first (built
    with no data under :func:`sbpflow.meta_init`), and each process then reads
    only the slices its ranks hold; ``model.strategy.shard_inputs`` lays out inputs. ``expert_axis``
    (Mixtral) splits the experts over that axis of the (data, tensor) mesh (:func:`moe.split_experts`) before
    the weights are read, so each process reads only its experts; ``expert`` is :func:`sbpflow.parallelize`'s
    (``expert=data`` stacks the experts over the data axis, before the weights are read too).
    """
    config = hf.read_config(folder)
    kind = config.get("model_type")
    if kind not in MODELS:
        raise SbpflowError(f"from_pretrained supports model_type {' and '.join(map(repr, MODELS))}, but "
                           f"{Path(folder) / 'config.json'} has {kind!r}")
    config_cls, model_cls = MODELS[kind]
    cfg = config_cls.from_dict(config)
    parallel = data > 1 or tensor > 1 or pipeline > 1 or expert > 1
    with sbpflow.meta_init(parallel):
        model = model_cls(cfg)
    if parallel:
        llama.parallelize(model, data=data, tensor=tensor, pipeline=pipeline, device=device, expert=expert)
    if expert_axis is not None:
        if not isinstance(model, moe.Mixtral) or not parallel:
            raise SbpflowError(f"from_pretrained(expert_axis={expert_axis}) splits the experts of a parallel "
                               f"Mixtral, but {folder} is a {kind!r} model on data={data}, tensor={tensor}")
        moe.split_experts(model, expert_axis)
    hf.load_weights(model, folder, skip=["lm_head.weight"] if cfg.tie_word_embeddings else [])
    return model


__all__ = ["MODELS", "from_pretrained"]
