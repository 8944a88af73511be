"""Trigger tables in a diffusers text-to-image pipeline, and the pipeline's own training loss.

``inject_pipeline(pipe, ["Zorblax"])`` puts tables on every text encoder the pipeline has
(``text_encoder``, ``text_encoder_2``, ``text_encoder_3``), each matched with its own tokenizer, so
``pipe(prompt)`` uses them with no other change. Sites follow the paper: SD1.5's CLIP reads
``last_hidden_state``; SD3's CLIP encoders are read at ``hidden_states[-2]`` (their pooled output is
left alone) and its T5 at ``last_hidden_state``. UNet / transformer, VAE and encoders stay frozen.

``denoise_loss`` is the DreamBooth objective with the pipeline's own pieces: encode the prompts
through ``pipe.encode_prompt`` (so training sees exactly the conditioning ``pipe()`` will), noise the
VAE latents at random timesteps of the pipeline's scheduler and regress its prediction target.

Shape legend: b batch, C image channels, h w image size, c l latent channels and side.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .encoder import TriggerRuntime, eject_triggers, inject_triggers
from .trigger import TriggerOptions

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def default_site(pipe: Any, name: str) -> str:
    sd3 = "StableDiffusion3" in type(pipe).__name__
    return "hidden:-2" if sd3 and name != "text_encoder_3" else "last"


def inject_pipeline(pipe: Any, triggers: Sequence[str], options: TriggerOptions | None = None,
                    sites: dict[str, str] | None = None) -> dict[str, TriggerRuntime]:
    """Tables on each text encoder of ``pipe``; returns {encoder attribute: runtime}."""
    opts = options or TriggerOptions()
    out = {}
    for name in ENCODERS:
        enc = getattr(pipe, name, None)
        if enc is None:
            continue
        tok = getattr(pipe, name.replace("text_encoder", "tokenizer"))
        site = (sites or {}).get(name, default_site(pipe, name))
        out[name] = inject_triggers(enc, tok, triggers, replace(opts, site=site))
    if not out:
        raise ValueError(f"{type(pipe).__name__} has no text encoder to put trigger tables on")
    for name in ("unet", "transformer", "vae"):
        if getattr(pipe, name, None) is not None:
            getattr(pipe, name).requires_grad_(False)
    return out


def eject_pipeline(pipe: Any) -> None:
    for name in ENCODERS:
        enc = getattr(pipe, name, None)
        if enc is not None and enc.__dict__.get("trigger_runtime") is not None:
            eject_triggers(enc)


def pipeline_parameters(runtimes: dict[str, TriggerRuntime]) -> list[nn.Parameter]:
    return [p for rt in runtimes.values() for p in rt.parameters()]


def denoise_loss(pipe: Any, images: torch.Tensor, prompts: Sequence[str],
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Noise-prediction loss of an SD-style pipeline on ``images`` [b, C, h, w] in [-1, 1]."""
    if images.dim() != 4 or len(prompts) != images.shape[0]:
        raise ValueError(f"need images [b, C, h, w] and one prompt per image, got "
                         f"{tuple(images.shape)} and {len(prompts)} prompts")
    device = images.device
    embeds = pipe.encode_prompt(list(prompts), device, 1, False)[0]  # [b, t, d]
    with torch.no_grad():
        latents = pipe.vae.encode(images.to(pipe.vae.dtype)).latent_dist.sample(generator)
        latents = latents * pipe.vae.config.scaling_factor  # [b, c, l, l]
    sched = pipe.scheduler
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(device)
    t = torch.randint(0, sched.config.num_train_timesteps, (latents.shape[0],),
                      generator=generator).to(device)
    noisy = sched.add_noise(latents, noise, t)
    pred = pipe.unet(noisy, t, encoder_hidden_states=embeds).sample
    kind = sched.config.get("prediction_type", "epsilon")
    target = noise if kind == "epsilon" else sched.get_velocity(latents, noise, t)
    return F.mse_loss(pred.float(), target.float())


__all__ = ["ENCODERS", "default_site", "denoise_loss", "eject_pipeline", "inject_pipeline",
           "pipeline_parameters"]
