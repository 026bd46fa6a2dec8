"""What a checkpoint's bytes can prove about themselves, checked before a tool trusts them.

DCP stores no checksum of its own, but it writes every entry (tensor chunk or pickled object) with ``torch.save``,
a zip archive whose central directory holds a CRC-32 of each record, and ``.metadata`` records each entry's file,
offset and length. ``verify_checkpoint`` checks all of that: every data file is present and long enough for its
entries, every entry is a readable archive, and every record's bytes match their CRC-32 (torch.load never checks
it). A ``torch.save`` file (zip format) gets the same CRC check. So a missing or truncated data file, a changed
length, and any changed payload bit are reported; what cannot be: a whole entry replaced by another valid archive
(its CRC recomputed), an edit of ``.metadata`` that stays consistent, entries written through a storage transform
(compression: their bytes are not archives) or as safetensors, and a legacy (non-zip) ``torch.save`` file.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path


def _check_archive(data: bytes | Path, what: str) -> bool:
    """ValueError naming ``what`` unless ``data`` is a zip archive whose records match their CRC-32; False when
    the archive records no CRC (torch.serialization.set_crc32_options(False) writes 0s), so nothing was verified."""
    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as z:
            records = z.infolist()
            if all(r.CRC == 0 for r in records):
                return False
            bad = z.testzip()  # reads every record, comparing its CRC-32
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
        raise ValueError(f"{what} is not a readable torch.save archive ({e})") from None
    if bad is not None:
        raise ValueError(f"{what}: record {bad} fails its CRC-32 or header check (its bytes were changed)")
    return True


def verify_dcp(folder: Path) -> int:
    """Check a DCP checkpoint folder (see the module docstring); the number of entries verified by CRC. A
    ValueError names the first entry or file that fails."""
    try:
        with open(folder / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        storage = metadata.storage_data
    except Exception as e:  # a truncated or foreign pickle raises any of several errors
        raise ValueError(f"{folder / '.metadata'} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(storage, dict):
        raise ValueError(f"{folder / '.metadata'} has no storage table")
    by_file: dict[str, list] = {}
    for index, info in storage.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    verified = 0
    for name, entries in sorted(by_file.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{path} is missing ({len(entries)} entries of the checkpoint are stored in it)")
        size = path.stat().st_size
        end = max(info.offset + info.length for _, info in entries)
        if size < end:
            raise ValueError(f"{path} is {size:,} bytes, but .metadata stores entries up to byte {end:,} (truncated)")
        with open(path, "rb") as f:
            for index, info in sorted(entries, key=lambda e: e[1].offset):
                f.seek(info.offset)
                data = f.read(info.length)
                if getattr(info, "transform_descriptors", None) or (
                        not data.startswith(b"PK\x03\x04") and _raw_tensor_entry(metadata, index, info.length)):
                    continue  # compressed or safetensors bytes: no CRC to check
                where = f"{path}: entry {index.fqn} (bytes {info.offset:,}-{info.offset + info.length:,})"
                verified += _check_archive(data, where)
    return verified


def _raw_tensor_entry(metadata, index, length: int) -> bool:
    """Whether a DCP entry of ``length`` bytes is a tensor chunk stored raw (safetensors format): its length is the
    chunk's element count times the element size."""
    md = metadata.state_dict_metadata.get(index.fqn)
    chunks = getattr(md, "chunks", None)
    if not chunks or index.index is None or index.index >= len(chunks):
        return False
    numel = 1
    for d in chunks[index.index].sizes:
        numel *= d
    import torch

    return length == numel * torch.empty((), dtype=md.properties.dtype).element_size()


def verify_checkpoint(path: Path) -> int:
    """Check a DCP folder or a torch.save file before loading it; the number of archives verified by CRC (0 for a
    legacy torch.save file, which holds none). A ValueError names what fails."""
    if os.path.isdir(path):
        return verify_dcp(Path(path))
    if zipfile.is_zipfile(path):
        return int(_check_archive(Path(path), str(path)))
    return 0


def verified_or_fail(prog: str, path: Path) -> None:
    """verify_checkpoint for a command line tool: a damaged or unreadable checkpoint ends ``prog`` with one line."""
    from .cli import fail

    try:
        verify_checkpoint(path)
    except ValueError as e:
        fail(prog, f"checkpoint {path} is damaged: {e}")
    except OSError as e:
        fail(prog, f"cannot read checkpoint {path}: {e.strerror or e}")
