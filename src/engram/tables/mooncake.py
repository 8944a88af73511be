"""The RDMA-pool baseline: Engram tables in a Mooncake Store, read with ranged reads.

The CXL paper (arXiv 2603.10087) argues that RDMA memory pools built for KV-cache blocks of
megabytes (Mooncake and the like) lose most of their bandwidth on Engram's reads: per token and
layer ~16 scattered rows of a few hundred bytes. This store puts that claim on real software: each
table is a handful of large, hard-pinned objects (never one object per row: the master keeps
~0.5-0.8 KB per key), a lookup de-duplicates its rows and fetches them with one ``get_into_ranges``
call per batch of ranges into a registered buffer. It is a TableStore, so the hot cache
(``engram.tables.cache.CachedTable``) and prefetch work in front of it unchanged.

Needs the optional extra ``pool`` (PyPI ``mooncake-transfer-engine-non-cuda``) and the system
library ``libibverbs1``; ``MooncakeServices`` runs ``mooncake_master`` and
``mooncake_client`` on loopback with the TCP transport. The reading process mounts no segment of
its own, so every row crosses the transport from the client service, as from a remote pool.

Shape legend: r rows, e row width, n rows asked for, u distinct rows among them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .tiers import check_rows

# Every process talking to the services must bind loopback (else TCP picks another interface).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")  # the engine logs every connection at INFO

_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


def mooncake_missing() -> str | None:
    """Why the Mooncake baseline cannot run here (None: it can)."""
    for exe in ("mooncake_master", "mooncake_client"):
        if shutil.which(exe) is None:
            return f"{exe} not on PATH (pip install 'engram[pool]')"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:  # e.g. "libibverbs.so.1: cannot open shared object file"
        return f"import mooncake.store failed: {e} (apt-get install -y libibverbs1)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeServices:
    """``mooncake_master`` (with its HTTP metadata server) and one ``mooncake_client`` holding a
    ``segment_bytes`` memory segment, on free loopback ports; logs go to ``log_dir``."""

    def __init__(self, segment_bytes: int = 1 << 30, log_dir: str | Path | None = None,
                 timeout_s: float = 30.0):
        why = mooncake_missing()
        if why:
            raise RuntimeError(f"Mooncake is not available: {why}")
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="engram-mooncake-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pm, pr, px, pc = (_free_port() for _ in range(4))
        self.metadata_url = f"http://127.0.0.1:{pm}/metadata"
        self.master_addr = f"127.0.0.1:{pr}"
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.procs: list[subprocess.Popen] = []
        # The services run in sessions of their own (they outlive a killed parent otherwise):
        # stopped when this object goes or the interpreter exits, if close() was not called.
        self._stop = weakref.finalize(self, _terminate, self.procs)
        try:
            self._spawn("master", ["mooncake_master", "--enable_http_metadata_server=true",
                                   "--http_metadata_server_host=127.0.0.1",
                                   f"--http_metadata_server_port={pm}", "--rpc_address=127.0.0.1",
                                   f"--rpc_port={pr}", f"--metrics_port={px}"], env)
            self._wait_port(pr, timeout_s)
            self._wait_port(pm, timeout_s)
            self._spawn("client", ["mooncake_client", "--host=127.0.0.1", f"--port={pc}",
                                   f"--global_segment_size={segment_bytes}",
                                   f"--master_server_address={self.master_addr}",
                                   f"--metadata_server={self.metadata_url}", "--protocol=tcp"], env)
            self._wait_segment(timeout_s)
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.log_dir}")

    def _wait_port(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"Mooncake service did not listen on port {port}; see {self.log_dir}")

    def _wait_segment(self, timeout_s: float) -> None:
        """Until the client's segment is mounted: a probe object can be put."""
        store = self.connect()
        probe = np.zeros(4096, np.uint8)
        store.register_buffer(probe.ctypes.data, probe.nbytes)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                if store.put_from("engram/probe", probe.ctypes.data, probe.nbytes) == 0:
                    store.remove("engram/probe", True)
                    return
                time.sleep(0.1)
            raise RuntimeError(f"mooncake_client mounted no segment in {timeout_s} s; see "
                               f"{self.log_dir}")
        finally:
            store.close()

    def connect(self, buffer_bytes: int = 16 << 20) -> Any:
        """A store client that mounts no segment of its own: every read crosses the transport."""
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", self.metadata_url, 0, buffer_bytes, "tcp", "",
                         self.master_addr)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}; see {self.log_dir}")
        return store

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> MooncakeServices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # only the processes these services started
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    procs.clear()


