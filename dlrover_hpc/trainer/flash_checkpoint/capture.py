"""A framework's own checkpoint writer, run into a scratch directory and kept as objects.

`captured_files(scratch)` runs a block (the framework's save) with `torch.save` and
safetensors' `save_file` diverted: a call whose file lies under `scratch` keeps its object
(no serialisation, no I/O); any other file the block writes there (JSON, a text file) is read
back as bytes.  The result is a `FileSet` for `FileSetCheckpointer.save_files`, named as the
framework named its files, so the framework's own loader reads what the saver writes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dlrover_hpc.checkpoint.api import StorageType
from dlrover_hpc.checkpoint.trainer.file_set import FileSetCheckpointer, SafetensorsFile

#: modules that bind safetensors' save_file under a name of their own (imported before use)
_SAFETENSORS_ALIASES = (
    ("safetensors.torch", "save_file"),
    ("transformers.modeling_utils", "safe_save_file"),
    ("accelerate.utils.other", "safe_save_file"),
)


class CapturedFiles:
    """What the block wrote under `scratch`: kept objects, then the files on disk."""

    def __init__(self, scratch: str) -> None:
        self.scratch = os.path.realpath(scratch)
        self.kept: dict[str, Any] = {}

    def relative(self, target: Any) -> str | None:
        """`target`'s name under the scratch directory, None for a file elsewhere."""
        if not isinstance(target, str | os.PathLike):
            return None
        path = os.path.realpath(os.fspath(target))
        if not path.startswith(self.scratch + os.sep):
            return None
        return os.path.relpath(path, self.scratch)

    def files(self, under: str = "") -> dict[str, Any]:
        """The files under `scratch/under` (names relative to it): kept objects, and the bytes
        of the files the block wrote there itself."""
        root = os.path.join(self.scratch, under) if under else self.scratch
        prefix = "" if not under else os.path.normpath(under) + os.sep
        out = {
            name[len(prefix) :]: obj for name, obj in self.kept.items() if name.startswith(prefix)
        }
        for directory, _, names in os.walk(root):
            for name in sorted(names):
                full = os.path.join(directory, name)
                rel = os.path.relpath(full, root)
                if rel not in out:
                    with open(full, "rb") as f:
                        out[rel] = f.read()
        return out


@contextlib.contextmanager
def captured_files(scratch: str) -> Iterator[CapturedFiles]:
    """Diverts torch.save and safetensors' save_file for files under `scratch` (this
    thread's training code; the functions are module attributes, so the diversion is
    process-wide for its duration: run nothing else that saves meanwhile)."""
    captured = CapturedFiles(scratch)
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        name = captured.relative(f)
        if name is None:
            real_save(obj, f, *args, **kwargs)
            return
        captured.kept[name] = obj

    patched: list[tuple[Any, str, Any]] = [(torch, "save", real_save)]
    for module_name, attr in _SAFETENSORS_ALIASES:
        module = sys.modules.get(module_name)
        real = getattr(module, attr, None) if module is not None else None
        if real is not None:
            patched.append((module, attr, real))
    try:
        torch.save = save
        for module, attr, real in patched[1:]:
            setattr(module, attr, _safetensors_saver(captured, real))
        yield captured
    finally:
        for module, attr, real in patched:
            setattr(module, attr, real)


def capture_directory(write: Callable[[str], Any], under: str) -> dict[str, Any]:
    """Runs `write(scratch)` (a framework's save into a fresh scratch directory) with its
    files captured, and returns those under `scratch/under`."""
    with tempfile.TemporaryDirectory(prefix="dlrover-hpc-ckpt-") as scratch:
        with captured_files(scratch) as captured:
            write(scratch)
        return captured.files(under)


def _safetensors_saver(captured: CapturedFiles, real: Any) -> Any:
    def save_file(tensors: Any, filename: Any, metadata: Any = None, *args: Any) -> None:
        name = captured.relative(filename)
        if name is None or args:
            real(tensors, filename, metadata, *args)
            return
        captured.kept[name] = SafetensorsFile(dict(tensors), dict(metadata or {}) or None)

    return save_file


class DirectoryCheckpointer:
    """A framework's save into a directory, through shared memory: `save(step, path, write)`
    runs `write(directory)` (the framework's own save, e.g. `accelerator.save_state`) into a
    scratch directory with its files captured, and saves them as `path`'s files."""

    def __init__(
        self, checkpoint_dir: str, *, keep_last: int | None = None, replica_count: int = 0
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.checkpointer = FileSetCheckpointer(
            checkpoint_dir, keep_last=keep_last, replica_count=replica_count
        )

    def save(
        self,
        step: int,
        path: str,
        write: Callable[[str], Any],
        storage_type: StorageType | str = StorageType.DISK,
    ) -> bool:
        """Every rank calls it, each with its own files; `storage_type` MEMORY or DISK (or
        their values, "memory" and "disk")."""

        def into(scratch: str) -> None:
            target = os.path.join(scratch, "step")
            os.makedirs(target)
            write(target)

        files = capture_directory(into, "step")
        return self.checkpointer.save_files(step, files, path, StorageType(storage_type))

    def last_checkpoint(self) -> str | None:
        """The directory of the newest step (memory first, its files written to storage
        when they are not there); None when there is none.  Every rank calls it."""
        found = self.checkpointer.restore_files()
        return None if found is None else found[1]

    def wait_latest_checkpoint(self, timeout: float = 1800) -> bool:
        return self.checkpointer.wait_latest_checkpoint(timeout)
