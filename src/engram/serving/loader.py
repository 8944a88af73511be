"""Opening a trained model: a run folder, an ``engram export-hf`` folder, or a run with a V4.1 layer
set, as one ``Runtime`` (see there). Opening reads only the folder and
writes nothing; the table files a run's file tiers read are written by ``write_tables``
(``engram export-tables``), and an export by ``export_hf``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..artifacts.run import FOLDER as RUN_FILES
from ..artifacts.run import TABLES
from ..artifacts.run import load_dense_state
from ..artifacts.table_files import stale_tables
from ..errors import UserError
from ..models.precision import check_names, resolve
from ..models.vocab import VocabMap
from ..tables.registry import open_tier
from .runtime import Runtime


def open_model(path: str | Path, *, tier: str = "memory", table_dir: str | Path | None = None,
               table_dtype: str | None = None, cache_fraction: float = 0.0,
               prefetch: bool = False, verify: bool = True, device: str | None = None,
               precision: str = "fp32", engram_layers: str | Path | None = None,
               **options: Any) -> Runtime:
    """A run folder (its newest checkpoint), an ``engram export-hf`` folder, or a run with a V4.1
    layer set (``engram_layers``), ready to serve, with tables on ``tier`` (``TIERS``); any other
    option of the tier in ``options`` (e.g. ``pool_path``). Opening reads only the folder and
    writes nothing: a run's table files for a file tier come from ``write_tables``."""
    from ..artifacts import kind_of
    from ..artifacts.export import check_serving
    from .hf_export import open_export

    check_names(device or "cpu", precision)
    check_serving({"tier": tier, "cache_fraction": cache_fraction})  # the export's own check
    if tier == "memory" and (cache_fraction > 0 or prefetch):
        raise UserError("--cache_fraction and --prefetch put a cache or background reads in "
                        "front of table files: on the memory tier they would do nothing (choose "
                        "a tier such as file, or leave them out)")
    if device is not None:
        resolve(device, precision)  # this machine can run it: before loading
    path = Path(path)
    kind = kind_of(path)
    if kind == "adapter":  # `engram finetune`'s folder: a transformers model + its Engram
        if engram_layers is not None:
            raise UserError(f"{path} is a finetuned adapter: --engram_layers applies to a run "
                            "folder")
        rt = open_adapter(path, tier=tier, table_dir=table_dir, table_dtype=table_dtype,
                          cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                          **options)
    elif kind == "export":
        if engram_layers is not None:
            raise UserError(f"{path} is an export: --engram_layers applies to a run folder")
        rt = open_export(path, {"tier": tier, "cache_fraction": cache_fraction,
                                "prefetch": prefetch, "verify": verify}, **options)
    else:
        rt = _open_run(path, tier=tier, table_dir=table_dir, table_dtype=table_dtype,
                       cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                       engram_layers=engram_layers, **options)
    rt.precision = precision
    if device is not None:
        rt.to(device)
    return rt


def open_adapter(path: Path, *, tier: str = "memory", table_dir: str | Path | None = None,
                 table_dtype: str | None = None, cache_fraction: float = 0.0,
                 prefetch: bool = False, verify: bool = True, **options: Any) -> Runtime:
    """``engram finetune``'s adapter folder: a ``Runtime`` over the base transformers model it
    names (models/pretrained.py) with its Engram loaded (models/adapter.py refuses another base
    model), as models/injected.py's InjectedLM. On a tier other than memory its tables are the
    table files ``engram export-tables ADAPTER`` wrote (``table_dir``, default ADAPTER/tables),
    injected as they are, as a run's are: the adapter's own copy is hashed a slice at a time (its
    digest) and never held, so its tables need not fit in memory."""
    import torch

    from ..artifacts.adapter import TABLES, load_base, read
    from ..models.hf import engram_runtime
    from ..models.injected import InjectedLM

    if cache_fraction > 0:
        raise UserError(f"{path} is a finetuned adapter: it has no row counts on its training "
                        "text for a hot cache (leave --cache_fraction out)")
    files = read(path, tables=tier == "memory")
    tables: dict[int, Any] = {}
    if tier != "memory":
        hasher = files.hasher()
        folder = Path(table_dir) if table_dir is not None else path / TABLES
        stale = stale_tables(folder, hasher, files.tag, table_dtype)
        if stale:
            raise UserError(f"{folder} holds no current table files of the adapter {path} "
                            f"({stale}); write them with `engram export-tables {path}`")
        tables = open_tier(tier, folder, hasher.config, hasher, prefetch=prefetch,
                           verify=verify, **options)
    lm = InjectedLM(load_base(files, tables=tables or None)).eval()
    v = lm.config.vocab_size
    return Runtime(lm, engram_runtime(lm.hf).hasher, VocabMap(torch.arange(v), v),
                   files.tokenizer, files.eos_id, path, files.tag, tier, tables,
                   tokenizer_file=files.tokenizer_file)


