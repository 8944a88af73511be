"""Faults over every command (issue 35), beside tests/test_bad_input.py: each ends in one line with
nothing lost.

- Two writers: while another process holds an output folder's lock (engram.outputs.writer), every
  command that would write it is refused in one line naming that process, and the tree is byte for
  byte as it was; a killed holder's lock is taken over; readers need no lock.
- A full disk: where a write is refused with ENOSPC (at fsync, as a filesystem with delayed
  allocation reports it; tests/test_crash.py fails every write call), the command ends in one
  line naming the file, exit 1, the old files kept and no temporary left; the rerun finishes.
  Where the machine allows it (root, tmpfs), one training run fills a real small filesystem.
- Ctrl-C and SIGTERM in every long command: tests/test_interrupts.py (one table).
"""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import snapshot  # every path's mode and SHA-256

import engram
from engram.cli import main
from engram.outputs import LOCK, mark

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(engram.__file__).parents[1]
TINY = ["--n_layer=2", "--d_model=32", "--n_head=2", "--seq_len=32", "--batch_size=2",
        "--table_size=500", "--max_chars=20000", "--eval_every=2", "--eval_batches=1",
        "--warmup=1", "--log_every=1", "--threads=1"]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/: run (2 steps), text.txt, v41/ (an empty folder: the lock refuses before it is
    read)."""
    root = tmp_path_factory.mktemp("faults")
    assert main(["train", f"--out_dir={root / 'run'}", "--steps=2", "--ckpt_every=2", *TINY]) == 0
    (root / "text.txt").write_text("In the beginning God created the heaven and the earth.\n" * 50)
    (root / "v41").mkdir()
    return root


# -- one writer per folder --------------------------------------------------------------------------

HOLD = ("import os, sys\n"
        "from engram.outputs import COMMAND_LINE, writer\n"
        "COMMAND_LINE[:] = ['engram', 'holder']\n"
        "beside = sys.argv[2] == '1'\n"
        "os.makedirs(os.path.dirname(sys.argv[1]) if beside else sys.argv[1], exist_ok=True)\n"
        "with writer(sys.argv[1], beside=beside):\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.read()\n")


def _hold(folder: Path, beside: bool = False) -> subprocess.Popen:
    """A process holding ``folder``'s writer lock until its stdin closes."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), "1" if beside else "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert p.stdout.readline().strip() == "held"  # blocks until it holds: no timing involved
    return p


def _let_go(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=120)


# (argv with {root}, the folder a holder holds, whether its lock is beside it)
WRITERS = [
    ("train --out_dir {root}/run --steps 3 " + " ".join(TINY), "run", False),
    ("train --out_dir {root}/fresh --steps 1 " + " ".join(TINY), "fresh", False),
    ("prepare --input {root}/text.txt --out {root}/corpus", "corpus", False),
    ("export-hf {root}/run {root}/export", "export", False),
    ("export-tables {root}/run", "run/tables", False),
    ("import-v41 {root}/v41 {root}/layers", "layers", True),
    ("export-v41 {root}/v41 {root}/ckpt", "ckpt", True),
    ("sweep-slots --out_dir {root}/sweep --steps 2", "sweep", False),
    ("pool-budget {root}/run --out_dir {root}/budget", "budget", False),
]


@pytest.mark.parametrize("argv,held,beside", WRITERS, ids=[w[0].split(" --")[0].split(" {")[0]
                                                           + ":" + w[1] for w in WRITERS])
def test_a_second_writer_is_refused_in_one_line(tree, argv, held, beside, capsys):
    holder = _hold(tree / held, beside)
    try:
        before = snapshot(tree)
        assert main(argv.format(root=tree).split()) == 2
        err = capsys.readouterr().err.strip()
        assert snapshot(tree) == before
    finally:
        _let_go(holder)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"is being written by pid {holder.pid} (`engram holder`); one writer per folder" in err
    assert not (tree / held / LOCK).exists() and not (tree / f".{held}{LOCK}").exists()


def test_a_killed_writer_s_lock_is_taken_over_and_readers_need_none(tree, tmp_path, capsys):
    out = tmp_path / "export"
    holder = _hold(out)
    mark(out, "export", "engram export-hf")  # what a killed export-hf left: its marker, a
    (out / ".model.safetensors.0badf00d.tmp").write_bytes(b"half")  # temporary, its lock
    try:
        rt = engram.open(str(tree / "run"))  # a reader: no lock, nothing written
        assert rt.checkpoint
    finally:
        holder.kill()
        holder.wait(timeout=120)
    assert (out / LOCK).exists()  # stale: its process is gone, the kernel let go of the lock
    assert main(["export-hf", str(tree / "run"), str(out)]) == 0
    assert not (out / LOCK).exists() and not list(out.rglob("*.tmp"))
    assert (out / "config.json").is_file()


# -- a full disk ------------------------------------------------------------------------------------