class MooncakeSession:
    """Services on loopback and one client of them, closed together (client first): what the
    ``mooncake`` tier of ``engram.tables.registry`` starts for one process's tables."""

    def __init__(self, segment_bytes: int, log_dir: str | Path | None = None):
        self.services = MooncakeServices(segment_bytes, log_dir)
        try:
            self.client = self.services.connect()
        except BaseException:
            self.services.close()
            raise
        self._close = weakref.finalize(self, _close_session, self.client, self.services)

    def close(self) -> None:
        self._close()


def _close_session(client: Any, services: MooncakeServices) -> None:
    try:
        client.close()
    finally:
        services.close()


def publish_table(store: Any, key: str, rows: torch.Tensor, *, object_bytes: int = 4 << 20) -> dict:
    """Put rows [r, e] under ``key`` as hard-pinned objects of ~``object_bytes`` (whole rows each)
    plus a small JSON object ``key/meta``; replaces an existing table of that key."""
    from mooncake.store import ReplicateConfig

    if rows.dim() != 2 or rows.dtype not in _NP:
        raise ValueError(f"rows must be [r, e] of {sorted(map(str, _NP))}, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    host = rows.detach().cpu().contiguous()
    raw = host.view(torch.uint8).numpy().reshape(-1)  # shares host's memory
    r, e = host.shape
    row_bytes = e * host.element_size()
    per = max(1, object_bytes // row_bytes)
    meta = {"num_rows": r, "dim": e, "dtype": str(host.dtype).removeprefix("torch."),
            "object_rows": per, "objects": -(-r // per)}
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True  # unpinned objects get evicted under memory pressure
    if store.register_buffer(raw.ctypes.data, raw.nbytes) != 0:
        raise RuntimeError("register_buffer failed for the table's host copy")
    try:
        for i in range(meta["objects"]):
            name = f"{key}/o{i}"
            if store.is_exist(name) == 1:
                store.remove(name, True)  # a put on an existing key would keep the old value
            a, b = i * per * row_bytes, min(r, (i + 1) * per) * row_bytes
            rc = store.put_from(name, raw.ctypes.data + a, b - a, cfg)
            if rc != 0:
                raise RuntimeError(f"Mooncake put_from({name}, {b - a} bytes) returned {rc} "
                                   "(is the client's segment large enough?)")
    finally:
        store.unregister_buffer(raw.ctypes.data)
    body = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    if store.is_exist(f"{key}/meta") == 1:
        store.remove(f"{key}/meta", True)
    if store.put(f"{key}/meta", body.tobytes(), cfg) != 0:
        raise RuntimeError(f"Mooncake put({key}/meta) failed")
    return meta


@dataclass
class MooncakeStats:
    lookups: int = 0  # lookup calls
    rows: int = 0  # row ids asked for
    ranges: int = 0  # ranged reads issued (= distinct rows)
    calls: int = 0  # get_into_ranges calls


class MooncakeTable:
    """A table published with ``publish_table``, read row by row with ranged reads.

    Its arguments:

    - ``store``: a client from ``MooncakeServices.connect`` (or any set-up store).
    - ``key``: the table's key prefix.
    - ``buffer_rows``: rows the registered receive buffer holds; larger lookups go in pieces.
    - ``max_ranges``: ranges per ``get_into_ranges`` call (batches over ~1024 can fail with
      "TCP lane queue-full" on this transport).
    - ``session``: the ``MooncakeSession`` ``store`` belongs to, kept alive by this table.
    """

    def __init__(self, store: Any, key: str, *, buffer_rows: int = 1 << 14,
                 max_ranges: int = 512, session: MooncakeSession | None = None):
        self.store, self.key, self.max_ranges = store, key, max_ranges
        self.session = session  # kept alive while this table is (None: the caller owns it)
        n = store.get_size(f"{key}/meta")
        if n <= 0:
            raise FileNotFoundError(f"no Mooncake table under {key!r} (publish_table first)")
        meta = json.loads(bytes(store.get(f"{key}/meta")).decode())
        self.meta = meta
        self.num_rows, self.dim, self.per = meta["num_rows"], meta["dim"], meta["object_rows"]
        self.dtype = getattr(torch, meta["dtype"])
        self.row_bytes = self.dim * torch.empty(0, dtype=self.dtype).element_size()
        self.keys = [f"{key}/o{i}" for i in range(meta["objects"])]
        self.buffer_rows = buffer_rows
        self._buf = np.zeros(buffer_rows * self.row_bytes, np.uint8)  # registered receive buffer
        if store.register_buffer(self._buf.ctypes.data, self._buf.nbytes) != 0:
            raise RuntimeError("register_buffer failed for the receive buffer")
        self._lock = threading.Lock()  # one receive buffer: a prefetch worker and the caller
        self.stats = MooncakeStats()

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        flat = check_rows(rows, self.num_rows).numpy()  # [n]
        uniq, inv = np.unique(flat, return_inverse=True)  # [u], [n]: each row fetched once
        out = torch.empty(uniq.size, self.dim, dtype=self.dtype)  # [u, e]
        dst = out.view(torch.uint8).numpy().reshape(-1)
        with self._lock:
            self.stats.lookups += 1
            self.stats.rows += flat.size
            for a in range(0, uniq.size, self.buffer_rows):
                part = uniq[a:a + self.buffer_rows]
                self._fetch(part)
                n = part.size * self.row_bytes
                dst[a * self.row_bytes:a * self.row_bytes + n] = self._buf[:n]
        return out.index_select(0, torch.from_numpy(inv)).view(*rows.shape, self.dim)

    def _fetch(self, part: np.ndarray) -> None:
        """Rows ``part`` (distinct, ascending) into the receive buffer, in order."""
        rb = self.row_bytes
        obj, off = part // self.per, (part % self.per) * rb
        for a in range(0, part.size, self.max_ranges):
            o, s = obj[a:a + self.max_ranges], off[a:a + self.max_ranges]
            keys, dsts, srcs, sizes = [], [], [], []
            for k in np.unique(o).tolist():  # one entry per object, its ranges together
                sel = np.flatnonzero(o == k)
                keys.append(self.keys[k])
                dsts.append(((a + sel) * rb).tolist())
                srcs.append(s[sel].tolist())
                sizes.append([rb] * sel.size)
            got = self.store.get_into_ranges([self._buf.ctypes.data], [keys], [dsts], [srcs],
                                             [sizes])
            self.stats.calls += 1
            self.stats.ranges += len(o)
            bad = [(keys[i], j, v) for i, r in enumerate(got[0]) for j, v in enumerate(r)
                   if v != rb]
            if bad:
                raise RuntimeError(f"Mooncake ranged read failed for {len(bad)} of {len(o)} rows "
                                   f"(first: object {bad[0][0]}, result {bad[0][2]})")

    def prefetch(self, rows: torch.Tensor) -> None:
        pass  # PrefetchTable runs the ranged reads in its worker

    def close(self) -> None:
        if self._buf is not None:
            self.store.unregister_buffer(self._buf.ctypes.data)
            self._buf = None

    def __repr__(self) -> str:
        return (f"MooncakeTable({self.key!r}, rows={self.num_rows}, dim={self.dim}, "
                f"objects={len(self.keys)})")