def _open_run(run_dir: Path, *, tier: str, table_dir: str | Path | None, table_dtype: str | None,
              cache_fraction: float, prefetch: bool, verify: bool,
              engram_layers: str | Path | None, **options: Any) -> Runtime:
    from ..models.nine_model import build_lm
    from ..artifacts.run import check_copies, read_run_files
    from ..tables.hotcold import check_index_files
    from ..artifacts.checkpoint import saved_meta, served_checkpoint

    state, ckpt, shards = served_checkpoint(run_dir)  # a torchrun run's: its shard files too
    files = read_run_files(run_dir)
    check_copies(run_dir, files, ckpt, saved_meta(ckpt))  # its copies of the config agree
    tok = files.tokenizer()
    hasher = files.hasher(state)  # Engram-Nine's carries the checkpoint's hot index
    ecfg = files.config.engram
    counts = files.row_counts if cache_fraction > 0 else None
    if cache_fraction > 0 and counts is None:
        raise UserError(f"{run_dir} has no row counts for a hot cache (a run without Engram)")
    tables: dict[int, Any] = {}
    layer_set = None
    if engram_layers is not None:
        from ..artifacts.layer_set import check_fits, read_layer_set

        layer_set = read_layer_set(engram_layers)
        check_fits(files.config, layer_set, hasher.parts)
        if tier != "memory":
            tables = open_tier(tier, layer_set.table_dir, layer_set.config, hasher, counts=counts,
                               cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                               **options)
    elif tier != "memory" and ecfg is not None:
        folder = Path(table_dir) if table_dir is not None else run_dir / TABLES
        stale = stale_tables(folder, hasher, ckpt.name, table_dtype)
        if stale:
            raise UserError(f"{folder} holds no current table files of {ckpt.name} ({stale}); "
                            f"write them with `engram export-tables {run_dir}`")
        check_index_files(folder, ecfg, hasher)  # the hot index the checkpoint trained
        tables = open_tier(tier, folder, ecfg, hasher, counts=counts,
                           cache_fraction=cache_fraction, prefetch=prefetch, verify=verify,
                           **options)
    # Built on meta, loaded with assign (gpt-fast's _load_model; issue 48): no table is drawn
    # only to be overwritten, and the checkpoint's tensors are the parameters, not copied.
    model = build_lm(files.config, hasher, tables or None, init=False)
    try:
        _load(model, state, shards, tables)
    except (KeyError, ValueError, RuntimeError) as e:  # a checkpoint not of model.json's model
        if isinstance(e, UserError):
            raise
        raise UserError(f"{run_dir}: checkpoint {ckpt.name} does not fit {RUN_FILES}/model.json "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}): copy the run "
                        "back from a copy, or train it again") from e
    if layer_set is not None:
        from ..artifacts.layer_set import load_layer_set

        load_layer_set(model, layer_set, hasher, memory_tables=tier == "memory", verify=verify)
    model.eval()
    return Runtime(model, hasher, VocabMap(files.vocab, tok.get_vocab_size(with_added_tokens=True)),
                   tok, files.eos_id, run_dir, ckpt.name, tier, tables, files.row_counts,
                   tokenizer_file=files.tokenizer_file, checkpoint_file=ckpt)


