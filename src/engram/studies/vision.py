"""`engram study-vision`: bind a trigger word to a concept from 5 images, with the text-to-image
model frozen, and measure binding, compositionality and forgetting per method (issue 11; Tiny-Engram,
arXiv 2605.20309, published image grids only).

Methods, each trained on the same shots, steps, learning rate and seeds (only its own parameters):
- ``trigger-plain``: the paper's table (one vector per trigger n-gram key, per-dimension scale) on
  MiniLM's last_hidden_state;
- ``trigger-engram``: the Engram table (context gate from the hidden state, short conv over the span);
- ``lora-text``: LoRA on MiniLM's query/value; ``lora-unet``: LoRA on the UNet's cross-attention key
  and value (peft);
- ``textual-inversion``: one learned input embedding that replaces the trigger's tokens.

Two concepts: a digit the base model was trained on (it only lacks the word), and a digit held out of
base training (can a text-side change reach an image the UNet never learned?).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UserError
from ..files import publish, publish_text
from ..ranges import AT_LEAST_1, NON_NEGATIVE, POSITIVE, check_ranges
from ..models.encoder import eject_triggers, inject_triggers
from ..models.trigger import TriggerMatcher, trigger_ids
from ..training.concept import fit_concept
from . import digits as D

METHODS = ("trigger-plain", "trigger-engram", "lora-text", "lora-unet", "textual-inversion")


@dataclass
class VisionConfig:
    out_dir: str = "out/vision"  # vision.json, report.md, grids, the base model
    trigger: str = "Zorblax"
    concept: int = 3  # digit bound to the trigger in the main experiment (the base model knows it)
    unseen: int = 9  # digit held out of base training, bound in a second experiment; -1 skips it
    shots: int = 5  # concept images per binding run (DreamBooth-style)
    bold_kernel: int = 2  # "bold" style: grey dilation by a square of this side (pixels)
    width: int = 16  # UNet channels of the first level (second level is twice this)
    base_steps: int = 1200  # base model training steps
    base_batch: int = 48  # images per base model step
    bind_steps: int = 200  # steps of every binding run
    bind_batch: int = 10  # images per binding step (the shots, repeated with fresh noise)
    lr: float = 5e-3  # one learning rate for every method's own parameters (AdamW)
    methods: tuple[str, ...] = field(default=METHODS, metadata={"choices": METHODS})
    seeds: int = 3  # binding runs per method and concept (different shots and noise)
    samples: int = 40  # images per trigger prompt per run
    control_seeds: int = 3  # images per control prompt ("a [bold] handwritten <digit>")
    ddim_steps: int = 15
    guidance: float = 2.0  # classifier-free guidance scale
    d_mem: int = 8  # trigger-engram: memory width per key
    lora_text_rank: int = 1
    lora_unet_rank: int = 2
    threads: int = 1
    small: bool = False  # smoke mode for tests: a few steps and samples, same code path

    def __post_init__(self) -> None:
        self.methods = tuple(self.methods)
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise UserError(f"unknown methods {bad} (known: {', '.join(METHODS)})")
        if self.bold_kernel < 2:
            raise UserError(f"bold_kernel must be at least 2, got {self.bold_kernel}")
        if not 0 <= self.concept <= 9 or self.unseen > 9 or self.concept == self.unseen:
            raise UserError("concept must be a digit 0-9, unseen another digit or -1")
        check_ranges(self, shots=AT_LEAST_1, width=AT_LEAST_1, base_steps=AT_LEAST_1,
                     base_batch=AT_LEAST_1, bind_steps=AT_LEAST_1, bind_batch=AT_LEAST_1,
                     lr=POSITIVE, seeds=AT_LEAST_1, samples=AT_LEAST_1, control_seeds=AT_LEAST_1,
                     ddim_steps=AT_LEAST_1, guidance=NON_NEGATIVE, d_mem=AT_LEAST_1,
                     lora_text_rank=AT_LEAST_1, lora_unet_rank=AT_LEAST_1, threads=AT_LEAST_1)
        if self.small:
            self.base_steps, self.bind_steps, self.samples = 4, 3, 4
            self.control_seeds, self.seeds, self.ddim_steps, self.base_batch = 1, 1, 2, 8


# -- methods -------------------------------------------------------------------------------------

def _lora(model: torch.nn.Module, rank: int, targets: list[str]) -> tuple[Any, list]:
    from peft import LoraConfig, inject_adapter_in_model

    model = copy.deepcopy(model)
    model.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets)
    model = inject_adapter_in_model(cfg, model)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    return model, params


def setup(method: str, cfg: VisionConfig, tok: Any, minilm: Any, unet: Any):
    """-> (encode, unet, trainable parameters, undo)."""
    if method.startswith("trigger-"):
        rt = inject_triggers(minilm, tok, [cfg.trigger], kind=method.split("-")[1],
                             d_mem=cfg.d_mem, site="last")
        return D.text_encoder(tok, minilm), unet, rt.parameters(), lambda: eject_triggers(minilm)
    if method == "lora-text":
        enc, params = _lora(minilm, cfg.lora_text_rank, ["query", "value"])
        return D.text_encoder(tok, enc), unet, params, lambda: None
    if method == "lora-unet":
        u, params = _lora(unet, cfg.lora_unet_rank, ["attn2.to_k", "attn2.to_v"])
        return D.text_encoder(tok, minilm), u, params, lambda: None
    # Textual inversion: the trigger's tokens read one learned embedding (init: their mean).
    emb = minilm.embeddings.word_embeddings
    ids = trigger_ids(tok, cfg.trigger)
    vec = torch.nn.Parameter(emb.weight[ids].detach().mean(0).clone())
    matcher = TriggerMatcher([tuple(ids)])

    def hook(module, args, out):
        at = matcher(args[0]).any(-1)  # [b, t]
        return torch.where(at[..., None], vec.to(out.dtype), out) if bool(at.any()) else out
    handle = emb.register_forward_hook(hook)
    return D.text_encoder(tok, minilm), unet, [vec], handle.remove


def bind(method: str, cfg: VisionConfig, tok, minilm, unet, shots: torch.Tensor, seed: int):
    encode, u, params, undo = setup(method, cfg, tok, minilm, unet)
    sched, _ = D.schedulers()
    gen = torch.Generator().manual_seed(seed)
    prompt = D.STYLES["plain"].format(cfg.trigger)
    u.eval()  # no dropout or norm statistics to move: only the method's parameters learn

    def loss(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(shots), (cfg.bind_batch,), generator=gen)
        h, m = encode([prompt])
        return D.diffusion_loss(u, sched, shots[idx], h.expand(cfg.bind_batch, -1, -1),
                                m.expand(cfg.bind_batch, -1), gen)
    t0 = time.perf_counter()
    curve = fit_concept(params, loss, cfg.bind_steps, lr=cfg.lr, desc=method)
    return encode, u, undo, {"params": sum(p.numel() for p in params), "train_s":
                             time.perf_counter() - t0, "loss_first": float(np.mean(curve[:10])),
                             "loss_last": float(np.mean(curve[-10:]))}


# -- evaluation ----------------------------------------------------------------------------------

def prompts_for(cfg: VisionConfig, known: list[int]) -> dict[str, tuple[list[str], list[int]]]:
    n, k = cfg.samples, cfg.control_seeds
    ctrl = [(D.STYLES[s].format(D.WORDS[c]), i) for s in D.STYLES for c in known for i in range(k)]
    return {"trigger": ([D.STYLES["plain"].format(cfg.trigger)] * n, list(range(1000, 1000 + n))),
            "bold": ([D.STYLES["bold"].format(cfg.trigger)] * n, list(range(2000, 2000 + n))),
            "control": ([p for p, _ in ctrl], [5000 + i for _, i in ctrl])}


def evaluate(cfg, judge, unet, encode, prompts, concept: int, base_ctrl=None) -> tuple[dict, dict]:
    imgs = {k: D.sample(unet, encode, p, s, cfg.ddim_steps, cfg.guidance)
            for k, (p, s) in prompts.items()}
    dt, _ = judge(imgs["trigger"])
    db, bb = judge(imgs["bold"])
    out = {"binding": float((dt == concept).mean()), "bold_is_concept": float((db == concept).mean()),
           "bold_is_bold": float(bb.mean()), "compositional": float(((db == concept) & bb).mean()),
           "trigger_digits": np.bincount(dt, minlength=10).tolist()}
    if "control" not in imgs:
        return out, imgs
    dc, bc = judge(imgs["control"])
    ctrl_p = prompts["control"][0]
    want = np.array([D.WORDS.index(p.split()[-1]) for p in ctrl_p])
    want_bold = np.array([" bold " in p for p in ctrl_p])
    out.update({"control_digit_acc": float((dc == want).mean()),
                "control_style_acc": float((bc == want_bold).mean())})
    if base_ctrl is not None:
        diff = (imgs["control"] - base_ctrl).abs()
        out.update({"control_pixel_change_mean": float(diff.mean()),
                    "control_pixel_change_max": float(diff.max()),
                    "control_images_changed": float((diff.flatten(1).amax(1) > 0).float().mean())})
    return out, imgs


def _summary(runs: list[dict]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, float)]
    return {k: {"mean": float(np.mean([r[k] for r in runs])), "min": float(min(r[k] for r in runs)),
                "max": float(max(r[k] for r in runs))} for k in keys} | {"params": runs[0]["params"]}


def _base_model(cfg: VisionConfig, tok, minilm, train: D.Digits, out: Path):
    """Train the base model, or reuse the one a previous run of the same settings saved."""
    from safetensors.torch import load_file, save_file

    # "-warm": trained on loop.schedule (warmup, then cosine); a file saved before that (warmup
    # times a cosine over all steps) is another model and is not reused.
    key = (f"w{cfg.width}-s{cfg.base_steps}-b{cfg.base_batch}-u{cfg.unseen}-k{cfg.bold_kernel}"
           f"-warm{D.BASE_WARMUP}")
    path = out / f"base_unet_{key}.safetensors"
    unet = D.build_unet(cfg.width)
    if path.is_file() and not cfg.small:
        unet.load_state_dict(load_file(str(path)))
        base = json.loads(path.with_suffix(".json").read_text())
    else:
        t0 = time.perf_counter()
        curve = D.train_base(unet, D.text_encoder(tok, minilm), train, cfg.base_steps,
                             cfg.base_batch, bold=cfg.bold_kernel)
        base = {"train_s": time.perf_counter() - t0, "loss_first": float(np.mean(curve[:20])),
                "loss_last": float(np.mean(curve[-20:])),
                "params": sum(p.numel() for p in unet.parameters()), "curve": curve[::10]}
        state = {k: v.contiguous() for k, v in unet.state_dict().items()}
        publish(path, lambda p: save_file(state, p))
        publish_text(path.with_suffix(".json"), json.dumps(base))
    unet.eval().requires_grad_(False)
    return unet, base


def run_vision(cfg: VisionConfig) -> dict[str, Any]:
    from .vision_report import save_grid, write_report

    t_start = time.perf_counter()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base_data, judge_data = D.load_digits()
    judge = D.Judge(judge_data, bold=cfg.bold_kernel)
    tok, minilm = D.load_minilm()
    keep = base_data.labels != cfg.unseen
    train = D.Digits(base_data.images[keep], base_data.labels[keep])
    known = sorted(set(train.labels.tolist()))
    unet, base = _base_model(cfg, tok, minilm, train, out)
    # The judge is scored on the base split: real digits it never saw in training.
    # cfg.threads is set by the entry point (`engram study-vision`); the count in force is recorded.
    result: dict[str, Any] = {"config": asdict(cfg), "torch_threads": torch.get_num_threads(),
                              "judge_accuracy": judge.accuracy(base_data),
                              "base": base, "concepts": {}}
    base_enc = D.text_encoder(tok, minilm)
    concepts = [("seen", cfg.concept)] + ([("unseen", cfg.unseen)] if cfg.unseen >= 0 else [])
    for name, concept in concepts:
        prompts = prompts_for(cfg, known)
        base_eval, base_imgs = evaluate(cfg, judge, unet, base_enc, prompts, concept)
        # What the base model does with the concept's real word: the ceiling a text-side
        # change can hope for (zero for the unseen digit by construction of the base model).
        word = {"trigger": ([D.STYLES["plain"].format(D.WORDS[concept])] * cfg.samples,
                            prompts["trigger"][1]),
                "bold": ([D.STYLES["bold"].format(D.WORDS[concept])] * cfg.samples,
                         prompts["bold"][1])}
        word_eval, _ = evaluate(cfg, judge, unet, base_enc, word, concept)
        grids = {"base": base_imgs}
        entry = {"digit": concept, "base_with_trigger": base_eval, "base_with_word": word_eval,
                 "methods": {}}
        pool = torch.nonzero(train.labels == concept).flatten() if name == "seen" else \
            torch.nonzero(judge_data.labels == concept).flatten()  # unseen: no base image of it
        for method in cfg.methods:
            runs = []
            for seed in range(cfg.seeds):
                g = torch.Generator().manual_seed(100 + seed)
                shots_idx = pool[torch.randperm(len(pool), generator=g)[:cfg.shots]]
                src = train if name == "seen" else judge_data
                enc, u, undo, stats = bind(method, cfg, tok, minilm, unet, src.images[shots_idx],
                                           seed)
                try:
                    ev, imgs = evaluate(cfg, judge, u, enc, prompts, concept, base_imgs["control"])
                finally:
                    undo()
                runs.append({**stats, **ev, "seed": seed})
                if seed == 0:
                    grids[method] = imgs
            entry["methods"][method] = {"runs": runs, "summary": _summary(runs)}
        entry["grid"] = save_grid(grids, out / f"grid_{name}.png", cfg, concept)
        result["concepts"][name] = entry
    result["total_s"] = time.perf_counter() - t_start
    publish_text(out / "vision.json", json.dumps(result, indent=1))
    write_report(result, out / "report.md")
    return result


__all__ = ["METHODS", "VisionConfig", "run_vision"]