def _fill_disk_at(monkeypatch, part: str) -> list[str]:
    """os.fsync fails with ENOSPC on every file whose name holds ``part``; the names it failed."""
    real, failed = os.fsync, []

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if part in os.path.basename(name):
            failed.append(name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    return failed


# (argv with {root} and {out}, the part of the file name that fails, the output folder or file
# under {out}, what must be there after; then the rerun must finish)
FULL = [
    ("train --out_dir {out}/run --steps 4 " + " ".join(TINY), "step_00000004", "run",
     ["run/checkpoints/step_00000002.safetensors"]),
    ("prepare --input {root}/text.txt --out {out}/corpus", "counts", "corpus", []),
    ("export-hf {root}/run {out}/export", "model.safetensors", "export", []),
    ("export-tables {root}/run --table_dir {out}/tables", "layer", "tables", []),
    ("eval {root}/run --text {root}/text.txt --json {out}/eval.json", "eval.json", "eval.json", []),
]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd through /proc")
@pytest.mark.parametrize("argv,part,out,kept", FULL, ids=[f[0].split()[0] for f in FULL])
def test_a_full_disk_is_one_line_and_the_rerun_finishes(tree, tmp_path, monkeypatch, capsys,
                                                        argv, part, out, kept):
    args = argv.format(root=tree, out=tmp_path).split()
    if out == "run":  # a run with a checkpoint already: the disk fills at the next one
        assert main([*args[:3], "--steps", "2", *args[5:]]) == 0
    capsys.readouterr()
    failed = _fill_disk_at(monkeypatch, part)
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert failed and err, err
    line = err[-1]
    assert "Traceback" not in "\n".join(err)
    assert line.startswith(f"engram {args[0]}: error: no space left on device writing "
                           f"{tmp_path / out}"), line
    assert part in line
    assert not list(tmp_path.rglob("*.tmp")), "a temporary was left behind"
    for k in kept:
        assert (tmp_path / k).is_file()
    if out == "eval.json":
        assert not (tmp_path / out).exists()
    monkeypatch.undo()
    assert main(args) == 0


@pytest.mark.parametrize("code,says", [(errno.ENOSPC, "no space left on device"),
                                       (errno.EDQUOT, "disk quota exceeded"),
                                       (errno.EROFS, "read-only file system"),
                                       (errno.EIO, "input/output error")])
@pytest.mark.parametrize("writer", ["os", "safetensors"])
def test_every_disk_error_is_one_line_naming_the_file_and_keeps_the_old_one(
        tmp_path, monkeypatch, code, says, writer):
    """Through the one publishing path (engram.files): the OS's error, or safetensors' own
    exception carrying the OS's text."""
    import torch
    from safetensors.torch import save_file

    from engram.errors import DiskError
    from engram.files import publish

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"the old file")
    if writer == "os":
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(
            OSError(code, os.strerror(code))))
        write = lambda tmp: save_file({"w": torch.zeros(4)}, tmp)  # noqa: E731
    else:
        def write(tmp):
            save_file({"w": torch.zeros(4)}, tmp)
            raise RuntimeError(f"Error while serializing: IoError({os.strerror(code)} "
                               f"(os error {code}))")
    with pytest.raises(DiskError) as e:
        publish(path, write, need=2_000_000)
    line = str(e.value)
    assert e.value.errno == code and "\n" not in line
    assert line.startswith(f"{says} writing {path}"), line
    assert ("it needs 2.0 MB" in line) == (code in (errno.ENOSPC, errno.EDQUOT))
    assert path.read_bytes() == b"the old file" and sorted(tmp_path.iterdir()) == [path]


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MB tmpfs at tmp_path/disk (root only); resized by calling it with a size."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to fill a real filesystem")

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
    resize.path = disk
    yield resize
    subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_a_real_full_disk_keeps_the_last_checkpoint_and_the_rerun_matches(small_disk, tmp_path,
                                                                          capsys):
    """A tiny run's checkpoints are ~4 MB: the third does not fit in 16 MB beside the first two
    and the run's model files. Freed, the rerun resumes to the uninterrupted run's weights."""
    from safetensors.torch import load_file

    argv = ["--steps=6", "--ckpt_every=2", *TINY]
    out = small_disk.path / "run"
    assert main(["train", f"--out_dir={out}", *argv]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"engram train: error: no space left on device writing {out}/"
                           "checkpoints/step_00000006.safetensors (it needs "), line
    assert line.endswith(f"the newest checkpoint is step 4 in {out}/checkpoints; the same command "
                         "resumes from it")
    assert not list(out.rglob("*.tmp"))
    small_disk("64m")
    assert main(["train", f"--out_dir={out}", *argv]) == 0
    assert main(["train", f"--out_dir={tmp_path / 'whole'}", *argv]) == 0
    a = load_file(out / "checkpoints" / "step_00000006.safetensors")
    b = load_file(tmp_path / "whole" / "checkpoints" / "step_00000006.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
