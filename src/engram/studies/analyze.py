"""`engram analyze RUN_DIR [--baseline RUN_DIR] [--pathway RUN_DIR]`: what the memory does (paper
section 6).

- Effective depth: LogitLens KL per layer for both models, linear CKA of Engram's layers against
  the baseline's (``lens``).
- Suppression: the model with the Engram output zeroed, and with the gate forced to 0 or 1, on
  held-out text split into token kinds, and on two probe sets (``probes``): retention = suppressed
  score / full score, the paper's table 6 measure. The score is the mean probability of the right
  token (and top-1 accuracy on the probes).
- Gates: mean gate per token kind, per language; the tokens and bigrams with the highest and
  lowest mean gate; an example figure (``analysis_report``).
- Where the gain lands: the per-token loss difference to the dense baseline and to the capacity-1
  control (``--pathway``), bucketed by how often each token's n-gram was trained on (``buckets``).

Shape legend:
    b batch, t positions, n tokens, m residual branches, V model vocabulary.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..artifacts.run import CONFIG
from ..errors import UserError
from ..files import publish_text
from ..ranges import AT_LEAST_1, NON_NEGATIVE, check_ranges
from ..models.surgery import engram_zeroed, forced_gate
from ..training.batches import val_batches
from .buckets import check_pair, run_buckets
from .lens import cka_matrix, read_layers
from .probes import KINDS, NgramCounts, copy_probes, memorised_probes, token_kinds

CONDITIONS = ("full", "zeroed", "gate0", "gate1")
LANGS = ("en", "zh")


@dataclass
class AnalyzeConfig:
    out_dir: str | None = None  # analysis.json, PNGs, report.md; None: RUN_DIR/analysis
    batches: int = 16  # held-out batches (spread over the validation stream) for suppression, gates
    lens_batches: int = 4  # of those, how many LogitLens reads (a full-vocabulary softmax per layer)
    cka_tokens: int = 4096  # tokens whose states CKA compares
    probes: int = 256  # probes per probe set
    context: int = 32  # real context tokens before a memorised 4-gram
    copy_span: int = 16  # length of the span repeated in a copy probe
    min_count: int = 20  # training occurrences that make a trigram / 4-gram a fixed phrase
    seed: int = 0  # probe sampling

    def __post_init__(self) -> None:
        check_ranges(self, batches=AT_LEAST_1, lens_batches=AT_LEAST_1, cka_tokens=AT_LEAST_1,
                     probes=AT_LEAST_1, context=AT_LEAST_1, copy_span=AT_LEAST_1,
                     min_count=AT_LEAST_1, seed=NON_NEGATIVE)


def condition(model, name: str):
    if name == "zeroed":
        return engram_zeroed(model)
    if name in ("gate0", "gate1"):
        return forced_gate(model, float(name[-1]))
    return nullcontext()


def token_lang(tokenizer, vocab: np.ndarray) -> np.ndarray:
    """Per local id: 0 = English (Latin letters), 1 = Chinese (CJK), 2 = neither."""
    out = np.full(len(vocab), 2, dtype=np.int8)
    for i, r in enumerate(vocab.tolist()):
        s = tokenizer.decode([r])
        if any("\u4e00" <= c <= "\u9fff" or "\u3400" <= c <= "\u4dbf" for c in s):
            out[i] = 1
        elif any(c.isascii() and c.isalpha() for c in s):
            out[i] = 0
    return out


@torch.no_grad()
def score_windows(rt, windows: np.ndarray, scored: slice,
                  conds: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Probe windows [b, t+1] (local ids) through the runtime ``rt``: mean p(target) and top-1
    accuracy on ``scored`` target positions, per condition."""
    model = rt.model
    y = torch.from_numpy(windows[:, 1:])[:, scored]  # [b, s]
    raw = torch.from_numpy(rt.vocab[windows[:, :-1]].astype(np.int64))
    out = {}
    for c in conds:
        with condition(model, c):
            o = rt.forward(raw, warn=False)
        lp = model.logits(o.hidden[:, scored]).float()  # [b, s, V]; log-probs either way
        lp = lp.log_softmax(-1)
        p = lp.gather(-1, y.unsqueeze(-1)).squeeze(-1).exp()
        out[c] = {"p": float(p.mean()), "acc": float((lp.argmax(-1) == y).float().mean()),
                  "nll": float(-p.log().mean())}
    return out


@torch.no_grad()
def held_out(rt, batches: list, conds: tuple[str, ...]) -> dict[str, Any]:
    """Per condition: per-token nll [n] over the batches (targets in stream order) through the
    runtime ``rt``, and the gates [n] (mean over branches, first Engram layer) of the full model."""
    model = rt.model
    res: dict[str, Any] = {c: [] for c in conds}
    gates = []
    for b in batches:
        for c in conds:
            with condition(model, c):
                o = rt.forward(b.raw, warn=False, gates=(c == "full" and rt.hasher is not None))
            res[c].append(model.token_nll(o, b.targets).flatten().numpy())
            if c == "full" and o.gates:
                gates.append(o.gates[min(o.gates)].mean(-1).flatten().numpy())
    out = {c: np.concatenate(v) for c, v in res.items()}
    out["gates"] = np.concatenate(gates) if gates else None
    return out


