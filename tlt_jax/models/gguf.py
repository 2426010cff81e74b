"""GGUF files: a fast parser of the header, metadata and tensor table, with lazy dequantization.

Shared by the model loader (`tlt_jax.models.loading`) and the tokenizer (`tlt_jax.models.tokenizer`, whose
BPE vocabulary and merges live in the GGUF metadata); it depends on neither.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

PathLike = str | os.PathLike


def missing_path_error(path: pathlib.Path, what: str) -> FileNotFoundError:
    """A FileNotFoundError for a missing model file, with the command that fetches the default model."""
    hint = " Run `make setup` to fetch it." if path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" else ""
    return FileNotFoundError(f"{what} {path} does not exist.{hint}")


# GGUF value type id -> struct format (scalars) and numpy dtype (arrays). 8 = string, 9 = array.
_GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_GGUF_NP = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: name, numpy-order shape ([out, in]), GGML type id, absolute byte offset."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF file: metadata (key -> Python value; arrays as lists) and tensor descriptors.

    Parsed directly (header, key/values, tensor infos) instead of with `gguf.GGUFReader`, which builds a numpy
    memmap view per array element and takes 3-10 s on the ~100k tokenizer strings of a small model; this takes
    ~0.2 s. Tensor bytes are read lazily from a memory map.
    """

    path: pathlib.Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    _buffer: Any = dataclasses.field(repr=False, default=None)

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8 [rows, bytes_per_row] (the layout `gguf.quants.dequantize` expects)."""
        data = np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return data.reshape(*info.shape[:-1], info.nbytes // max(rows, 1))

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as a float32 array of `info.shape`."""
        import gguf

        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        try:
            w = gguf.quants.dequantize(self.raw(info), qtype)
        except NotImplementedError as e:
            raise ValueError(
                f"{self.path}: tensor {info.name!r} uses GGML type {qtype.name}, which the installed gguf "
                "package cannot dequantize: re-export the model with another quantization (e.g. Q8_0, Q4_1)."
            ) from e
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(info.shape)
        return w if w.flags.writeable else w.copy()  # F32 tensors are views into the read-only file map


def read_gguf(path: PathLike) -> GGUFFile:
    """Parse a GGUF (v2/v3) file's metadata and tensor table; tensor data stays in a memory map."""
    import mmap
    import struct

    import gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise missing_path_error(path, "GGUF file")
    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF').")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3).")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return buf[pos - n : pos].decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _GGUF_NP:
                arr = np.frombuffer(buf, dtype=_GGUF_NP[etype], count=count, offset=pos)
                pos += arr.nbytes
                return arr.tolist()
            return [value(etype) for _ in range(count)]
        if vtype not in _GGUF_SCALARS:
            raise ValueError(f"{path}: unknown GGUF value type {vtype} at byte {pos}: the file is corrupt.")
        (v,) = struct.unpack_from(_GGUF_SCALARS[vtype], buf, pos)
        pos += struct.calcsize(_GGUF_SCALARS[vtype])
        return v

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        metadata[key] = value(vtype)

    raw_infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        raw_infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    align = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = (pos + align - 1) // align * align
    infos = []
    for name, shape, ggml_type, offset in raw_infos:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {ggml_type}.") from None
        n = int(np.prod(shape, dtype=np.int64))
        infos.append(GGUFTensorInfo(name, shape, ggml_type, data_start + offset, n // block * type_size))
        if data_start + offset + infos[-1].nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name!r} extends past the end of the file: it is truncated.")
    return GGUFFile(path=path, metadata=metadata, tensors=infos, _buffer=buf)