def _load(model: Any, state: dict[str, Any], shards: list[Path], tables: dict[int, Any]) -> None:
    """The checkpoint's state into a model built on meta (``shards``: a torchrun run's files)."""
    from ..tables.sharded import read_shards

    if shards:  # a torchrun run's: its table rows are in the shard files, of any world size
        if not tables:
            for e in model.engrams().values():
                e.table.to_empty(device="cpu")  # filled by read_shards, row range by row range
        load_dense_state(model, state["model"], outside=model.config.engram_layers)
        if not tables:
            read_shards(shards, {lid: e.table for lid, e in model.engrams().items()}, None)
    else:
        load_dense_state(model, state["model"], outside=tables)


def write_tables(run_dir: str | Path, table_dir: str | Path | None = None, dtype: str = "fp32",
                 say: Callable[[str], None] | None = None) -> Path:
    """The table files of a run's newest checkpoint, or of an ``engram finetune`` adapter, in
    ``table_dir`` (default RUN/tables), for the file tiers; nothing is written when they are
    current. The folder must be new, empty or one of ours (a "tables" folder)."""
    from contextlib import ExitStack

    from ..artifacts import adapter, kind_of
    from ..artifacts.checkpoint import newest_checkpoint
    from ..artifacts.run import read_run_files
    from ..artifacts.table_files import export_tables
    from ..outputs import claim_folder

    run_dir = Path(run_dir)
    kind = kind_of(run_dir)
    if kind == "export":
        raise UserError(f"{run_dir} is an `engram export-hf` folder: its table files are its own "
                        "(write another format with `engram export-hf RUN OUT --table_dtype`)")
    folder = Path(table_dir) if table_dir is not None else \
        run_dir / (adapter.TABLES if kind == "adapter" else TABLES)
    # current files are known without loading the checkpoint (Nine's parts need it) or the
    # adapter's base model
    if kind == "run":
        files, ckpt = read_run_files(run_dir), newest_checkpoint(run_dir)
        if ckpt is not None and files.config.engram is not None and files.nine_shared is None \
                and not stale_tables(folder, files.hasher(), ckpt.name, dtype):
            return folder
    else:
        found = adapter.read(run_dir, tables=False)
        if not stale_tables(folder, found.hasher(), found.tag, dtype):
            return folder
    rt = open_model(run_dir)
    if rt.hasher is None:
        raise UserError(f"{run_dir} has no Engram layers: it has no tables to write")
    if not stale_tables(folder, rt.hasher, rt.checkpoint, dtype):
        return folder
    with ExitStack() as hold:  # its writer lock (outputs.writer), nested in a command's own
        claim_folder(folder, "tables", "engram export-tables", "table_dir", hold=hold)
        if say is not None:
            say(f"writing the table files of {rt.checkpoint} ({dtype}) to {folder}")
        export_tables(rt.model, folder, dtype=dtype, hasher=rt.hasher, tag=rt.checkpoint,
                      kept=[])  # after Ctrl-C: the files already written whole stay
    return folder


def export_hf(run_dir: str | Path, out_dir: str | Path, *, tier: str = "memory",
              table_dtype: str = "fp32", cache_fraction: float = 0.0,
              prefetch: bool = False, engram_layers: str | Path | None = None,
              kept: list[Path] | None = None) -> Path:
    """Write an export (artifacts/export.py) of the newest checkpoint of ``run_dir`` (files
    already there and current are kept, named in ``kept``);
    ``engram_layers``: a V4.1 layer set replacing its Engram layers (fp8 tables keep E8M0 scales,
    so the served rows equal the layer set's bit for bit)."""
    from ..artifacts.export import check_serving
    from ..artifacts.export import write as export_model

    check_serving({"tier": tier, "cache_fraction": cache_fraction})
    rt = open_model(run_dir, engram_layers=engram_layers)
    return export_model(rt.model, rt.hasher, rt.vocab, out_dir, counts=rt.row_counts,
                        tier=tier, table_dtype=table_dtype, cache_fraction=cache_fraction,
                        prefetch=prefetch, tag=rt.checkpoint,
                        scale_format="fp32" if engram_layers is None else "e8m0",
                        tokenizer_file=rt.tokenizer_file, eos_id=rt.eos_id, kept=kept)