def summarise_kinds(nll: dict[str, np.ndarray], kind: np.ndarray, lang: np.ndarray,
                    conds: tuple[str, ...]) -> dict[str, Any]:
    """{lang or "all": {kind or "all": {condition: {p, nll}, "n": count}}}."""
    out: dict[str, Any] = {}
    for li, lname in [(None, "all"), *enumerate(LANGS)]:
        out[lname] = {}
        for ki, kname in [(None, "all"), *enumerate(KINDS)]:
            m = np.ones_like(kind, dtype=bool)
            if li is not None:
                m &= lang == li
            if ki is not None:
                m &= kind == ki
            row: dict[str, Any] = {"n": int(m.sum())}
            for c in conds:
                v = nll[c][m]
                row[c] = {"p": float(np.exp(-v).mean()) if len(v) else None,
                          "nll": float(v.mean()) if len(v) else None}
            out[lname][kname] = row
    return out


def gate_table(gates: np.ndarray, inputs: np.ndarray, prev: np.ndarray, lang: np.ndarray,
               tokenizer, vocab: np.ndarray, k: int = 12, min_tok: int = 20,
               min_bigram: int = 8) -> dict[str, Any]:
    """Per language: tokens and bigrams (ending at the gated position) by mean gate."""
    def text(ids):
        return "".join(tokenizer.decode([int(vocab[i])]) for i in ids)

    out = {}
    for li, lname in enumerate(LANGS):
        m = lang == li
        res = {"mean_gate": float(gates[m].mean()) if m.any() else None, "positions": int(m.sum())}
        for name, keys, min_n in (("tokens", inputs[m], min_tok),
                                  ("bigrams", prev[m] * len(vocab) + inputs[m], min_bigram)):
            uk, inv, cnt = np.unique(keys, return_inverse=True, return_counts=True)
            mean = np.bincount(inv, weights=gates[m]) / cnt
            ok = np.flatnonzero(cnt >= min_n)
            order = ok[np.argsort(-mean[ok])]
            rows = [{"text": text([u] if name == "tokens" else [u // len(vocab), u % len(vocab)]),
                     "mean_gate": float(mean[j]), "count": int(cnt[j])}
                    for j in (*order[:k], *order[::-1][:k])
                    for u in [int(uk[j])]]
            res[f"top_{name}"], res[f"bottom_{name}"] = rows[:k], rows[len(order[:k]):]
        out[lname] = res
    return out


def run_analyze(run_dir: str, baseline: str | None, ac: AnalyzeConfig,
                progress: bool = True, pathway: str | None = None) -> dict[str, Any]:
    """Analyse the Engram run ``run_dir``; ``baseline``: the dense run of its seed; ``pathway``:
    its capacity-1 control (compare's pathway arm), for where the gain lands."""
    from tqdm.auto import tqdm

    from ..serving.loader import open_model
    from ..training.corpus import build_corpus
    from ..training.train import TrainConfig
    from .analysis_report import write_analysis

    out = Path(ac.out_dir) if ac.out_dir else Path(run_dir) / "analysis"
    served = open_model(run_dir)
    model, hasher, vocab, tok = served.model, served.hasher, served.vocab, served.tokenizer
    if not model.config.engram_layers:
        raise UserError(f"{run_dir} has no Engram layers: analyze the Engram run, and pass the "
                         "dense one as --baseline")
    n = model.config.max_seq_len  # the probes' windows must fit the context, before any work
    if ac.context + 4 > n or 2 * ac.copy_span > n:
        raise UserError(f"the probes need {ac.context + 4} (--context={ac.context} + a 4-gram) "
                        f"and {2 * ac.copy_span} (2 x --copy_span={ac.copy_span}) positions; the "
                        f"model has max_seq_len={n}")
    saved = json.loads((Path(run_dir) / CONFIG).read_text())
    for flag, other in (("--baseline", baseline), ("--pathway", pathway)):
        if other:  # compared token by token: the same data, seed and training windows
            check_pair(run_dir, saved, other, flag)
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig.from_record(saved, Path(run_dir) / CONFIG)
    corpus = build_corpus(cfg.data_config(), tok)
    base = open_model(baseline) if baseline else None
    if base is not None and not np.array_equal(base.vocab, vocab):
        raise UserError(f"{baseline} was trained on another vocabulary than {run_dir}")
    steps = tqdm(total=8, desc="analyze", disable=not progress)
    # Unhashed: every forward goes through the runtime, which hashes the raw ids itself.
    batches = list(val_batches(corpus.val, cfg.batch_size, cfg.seq_len, corpus,
                               max_batches=ac.batches))
    # -- effective depth
    # Evenly spaced batches: the stream is English, then Chinese; both should be read.
    lens_b = batches[::max(1, len(batches) // max(1, ac.lens_batches))][:ac.lens_batches]
    lens = read_layers(served, lens_b, ac.cka_tokens)
    res: dict[str, Any] = {"run": str(run_dir), "baseline": baseline, "pathway": pathway,
                           "checkpoint": served.checkpoint,
                           "engram_layers": model.config.engram_layers,
                           "lens": {"engram": lens["kl"]}}
    steps.update()
    if base is not None:
        blens = read_layers(base, lens_b, ac.cka_tokens)
        res["lens"]["baseline"] = blens["kl"]
        res["cka"] = cka_matrix(lens["states"], blens["states"])
    steps.update()
    # -- token kinds and languages from the corpus itself
    ng = NgramCounts.build(corpus.to_local(corpus.train), len(vocab))
    lang_of = token_lang(tok, vocab)
    kind = np.concatenate([token_kinds(np.concatenate([b.inputs[i, :1].numpy(),
                                                       b.targets[i].numpy()]), ng, ac.min_count)
                           for b in batches for i in range(len(b.inputs))])
    tgt = np.concatenate([b.targets.flatten().numpy() for b in batches])
    inp = np.concatenate([b.inputs.flatten().numpy() for b in batches])
    prev = np.concatenate([np.concatenate([np.full((len(b.inputs), 1), -1), b.inputs[:, :-1].numpy()],
                                          axis=1).flatten() for b in batches]).clip(0)
    # Language of a position: its window's majority script, so punctuation goes with its text.
    win_lang = [np.where((lang_of[w] == 1).sum() > (lang_of[w] == 0).sum(), 1, 0)
                for b in batches for w in b.inputs.numpy()]
    lang = np.repeat(np.asarray(win_lang), cfg.seq_len)[:len(tgt)]
    steps.update()
    # -- suppression on held-out text
    ho = held_out(served, batches, CONDITIONS)
    res["kinds"] = summarise_kinds(ho, kind, lang, CONDITIONS)
    if base is not None:
        bho = held_out(base, batches, ("full",))
        res["kinds_baseline"] = summarise_kinds(bho, kind, lang, ("full",))
    steps.update()
    # -- where the gain lands
    nll = {"engram": ho["full"], **({"dense": bho["full"]} if base is not None else {})}
    if pathway:
        pw = open_model(pathway)
        nll["pathway"] = held_out(pw, batches, ("full",))["full"]
    res["buckets"] = run_buckets(cfg, corpus, hasher, run_dir, batches, nll)
    steps.update()
    # -- probe sets
    val_local = corpus.to_local(corpus.val)
    mem = memorised_probes(val_local, ng, ac.context, ac.probes, ac.min_count, seed=ac.seed)
    cp = copy_probes(ng.unigram, ac.copy_span, ac.probes, seed=ac.seed)
    mem_sl, cp_sl = slice(-2, None), slice(ac.copy_span, 2 * ac.copy_span - 1)
    res["probes"] = {"memorised": {"n": len(mem), **score_windows(served, mem, mem_sl,
                                                                  CONDITIONS)},
                     "copy": {"n": len(cp), **score_windows(served, cp, cp_sl, CONDITIONS)}}
    if base is not None:
        for name, w, sl in (("memorised", mem, mem_sl), ("copy", cp, cp_sl)):
            res["probes"][name]["baseline"] = score_windows(base, w, sl, ("full",))["full"]
    res["probe_examples"] = {"memorised": [tok.decode([int(vocab[i]) for i in w[-8:]])
                                           for w in mem[:8]]}
    steps.update()
    # -- gates
    gates = ho["gates"]
    res["gates"] = {"by_kind": {ln: {k: float(gates[(lang == li) & (kind == ki)].mean())
                                     if ((lang == li) & (kind == ki)).any() else None
                                     for ki, k in enumerate(KINDS)}
                                for li, ln in enumerate(LANGS)},
                    **gate_table(gates, inp, prev, lang, tok, vocab)}
    steps.update()
    res["retention"] = retention(res)
    write_analysis(res, out, vocab, tok, batches, ho, lang)
    steps.update()
    steps.close()
    publish_text(out / "analysis.json", json.dumps(res, indent=2))
    return res


def retention(res: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Suppressed score / full score per row of the paper-style table (score: mean p(target);
    top-1 accuracy for the probes)."""
    rows = {f"held-out {k} ({ln})": res["kinds"][ln][k] for ln in ("all", *LANGS)
            for k in ("all", *KINDS)}
    out = {}
    for name, r in rows.items():
        out[name] = {c: (r[c]["p"] / r["full"]["p"] if r["full"]["p"] else None)
                     for c in CONDITIONS[1:]}
    for name in ("memorised", "copy"):
        for metric in ("acc", "p"):
            r = res["probes"][name]
            out[f"probe {name} ({metric})"] = {c: (r[c][metric] / r["full"][metric]
                                                   if r["full"][metric] else None)
                                               for c in CONDITIONS[1:]}
    return out
